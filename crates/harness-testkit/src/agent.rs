//! [`ScriptHarness`]: an agent adapter whose "agent" is a shell script
//! printing JSON lines slowly. It runs as a real detached process in a real
//! sandbox through the real slice runner; only the agent is scripted. The
//! engine conformance suite and the engines' own tests use it where a real
//! model conversation would only add time.
//!
//! The prompt configures the script: `lines=N delay=SECONDS [approval=K]
//! [exit=CODE]`. Line `i` is `{"type":"text","text":"line i"}`. With
//! `approval=K`, after line K the script prints
//! `{"type":"approval","id":"approve-K"}` and waits — like Claude Code's
//! approval tool — for the harness to write the answer file
//! (`<spool>/relay/answers/approve-K.json`), then prints `approved K`
//! or `denied K` as a text line, so a test sees the answer reach the agent.

use harness_core::bootstrap::BootstrapRecipe;
use harness_core::harness::{AgentCommand, Harness, OutputParser, TurnContext};
use harness_core::part::StreamPart;
use harness_core::Result;

/// Adapter name used in turn states.
pub const SCRIPT_AGENT: &str = "script";

/// See the module docs.
#[derive(Debug, Default)]
pub struct ScriptHarness;

fn setting(prompt: &str, key: &str) -> Option<String> {
    prompt
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_string))
}

impl Harness for ScriptHarness {
    fn name(&self) -> &'static str {
        SCRIPT_AGENT
    }

    fn bootstrap_recipe(&self) -> Result<BootstrapRecipe> {
        Ok(BootstrapRecipe::default())
    }

    fn turn_command(&self, turn: &TurnContext<'_>) -> Result<AgentCommand> {
        let prompt = &turn.state.prompt;
        let lines: u32 = setting(prompt, "lines")
            .and_then(|v| v.parse().ok())
            .unwrap_or(10);
        let delay: f64 = setting(prompt, "delay")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.2);
        let approval: i64 = setting(prompt, "approval")
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1);
        let exit: i32 = setting(prompt, "exit")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        // The answer file is bounded-waited for (10 minutes): a test that
        // never answers aborts the turn, which kills the script.
        let script = format!(
            r#"i=0
while [ $i -lt {lines} ]; do
  printf '{{"type":"text","text":"line %d"}}\n' $i
  if [ $i -eq {approval} ]; then
    printf '{{"type":"approval","id":"approve-%d"}}\n' $i
    ans="$HOME/.harness/turns/$HARNESS_TURN/relay/answers/approve-$i.json"
    n=0
    while [ ! -f "$ans" ] && [ $n -lt 12000 ]; do sleep 0.05; n=$((n+1)); done
    if grep -q '"approved":true' "$ans" 2>/dev/null; then verdict=approved; else verdict=denied; fi
    printf '{{"type":"text","text":"%s %d"}}\n' $verdict $i
  fi
  i=$((i+1))
  sleep {delay}
done
exit {exit}"#
        );
        let mut env = std::collections::BTreeMap::new();
        env.insert("HARNESS_TURN".to_string(), turn.state.turn_id.clone());
        Ok(AgentCommand {
            argv: vec!["bash".into(), "-c".into(), script],
            env,
            cwd: turn.workdir.to_string(),
        })
    }

    fn parser(&self) -> Box<dyn OutputParser> {
        Box::new(ScriptParser::default())
    }

    fn state_dirs(&self, _home: &str) -> Vec<String> {
        Vec::new()
    }
}

/// Parser for the script's lines: each text line is one whole text block.
#[derive(Debug, Default)]
pub struct ScriptParser {
    blocks: u64,
}

impl OutputParser for ScriptParser {
    fn push_line(&mut self, line: &str) -> Vec<StreamPart> {
        let raw = || StreamPart::Raw {
            value: serde_json::Value::String(line.to_string()),
        };
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            return vec![raw()];
        };
        match value["type"].as_str() {
            Some("text") => {
                self.blocks += 1;
                let id = format!("b{}", self.blocks);
                vec![
                    StreamPart::TextStart { id: id.clone() },
                    StreamPart::TextDelta {
                        id: id.clone(),
                        delta: value["text"].as_str().unwrap_or_default().to_string(),
                    },
                    StreamPart::TextEnd { id },
                ]
            }
            Some("approval") => {
                let id = value["id"].as_str().unwrap_or_default().to_string();
                vec![StreamPart::ToolApprovalRequest {
                    approval_id: id.clone(),
                    tool_call_id: id,
                    tool_name: "Bash".into(),
                    input: serde_json::json!({"command": "true"}),
                }]
            }
            _ => vec![raw()],
        }
    }

    fn agent_session_id(&self) -> Option<String> {
        None
    }

    fn in_block(&self) -> bool {
        false
    }
}

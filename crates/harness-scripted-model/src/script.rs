//! Scripts: which answer the scripted model gives to which request.
//!
//! A [`Script`] is an ordered list of [`Rule`]s. For each request the server
//! picks the FIRST rule whose [`Matcher`] accepts the request itself: there is
//! no hidden turn counter, so a resumed session (whose request repeats the
//! earlier turns) gets the answer that fits its last message instead of
//! replaying the script from the top.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::request::{Api, ModelRequest};

type MatchFn = Arc<dyn Fn(&ModelRequest) -> bool + Send + Sync>;
type CheckFn = Arc<dyn Fn(&ModelRequest) -> Result<(), String> + Send + Sync>;

/// Decides whether a [`Rule`] applies to a request.
#[derive(Clone)]
pub enum Matcher {
    /// Every request.
    Any,
    /// The most recent user message with text contains this (tool results are
    /// not text, see [`ModelRequest::last_user_text`]).
    LastUserTextContains(String),
    /// The request ends with a tool result for this call id.
    LastIsToolResultFor(String),
    /// The request ends with some tool result.
    LastIsToolResult,
    /// The system prompt / instructions contain this.
    SystemContains(String),
    /// The request came in on this API.
    Api(Api),
    /// All of these match.
    All(Vec<Matcher>),
    /// Any of these match.
    AnyOf(Vec<Matcher>),
    /// This does not match.
    Not(Box<Matcher>),
    /// A custom predicate.
    Custom(MatchFn),
}

impl fmt::Debug for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Matcher::Any => write!(f, "any()"),
            Matcher::LastUserTextContains(s) => write!(f, "last_user_text_contains({s:?})"),
            Matcher::LastIsToolResultFor(s) => write!(f, "last_is_tool_result_for({s:?})"),
            Matcher::LastIsToolResult => write!(f, "last_is_tool_result()"),
            Matcher::SystemContains(s) => write!(f, "system_contains({s:?})"),
            Matcher::Api(a) => write!(f, "api({a:?})"),
            Matcher::All(m) => f.debug_tuple("all").field(m).finish(),
            Matcher::AnyOf(m) => f.debug_tuple("any_of").field(m).finish(),
            Matcher::Not(m) => f.debug_tuple("not").field(m).finish(),
            Matcher::Custom(_) => write!(f, "custom(..)"),
        }
    }
}

impl Matcher {
    /// Whether this matcher accepts `req`.
    pub fn matches(&self, req: &ModelRequest) -> bool {
        match self {
            Matcher::Any => true,
            Matcher::LastUserTextContains(s) => {
                req.last_user_text().is_some_and(|t| t.contains(s.as_str()))
            }
            Matcher::LastIsToolResultFor(id) => req.last_is_tool_result_for(id),
            Matcher::LastIsToolResult => !req.last_tool_results().is_empty(),
            Matcher::SystemContains(s) => req.system_text().contains(s.as_str()),
            Matcher::Api(a) => req.api == *a,
            Matcher::All(ms) => ms.iter().all(|m| m.matches(req)),
            Matcher::AnyOf(ms) => ms.iter().any(|m| m.matches(req)),
            Matcher::Not(m) => !m.matches(req),
            Matcher::Custom(f) => f(req),
        }
    }
}

/// Matches every request.
pub fn any() -> Matcher {
    Matcher::Any
}
/// Matches when the most recent user text contains `s`.
pub fn last_user_text_contains(s: impl Into<String>) -> Matcher {
    Matcher::LastUserTextContains(s.into())
}
/// Matches when the request ends with a tool result for `call_id`.
pub fn last_is_tool_result_for(call_id: impl Into<String>) -> Matcher {
    Matcher::LastIsToolResultFor(call_id.into())
}
/// Matches when the request ends with any tool result.
pub fn last_is_tool_result() -> Matcher {
    Matcher::LastIsToolResult
}
/// Matches when the system prompt / instructions contain `s`.
pub fn system_contains(s: impl Into<String>) -> Matcher {
    Matcher::SystemContains(s.into())
}
/// Matches requests on one API.
pub fn api(api: Api) -> Matcher {
    Matcher::Api(api)
}
/// Matches when every matcher matches.
pub fn all(ms: impl IntoIterator<Item = Matcher>) -> Matcher {
    Matcher::All(ms.into_iter().collect())
}
/// Matches when any matcher matches.
pub fn any_of(ms: impl IntoIterator<Item = Matcher>) -> Matcher {
    Matcher::AnyOf(ms.into_iter().collect())
}
/// Negation.
pub fn not(m: Matcher) -> Matcher {
    Matcher::Not(Box::new(m))
}
/// A custom predicate over the request.
pub fn matcher_fn(f: impl Fn(&ModelRequest) -> bool + Send + Sync + 'static) -> Matcher {
    Matcher::Custom(Arc::new(f))
}

/// A check on the request a rule answers (typically on the tool result the
/// client sent back). A failed check is recorded (see
/// [`super::ScriptedModel::failures`]) and the model answers
/// `ASSERTION FAILED: ...` instead of the rule's reply.
#[derive(Clone)]
pub enum Assertion {
    /// The request carries a tool result for `call_id` whose text contains `needle`.
    ToolResultContains {
        /// The call id.
        call_id: String,
        /// The text expected in the result.
        needle: String,
    },
    /// Some user text in the request contains this (multi-turn context).
    UserTextsContain(String),
    /// Some assistant text in the request contains this (multi-turn context).
    AssistantTextsContain(String),
    /// A custom check.
    Custom(CheckFn),
}

impl fmt::Debug for Assertion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Assertion::ToolResultContains { call_id, needle } => {
                write!(f, "tool_result_contains({call_id:?}, {needle:?})")
            }
            Assertion::UserTextsContain(s) => write!(f, "user_texts_contain({s:?})"),
            Assertion::AssistantTextsContain(s) => write!(f, "assistant_texts_contain({s:?})"),
            Assertion::Custom(_) => write!(f, "custom(..)"),
        }
    }
}

impl Assertion {
    /// Check `req`; `Err` carries a human-readable reason.
    pub fn check(&self, req: &ModelRequest) -> Result<(), String> {
        match self {
            Assertion::ToolResultContains { call_id, needle } => match req.tool_result(call_id) {
                Some(r) if r.content.contains(needle.as_str()) => Ok(()),
                Some(r) => Err(format!(
                    "tool result for {call_id} does not contain {needle:?}: {:?}",
                    r.content
                )),
                None => Err(format!("request carries no tool result for {call_id}")),
            },
            Assertion::UserTextsContain(s) => {
                if req.user_texts().iter().any(|t| t.contains(s.as_str())) {
                    Ok(())
                } else {
                    Err(format!("no user message contains {s:?}"))
                }
            }
            Assertion::AssistantTextsContain(s) => {
                if req.assistant_texts().iter().any(|t| t.contains(s.as_str())) {
                    Ok(())
                } else {
                    Err(format!("no assistant message contains {s:?}"))
                }
            }
            Assertion::Custom(f) => f(req),
        }
    }
}

/// What tool the model calls.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolKind {
    /// A shell command, rendered per API: Anthropic `Bash`
    /// `{command, description}`, OpenAI `exec_command` `{"cmd": command}`.
    Shell {
        /// The command line.
        command: String,
        /// Anthropic's `description` field.
        description: String,
    },
    /// The same tool name and input on both APIs.
    Named {
        /// Tool name.
        name: String,
        /// JSON input (OpenAI: serialised into `arguments`).
        input: Value,
    },
    /// Different tools per API.
    PerApi {
        /// Anthropic tool name and input.
        anthropic: (String, Value),
        /// OpenAI function name and arguments.
        openai: (String, Value),
    },
    /// Anthropic: a tool with JSON input; OpenAI: a custom (freeform) tool
    /// call, `custom_tool_call` with a string `input` — how Codex's code
    /// mode is called (`exec` with JavaScript that calls nested tools such
    /// as MCP tools: `await tools.mcp__host__lookup({...})`).
    CustomOnOpenAi {
        /// Anthropic tool name and input.
        anthropic: (String, Value),
        /// OpenAI custom tool name and its freeform input.
        openai: (String, String),
    },
}

/// One tool call in a reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The call id (`tool_use.id` / `function_call.call_id`); matchers and
    /// assertions refer to it.
    pub id: String,
    /// Which tool.
    pub kind: ToolKind,
}

impl ToolCall {
    /// A shell command (Anthropic `Bash`, OpenAI `exec_command`).
    pub fn shell(id: impl Into<String>, command: impl Into<String>) -> Self {
        let command = command.into();
        Self {
            id: id.into(),
            kind: ToolKind::Shell {
                description: "run a command".into(),
                command,
            },
        }
    }
    /// A tool with the same name and input on both APIs.
    pub fn named(id: impl Into<String>, name: impl Into<String>, input: Value) -> Self {
        Self {
            id: id.into(),
            kind: ToolKind::Named {
                name: name.into(),
                input,
            },
        }
    }
    /// Different tools per API.
    pub fn per_api(
        id: impl Into<String>,
        anthropic: (impl Into<String>, Value),
        openai: (impl Into<String>, Value),
    ) -> Self {
        Self {
            id: id.into(),
            kind: ToolKind::PerApi {
                anthropic: (anthropic.0.into(), anthropic.1),
                openai: (openai.0.into(), openai.1),
            },
        }
    }
    /// [`ToolKind::CustomOnOpenAi`].
    pub fn custom_on_openai(
        id: impl Into<String>,
        anthropic: (impl Into<String>, Value),
        openai: (impl Into<String>, impl Into<String>),
    ) -> Self {
        Self {
            id: id.into(),
            kind: ToolKind::CustomOnOpenAi {
                anthropic: (anthropic.0.into(), anthropic.1),
                openai: (openai.0.into(), openai.1.into()),
            },
        }
    }

    /// Whether the call is a custom (freeform) tool call on `api`.
    pub fn is_custom(&self, api: Api) -> bool {
        matches!(self.kind, ToolKind::CustomOnOpenAi { .. }) && api == Api::OpenAi
    }

    /// Tool name and JSON input as sent on `api` (a custom call's freeform
    /// input as a JSON string).
    pub fn render(&self, api: Api) -> (String, Value) {
        match (&self.kind, api) {
            (
                ToolKind::Shell {
                    command,
                    description,
                },
                Api::Anthropic,
            ) => (
                "Bash".into(),
                json!({"command": command, "description": description}),
            ),
            (ToolKind::Shell { command, .. }, Api::OpenAi) => {
                ("exec_command".into(), json!({"cmd": command}))
            }
            (ToolKind::Named { name, input }, _) => (name.clone(), input.clone()),
            (ToolKind::PerApi { anthropic, .. }, Api::Anthropic) => anthropic.clone(),
            (ToolKind::PerApi { openai, .. }, Api::OpenAi) => openai.clone(),
            (ToolKind::CustomOnOpenAi { anthropic, .. }, Api::Anthropic) => anthropic.clone(),
            (ToolKind::CustomOnOpenAi { openai, .. }, Api::OpenAi) => {
                (openai.0.clone(), Value::String(openai.1.clone()))
            }
        }
    }
}

/// One part of a reply, in the order it is streamed.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Assistant text, streamed as these chunks.
    Text(Vec<String>),
    /// Reasoning / thinking text, streamed as these chunks.
    Thinking(Vec<String>),
    /// A tool call.
    Tool(ToolCall),
}

/// Stop reason of a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model is done.
    EndTurn,
    /// The model waits for tool results.
    ToolUse,
    /// The output hit `max_tokens`.
    MaxTokens,
}

impl StopReason {
    /// Anthropic's spelling.
    pub fn as_anthropic(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::ToolUse => "tool_use",
            StopReason::MaxTokens => "max_tokens",
        }
    }
}

/// A switch a test opens to let a held reply go on ([`Reply::hold_before_delta`]):
/// the model's stream waits on an event of the test's, not on a timer.
#[derive(Debug, Clone, Default)]
pub struct Gate(Arc<(std::sync::atomic::AtomicBool, tokio::sync::Notify)>);

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Open it: every reply held on it goes on, now and later.
    pub fn open(&self) {
        self.0 .0.store(true, std::sync::atomic::Ordering::SeqCst);
        self.0 .1.notify_waiters();
    }

    /// Whether it was opened.
    pub fn is_open(&self) -> bool {
        self.0 .0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Wait until it is open.
    pub async fn opened(&self) {
        loop {
            let notified = self.0 .1.notified();
            if self.is_open() {
                return;
            }
            notified.await;
        }
    }
}

impl PartialEq for Gate {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// What the model answers: parts streamed in order, with an optional delay
/// before each streamed chunk.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The parts in order.
    pub parts: Vec<Part>,
    /// Pause before each streamed delta.
    pub delay: Duration,
    /// Overrides the stop reason derived from the parts.
    pub stop_reason: Option<StopReason>,
    /// Hold the stream before its n-th delta (from 0) until the gate opens.
    pub hold: Option<(usize, Gate)>,
}

/// Split `s` into about `n` chunks on char boundaries (at least one chunk).
fn split_chunks(s: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    if chars.len() < 2 || n < 2 {
        return vec![s.to_string()];
    }
    let size = chars.len().div_ceil(n);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

impl Reply {
    /// An empty reply (add parts with the `then_*` methods).
    pub fn empty() -> Self {
        Self {
            parts: Vec::new(),
            delay: Duration::ZERO,
            stop_reason: None,
            hold: None,
        }
    }
    /// A text answer, split into three chunks so streaming is observable.
    pub fn text(s: impl Into<String>) -> Self {
        Self::empty().then_text(s)
    }
    /// A text answer streamed as exactly these chunks.
    pub fn text_chunks<I, S>(chunks: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::empty().then_text_chunks(chunks)
    }
    /// A reasoning / thinking block (split into chunks).
    pub fn thinking(s: impl Into<String>) -> Self {
        Self::empty().then_thinking(s)
    }
    /// A single tool call.
    pub fn tool(call: ToolCall) -> Self {
        Self::empty().then_tool(call)
    }
    /// A single shell call (Anthropic `Bash`, OpenAI `exec_command`).
    pub fn shell(call_id: impl Into<String>, command: impl Into<String>) -> Self {
        Self::tool(ToolCall::shell(call_id, command))
    }
    /// Append text (split into three chunks).
    pub fn then_text(mut self, s: impl Into<String>) -> Self {
        self.parts.push(Part::Text(split_chunks(&s.into(), 3)));
        self
    }
    /// Append text streamed as exactly these chunks.
    pub fn then_text_chunks<I, S>(mut self, chunks: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.parts
            .push(Part::Text(chunks.into_iter().map(Into::into).collect()));
        self
    }
    /// Append reasoning / thinking text (split into chunks).
    pub fn then_thinking(mut self, s: impl Into<String>) -> Self {
        self.parts.push(Part::Thinking(split_chunks(&s.into(), 2)));
        self
    }
    /// Append a tool call.
    pub fn then_tool(mut self, call: ToolCall) -> Self {
        self.parts.push(Part::Tool(call));
        self
    }
    /// Pause `ms` milliseconds before each streamed delta.
    pub fn with_delay(mut self, ms: u64) -> Self {
        self.delay = Duration::from_millis(ms);
        self
    }
    /// Stream up to the `n`-th delta (from 0), then wait until `gate`
    /// opens before sending it and the rest: a test can act while the agent
    /// is mid-answer, whatever the machine's speed.
    pub fn hold_before_delta(mut self, n: usize, gate: Gate) -> Self {
        self.hold = Some((n, gate));
        self
    }
    /// Override the stop reason.
    pub fn with_stop_reason(mut self, r: StopReason) -> Self {
        self.stop_reason = Some(r);
        self
    }
    /// The stop reason: explicit, else `ToolUse` if there is a tool call, else `EndTurn`.
    pub fn stop_reason(&self) -> StopReason {
        self.stop_reason.unwrap_or_else(|| {
            if self.parts.iter().any(|p| matches!(p, Part::Tool(_))) {
                StopReason::ToolUse
            } else {
                StopReason::EndTurn
            }
        })
    }
    /// The full assistant text of the reply.
    pub fn full_text(&self) -> String {
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Text(c) => Some(c.concat()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("")
    }
}

/// One scripted answer: when `matcher` matches, check `assertions` and reply.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Selects the requests this rule answers.
    pub matcher: Matcher,
    /// Checks on the request; any failure replaces the reply.
    pub assertions: Vec<Assertion>,
    /// The answer.
    pub reply: Reply,
    /// A label for failures and recorded requests.
    pub name: Option<String>,
}

impl Rule {
    /// A rule answering `reply` to requests that `matcher` accepts.
    pub fn new(matcher: Matcher, reply: Reply) -> Self {
        Self {
            matcher,
            assertions: Vec::new(),
            reply,
            name: None,
        }
    }
    /// Label the rule.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }
    /// Add an assertion.
    pub fn assert(mut self, a: Assertion) -> Self {
        self.assertions.push(a);
        self
    }
    /// Assert the tool result for `call_id` contains `needle`.
    pub fn assert_tool_result_contains(
        self,
        call_id: impl Into<String>,
        needle: impl Into<String>,
    ) -> Self {
        self.assert(Assertion::ToolResultContains {
            call_id: call_id.into(),
            needle: needle.into(),
        })
    }
    /// Assert some user message (this or an earlier turn) contains `s`.
    pub fn assert_user_texts_contain(self, s: impl Into<String>) -> Self {
        self.assert(Assertion::UserTextsContain(s.into()))
    }
    /// Assert some assistant message (an earlier turn) contains `s`.
    pub fn assert_assistant_texts_contain(self, s: impl Into<String>) -> Self {
        self.assert(Assertion::AssistantTextsContain(s.into()))
    }
    /// Add a custom assertion.
    pub fn assert_fn(
        self,
        f: impl Fn(&ModelRequest) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.assert(Assertion::Custom(Arc::new(f)))
    }
    /// A display label: the name, else the matcher.
    pub fn label(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("{:?}", self.matcher))
    }
}

/// The id of the shell call made by [`Script::bash_then_text`].
pub const BASH_CALL_ID: &str = "toolu_bash_1";

/// An ordered list of rules; the first matching rule answers.
#[derive(Debug, Clone, Default)]
pub struct Script {
    /// The rules, in priority order.
    pub rules: Vec<Rule>,
}

impl Script {
    /// An empty script (every request fails with "no scripted reply matched").
    pub fn new() -> Self {
        Self::default()
    }
    /// Append a rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }
    /// Append `Rule::new(matcher, reply)`.
    pub fn on(self, matcher: Matcher, reply: Reply) -> Self {
        self.rule(Rule::new(matcher, reply))
    }
    /// Every request gets the text `reply`.
    pub fn text(reply: impl Into<String>) -> Self {
        Self::new().on(any(), Reply::text(reply))
    }
    /// A request ending in the result of the shell call [`BASH_CALL_ID`] gets
    /// `final_text`; any other request gets a shell call running `command`
    /// (Anthropic `Bash` `{command, description}`, OpenAI `exec_command`
    /// `{"cmd": command}`). To also check the command's output, use
    /// [`Script::bash_then_text_expecting`].
    pub fn bash_then_text(command: impl Into<String>, final_text: impl Into<String>) -> Self {
        Self::new()
            .rule(
                Rule::new(
                    last_is_tool_result_for(BASH_CALL_ID),
                    Reply::text(final_text),
                )
                .named("bash result -> final text"),
            )
            .rule(Rule::new(any(), Reply::shell(BASH_CALL_ID, command)).named("prompt -> bash"))
    }
    /// Like [`Script::bash_then_text`], and asserts the command's output
    /// (the tool result) contains `expect_output`.
    pub fn bash_then_text_expecting(
        command: impl Into<String>,
        expect_output: impl Into<String>,
        final_text: impl Into<String>,
    ) -> Self {
        let mut s = Self::bash_then_text(command, final_text);
        s.rules[0] = s.rules[0]
            .clone()
            .assert_tool_result_contains(BASH_CALL_ID, expect_output);
        s
    }
    /// Every turn of a session: the prompt gets a shell call running
    /// `command` (with a call id of its own per turn, so a resumed
    /// conversation never repeats an id), its result gets `final_text`.
    /// What `harness serve --demo` answers any number of prompts with.
    /// Turns are told apart by how many user texts the request carries
    /// (up to 1000 turns).
    pub fn bash_each_turn(command: impl Into<String>, final_text: impl Into<String>) -> Self {
        let command = command.into();
        let mut s = Self::new().rule(
            Rule::new(
                matcher_fn(|r| {
                    r.last_tool_results()
                        .iter()
                        .any(|t| t.call_id.starts_with("toolu_turn_"))
                }),
                Reply::text(final_text),
            )
            .named("shell result -> final text"),
        );
        for n in 1..=1000usize {
            s = s.rule(
                Rule::new(
                    matcher_fn(move |r| {
                        r.last_tool_results().is_empty() && r.user_texts().len() == n
                    }),
                    Reply::shell(format!("toolu_turn_{n}"), command.clone()),
                )
                .named(format!("prompt {n} -> shell")),
            );
        }
        s
    }

    /// The first rule (index and rule) matching `req`.
    pub fn select(&self, req: &ModelRequest) -> Option<(usize, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, r)| r.matcher.matches(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_on_char_boundaries() {
        assert_eq!(split_chunks("héllo wörld", 3).concat(), "héllo wörld");
        assert_eq!(split_chunks("héllo wörld", 3).len(), 3);
        assert_eq!(split_chunks("a", 3), vec!["a"]);
        assert_eq!(split_chunks("", 3), vec![""]);
    }

    #[test]
    fn stop_reason_is_derived_from_content() {
        assert_eq!(Reply::text("x").stop_reason(), StopReason::EndTurn);
        assert_eq!(
            Reply::text("x")
                .then_tool(ToolCall::shell("c", "ls"))
                .stop_reason(),
            StopReason::ToolUse
        );
    }
}

//! [`WorkflowsEngine`]: [`DurableEngine`] over a Workflow binding.

use async_trait::async_trait;
use wasm_bindgen::JsValue;

use harness_core::engine::DurableEngine;
use harness_core::turn::{ApprovalAnswer, TurnState};
use harness_core::{Error, Result};

use crate::binding::{js_message, sleep_ms, WorkflowBinding, WorkflowInstance};
use crate::run::{StepTuning, TurnInput, TurnParams};

/// How often [`DurableEngine::wait_turn`] asks for the instance's status.
const WAIT_POLL_MS: u64 = 500;

/// Turns as Workflow instances of one binding. Cheap to make: a Durable
/// Object makes one per command, with the runner generation its instance
/// is to emit as.
#[derive(Debug, Clone)]
pub struct WorkflowsEngine {
    binding: WorkflowBinding,
    generation: u64,
    tuning: StepTuning,
}

impl WorkflowsEngine {
    /// An engine creating instances of `binding` that emit as runner
    /// `generation`.
    pub fn new(binding: WorkflowBinding, generation: u64) -> Self {
        Self {
            binding,
            generation,
            tuning: StepTuning::default(),
        }
    }

    /// Retries and timeouts of the steps of the turns it starts.
    pub fn with_tuning(mut self, tuning: StepTuning) -> Self {
        self.tuning = tuning;
        self
    }

    async fn instance(&self, session_id: &str, turn_id: &str) -> Result<WorkflowInstance> {
        let id = instance_id(session_id, turn_id);
        self.binding.instance(&id).await.map_err(|e| {
            Error::not_found(format!(
                "turn {turn_id} of session {session_id} has no Workflow instance {id}: {e}"
            ))
        })
    }

    async fn send(&self, session_id: &str, turn_id: &str, input: &TurnInput) -> Result<()> {
        let instance = self.instance(session_id, turn_id).await?;
        let (status, _, _) = instance.current_status().await.map_err(Error::backend)?;
        if is_over(&status) {
            // Answering or aborting a turn that ended is not an error.
            return Ok(());
        }
        let json = serde_json::to_string(input)?;
        instance
            .send_input(&json)
            .await
            .map_err(|e| Error::backend(format!("sending {json} to turn {turn_id}: {e}")))
    }
}

/// The instance id of a turn: `<session>--<turn>`, with characters a
/// Workflow id does not take replaced and a hash of the original appended
/// when anything was replaced or cut (ids are at most 100 characters).
pub fn instance_id(session_id: &str, turn_id: &str) -> String {
    let raw = format!("{session_id}--{turn_id}");
    let clean: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean == raw && raw.len() <= 100 {
        return raw;
    }
    // FNV-1a: an id, not a security boundary.
    let hash = raw.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut id: String = clean.chars().take(83).collect();
    id.push_str(&format!("-{hash:016x}"));
    id
}

fn is_over(status: &str) -> bool {
    matches!(status, "complete" | "errored" | "terminated")
}

fn final_state(
    turn_id: &str,
    status: &str,
    error: Option<String>,
    output: JsValue,
) -> Result<TurnState> {
    match status {
        "complete" => {
            let json = output.as_string().ok_or_else(|| {
                Error::backend(format!("turn {turn_id}'s instance returned no state"))
            })?;
            Ok(serde_json::from_str(&json)?)
        }
        _ => Err(Error::backend(format!(
            "turn {turn_id}'s Workflow instance is {status}: {}",
            error.unwrap_or_else(|| "no error given".into())
        ))),
    }
}

#[async_trait(?Send)]
impl DurableEngine for WorkflowsEngine {
    fn name(&self) -> &'static str {
        "cloudflare-workflows"
    }

    async fn start_turn(&self, state: TurnState) -> Result<()> {
        let id = instance_id(&state.session_id, &state.turn_id);
        let params = TurnParams {
            state,
            generation: self.generation,
            tuning: self.tuning.clone(),
        };
        let json = serde_json::to_string(&params)?;
        let value = js_sys::JSON::parse(&json).map_err(|e| Error::backend(js_message(&e)))?;
        match self.binding.create_instance(&id, &value).await {
            Ok(()) => Ok(()),
            Err(create_error) => match self.binding.instance(&id).await {
                // Started before (a re-dispatch after the object restarted).
                Ok(_) => Err(Error::conflict(format!("Workflow instance {id} exists"))),
                Err(_) => Err(Error::backend(format!(
                    "creating Workflow instance {id}: {create_error}"
                ))),
            },
        }
    }

    async fn turn_state(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        let instance = self.instance(session_id, turn_id).await?;
        let (status, error, output) = instance.current_status().await.map_err(Error::backend)?;
        if !is_over(&status) {
            // An instance exposes its output only at the end; the session
            // log has the turn's progress.
            return Err(Error::unsupported(format!(
                "turn {turn_id} is {status}: a Workflow instance reports its state when it ends \
                 (read the session's frames for its progress)"
            )));
        }
        final_state(turn_id, &status, error, output)
    }

    async fn answer_approval(
        &self,
        session_id: &str,
        turn_id: &str,
        answer: ApprovalAnswer,
    ) -> Result<()> {
        self.send(session_id, turn_id, &TurnInput::Answer { answer })
            .await
    }

    async fn abort_turn(&self, session_id: &str, turn_id: &str, reason: &str) -> Result<()> {
        let reason = reason.to_string();
        self.send(session_id, turn_id, &TurnInput::Abort { reason })
            .await
    }

    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        let instance = self.instance(session_id, turn_id).await?;
        loop {
            let (status, error, output) =
                instance.current_status().await.map_err(Error::backend)?;
            if is_over(&status) {
                return final_state(turn_id, &status, error, output);
            }
            sleep_ms(WAIT_POLL_MS).await;
        }
    }
}

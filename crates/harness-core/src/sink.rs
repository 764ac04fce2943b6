//! [`LogSink`]: a [`PartSink`] that runs the session actor's machine
//! in-process over a [`SessionLog`], as the session's runner.
//!
//! Engines that run without a session server (the CLI, tests) use it, and
//! get the same folding of text deltas into one stored message, the same
//! idempotency and the same fencing as through the server: a restarted
//! worker attaches with a higher generation and the old one's writes are
//! refused.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use futures::lock::Mutex;

use crate::actor::{ActorConfig, Input, Output, Role, RunnerMessage, ServerMessage, SessionActor};
use crate::frame::SessionId;
use crate::log::SessionLog;
use crate::part::StreamPart;
use crate::slice::PartSink;
use crate::turn::TurnState;
use crate::{Error, Result};

/// The connection id the sink uses for itself inside each actor.
const RUNNER_CONN: u64 = 0;

/// See the module docs.
pub struct LogSink {
    log: Arc<dyn SessionLog>,
    generation: u64,
    actors: Mutex<HashMap<SessionId, SessionActor>>,
}

impl std::fmt::Debug for LogSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogSink")
            .field("log", &self.log)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl LogSink {
    /// A sink writing to `log` as runner `generation` (use something that
    /// grows across restarts, e.g. the start time in milliseconds).
    pub fn new(log: Arc<dyn SessionLog>, generation: u64) -> Self {
        Self {
            log,
            generation,
            actors: Mutex::new(HashMap::new()),
        }
    }

    async fn send(&self, session: &str, message: RunnerMessage) -> Result<()> {
        let session = SessionId::parse(session)?;
        let mut actors = self.actors.lock().await;
        if !actors.contains_key(&session) {
            let mut actor = SessionActor::new(ActorConfig::default());
            let mut after = 0;
            loop {
                let frames = self.log.read(&session, after, 1000).await?;
                let Some(last) = frames.last() else { break };
                after = last.seq;
                for frame in &frames {
                    actor.recover(frame);
                }
            }
            let outputs = actor.handle(Input::Connect {
                conn: RUNNER_CONN,
                role: Role::Runner {
                    generation: self.generation,
                },
                after: None,
            });
            self.perform(&session, &mut actor, outputs).await?;
            actors.insert(session.clone(), actor);
        }
        let actor = actors.get_mut(&session).expect("inserted above");
        let outputs = actor.handle(Input::Runner {
            conn: RUNNER_CONN,
            message,
        });
        self.perform(&session, actor, outputs).await
    }

    /// Execute outputs in order, feeding append results straight back.
    async fn perform(
        &self,
        session: &SessionId,
        actor: &mut SessionActor,
        outputs: Vec<Output>,
    ) -> Result<()> {
        let mut queue: std::collections::VecDeque<Output> = outputs.into();
        let mut refusal = None;
        while let Some(output) = queue.pop_front() {
            match output {
                Output::Append(request) => {
                    let input = match self.log.append(session, request).await {
                        Ok(appended) => {
                            let frame = self
                                .log
                                .read(session, appended.seq - 1, 1)
                                .await?
                                .into_iter()
                                .next()
                                .ok_or_else(|| Error::backend("appended frame is not readable"))?;
                            Input::Appended {
                                frame,
                                duplicate: appended.duplicate,
                            }
                        }
                        Err(e) => Input::AppendFailed {
                            error: e.to_string(),
                        },
                    };
                    for (i, o) in actor.handle(input).into_iter().enumerate() {
                        queue.insert(i, o);
                    }
                }
                Output::Send {
                    conn: RUNNER_CONN,
                    message: ServerMessage::Error { code, message },
                } => {
                    refusal = Some(match code.as_str() {
                        "stale_runner" | "sealed" => Error::conflict(message),
                        "frame_too_large" | "invalid" => Error::invalid(message),
                        _ => Error::backend(message),
                    });
                }
                Output::Close {
                    conn: RUNNER_CONN,
                    reason,
                } => {
                    refusal.get_or_insert_with(|| Error::conflict(reason));
                }
                // No clients are attached to an in-process sink.
                Output::Send { .. } | Output::Close { .. } | Output::Replay { .. } => {}
            }
        }
        refusal.map_or(Ok(()), Err)
    }
}

#[async_trait]
impl PartSink for LogSink {
    async fn emit(
        &self,
        session_id: &str,
        turn_id: &str,
        part: StreamPart,
        key: String,
    ) -> Result<()> {
        self.send(
            session_id,
            RunnerMessage::Part {
                turn_id: turn_id.to_string(),
                part,
                key: Some(key),
            },
        )
        .await
    }

    async fn turn_status(&self, state: &TurnState) -> Result<()> {
        let key = format!("{}:status:{}", state.turn_id, state.status.as_str());
        self.send(
            &state.session_id,
            RunnerMessage::TurnStatus {
                turn_id: state.turn_id.clone(),
                status: state.status,
                error: state.error.clone(),
                key: Some(key),
            },
        )
        .await
    }
}

//! Audit records: what ran in a session's sandbox and which model calls it
//! made, as frames of its log (so the audit chain covers them).
//!
//! A record travels as a [`StreamPart::Audit`](crate::part::StreamPart)
//! part of its turn, through the same runner → actor → log path as the
//! agent's own parts, with an idempotency key that names it: a retried
//! slice that repeats an exec with the same outcome records it once, one
//! with another outcome records both (both happened). Approvals are frames
//! already (`approval-response`), and so are the commands the agent runs
//! (its `tool-call`/`tool-result` parts). See `docs/audit.md`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::decorate::{Decorated, Decoration};
use crate::sandbox::{
    DetachedProcess, DetachedRequest, ExecEvent, ExecRequest, ExecStream, Sandbox,
};
use crate::Result;

/// Bytes of one argument kept in a record (a bootstrap script can be
/// long); the rest is cut, with a note of how much.
pub const ARG_LIMIT: usize = 2048;

/// One audited event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "kind",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum AuditRecord {
    /// The harness ran a command in the sandbox.
    Exec {
        /// Program and arguments (each cut at [`ARG_LIMIT`] bytes).
        argv: Vec<String>,
        /// The working directory asked for.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        /// The names of the environment variables it was given (never
        /// their values: they carry session tokens).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        env: Vec<String>,
        /// Started detached (the agent itself): no exit code here; the
        /// turn's status records how it ended.
        #[serde(default)]
        detached: bool,
        /// Its exit code, when it exited normally.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exit_code: Option<i32>,
        /// The signal that ended it, if one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<i32>,
        /// Why it ended, when it was waited for: `exited`, `aborted`,
        /// `timed_out`, or `unfinished` (its output was not read to the
        /// end).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ended: Option<String>,
    },
    /// The model broker forwarded (or refused) one model request of the
    /// session.
    ModelCall {
        /// Its place in the broker's journal of the session (1, 2, …),
        /// shared with [`AuditRecord::Egress`].
        index: u64,
        /// The model the request named.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
        /// The upstream's HTTP status (0 when it did not answer).
        status: u16,
        /// Prompt tokens.
        input_tokens: u64,
        /// Completion tokens.
        output_tokens: u64,
        /// What it cost by the broker's price table, in millionths of a
        /// dollar (absent for an unpriced model).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        spend_micros: Option<u64>,
    },
    /// The egress proxy of a `custom` network policy decided on one
    /// connection.
    Egress {
        /// Its place in the broker's journal of the session.
        index: u64,
        /// `host:port` as the sandbox asked for it (empty for a request
        /// that never named one).
        target: String,
        /// `allowed`, `refused` (by the policy) or `failed` (malformed,
        /// unreachable).
        decision: String,
        /// Why: the rule that allowed or refused it, or what failed.
        reason: String,
    },
}

impl AuditRecord {
    /// The idempotency key of this record as the `n`th of `scope`: for a
    /// command, the scope (a slice), the position and the record's own
    /// hash, so a repeat of the same event dedups and a different one never
    /// collides; for a journal record, the scope (the session — a fork's
    /// log holds its parent's records, numbered by the parent's journal —
    /// and the broker's journal id when it has one:
    /// `ModelBroker::journal_id`) and the journal's number.
    pub fn key(&self, scope: &str, n: usize) -> String {
        match self {
            AuditRecord::ModelCall { index, .. } | AuditRecord::Egress { index, .. } => {
                format!("audit:{scope}:broker:{index}")
            }
            AuditRecord::Exec { .. } => {
                let body = serde_json::to_vec(self).unwrap_or_default();
                let hash = hex::encode(&Sha256::digest(&body)[..8]);
                format!("audit:{scope}:{n}:{hash}")
            }
        }
    }

    /// Its number in the broker's journal of the session (none for a
    /// command the harness ran).
    pub fn journal_index(&self) -> Option<u64> {
        match self {
            AuditRecord::ModelCall { index, .. } | AuditRecord::Egress { index, .. } => {
                Some(*index)
            }
            AuditRecord::Exec { .. } => None,
        }
    }

    fn exec(argv: &[String], cwd: Option<&str>, env: &BTreeMap<String, String>) -> Self {
        AuditRecord::Exec {
            argv: argv.iter().map(|a| cut(a)).collect(),
            cwd: cwd.map(str::to_string),
            env: env.keys().cloned().collect(),
            detached: false,
            exit_code: None,
            signal: None,
            ended: None,
        }
    }
}

fn cut(arg: &str) -> String {
    if arg.len() <= ARG_LIMIT {
        return arg.to_string();
    }
    let mut end = ARG_LIMIT;
    while !arg.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} more bytes)", &arg[..end], arg.len() - end)
}

/// Where records gather until they are written as frames.
#[derive(Debug, Clone, Default)]
pub struct AuditLog(Arc<Mutex<Vec<AuditRecord>>>);

impl AuditLog {
    /// Add a record.
    pub fn push(&self, record: AuditRecord) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
    }

    /// Everything gathered so far, in order, leaving the log empty.
    pub fn take(&self) -> Vec<AuditRecord> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A sandbox whose commands are recorded in an [`AuditLog`]: `exec` (with
/// how it ended) and `spawn_detached`; every other call goes to the real
/// sandbox unchanged ([`Decorated`]).
pub type AuditedSandbox = Decorated<Auditor>;

/// The [`Decoration`] that records commands into its log.
#[derive(Debug, Clone)]
pub struct Auditor {
    log: AuditLog,
}

impl AuditedSandbox {
    /// `inner`, recorded into `log`.
    pub fn audited(inner: Box<dyn Sandbox>, log: AuditLog) -> Self {
        Decorated::new(inner, Auditor { log })
    }
}

/// Records its exec when the command's exit is read, or as `unfinished`
/// when its stream is dropped first.
struct Recorder {
    record: Option<AuditRecord>,
    log: AuditLog,
}

impl Recorder {
    fn ended(&mut self, status: Option<&crate::sandbox::ExitStatus>) {
        let Some(mut record) = self.record.take() else {
            return;
        };
        if let AuditRecord::Exec {
            exit_code,
            signal,
            ended,
            ..
        } = &mut record
        {
            match status {
                Some(s) => {
                    *exit_code = s.code;
                    *signal = s.signal;
                    *ended = Some(
                        serde_json::to_value(s.reason)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                            .unwrap_or_default(),
                    );
                }
                None => *ended = Some("unfinished".into()),
            }
        }
        self.log.push(record);
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.ended(None);
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl Decoration for Auditor {
    async fn exec(&self, inner: &dyn Sandbox, request: ExecRequest) -> Result<ExecStream> {
        let mut recorder = Recorder {
            record: Some(AuditRecord::exec(
                &request.argv,
                request.cwd.as_deref(),
                &request.env,
            )),
            log: self.log.clone(),
        };
        let stream = match inner.exec(request).await {
            Ok(s) => s,
            Err(e) => {
                recorder.ended(None);
                return Err(e);
            }
        };
        Ok(Box::pin(stream.map(move |event| {
            if let Ok(ExecEvent::Exit(status)) = &event {
                recorder.ended(Some(status));
            }
            event
        })))
    }

    async fn spawn_detached(
        &self,
        inner: &dyn Sandbox,
        request: DetachedRequest,
    ) -> Result<DetachedProcess> {
        let mut record = AuditRecord::exec(&request.argv, request.cwd.as_deref(), &request.env);
        if let AuditRecord::Exec { detached, .. } = &mut record {
            *detached = true;
        }
        let process = inner.spawn_detached(request).await;
        if process.is_ok() {
            self.log.push(record);
        }
        process
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_arguments_are_cut_on_a_char_boundary() {
        let long = "é".repeat(ARG_LIMIT);
        let cut = cut(&long);
        assert!(cut.len() < ARG_LIMIT + 40, "{}", cut.len());
        assert!(cut.ends_with("more bytes)"), "{cut}");
    }

    #[test]
    fn keys_name_the_record_and_its_place() {
        let a = AuditRecord::exec(&["true".into()], None, &BTreeMap::new());
        let b = AuditRecord::exec(&["false".into()], None, &BTreeMap::new());
        assert_eq!(a.key("s1", 0), a.key("s1", 0));
        assert_ne!(a.key("s1", 0), b.key("s1", 0));
        assert_ne!(a.key("s1", 0), a.key("s1", 1));
        let call = AuditRecord::ModelCall {
            index: 7,
            model: None,
            status: 200,
            input_tokens: 1,
            output_tokens: 2,
            spend_micros: None,
        };
        assert_eq!(call.key("s-1", 3), "audit:s-1:broker:7");
        assert_ne!(
            call.key("s-1", 3),
            call.key("s-2", 3),
            "a fork's own records collide with its parent's"
        );
    }
}

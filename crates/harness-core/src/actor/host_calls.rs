//! Host calls: the one tool-host lease a session holds, and the life of
//! every call its agent makes, each ending in exactly one recorded outcome
//! (`docs/host-tools.md`).

use crate::frame::{Frame, FrameBody};
use crate::log::AppendRequest;
use crate::relay::{HostCall, HostCallRequest, HostMessage, HostOutcome, ToolSpec};

use super::{ConnId, ErrorCode, Output, ServerMessage, SessionActor, Then};

/// The attached tool host.
#[derive(Debug, Clone)]
pub(super) struct HostLease {
    pub(super) conn: ConnId,
    pub(super) tools: Vec<ToolSpec>,
}

/// A host call of the active turn.
#[derive(Debug, Clone)]
pub(super) struct Call {
    pub(super) turn_id: String,
    pub(super) state: CallState,
}

#[derive(Debug, Clone)]
pub(super) enum CallState {
    /// Its frame is being stored.
    Recording { waiter: Option<ConnId> },
    /// Out at the host.
    Out {
        host: ConnId,
        deadline_at_ms: u64,
        budget: u64,
        /// What arrived so far, kept up to the budget.
        output: String,
        /// Bytes the host sent in all.
        total: u64,
        waiter: Option<ConnId>,
    },
    /// Its outcome is being stored.
    Finishing { waiter: Option<ConnId> },
    /// Recorded before this actor started, with no outcome: the host it
    /// went to is gone with the old connection.
    Orphaned,
    /// Its outcome frame, answered to every repeat of the call id.
    Done(Frame),
}

impl CallState {
    pub(super) fn waiter_mut(&mut self) -> Option<&mut Option<ConnId>> {
        match self {
            CallState::Recording { waiter }
            | CallState::Out { waiter, .. }
            | CallState::Finishing { waiter } => Some(waiter),
            CallState::Orphaned | CallState::Done(_) => None,
        }
    }
}

impl SessionActor {
    /// A runner asks for a host call: answer a known call id from its
    /// state, else store the call (then hand it to the host).
    pub(super) fn host_call(
        &mut self,
        conn: ConnId,
        turn_id: String,
        call: HostCallRequest,
        out: &mut Vec<Output>,
    ) {
        if let Err(e) = call.validate() {
            return Self::refuse(conn, ErrorCode::Invalid, e, out);
        }
        let active = self.meta.active_turn().map(|t| t.turn_id.clone());
        if active.as_deref() != Some(turn_id.as_str()) {
            let text = format!("turn {turn_id} is not running: no host call for it");
            return Self::refuse(conn, ErrorCode::NoActiveTurn, text, out);
        }
        if let Some(known) = self.calls.get_mut(&call.call_id) {
            if known.turn_id != turn_id {
                let text = format!(
                    "call id {:?} belongs to turn {}",
                    call.call_id, known.turn_id
                );
                return Self::refuse(conn, ErrorCode::Conflict, text, out);
            }
            match &mut known.state {
                CallState::Done(frame) => out.push(Output::Send {
                    conn,
                    message: ServerMessage::Frame {
                        frame: frame.clone(),
                    },
                }),
                CallState::Orphaned => {
                    let outcome = HostOutcome::Ambiguous {
                        reason: "the session restarted while the call was out at its host".into(),
                    };
                    self.finish_call(&call.call_id, outcome, Some(conn), out);
                }
                state => {
                    if let Some(waiter) = state.waiter_mut() {
                        *waiter = Some(conn);
                    }
                }
            }
            return;
        }
        let body = FrameBody::HostCall {
            turn_id: turn_id.clone(),
            call_id: call.call_id.clone(),
            tool: call.tool.clone(),
            byte_budget: call.budget(),
            timeout_ms: call.timeout(),
            input: call.input,
        };
        if let Err(e) = self.check_size(&body) {
            return Self::refuse(conn, ErrorCode::FrameTooLarge, e.message(), out);
        }
        self.calls.insert(
            call.call_id.clone(),
            Call {
                turn_id,
                state: CallState::Recording { waiter: Some(conn) },
            },
        );
        let key = format!("host-call:{}", call.call_id);
        self.append_then(
            AppendRequest::idempotent(body, key),
            None,
            Then::CallStored(call.call_id),
            out,
        );
    }

    /// A call's frame is stored: hand it to the host, or record why not.
    pub(super) fn call_stored(
        &mut self,
        call_id: &str,
        frame: &Frame,
        duplicate: bool,
        out: &mut Vec<Output>,
    ) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        let CallState::Recording { waiter } = call.state else {
            return;
        };
        let FrameBody::HostCall {
            tool,
            input,
            byte_budget,
            timeout_ms,
            ..
        } = &frame.body
        else {
            return;
        };
        if duplicate {
            // Stored by an earlier actor whose state this one never read:
            // it may have gone out to a host that is gone now.
            call.state = CallState::Orphaned;
            let outcome = HostOutcome::Ambiguous {
                reason:
                    "the call was recorded before the session restarted; its host may have run it"
                        .into(),
            };
            return self.finish_call(call_id, outcome, waiter, out);
        }
        let unavailable = match &self.host {
            None => Some("no tool host is attached to this session".to_string()),
            Some(h) if !h.tools.iter().any(|t| t.name == *tool) => Some(format!(
                "the attached tool host does not offer {tool:?} (it offers: {})",
                h.tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Some(_) => None,
        };
        if let Some(reason) = unavailable {
            return self.finish_call(call_id, HostOutcome::Unavailable { reason }, waiter, out);
        }
        let host = self.host.as_ref().map(|h| h.conn).unwrap_or_default();
        // The deadline runs from when the call was stored (the log's clock,
        // the same on every repeat); a log without a clock leaves the
        // actor's own time.
        let deadline_at_ms = frame.at_ms.max(self.now_ms).saturating_add(*timeout_ms);
        out.push(Output::Send {
            conn: host,
            message: ServerMessage::HostCall {
                call: HostCall {
                    call_id: call_id.to_string(),
                    tool: tool.clone(),
                    input: input.clone(),
                    byte_budget: *byte_budget,
                    deadline_at_ms,
                },
            },
        });
        call.state = CallState::Out {
            host,
            deadline_at_ms,
            budget: *byte_budget,
            output: String::new(),
            total: 0,
            waiter,
        };
    }

    /// Store a call's one outcome (the host hears nothing more of it).
    pub(super) fn finish_call(
        &mut self,
        call_id: &str,
        outcome: HostOutcome,
        waiter: Option<ConnId>,
        out: &mut Vec<Output>,
    ) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        call.state = CallState::Finishing { waiter };
        let body = FrameBody::HostOutcome {
            turn_id: call.turn_id.clone(),
            call_id: call_id.to_string(),
            outcome,
        };
        let key = format!("host-outcome:{call_id}");
        self.append_then(
            AppendRequest::idempotent(body, key),
            None,
            Then::OutcomeStored(call_id.to_string()),
            out,
        );
    }

    /// A call's outcome is stored (or was already: the log answers with
    /// the first one): keep it for repeats and answer the waiting runner.
    pub(super) fn outcome_stored(&mut self, call_id: &str, frame: &Frame, out: &mut Vec<Output>) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        let waiter = call.state.waiter_mut().and_then(|w| w.take());
        call.state = CallState::Done(frame.clone());
        if let Some(conn) = waiter {
            out.push(Output::Send {
                conn,
                message: ServerMessage::Frame {
                    frame: frame.clone(),
                },
            });
        }
    }

    /// The calls out at `host` end `ambiguous`: it left (or was replaced)
    /// without answering, and may or may not have run them.
    pub(super) fn orphan_host_calls(&mut self, host: ConnId, reason: &str, out: &mut Vec<Output>) {
        let ids: Vec<(String, Option<ConnId>)> = self
            .calls
            .iter()
            .filter_map(|(id, c)| match c.state {
                CallState::Out {
                    host: h, waiter, ..
                } if h == host => Some((id.clone(), waiter)),
                _ => None,
            })
            .collect();
        for (id, waiter) in ids {
            let outcome = HostOutcome::Ambiguous {
                reason: reason.to_string(),
            };
            self.finish_call(&id, outcome, waiter, out);
        }
    }

    /// Cancel at the host and record `outcome` for every call out that
    /// `pick` selects.
    pub(super) fn cancel_calls(
        &mut self,
        pick: impl Fn(u64) -> bool,
        reason: &str,
        outcome: impl Fn(u64) -> HostOutcome,
        out: &mut Vec<Output>,
    ) {
        let due: Vec<(String, ConnId, u64, Option<ConnId>)> = self
            .calls
            .iter()
            .filter_map(|(id, c)| match c.state {
                CallState::Out {
                    host,
                    deadline_at_ms,
                    waiter,
                    ..
                } if pick(deadline_at_ms) => Some((id.clone(), host, deadline_at_ms, waiter)),
                _ => None,
            })
            .collect();
        for (id, host, deadline, waiter) in due {
            out.push(Output::Send {
                conn: host,
                message: ServerMessage::HostCancel {
                    call_id: id.clone(),
                    reason: reason.to_string(),
                },
            });
            self.finish_call(&id, outcome(deadline), waiter, out);
        }
    }

    pub(super) fn tick(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        self.now_ms = self.now_ms.max(now_ms);
        let now = self.now_ms;
        self.cancel_calls(
            |deadline| deadline <= now,
            "the call's deadline passed",
            |deadline_at_ms| HostOutcome::Timeout { deadline_at_ms },
            out,
        );
    }

    /// A turn ended: its calls still out are cancelled (nobody waits for
    /// them now). A new turn starts: the last turn's calls are forgotten.
    pub(super) fn turn_boundary(&mut self, body: &FrameBody, out: &mut Vec<Output>) {
        match body {
            FrameBody::TurnStatus { status, .. } if status.is_terminal() => {
                self.cancel_calls(
                    |_| true,
                    "the call's turn ended",
                    |_| HostOutcome::Ambiguous {
                        reason: "the turn ended while the call was running".into(),
                    },
                    out,
                );
            }
            FrameBody::UserMessage { .. } => self.calls.clear(),
            _ => {}
        }
    }

    /// The tool host's message: a declaration, part of a result, a result.
    pub(super) fn host_message(
        &mut self,
        conn: ConnId,
        message: HostMessage,
        out: &mut Vec<Output>,
    ) {
        let Some(lease) = self.host.as_mut().filter(|h| h.conn == conn) else {
            let text = "only the session's tool host sends declarations and results";
            return Self::refuse(conn, ErrorCode::NotAHost, text, out);
        };
        match message {
            HostMessage::Declare { tools } => {
                if let Err(e) = crate::relay::validate_tools(&tools) {
                    return Self::refuse(conn, ErrorCode::Invalid, e, out);
                }
                lease.tools = tools;
                Self::received(conn, out);
            }
            HostMessage::Chunk { call_id, data } => match self.out_at(conn, &call_id) {
                Some(CallState::Out {
                    budget,
                    output,
                    total,
                    ..
                }) => {
                    keep_within(output, &data, *budget);
                    *total += data.len() as u64;
                    Self::received(conn, out);
                }
                _ => Self::not_out(conn, &call_id, out),
            },
            HostMessage::Result {
                call_id,
                output: rest,
                is_error,
                produced_bytes,
            } => {
                let Some(CallState::Out {
                    budget,
                    output,
                    total,
                    waiter,
                    ..
                }) = self.out_at(conn, &call_id)
                else {
                    return Self::not_out(conn, &call_id, out);
                };
                keep_within(output, &rest, *budget);
                let total = (*total + rest.len() as u64).max(produced_bytes.unwrap_or(0));
                let (text, truncated) =
                    crate::relay::truncate_counted(std::mem::take(output), *budget, total);
                let outcome = HostOutcome::Completed {
                    output: text,
                    is_error,
                    truncated,
                };
                let waiter = *waiter;
                Self::received(conn, out);
                self.finish_call(&call_id, outcome, waiter, out);
            }
        }
    }

    /// The state of `call_id` if it is out at host `conn`.
    pub(super) fn out_at(&mut self, conn: ConnId, call_id: &str) -> Option<&mut CallState> {
        self.calls
            .get_mut(call_id)
            .map(|c| &mut c.state)
            .filter(|s| matches!(s, CallState::Out { host, .. } if *host == conn))
    }

    pub(super) fn not_out(conn: ConnId, call_id: &str, out: &mut Vec<Output>) {
        let text = format!(
            "call {call_id:?} is not out at this host (it timed out, its turn ended, or it was never sent): dropped"
        );
        Self::refuse(conn, ErrorCode::Invalid, text, out);
    }
}

/// Append `data` to `output`, keeping at most `budget` bytes plus one
/// character (enough for the final cut to see the output was longer).
fn keep_within(output: &mut String, data: &str, budget: u64) {
    let room = usize::try_from(budget)
        .unwrap_or(usize::MAX)
        .saturating_add(4)
        .saturating_sub(output.len());
    if room == 0 {
        return;
    }
    let mut take = room.min(data.len());
    while !data.is_char_boundary(take) {
        take -= 1;
    }
    output.push_str(&data[..take]);
}

#[cfg(test)]
mod tests {
    use super::keep_within;

    #[test]
    fn kept_output_is_cut_back_to_a_char_boundary() {
        // Room for 4 bytes (budget 0 plus the 4 the final cut needs to see
        // more): "aéé" is 5 bytes and byte 4 falls inside the second `é`.
        let mut output = String::new();
        keep_within(&mut output, "aéé", 0);
        assert_eq!(output, "aé");
        // Nothing more once the room is used.
        keep_within(&mut output, "b", 0);
        assert_eq!(output, "aéb");
        keep_within(&mut output, "c", 0);
        assert_eq!(output, "aéb");
    }
}

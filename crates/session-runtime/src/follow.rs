//! [`TurnFollower`]: what a client sees of one turn, as stream parts.
//!
//! A client connection receives stored frames and live parts of the whole
//! session. The follower keeps the ones of its turn and turns them back
//! into the AI SDK part sequence: live `text-delta`s as they come, a stored
//! `message` frame as the block's `text-end` (or as start/delta/end when
//! the client joined after the block streamed), tool calls, results and
//! approval requests as stored, and the turn's terminal `turn-status` as
//! the end. The embedding API and `harness run` (in-process or over SSE)
//! both follow turns with it.

use std::collections::HashSet;

use harness_core::actor::ServerMessage;
use harness_core::frame::{FrameBody, MessageKind};
use harness_core::part::StreamPart;
use harness_core::turn::TurnStatus;

/// Something that happened in a followed turn.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnUpdate {
    /// A part of the turn (text arrives as deltas).
    Part(StreamPart),
    /// The turn ended.
    Ended {
        /// `finished`, `failed` or `timed_out`.
        status: TurnStatus,
        /// Why it failed, if it did.
        error: Option<String>,
    },
}

/// Follows one turn. See the module docs.
#[derive(Debug, Clone)]
pub struct TurnFollower {
    turn_id: String,
    live: HashSet<(MessageKind, String)>,
    ended: bool,
    text: String,
}

impl TurnFollower {
    /// Follow `turn_id`.
    pub fn new(turn_id: impl Into<String>) -> Self {
        Self {
            turn_id: turn_id.into(),
            live: HashSet::new(),
            ended: false,
            text: String::new(),
        }
    }

    /// The turn.
    pub fn turn_id(&self) -> &str {
        &self.turn_id
    }

    /// Whether the end was seen.
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// The assistant text so far (every text block, in order).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// What `message` means for the turn.
    pub fn push(&mut self, message: &ServerMessage) -> Vec<TurnUpdate> {
        if self.ended {
            return Vec::new();
        }
        match message {
            ServerMessage::Live { turn_id, part } if *turn_id == self.turn_id => {
                match part {
                    StreamPart::TextStart { id } => {
                        self.live.insert((MessageKind::Text, id.clone()));
                    }
                    StreamPart::ReasoningStart { id } => {
                        self.live.insert((MessageKind::Reasoning, id.clone()));
                    }
                    _ => {}
                }
                vec![TurnUpdate::Part(part.clone())]
            }
            ServerMessage::Frame { frame } => self.frame(&frame.body),
            _ => Vec::new(),
        }
    }

    fn frame(&mut self, body: &FrameBody) -> Vec<TurnUpdate> {
        match body {
            FrameBody::Part { turn_id, part } if *turn_id == self.turn_id => {
                vec![TurnUpdate::Part(part.clone())]
            }
            FrameBody::Message {
                turn_id,
                id,
                kind,
                text,
                ..
            } if *turn_id == self.turn_id => {
                if *kind == MessageKind::Text {
                    self.text.push_str(text);
                }
                let (start, delta, end) = match kind {
                    MessageKind::Text => (
                        StreamPart::TextStart { id: id.clone() },
                        StreamPart::TextDelta {
                            id: id.clone(),
                            delta: text.clone(),
                        },
                        StreamPart::TextEnd { id: id.clone() },
                    ),
                    MessageKind::Reasoning => (
                        StreamPart::ReasoningStart { id: id.clone() },
                        StreamPart::ReasoningDelta {
                            id: id.clone(),
                            delta: text.clone(),
                        },
                        StreamPart::ReasoningEnd { id: id.clone() },
                    ),
                };
                if self.live.remove(&(*kind, id.clone())) {
                    vec![TurnUpdate::Part(end)]
                } else {
                    [start, delta, end]
                        .into_iter()
                        .map(TurnUpdate::Part)
                        .collect()
                }
            }
            FrameBody::TurnStatus {
                turn_id,
                status,
                error,
                ..
            } if *turn_id == self.turn_id && status.is_terminal() => {
                self.ended = true;
                vec![TurnUpdate::Ended {
                    status: *status,
                    error: error.clone(),
                }]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::frame::Frame;

    fn frame(seq: u64, body: FrameBody) -> ServerMessage {
        ServerMessage::Frame {
            frame: Frame {
                seq,
                at_ms: 0,
                body,
            },
        }
    }

    #[test]
    fn live_text_then_its_stored_message_ends_the_block_once() {
        let mut f = TurnFollower::new("t1");
        let live = |part| ServerMessage::Live {
            turn_id: "t1".into(),
            part,
        };
        assert_eq!(
            f.push(&live(StreamPart::TextStart { id: "b".into() }))
                .len(),
            1
        );
        f.push(&live(StreamPart::TextDelta {
            id: "b".into(),
            delta: "Hi".into(),
        }));
        let message = FrameBody::Message {
            turn_id: "t1".into(),
            id: "b".into(),
            kind: MessageKind::Text,
            text: "Hi".into(),
            interrupted: false,
        };
        assert_eq!(
            f.push(&frame(2, message.clone())),
            vec![TurnUpdate::Part(StreamPart::TextEnd { id: "b".into() })]
        );
        // A block never seen live is replayed whole.
        let mut late = TurnFollower::new("t1");
        assert_eq!(late.push(&frame(2, message)).len(), 3);
        assert_eq!(late.text(), "Hi");
        // Other turns are ignored; the terminal status ends it.
        let other = FrameBody::TurnStatus {
            turn_id: "t0".into(),
            status: TurnStatus::Finished,
            error: None,
            code: None,
            sandbox: None,
            agent_session_id: None,
            checkpoint: None,
        };
        assert!(f.push(&frame(3, other)).is_empty());
        let end = FrameBody::TurnStatus {
            turn_id: "t1".into(),
            status: TurnStatus::Failed,
            error: Some("aborted: x".into()),
            code: None,
            sandbox: None,
            agent_session_id: None,
            checkpoint: None,
        };
        assert!(matches!(
            &f.push(&frame(4, end))[..],
            [TurnUpdate::Ended {
                status: TurnStatus::Failed,
                ..
            }]
        ));
        assert!(f.is_ended());
    }
}

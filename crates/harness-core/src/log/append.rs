//! The append decision: the one place the log's append rules live.
//!
//! Every store (memory [`LogState`](super::LogState), SQLite, the Durable
//! Object, any later one) appends in two steps:
//!
//! 1. [`CheckedAppend::new`] — outside any transaction: the size and key
//!    limits, and the body encoded once (the text SQL stores keep, so every
//!    store writes the same bytes).
//! 2. [`plan_append`] — inside the store's transaction, over an
//!    [`AppendView`] of what the store holds: the decision. A key seen
//!    before answers with its frame (a duplicate, even on a sealed log: a
//!    retry of a write acknowledged just before the seal), or is a conflict
//!    when the content differs; a sealed log refuses; otherwise the next seq,
//!    the seal flag and the folded meta. The store then writes exactly what
//!    the [`AppendPlan`] says.
//!
//! A store decides nothing itself, so a rule added here reaches every store
//! at once: the audit chain is one ([`NewFrame::hash`], computed here with
//! the key the store was given; see [`chain`](super::chain)), the search
//! index another ([`NewFrame::document`], see [`search`](crate::search)).

use crate::frame::{Frame, FrameBody, SessionId};
use crate::session::SessionMeta;
use crate::{Error, Result};

use super::chain::{link, ChainKey, FrameHash};
use super::{check_append, key_reuse_error, sealed_error, AppendRequest, Appended};

/// An append that passed the limits, with its body encoded.
#[derive(Debug, Clone)]
pub struct CheckedAppend {
    request: AppendRequest,
    body_json: String,
}

impl CheckedAppend {
    /// Check `request` against the limits (frame size after encoding, key
    /// length) and encode its body.
    pub fn new(request: AppendRequest, max_frame_bytes: usize) -> Result<Self> {
        let body_json = serde_json::to_string(&request.body)
            .map_err(|e| Error::invalid(format!("frame body does not encode: {e}")))?;
        check_append(&request, body_json.len(), max_frame_bytes)?;
        Ok(Self { request, body_json })
    }

    /// The request.
    pub fn request(&self) -> &AppendRequest {
        &self.request
    }
}

/// The log's head: what every append reads first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogHead {
    /// Seq of the last frame (0 when empty).
    pub last_seq: u64,
    /// Whether the log is sealed.
    pub sealed: bool,
    /// The last frame's chain hash (`None` when the log is empty or its
    /// last frame predates the chain: the next frame then chains from
    /// [`FrameHash::GENESIS`]).
    pub last_hash: Option<FrameHash>,
}

/// What a store holds, as the decision reads it (inside the store's
/// transaction). Lookups the decision does not need are never made: the
/// meta is read only for a frame that can change it.
pub trait AppendView {
    /// The session.
    fn session(&self) -> &SessionId;
    /// The head; `NotFound` for an unknown session.
    fn head(&mut self) -> Result<LogHead>;
    /// The stored frame whose idempotency key is `key`.
    fn frame_by_key(&mut self, key: &str) -> Result<Option<Frame>>;
    /// The session's meta now.
    fn meta(&mut self) -> Result<SessionMeta>;
}

/// What to write.
#[derive(Debug, Clone, PartialEq)]
pub struct NewFrame {
    /// The frame, with its seq and time.
    pub frame: Frame,
    /// Its body as stored (JSON text).
    pub body_json: String,
    /// Its idempotency key.
    pub key: Option<String>,
    /// The frame seals the log.
    pub seals: bool,
    /// The session's meta after the frame, when the frame changed it.
    pub meta: Option<SessionMeta>,
    /// Its link in the audit chain, to store with it (`None` only under
    /// [`ChainKey::off`], the bench's anchor).
    pub hash: Option<FrameHash>,
    /// What the search index holds of it ([`crate::search::document`]),
    /// to write in the same transaction; `None` for a frame with nothing
    /// to find.
    pub document: Option<crate::search::Document>,
}

impl NewFrame {
    /// The answer once stored.
    pub fn appended(&self) -> Appended {
        Appended {
            seq: self.frame.seq,
            duplicate: false,
            frame: self.frame.clone(),
        }
    }
}

/// The decision.
// A plan lives for one append, on the stack of the store deciding it:
// boxing a variant would cost an allocation per append for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum AppendPlan {
    /// The key was used before for the same content: store nothing,
    /// answer with the stored frame.
    Duplicate(Appended),
    /// Store this.
    Write(NewFrame),
}

/// Decide an append at `now_ms` over what `view` holds, chaining the new
/// frame with `chain` (see the module docs for the rules).
pub fn plan_append(
    view: &mut dyn AppendView,
    append: CheckedAppend,
    now_ms: u64,
    chain: &ChainKey,
) -> Result<AppendPlan> {
    let CheckedAppend { request, body_json } = append;
    let head = view.head()?;
    if let Some(key) = &request.idempotency_key {
        if let Some(stored) = view.frame_by_key(key)? {
            // Decoded bodies are compared, so JSON formatting never turns
            // a retry into a conflict.
            return if stored.body == request.body {
                Ok(AppendPlan::Duplicate(Appended {
                    seq: stored.seq,
                    duplicate: true,
                    frame: stored,
                }))
            } else {
                Err(key_reuse_error(key, stored.seq))
            };
        }
    }
    if head.sealed {
        return Err(sealed_error(view.session()));
    }
    let seq = head.last_seq + 1;
    let key = request.idempotency_key;
    let meta = if SessionMeta::touched_by(&request.body) {
        let mut meta = view.meta()?;
        meta.apply(seq, &request.body, key.as_deref())
            .then_some(meta)
    } else {
        None
    };
    let hash = chain.chains().then(|| {
        link(
            chain,
            &head.last_hash.unwrap_or(FrameHash::GENESIS),
            seq,
            now_ms,
            key.as_deref(),
            &body_json,
        )
    });
    Ok(AppendPlan::Write(NewFrame {
        seals: matches!(request.body, FrameBody::Sealed {}),
        document: crate::search::document(&request.body),
        frame: Frame {
            seq,
            at_ms: now_ms,
            body: request.body,
        },
        body_json,
        key,
        meta,
        hash,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::SessionConfig;

    /// A view over plain values, counting the lookups made.
    struct Plain {
        session: SessionId,
        head: LogHead,
        frames: Vec<(Frame, Option<String>)>,
        meta: SessionMeta,
        meta_reads: usize,
        chain: Vec<crate::log::chain::ChainedFrame>,
    }

    impl Plain {
        fn new() -> Self {
            Self {
                session: SessionId::parse("s").unwrap(),
                head: LogHead {
                    last_seq: 0,
                    sealed: false,
                    last_hash: None,
                },
                frames: Vec::new(),
                meta: SessionMeta::new(Some(SessionConfig::default())),
                meta_reads: 0,
                chain: Vec::new(),
            }
        }

        fn apply(&mut self, plan: AppendPlan) -> Appended {
            match plan {
                AppendPlan::Duplicate(a) => a,
                AppendPlan::Write(w) => {
                    self.head.last_seq = w.frame.seq;
                    self.head.sealed |= w.seals;
                    self.head.last_hash = w.hash;
                    self.chain.push(crate::log::chain::ChainedFrame {
                        seq: w.frame.seq,
                        at_ms: w.frame.at_ms,
                        key: w.key.clone(),
                        body: w.body_json.clone(),
                        hash: w.hash,
                    });
                    if let Some(meta) = w.meta.clone() {
                        self.meta = meta;
                    }
                    self.frames.push((w.frame.clone(), w.key.clone()));
                    w.appended()
                }
            }
        }

        fn append(&mut self, request: AppendRequest) -> Result<Appended> {
            let checked = CheckedAppend::new(request, 1 << 20)?;
            let plan = plan_append(self, checked, 7, &ChainKey::new(*b"test"))?;
            Ok(self.apply(plan))
        }
    }

    impl AppendView for Plain {
        fn session(&self) -> &SessionId {
            &self.session
        }
        fn head(&mut self) -> Result<LogHead> {
            Ok(self.head)
        }
        fn frame_by_key(&mut self, key: &str) -> Result<Option<Frame>> {
            Ok(self
                .frames
                .iter()
                .find(|(_, k)| k.as_deref() == Some(key))
                .map(|(f, _)| f.clone()))
        }
        fn meta(&mut self) -> Result<SessionMeta> {
            self.meta_reads += 1;
            Ok(self.meta.clone())
        }
    }

    fn text(t: &str) -> FrameBody {
        FrameBody::Message {
            turn_id: "t1".into(),
            id: "m".into(),
            kind: crate::frame::MessageKind::Text,
            text: t.into(),
            interrupted: false,
        }
    }

    #[test]
    fn seqs_follow_the_head_and_frames_carry_the_time() {
        let mut view = Plain::new();
        for want in 1..=3 {
            let a = view.append(AppendRequest::new(text("x"))).unwrap();
            assert_eq!((a.seq, a.frame.at_ms, a.duplicate), (want, 7, false));
        }
    }

    #[test]
    fn a_key_seen_before_is_a_duplicate_even_when_sealed_and_a_conflict_with_other_content() {
        let mut view = Plain::new();
        let first = view
            .append(AppendRequest::idempotent(text("a"), "k"))
            .unwrap();
        view.append(AppendRequest::new(FrameBody::Sealed {}))
            .unwrap();
        let again = view
            .append(AppendRequest::idempotent(text("a"), "k"))
            .unwrap();
        assert!(again.duplicate);
        assert_eq!(again.frame, first.frame);
        let err = view
            .append(AppendRequest::idempotent(text("b"), "k"))
            .unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Conflict);
        let err = view.append(AppendRequest::new(text("c"))).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Conflict, "{err}");
        assert!(err.to_string().contains("sealed"), "{err}");
        assert_eq!(view.frames.len(), 2, "nothing stored after the seal");
    }

    #[test]
    fn the_meta_is_read_and_written_only_for_frames_that_change_it() {
        let mut view = Plain::new();
        view.append(AppendRequest::new(text("x"))).unwrap();
        assert_eq!(view.meta_reads, 0, "a text frame cannot change the meta");
        let mut plan = |body| {
            let checked = CheckedAppend::new(AppendRequest::new(body), 1 << 20).unwrap();
            match plan_append(&mut view, checked, 1, &ChainKey::unkeyed()).unwrap() {
                AppendPlan::Write(w) => w.meta,
                AppendPlan::Duplicate(_) => panic!("no key, no duplicate"),
            }
        };
        let meta = plan(FrameBody::UserMessage {
            text: "go".into(),
            turn_id: None,
        })
        .expect("a prompt opens a turn");
        assert_eq!(meta.turn.unwrap().turn_id, "t1");
        assert!(plan(FrameBody::RunnerAttached { generation: 0 }).is_none());
    }

    #[test]
    fn every_written_frame_is_chained_to_the_one_before_and_a_duplicate_adds_no_link() {
        let mut view = Plain::new();
        view.append(AppendRequest::idempotent(text("a"), "k"))
            .unwrap();
        view.append(AppendRequest::new(text("b"))).unwrap();
        view.append(AppendRequest::idempotent(text("a"), "k"))
            .unwrap();
        view.append(AppendRequest::new(FrameBody::Sealed {}))
            .unwrap();
        assert_eq!(view.chain.len(), 3);
        let key = ChainKey::new(*b"test");
        let report = crate::log::chain::verify_chain(&key, &view.chain, 3);
        assert!(report.intact(), "{report:?}");
        assert_eq!(report.head, view.head.last_hash);
        // Another key does not verify it: the chain is keyed.
        let other = crate::log::chain::verify_chain(&ChainKey::unkeyed(), &view.chain, 3);
        assert!(!other.intact());
    }

    #[test]
    fn limits_are_checked_on_the_encoded_body() {
        let body = text(&"x".repeat(100));
        let len = serde_json::to_string(&body).unwrap().len();
        assert!(CheckedAppend::new(AppendRequest::new(body.clone()), len).is_ok());
        let err = CheckedAppend::new(AppendRequest::new(body.clone()), len - 1).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidInput);
        let err = CheckedAppend::new(AppendRequest::idempotent(body, ""), 1 << 20).unwrap_err();
        assert!(err.to_string().contains("idempotency key"), "{err}");
    }
}

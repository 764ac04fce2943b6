//! Who runs a session's actor when several servers share one log.
//!
//! One actor per session is what keeps a log gap-free and every key once
//! (the actor is its session's only writer). On one server the hub's
//! registry guarantees it; across servers over one shared log (PostgreSQL)
//! a **lease** per session does: a server runs a session's actor only
//! while it holds the lease, renews it while the actor runs, and the store
//! refuses appends from a server whose lease was taken (a *generation*
//! that grows each time the lease changes hands fences the old owner).
//! Servers that do not hold a session's lease forward its connections to
//! the server that does.
//!
//! A node is named by the URL its peers reach it at, so the name is also
//! where to forward to.

use std::time::Duration;

use async_trait::async_trait;

use crate::frame::SessionId;
use crate::maybe::{MaybeSend, MaybeSync};
use crate::Result;

/// What [`SessionLeases::acquire`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This node holds the lease now, at this generation.
    Owned {
        /// Grows each time the lease changes node.
        generation: u64,
        /// The lease came from another node (or the same node's previous
        /// life) rather than being free or already held here: the actor
        /// takes over whatever the old owner left running.
        taken_over: bool,
    },
    /// Another node holds it and has renewed it in time.
    Held {
        /// The owner's name: the URL its peers reach it at.
        node: String,
    },
}

/// A lease per session, shared by every node of one deployment.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait SessionLeases: MaybeSend + MaybeSync + std::fmt::Debug {
    /// This node's name (the URL its peers reach it at).
    fn node(&self) -> &str;

    /// How long a lease lasts unless renewed: how long a dead node's
    /// sessions wait for a new owner. Renew well within it.
    fn ttl(&self) -> Duration;

    /// Take `session`'s lease if it is free, expired or already this
    /// node's; otherwise say who holds it.
    async fn acquire(&self, session: &SessionId) -> Result<Claim>;

    /// Extend the lease held at `generation`; `false` once another node
    /// took it (the actor must stop: its appends are refused from now on).
    async fn renew(&self, session: &SessionId, generation: u64) -> Result<bool>;

    /// Extend every lease of `held` (session, generation) at once: for each,
    /// in order, whether this node still holds it. A node renews all its
    /// leases this way every third of the lease — one round trip for the
    /// node, not one per session. By default one [`renew`](Self::renew)
    /// each; a store that can do it in one statement overrides it.
    async fn renew_all(&self, held: &[(SessionId, u64)]) -> Result<Vec<bool>> {
        let mut renewed = Vec::with_capacity(held.len());
        for (session, generation) in held {
            renewed.push(self.renew(session, *generation).await?);
        }
        Ok(renewed)
    }

    /// Give the lease held at `generation` up now (an actor that retired):
    /// the next node may take the session without waiting for expiry.
    async fn release(&self, session: &SessionId, generation: u64) -> Result<()>;

    /// Who holds `session`'s lease and whether it is still valid:
    /// `(node, generation, expired)`; `None` when no node ever held it.
    async fn holder(&self, session: &SessionId) -> Result<Option<(String, u64, bool)>>;

    /// Sessions whose lease expired without being released — their node
    /// died or stalled — at most `limit`, the longest expired first: what
    /// the nodes sweep for, so a session with work left is taken over even
    /// when no client or runner asks for it.
    async fn orphans(&self, limit: usize) -> Result<Vec<SessionId>>;
}

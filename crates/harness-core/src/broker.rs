//! The model broker's contract: how an agent reaches its model without the
//! key.
//!
//! With a broker configured, the slice runner never hands the agent the
//! real credentials. A sandbox is made with [`HostForward`]s to the broker
//! (and, for a `custom` network policy, to the egress proxy that enforces
//! it), and the agent's environment names the broker's endpoint and a
//! session-scoped token instead of the provider's URL and key. The broker,
//! on the host, checks the token against the session the endpoint belongs
//! to, swaps in the real key and forwards the stream.
//!
//! The implementation (sockets, HTTP, the real keys) lives outside core, in
//! the `harness-broker` crate; this trait is what the slice runner calls.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::maybe::{MaybeSend, MaybeSync};
use crate::sandbox::{HostForward, NetworkPolicy};
use crate::Result;

/// The variables that carry model credentials and endpoints. The slice runner
/// removes them from the caller's environment before it adds what the broker
/// gives: with a broker, the agent sees none of the caller's values.
pub const CREDENTIAL_ENV_VARS: &[&str] = &[
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
];

/// How a sandbox's commands reach a host service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Through the sandbox's [`HostForward`]s, on its own loopback.
    Forwarded,
    /// Directly: the sandbox shares the host's network namespace
    /// ([`SandboxProvider::shares_host_network`](crate::sandbox::SandboxProvider::shares_host_network)).
    HostNetwork,
}

/// The host side of an agent's model access and egress.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait ModelBroker: MaybeSend + MaybeSync + std::fmt::Debug {
    /// The host services a new sandbox of `session_id` with this network
    /// policy reaches on its loopback: the broker, and the egress proxy when
    /// the policy is `custom`. Registers the session (and its policy) so
    /// that both answer from now on, in this process and after a restart.
    async fn forwards(&self, session_id: &str, network: &NetworkPolicy)
        -> Result<Vec<HostForward>>;

    /// What the agent's environment gets instead of the real credentials:
    /// the broker's endpoint for this session, the session's token, and
    /// the proxy variables of a `custom` policy. Called when a turn's agent
    /// starts: from then until [`turn_ended`](Self::turn_ended) the token
    /// opens the session's endpoint.
    async fn agent_env(
        &self,
        session_id: &str,
        network: &NetworkPolicy,
        reach: Reach,
    ) -> Result<BTreeMap<String, String>>;

    /// The session's turn ended (its agent is gone): the session's token
    /// opens nothing until its next turn starts. The slice runner calls it
    /// once per turn end; it is idempotent.
    async fn turn_ended(&self, session_id: &str) -> Result<()>;

    /// The session's turn is still running: the slice runner says so at the
    /// start of every slice. A broker that tells running turns from ones
    /// whose runner is gone (a killed server nobody restarted) refreshes
    /// the session's mark here, and one that stopped serving starts again.
    /// The default does nothing.
    async fn turn_running(&self, session_id: &str) -> Result<()> {
        let _ = session_id;
        Ok(())
    }

    /// Hold `session_id` to `budget` from now on: once its usage crosses
    /// it, the broker refuses the session's model calls. A broker that
    /// cannot enforce budgets says so (the default), so a budget is never
    /// silently ignored.
    async fn set_budget(&self, session_id: &str, budget: &crate::turn::Budget) -> Result<()> {
        let _ = session_id;
        if budget.is_unlimited() {
            Ok(())
        } else {
            Err(crate::Error::unsupported(
                "this model broker does not enforce budgets",
            ))
        }
    }

    /// What the session used so far (`None` when this broker does not
    /// count).
    async fn usage(&self, session_id: &str) -> Result<Option<crate::turn::ModelUsage>> {
        let _ = session_id;
        Ok(None)
    }

    /// The session's brokered calls and egress decisions not yet in its
    /// log (`AuditRecord::ModelCall` and `Egress`, in order; none from a
    /// broker that keeps no journal). The slice runner writes them at each
    /// turn's end, then acknowledges them with
    /// [`model_calls_recorded`](Self::model_calls_recorded).
    async fn model_calls(&self, session_id: &str) -> Result<Vec<crate::audit::AuditRecord>> {
        let _ = session_id;
        Ok(Vec::new())
    }

    /// Which journal [`model_calls`](Self::model_calls) numbers its records
    /// in, when a session's records may come from several: a broker that
    /// keeps its journal on its own host (one per harness home) numbers a
    /// session's calls from 1 there, so two workers' record 1 of the same
    /// session are two records. Their keys in the log carry this id, so
    /// they never collide; a retry through the same broker writes the same
    /// keys again. `None` (the default): the session has one journal,
    /// wherever its turns run.
    fn journal_id(&self) -> Option<String> {
        None
    }

    /// The session's journal up to `upto` (its records' `index`) is in
    /// its log.
    async fn model_calls_recorded(&self, session_id: &str, upto: u64) -> Result<()> {
        let _ = (session_id, upto);
        Ok(())
    }
}

//! # harness-egress
//!
//! The egress proxy of a `custom` network policy.
//!
//! A sandbox under [`NetworkPolicy::Custom`](harness_core::sandbox::NetworkPolicy::Custom)
//! has no route out. Its only way out is this HTTP/1.1 proxy on the host,
//! which the sandbox reaches on its own loopback
//! (`127.0.0.1:`[`EGRESS_PROXY_PORT`](harness_core::sandbox::EGRESS_PROXY_PORT))
//! through a forwarded Unix socket, with `HTTP_PROXY`, `HTTPS_PROXY` and
//! `ALL_PROXY` pointing at it. The proxy checks every destination against
//! the policy and connects only to addresses that passed the check.
//!
//! - [`EgressPolicy`] validates the policy and [`decides`](EgressPolicy::decide)
//!   about one destination (pure, no I/O).
//! - [`serve_connection`] serves one client connection (`CONNECT` tunnels
//!   and absolute-form `http://` requests).
//! - [`EgressProxy`] serves a Unix or TCP listener with one policy and
//!   counts allowed and refused connections.
//!
//! ```no_run
//! # async fn demo() -> harness_core::Result<()> {
//! use harness_core::sandbox::NetworkPolicy;
//! use harness_egress::{EgressPolicy, EgressProxy};
//!
//! let policy = EgressPolicy::from_network(&NetworkPolicy::Custom {
//!     allowed_hosts: vec!["*.github.com".into(), "pypi.org".into(), "files.pythonhosted.org".into()],
//!     allowed_cidrs: vec![],
//!     denied_cidrs: vec!["10.0.0.0/8".into(), "169.254.0.0/16".into()],
//!     allowed_ports: vec![443],
//! })?;
//! let proxy = EgressProxy::new(policy);
//! let listener = tokio::net::UnixListener::bind("/run/harness/s1/egress.sock")?;
//! let task = proxy.serve_unix(listener);
//! # task.abort();
//! # Ok(()) }
//! ```
//!
//! See `docs/network.md` ("The egress proxy") for the rules and replies.
#![warn(missing_docs)]

mod http;
mod policy;
mod proxy;

pub use policy::{Decision, EgressPolicy};
pub use proxy::{
    serve_connection, EgressCounts, EgressProxy, Journal, Outcome, CONNECT_TIMEOUT, EGRESS_HEADER,
    HEADER_TIMEOUT, MAX_HEADERS, MAX_HEADER_BYTES,
};

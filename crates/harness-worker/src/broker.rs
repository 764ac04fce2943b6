//! The model broker on Cloudflare: the key stays in the Worker.
//!
//! A Cloudflare sandbox cannot reach a socket on any host, so the native
//! broker's forwards do not apply; but its container reaches the network,
//! and the Worker is on it. So the Worker is the broker:
//!
//! ```text
//!   bridge sandbox                      the Worker                      provider
//!   agent ──► HARNESS_BROKER_URL/v1/broker/s/<session>/anthropic/… ──► token → key ──►
//! ```
//!
//! - a turn's agent gets `wire::agent_env`: the Worker's broker path for its
//!   session and a **turn token** (`token::turn_token_for`, an HMAC of the
//!   session and the turn under `HARNESS_BROKER_SECRET`), never the key;
//! - the route checks the tag against the session the path names, then asks
//!   the session's object whether that turn is the one running: a token
//!   opens its session only while its turn runs (an ended turn's token is
//!   expired for good);
//! - the real key (`ANTHROPIC_API_KEY` / `OPENAI_API_KEY`, secrets of the
//!   Worker, with `ANTHROPIC_BASE_URL` / `OPENAI_BASE_URL`) is added here,
//!   and the answer streams back as it arrives.
//!
//! The rules (tokens, headers, the path, refusals, the agent's variables)
//! are `harness-broker-proto`'s, the native broker's own.

use std::collections::BTreeMap;

use async_trait::async_trait;
use harness_broker_proto::token;
use harness_broker_proto::wire::{self, Api, MAX_REQUEST_BYTES};
use harness_core::broker::{ModelBroker, Reach};
use harness_core::log::LogInfo;
use harness_core::sandbox::{HostForward, NetworkPolicy};
use harness_core::{Error, Result, SessionId};
use worker::{Env, Fetch, Headers, Method, Request, RequestInit, Response};

use crate::object::secret_or_var;
use crate::turns::{object_request, var};

/// The Worker's URL as sandboxes reach it (its public URL in a
/// deployment): set, turns run through the broker.
pub(crate) const BROKER_URL_VAR: &str = "HARNESS_BROKER_URL";
/// The secret turn tokens are made with (a Worker secret).
pub(crate) const BROKER_SECRET_VAR: &str = "HARNESS_BROKER_SECRET";

/// Where the broker's routes live under the Worker's URL.
const ROUTE: &str = "v1/broker/s";

/// The broker of one turn, as the slice runner sees it.
pub(crate) struct TurnBroker {
    secret: Vec<u8>,
    url: String,
    turn_id: String,
}

impl std::fmt::Debug for TurnBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        f.debug_struct("TurnBroker")
            .field("url", &self.url)
            .field("turn_id", &self.turn_id)
            .finish_non_exhaustive()
    }
}

impl TurnBroker {
    /// The broker of `turn_id` when the Worker is configured as one
    /// (`HARNESS_BROKER_URL`); an error when it is half configured.
    pub(crate) fn from_env(env: &Env, turn_id: &str) -> Result<Option<Self>> {
        let Some(url) = var(env, BROKER_URL_VAR) else {
            return Ok(None);
        };
        let secret = secret_or_var(env, BROKER_SECRET_VAR).ok_or_else(|| {
            Error::invalid(format!(
                "{BROKER_URL_VAR} is set but {BROKER_SECRET_VAR} is not: the Worker's broker \
                 makes its turn tokens with that secret (`wrangler secret put \
                 {BROKER_SECRET_VAR}`, 32 random bytes or more)"
            ))
        })?;
        Ok(Some(Self {
            secret: secret.into_bytes(),
            url: url.trim_end_matches('/').to_string(),
            turn_id: turn_id.to_string(),
        }))
    }
}

#[async_trait(?Send)]
impl ModelBroker for TurnBroker {
    async fn forwards(
        &self,
        _session_id: &str,
        _network: &NetworkPolicy,
    ) -> Result<Vec<HostForward>> {
        // The sandbox reaches the Worker over the network: nothing to forward.
        Ok(Vec::new())
    }

    async fn agent_env(
        &self,
        session_id: &str,
        _network: &NetworkPolicy,
        _reach: Reach,
    ) -> Result<BTreeMap<String, String>> {
        let id = SessionId::parse(session_id)?;
        let base = format!("{}/{ROUTE}/{}", self.url, id.as_str());
        let token = token::turn_token_for(&self.secret, id.as_str(), &self.turn_id);
        Ok(wire::agent_env(&base, &token))
    }

    async fn turn_ended(&self, _session_id: &str) -> Result<()> {
        // The token expires with its turn: the route asks the session's
        // object which turn runs, so there is nothing to revoke.
        Ok(())
    }
}

/// A refusal as both SDKs print it.
fn refuse(status: u16, kind: &str, message: &str) -> worker::Result<Response> {
    let headers = Headers::new();
    headers.set("content-type", "application/json")?;
    Ok(Response::ok(wire::refusal_body(kind, message))?
        .with_status(status)
        .with_headers(headers))
}

/// `/v1/broker/s/<session>/<api>/<rest>`: check the turn token, swap in the
/// real key, forward, and stream the answer back.
pub(crate) async fn forward(
    mut req: Request,
    env: &Env,
    session: &str,
    api: &str,
    rest: &str,
) -> worker::Result<Response> {
    let Ok(session) = SessionId::parse(session) else {
        return refuse(404, "not_found", "no such session");
    };
    let Some(api) = Api::parse(api) else {
        return refuse(
            404,
            "not_found",
            "unknown provider in the path: use /anthropic/ or /openai/",
        );
    };
    let Some(secret) = secret_or_var(env, BROKER_SECRET_VAR) else {
        return refuse(
            503,
            "api_error",
            &format!("this Worker is not a model broker: {BROKER_SECRET_VAR} is not set"),
        );
    };
    let headers = req.headers();
    let (x_api_key, authorization) = (headers.get("x-api-key")?, headers.get("authorization")?);
    let presented = wire::presented_token(x_api_key.as_deref(), authorization.as_deref());
    let Some(turn) = presented
        .and_then(|t| token::verify_turn(secret.as_bytes(), session.as_str(), t))
        .map(str::to_string)
    else {
        return refuse(
            401,
            "authentication_error",
            "this token does not open this session",
        );
    };
    match running_turn(env, &session).await {
        Ok(Some(running)) if running == turn => {}
        Ok(_) => {
            return refuse(
                403,
                "permission_error",
                &format!("turn {turn} of this session is not running: its token expired with it"),
            )
        }
        Err(e) => return refuse(502, "api_error", &format!("the session's object: {e}")),
    }
    let Some(key) = secret_or_var(env, api.key_var()) else {
        return refuse(
            503,
            "api_error",
            &format!(
                "no key for this provider: set {} as a secret of the Worker",
                api.key_var()
            ),
        );
    };
    let base = var(env, api.url_var()).unwrap_or_else(|| api.default_url().to_string());

    let body = match crate::front::limited_body(&mut req, MAX_REQUEST_BYTES).await {
        Ok(body) => body,
        Err(None) => {
            return refuse(
                413,
                "request_too_large",
                &format!("request body over {MAX_REQUEST_BYTES} bytes"),
            )
        }
        Err(Some(e)) => return Err(e),
    };
    let url = req.url()?;
    let target = wire::upstream_url(&base, rest, url.query());
    let upstream_headers = Headers::new();
    for (name, value) in req.headers().entries() {
        if !wire::is_hop_header(&name) {
            upstream_headers.append(&name, &value)?;
        }
    }
    let (key_header, key) = api.key_header(&key);
    upstream_headers.set(key_header, &key)?;
    let mut init = RequestInit::new();
    init.with_method(req.method())
        .with_headers(upstream_headers);
    if req.method() != Method::Get && req.method() != Method::Head {
        init.with_body(Some(
            worker::js_sys::Uint8Array::from(body.as_slice()).into(),
        ));
    }
    let upstream = Request::new_with_init(&target, &init)?;
    let mut answer = match Fetch::Request(upstream).send().await {
        Ok(a) => a,
        Err(e) => {
            return refuse(
                502,
                "api_error",
                &format!("the upstream {base} did not answer: {e}"),
            )
        }
    };
    let headers = Headers::new();
    for (name, value) in answer.headers().entries() {
        if !wire::is_hop_header(&name) {
            headers.append(&name, &value)?;
        }
    }
    let status = answer.status_code();
    Ok(Response::from_stream(answer.stream()?)?
        .with_status(status)
        .with_headers(headers))
}

/// The turn `session`'s object says is running, if any.
async fn running_turn(env: &Env, session: &SessionId) -> Result<Option<String>> {
    let mut response = object_request(env, session.as_str(), Method::Get, "info", None)
        .await
        .map_err(|e| Error::backend(e.to_string()))?;
    if response.status_code() != 200 {
        return Err(Error::backend(format!(
            "it answered {} to info",
            response.status_code()
        )));
    }
    let info: LogInfo = response
        .json()
        .await
        .map_err(|e| Error::backend(format!("its info: {e}")))?;
    Ok(info.meta.active_turn().map(|t| t.turn_id.clone()))
}

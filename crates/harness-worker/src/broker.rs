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
//! - the session's budget is checked against its usage so far
//!   (`usage::admit`, the native broker's rule; spend priced by
//!   `HARNESS_MODEL_PRICES`);
//! - the real key (`ANTHROPIC_API_KEY` / `OPENAI_API_KEY`, secrets of the
//!   Worker, with `ANTHROPIC_BASE_URL` / `OPENAI_BASE_URL`) is added here,
//!   and the answer streams back as it arrives, its token counts read as
//!   it passes; once it ends the call is journaled in the session's object
//!   (`journal.rs`), from where the turn writes it into the log.
//!
//! The rules (tokens, headers, the path, refusals, the agent's variables)
//! are `harness-broker-proto`'s, the native broker's own.

use std::collections::BTreeMap;

use async_trait::async_trait;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use futures::channel::oneshot;
use futures::Stream;
use harness_broker_proto::token;
use harness_broker_proto::usage::{self, PriceTable, UsageScanner};
use harness_broker_proto::wire::{self, Api, MAX_REQUEST_BYTES};
use harness_core::audit::AuditRecord;
use harness_core::broker::{ModelBroker, Reach};
use harness_core::sandbox::{HostForward, NetworkPolicy};
use harness_core::turn::{Budget, ModelUsage};
use harness_core::{Error, Result, SessionId};
use worker::{ByteStream, Context, Env, Fetch, Headers, Method, Request, RequestInit, Response};

use crate::journal::{BrokerState, CallFigures};

use crate::object::secret_or_var;
use crate::turns::{object_request, var};

/// The Worker's URL as sandboxes reach it (its public URL in a
/// deployment): set, turns run through the broker.
pub(crate) const BROKER_URL_VAR: &str = "HARNESS_BROKER_URL";
/// The secret turn tokens are made with (a Worker secret).
pub(crate) const BROKER_SECRET_VAR: &str = "HARNESS_BROKER_SECRET";
/// The price table spend is counted by (`usage::PriceTable`'s JSON).
const PRICES_VAR: &str = "HARNESS_MODEL_PRICES";

/// Where the broker's routes live under the Worker's URL.
const ROUTE: &str = "v1/broker/s";

/// The broker of one turn, as the slice runner sees it.
pub(crate) struct TurnBroker {
    env: Env,
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
            env: env.clone(),
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

    async fn set_budget(&self, session_id: &str, budget: &Budget) -> Result<()> {
        let body = serde_json::to_vec(budget)?;
        journal_op(
            &self.env,
            session_id,
            Method::Post,
            "broker-budget",
            Some(body),
        )
        .await?;
        Ok(())
    }

    async fn usage(&self, session_id: &str) -> Result<Option<ModelUsage>> {
        Ok(Some(broker_state(&self.env, session_id).await?.usage))
    }

    async fn model_calls(&self, session_id: &str) -> Result<Vec<AuditRecord>> {
        let mut answer =
            journal_op(&self.env, session_id, Method::Get, "broker-calls", None).await?;
        answer
            .json()
            .await
            .map_err(|e| Error::backend(format!("the session's journal: {e}")))
    }

    async fn model_calls_recorded(&self, session_id: &str, upto: u64) -> Result<()> {
        let op = format!("broker-recorded?upto={upto}");
        journal_op(&self.env, session_id, Method::Post, &op, None).await?;
        Ok(())
    }
}

/// `op` of the session's journal (`journal.rs`, in its object); an error
/// unless it answers 2xx.
async fn journal_op(
    env: &Env,
    session: &str,
    method: Method,
    op: &str,
    body: Option<Vec<u8>>,
) -> Result<Response> {
    let mut answer = object_request(env, session, method, op, body)
        .await
        .map_err(|e| Error::backend(format!("the session's object: {e}")))?;
    let status = answer.status_code();
    if !(200..300).contains(&status) {
        let text = answer.text().await.unwrap_or_default();
        return Err(Error::backend(format!(
            "the session's object answered {status} to {op}: {text}"
        )));
    }
    Ok(answer)
}

/// Journal one call of `session`.
async fn journal_call(env: &Env, session: &str, call: &CallFigures) -> Result<()> {
    let body = serde_json::to_vec(call)?;
    journal_op(env, session, Method::Post, "broker-call", Some(body)).await?;
    Ok(())
}

/// Which turn of `session` runs, its budget and its usage so far.
async fn broker_state(env: &Env, session: &str) -> Result<BrokerState> {
    let mut answer = journal_op(env, session, Method::Get, "broker-state", None).await?;
    answer
        .json()
        .await
        .map_err(|e| Error::backend(format!("the session's broker state: {e}")))
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
    ctx: &Context,
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
    let state = match broker_state(env, session.as_str()).await {
        Ok(state) => state,
        Err(e) => return refuse(502, "api_error", &e.to_string()),
    };
    if state.running_turn.as_deref() != Some(turn.as_str()) {
        return refuse(
            403,
            "permission_error",
            &format!("turn {turn} of this session is not running: its token expired with it"),
        );
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
    // The session's budget, by the native broker's rule.
    let prices = match var(env, PRICES_VAR) {
        Some(json) => match PriceTable::parse(json.as_bytes(), PRICES_VAR) {
            Ok(prices) => prices,
            Err(e) => return refuse(500, "api_error", &format!("the broker's price table: {e}")),
        },
        None => PriceTable::default(),
    };
    let model = wire::request_model(&body);
    if let Err(why) = admit(env, &session, &state, &prices, &model).await {
        return refuse(403, "permission_error", &why);
    }
    let upstream = upstream_request(&req, &body, &base, rest, api, &key)?;
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
    // The answer passes as it arrives; its token counts are read on the
    // way, and once it ended (or the agent hung up) the call is journaled.
    let (ended, figures) = oneshot::channel();
    let scanned = Scanned {
        inner: Box::pin(answer.stream()?),
        scanner: Some(UsageScanner::default()),
        ended: Some(ended),
    };
    let env = env.clone();
    let session_id = session.to_string();
    ctx.wait_until(async move {
        let (input_tokens, output_tokens) = figures.await.unwrap_or((0, 0));
        let call = CallFigures {
            spend_micros: prices.spend_micros(
                model.as_deref().unwrap_or(""),
                input_tokens,
                output_tokens,
            ),
            model,
            status,
            input_tokens,
            output_tokens,
        };
        if let Err(e) = journal_call(&env, &session_id, &call).await {
            worker::console_error!("the broker could not journal a call of {session_id}: {e}");
        }
    });
    Ok(Response::from_stream(scanned)?
        .with_status(status)
        .with_headers(headers))
}

/// The session's budget, by the native broker's rule: a call it refuses is
/// journaled as the native broker journals it (status 403, nothing spent).
async fn admit(
    env: &Env,
    session: &SessionId,
    state: &BrokerState,
    prices: &PriceTable,
    model: &Option<String>,
) -> std::result::Result<(), String> {
    let why = match usage::admit(
        &state.budget,
        &state.usage,
        prices,
        model.as_deref(),
        PRICES_VAR,
    ) {
        Ok(()) => return Ok(()),
        Err(why) => why,
    };
    let call = CallFigures {
        model: model.clone(),
        status: 403,
        input_tokens: 0,
        output_tokens: 0,
        spend_micros: Some(0),
    };
    if let Err(e) = journal_call(env, session.as_str(), &call).await {
        worker::console_error!("the broker could not journal a refusal of {session}: {e}");
    }
    Err(why)
}

/// The agent's request as the provider gets it: to `base` + `rest`, its
/// headers less the hop-by-hop ones, the real key in place of the token.
fn upstream_request(
    req: &Request,
    body: &[u8],
    base: &str,
    rest: &str,
    api: Api,
    key: &str,
) -> worker::Result<Request> {
    let url = req.url()?;
    let target = wire::upstream_url(base, rest, url.query());
    let upstream_headers = Headers::new();
    for (name, value) in req.headers().entries() {
        if !wire::is_hop_header(&name) {
            upstream_headers.append(&name, &value)?;
        }
    }
    let (key_header, key) = api.key_header(key);
    upstream_headers.set(key_header, &key)?;
    let mut init = RequestInit::new();
    init.with_method(req.method())
        .with_headers(upstream_headers);
    if req.method() != Method::Get && req.method() != Method::Head {
        init.with_body(Some(worker::js_sys::Uint8Array::from(body).into()));
    }
    Request::new_with_init(&target, &init)
}

/// An answer's body passing through, its usage read on the way; the
/// counts go to `ended` once it ends or is dropped (an agent that hung up
/// mid-answer still had what passed counted).
struct Scanned {
    inner: Pin<Box<ByteStream>>,
    scanner: Option<UsageScanner>,
    ended: Option<oneshot::Sender<(u64, u64)>>,
}

impl Scanned {
    fn end(&mut self) {
        if let (Some(scanner), Some(ended)) = (self.scanner.take(), self.ended.take()) {
            let _ = ended.send(scanner.finish());
        }
    }
}

impl Stream for Scanned {
    type Item = worker::Result<Vec<u8>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(chunk))) => {
                if let Some(scanner) = self.scanner.as_mut() {
                    scanner.feed(chunk);
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.end(),
            Poll::Pending => {}
        }
        polled
    }
}

impl Drop for Scanned {
    fn drop(&mut self) {
        self.end();
    }
}

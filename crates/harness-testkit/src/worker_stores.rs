//! The Cloudflare Worker's stores as the core traits, over HTTP, so the
//! shared conformance suites run against them under `wrangler dev`:
//! [`WorkerLog`] (a `SessionLog` whose sessions are Durable Objects, each
//! with its `DoStore`) and [`WorkerCheckpoints`] (a `CheckpointStore` that is
//! the Worker's `R2Store` on wrangler's local bucket).
//!
//! Each call is one request to the Worker's test routes
//! (`crates/harness-worker/src/test_routes.rs`, only in its test build),
//! which make the same call on the real store; forks, listing, search and
//! trim take the public routes. An error comes back with the kind the store raised
//! (`durable_workflows::remote::RemoteError`), or as the session API's error
//! body, whose code names the kind.
//!
//! Fresh logs in one `wrangler dev`: a suite wants an empty log per check,
//! and Durable Objects cannot be dropped wholesale, so each [`WorkerLog`]
//! has a namespace — its session ids carry a prefix on the wire, which the
//! answers lose again — and sees only its own sessions. Fresh checkpoint
//! stores: [`WorkerCheckpoints::emptied`] deletes every object first.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use durable_workflows::remote::RemoteError;
use futures::future::BoxFuture;
use futures::StreamExt;
use harness_core::checkpoint::{CheckpointStore, ObjectMeta};
use harness_core::frame::{Frame, SessionId};
use harness_core::log::{AppendRequest, Appended, ChainedFrame, LogInfo, SessionLog};
use harness_core::search::{SearchHit, SearchQuery, MAX_LIMIT};
use harness_core::session::SessionConfig;
use harness_core::stream::{self, ByteStream};
use harness_core::{Error, ErrorKind, Result};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::conformance::checkpoint::{StoreUnderTest, Tamper};

/// The error for a non-2xx answer: the store's own (a `RemoteError` body),
/// the session API's (`{"error": {"code", "message"}}`, its code naming the
/// kind), or a backend error carrying what came back.
fn answer_error(what: &str, status: u16, text: &str) -> Error {
    if serde_json::from_str::<RemoteError>(text).is_ok() {
        return RemoteError::from_answer(what, status, text);
    }
    let body: serde_json::Value = serde_json::from_str(text).unwrap_or_default();
    let (code, message) = (
        body["error"]["code"].as_str().unwrap_or_default(),
        body["error"]["message"].as_str().unwrap_or(text),
    );
    let kind = match code {
        "not_found" => ErrorKind::NotFound,
        "invalid" | "frame_too_large" => ErrorKind::InvalidInput,
        "conflict" | "sealed" => ErrorKind::Conflict,
        "stale_runner" => ErrorKind::Fenced,
        "gone" => ErrorKind::Gone,
        "unsupported" => ErrorKind::Unsupported,
        "unauthorized" | "forbidden" => ErrorKind::Unauthorized,
        _ => return Error::backend(format!("{what} answered {status}: {text}")),
    };
    Error::new(kind, message.to_string())
}

fn transport(what: &str) -> impl FnOnce(reqwest::Error) -> Error + '_ {
    move |e| Error::backend(format!("{what}: {e}"))
}

/// Send `request`; a 2xx answer's body, else the error it carries.
async fn send(what: &str, request: reqwest::RequestBuilder) -> Result<Bytes> {
    let response = request.send().await.map_err(transport(what))?;
    let status = response.status().as_u16();
    let body = response.bytes().await.map_err(transport(what))?;
    if (200..300).contains(&status) {
        Ok(body)
    } else {
        Err(answer_error(what, status, &String::from_utf8_lossy(&body)))
    }
}

async fn send_json<T: DeserializeOwned>(what: &str, request: reqwest::RequestBuilder) -> Result<T> {
    let body = send(what, request).await?;
    serde_json::from_slice(&body)
        .map_err(|e| Error::backend(format!("{what}: unexpected answer ({e}): {body:?}")))
}

/// Namespaces of [`WorkerLog`]s made by this process.
static NAMESPACES: AtomicU64 = AtomicU64::new(0);

/// A `SessionLog` over the Worker under test (module docs).
#[derive(Debug, Clone)]
pub struct WorkerLog {
    http: reqwest::Client,
    base: String,
    token: String,
    prefix: String,
}

impl WorkerLog {
    /// The Worker at `base` (`http://127.0.0.1:PORT`), with a host `token`,
    /// in a namespace no other `WorkerLog` of this process has: it starts
    /// empty.
    pub fn new(base: &str, token: &str) -> Self {
        let n = NAMESPACES.fetch_add(1, Ordering::Relaxed);
        Self {
            http: reqwest::Client::new(),
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
            prefix: format!("ns{}x{n}-", std::process::id()),
        }
    }

    fn wire(&self, session: &SessionId) -> String {
        format!("{}{session}", self.prefix)
    }

    /// `id` without this namespace's prefix.
    fn local(&self, id: &SessionId) -> Result<SessionId> {
        let bare = id.as_str().strip_prefix(&self.prefix).ok_or_else(|| {
            Error::backend(format!("session {id} is not in namespace {}", self.prefix))
        })?;
        SessionId::parse(bare)
    }

    /// `info` as this namespace names things.
    fn unwire(&self, mut info: LogInfo) -> Result<LogInfo> {
        info.session = self.local(&info.session)?;
        if let Some(origin) = info.forked_from.as_mut() {
            origin.session = self.local(&origin.session)?;
        }
        Ok(info)
    }

    fn op(&self, op: &str, session: &SessionId) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}/v1/test/log/{op}", self.base))
            .bearer_auth(&self.token)
            .query(&[("session", self.wire(session))])
    }

    /// One page of the public listing, after `after` (a wire id), of this
    /// namespace's sessions only.
    async fn page(&self, after: &str, limit: usize) -> Result<Vec<LogInfo>> {
        let request = self
            .http
            .get(format!("{}/v1/sessions", self.base))
            .bearer_auth(&self.token)
            .query(&[("after", after), ("limit", &limit.to_string())]);
        let infos: Vec<LogInfo> = send_json("list sessions", request).await?;
        infos
            .into_iter()
            .take_while(|info| info.session.as_str().starts_with(&self.prefix))
            .map(|info| self.unwire(info))
            .collect()
    }
}

#[async_trait]
impl SessionLog for WorkerLog {
    async fn create_with(
        &self,
        session: &SessionId,
        config: Option<SessionConfig>,
    ) -> Result<LogInfo> {
        let request = self.op("create", session).json(&config);
        self.unwire(send_json("create", request).await?)
    }

    async fn info(&self, session: &SessionId) -> Result<LogInfo> {
        self.unwire(send_json("info", self.op("info", session)).await?)
    }

    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended> {
        let body = json!({"body": request.body, "key": request.idempotency_key});
        send_json("append", self.op("append", session).json(&body)).await
    }

    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>> {
        let request = self
            .op("read", session)
            .query(&[("after", after), ("limit", limit as u64)]);
        send_json("read", request).await
    }

    async fn read_chain(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<ChainedFrame>> {
        let request = self
            .op("read-chain", session)
            .query(&[("after", after), ("limit", limit as u64)]);
        send_json("read-chain", request).await
    }

    async fn seal(&self, session: &SessionId) -> Result<LogInfo> {
        self.unwire(send_json("seal", self.op("seal", session)).await?)
    }

    async fn search(&self, query: &SearchQuery) -> Result<Vec<SearchHit>> {
        query.check()?;
        // Asked for the most the Worker answers, then cut to this
        // namespace's hits: other namespaces' sessions may rank higher.
        let mut params: Vec<(&str, String)> =
            vec![("q", query.text.clone()), ("limit", MAX_LIMIT.to_string())];
        for (name, value) in [
            ("agent", &query.agent),
            ("provider", &query.provider),
            ("status", &query.status),
        ] {
            if let Some(value) = value {
                params.push((name, value.clone()));
            }
        }
        if let Some(after) = query.after_ms {
            params.push(("after", after.to_string()));
        }
        if let Some(before) = query.before_ms {
            params.push(("before", before.to_string()));
        }
        let request = self
            .http
            .get(format!("{}/v1/search", self.base))
            .bearer_auth(&self.token)
            .query(&params);
        let hits: Vec<SearchHit> = send_json("search", request).await?;
        let mut own = Vec::new();
        for mut hit in hits {
            if hit.session.as_str().starts_with(&self.prefix) {
                hit.session = self.local(&hit.session)?;
                own.push(hit);
            }
        }
        own.truncate(query.limit()?);
        Ok(own)
    }

    async fn delete(&self, session: &SessionId) -> Result<()> {
        send("delete", self.op("delete", session)).await?;
        Ok(())
    }

    async fn trim(&self, session: &SessionId, through: u64) -> Result<LogInfo> {
        let request = self
            .http
            .post(format!(
                "{}/v1/sessions/{}/trim",
                self.base,
                self.wire(session)
            ))
            .bearer_auth(&self.token)
            .json(&json!({ "through": through }));
        self.unwire(send_json("trim", request).await?)
    }

    async fn fork(&self, source: &SessionId, until: u64, target: &SessionId) -> Result<LogInfo> {
        let request = self
            .http
            .post(format!(
                "{}/v1/sessions/{}/fork",
                self.base,
                self.wire(source)
            ))
            .bearer_auth(&self.token)
            .query(&[("until", until.to_string()), ("target", self.wire(target))]);
        self.unwire(send_json("fork", request).await?)
    }

    async fn list(&self) -> Result<Vec<LogInfo>> {
        let mut all: Vec<LogInfo> = Vec::new();
        loop {
            let after = match all.last() {
                Some(info) => self.wire(&info.session),
                None => self.prefix.clone(),
            };
            let page = self.page(&after, 100).await?;
            let full = page.len() == 100;
            all.extend(page);
            if !full {
                return Ok(all);
            }
        }
    }

    async fn list_page(&self, after: Option<&SessionId>, limit: usize) -> Result<Vec<LogInfo>> {
        let after = after.map_or_else(|| self.prefix.clone(), |a| self.wire(a));
        self.page(&after, limit).await
    }
}

/// A `CheckpointStore` over the Worker under test: its `R2Store` on the
/// bucket `wrangler dev` keeps (module docs).
#[derive(Debug, Clone)]
pub struct WorkerCheckpoints {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl WorkerCheckpoints {
    /// The Worker at `base`, with a host `token`.
    pub fn new(base: &str, token: &str) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
        }
    }

    fn op(&self, op: &str, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}/v1/test/checkpoints/{op}", self.base))
            .bearer_auth(&self.token)
            .query(&[("key", key)])
    }

    /// The store with every object deleted first: a fresh, empty store.
    pub async fn emptied(self) -> Result<Self> {
        for meta in self.list("").await? {
            self.delete(&meta.key).await?;
        }
        Ok(self)
    }

    /// Write `bytes` under `key` behind the store's back, keeping the hash
    /// it recorded (the suite's [`Tamper`]).
    pub async fn tamper(&self, key: &str, bytes: Bytes) -> Result<()> {
        send("tamper", self.op("tamper", key).body(bytes)).await?;
        Ok(())
    }

    /// The store under test, with [`tamper`](Self::tamper) as its hook.
    pub fn under_test(self) -> StoreUnderTest {
        let store = Arc::new(self);
        let tamperer = store.clone();
        let tamper: Tamper = Arc::new(
            move |key: String, bytes: Bytes| -> BoxFuture<'static, anyhow::Result<()>> {
                let store = tamperer.clone();
                Box::pin(async move { Ok(store.tamper(&key, bytes).await?) })
            },
        );
        StoreUnderTest::new(store, tamper)
    }
}

#[async_trait]
impl CheckpointStore for WorkerCheckpoints {
    async fn put(&self, key: &str, mut content: ByteStream) -> Result<ObjectMeta> {
        // The content is read here, then sent whole with its length: a
        // source that fails half-way is sent as the bytes it gave and its
        // error (`&fail=`), which the Worker hands its store as the same
        // stream. (A request cut short instead can reach the Worker looking
        // whole under `wrangler dev`; the public route refuses bodies whose
        // length was not declared for that reason.)
        let mut body = Vec::new();
        let mut failed = None;
        while let Some(chunk) = content.next().await {
            match chunk {
                Ok(bytes) => body.extend_from_slice(&bytes),
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        let mut request = self.op("put", key);
        if let Some(message) = failed {
            request = request.query(&[("fail", message)]);
        }
        send_json("put", request.body(body)).await
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        Ok(stream::once(send("get", self.op("get", key)).await?))
    }

    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        let request = self
            .op("get-range", key)
            .query(&[("start", range.start), ("end", range.end)]);
        send("get-range", request).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        send_json("head", self.op("head", key)).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let request = self
            .http
            .post(format!("{}/v1/test/checkpoints/list", self.base))
            .bearer_auth(&self.token)
            .query(&[("prefix", prefix)]);
        send_json("list", request).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        send("delete", self.op("delete", key)).await?;
        Ok(())
    }
}

//! The Worker's stores, reachable from outside for the shared conformance
//! suites (`harness_testkit::conformance::{log, checkpoint}`), which run on
//! the host: the test's HTTP adapters (`harness_testkit::worker_stores`)
//! turn each `SessionLog` / `CheckpointStore` call into one request here,
//! and this module makes the same call on the Durable Object's log
//! ([`DoStore`]) or the R2 store ([`R2Store`]) — the implementations a
//! deployment runs, not copies.
//!
//! Compiled only with the `test-routes` feature (`cargo xtask worker build
//! --test-routes`, what the tests run); a deploy build has none of these
//! routes and answers 404 (`tests/wrangler.rs` checks it). Every route
//! takes a host token.
//!
//! - `POST /v1/test/log/<op>?session=<id>`: `create` (body: a
//!   `SessionConfig` or `null`; the session is also recorded in the
//!   directory, so `GET /v1/sessions` lists it), `info`, `append` (body:
//!   `{"body": <FrameBody>, "key": <string|null>}`), `read` and `read-chain`
//!   (`&after=&limit=`), `seal`, and `delete` (as a store deletes: without
//!   the server's refusal while a turn runs; the directory forgets the id).
//!   Forks, listing, search and trim go through the public routes.
//! - `POST /v1/test/checkpoints/<op>?key=<key>`: `put` (body: the content;
//!   with `&fail=<message>`, what the client's source gave before it failed
//!   with that message: the store gets those bytes, then the error),
//!   `get` (the whole content, verified in the Worker before it is answered,
//!   so a corrupt object is an error the client sees, not a cut body),
//!   `get-range` (`&start=&end=`), `head`, `list` (`?prefix=`), `delete`,
//!   and `tamper` (body: bytes written under the key with the metadata the
//!   store recorded, behind the store's back — the suite's corruption case).
//!
//! A failure is answered as `durable_workflows::remote::RemoteError` (the
//! error's kind and message), so the adapter raises the error the store
//! raised, kind for kind.

use std::collections::HashMap;

use durable_workflows::remote::RemoteError;
use futures::StreamExt;
use harness_core::checkpoint::CheckpointStore;
use harness_core::frame::{FrameBody, SessionId};
use harness_core::log::{unknown_session, AppendRequest, SessionStore};
use harness_core::session::SessionConfig;
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};
use serde::{Deserialize, Serialize};
use session_api::request;
use worker::{Env, Request, Response};

use crate::checkpoints::R2Store;
use crate::store::DoStore;

/// The object op prefix of the log's test ops.
pub(crate) const LOG_OP: &str = "test-log/";

/// An append on the wire: `AppendRequest`'s fields.
#[derive(Serialize, Deserialize)]
struct WireAppend {
    body: FrameBody,
    key: Option<String>,
}

/// `result` as the route's answer: 200 and its JSON, or the error as a
/// [`RemoteError`] with its status.
pub(crate) fn answer<T: Serialize>(result: Result<T>) -> worker::Result<Response> {
    match result {
        Ok(value) => Response::from_json(&value),
        Err(e) => {
            let remote = RemoteError::of(&e);
            Ok(Response::from_json(&remote)?.with_status(remote.status()))
        }
    }
}

fn js(e: worker::Error) -> Error {
    Error::backend(e.to_string())
}

fn u64_param(params: &HashMap<String, String>, name: &str) -> Result<u64> {
    request::param_u64(params, name)
        .map_err(|e| Error::invalid(e.message))?
        .ok_or_else(|| Error::invalid(format!("?{name}= is required")))
}

/// A log test op in the session's object, on its store. `create` makes the
/// log; every other op needs it to exist (`NotFound`, nothing written).
pub(crate) async fn object_log_op(
    store: &DoStore,
    stored: Option<SessionId>,
    op: &str,
    req: &mut Request,
    params: &HashMap<String, String>,
) -> worker::Result<Response> {
    let body = req.bytes().await?;
    answer(log_op(store, stored, op, &body, params).await)
}

async fn log_op(
    store: &DoStore,
    stored: Option<SessionId>,
    op: &str,
    body: &[u8],
    params: &HashMap<String, String>,
) -> Result<serde_json::Value> {
    if op == "create" {
        let config: Option<SessionConfig> = serde_json::from_slice(body)
            .map_err(|e| Error::invalid(format!("malformed session config: {e}")))?;
        return json(&store.create(config)?);
    }
    if stored.as_ref() != Some(store.session()) {
        return Err(unknown_session(store.session()));
    }
    let page = || -> Result<(u64, usize)> {
        let after = u64_param(params, "after")?;
        let limit = usize::try_from(u64_param(params, "limit")?).unwrap_or(usize::MAX);
        Ok((after, limit))
    };
    match op {
        "info" => json(&store.info().await?),
        "append" => {
            let wire: WireAppend = serde_json::from_slice(body)
                .map_err(|e| Error::invalid(format!("malformed append: {e}")))?;
            let request = AppendRequest {
                body: wire.body,
                idempotency_key: wire.key,
            };
            json(&store.append(request).await?)
        }
        "read" => {
            let (after, limit) = page()?;
            json(&store.read(after, limit).await?)
        }
        "read-chain" => {
            let (after, limit) = page()?;
            json(&store.read_chain(after, limit).await?)
        }
        "seal" => {
            // As every native store seals: a `sealed` frame, once.
            if !store.info().await?.sealed {
                store
                    .append(AppendRequest::new(FrameBody::Sealed {}))
                    .await?;
            }
            json(&store.info().await?)
        }
        _ => Err(Error::not_found(format!("no log test op {op:?}"))),
    }
}

fn json<T: Serialize>(value: &T) -> Result<serde_json::Value> {
    serde_json::to_value(value).map_err(|e| Error::backend(e.to_string()))
}

/// `POST /v1/test/checkpoints/<op>` on the Worker's R2 store.
pub(crate) async fn checkpoints(
    env: &Env,
    op: &str,
    params: &HashMap<String, String>,
    body: Vec<u8>,
) -> worker::Result<Response> {
    let store = match R2Store::from_env(env) {
        Ok(store) => store,
        Err(e) => return answer::<()>(Err(e)),
    };
    let key = params.get("key").cloned().unwrap_or_default();
    match op {
        "get" => match read_all(&store, &key).await {
            Ok(bytes) => Response::from_bytes(bytes),
            Err(e) => answer::<()>(Err(e)),
        },
        "get-range" => {
            let range = u64_param(params, "start").and_then(|start| {
                let end = u64_param(params, "end")?;
                Ok(start..end)
            });
            match range {
                Ok(range) => match store.get_range(&key, range).await {
                    Ok(bytes) => Response::from_bytes(bytes.to_vec()),
                    Err(e) => answer::<()>(Err(e)),
                },
                Err(e) => answer::<()>(Err(e)),
            }
        }
        "put" => {
            // `&fail=<message>`: the client's source failed after `body`;
            // the store gets the same stream, the bytes and then that
            // error, and must leave nothing of it.
            let mut chunks = vec![Ok(bytes::Bytes::from(body))];
            if let Some(message) = params.get("fail") {
                chunks.push(Err(Error::backend(message.clone())));
            }
            let content: ByteStream = Box::pin(futures::stream::iter(chunks));
            answer(store.put(&key, content).await)
        }
        "head" => answer(store.head(&key).await),
        "list" => {
            let prefix = params.get("prefix").cloned().unwrap_or_default();
            answer(store.list(&prefix).await)
        }
        "delete" => answer(store.delete(&key).await),
        "tamper" => answer(tamper(env, &key, body).await),
        _ => answer::<()>(Err(Error::not_found(format!(
            "no checkpoint test op {op:?}"
        )))),
    }
}

/// Every byte of `key`, through the store's verifying read.
async fn read_all(store: &R2Store, key: &str) -> Result<Vec<u8>> {
    let mut stream = store.get(key).await?;
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk?);
    }
    Ok(out)
}

/// Replace the bytes under `key` with `bytes`, keeping the custom metadata
/// (the recorded hash) the store wrote: a disk or an operator changing the
/// object. The binding's own put, with no digest for R2 to check.
async fn tamper(env: &Env, key: &str, bytes: Vec<u8>) -> Result<()> {
    let bucket = env.bucket(crate::checkpoints::BINDING).map_err(js)?;
    let object_key = R2Store::from_env(env)?.object_key(key);
    let object = bucket
        .head(&object_key)
        .await
        .map_err(js)?
        .ok_or_else(|| Error::not_found(format!("no checkpoint {key:?} to tamper with")))?;
    let metadata = object.custom_metadata().map_err(js)?;
    bucket
        .put(&object_key, bytes)
        .custom_metadata(metadata)
        .execute()
        .await
        .map_err(js)?;
    Ok(())
}

//! The directory of sessions: one Durable Object (`SessionDirectory`, named
//! "sessions") holding the id of every session created on this Worker, so
//! `GET /v1/sessions` can answer as `session-server` does.
//!
//! It keeps ids only. A session's info changes with every frame, and
//! writing the directory on every append would double the rows written per
//! frame; the front asks each listed session's object for its info instead
//! (one subrequest per session). An id is recorded *before* its session is
//! created, so a session is never missing from the list; an id whose
//! creation then failed answers 404 and is left out.

// `#[durable_object]` expands to an unsafe block: allowed here, denied
// elsewhere in the crate.
#![allow(unsafe_code)]

use serde::Deserialize;
use worker::{
    durable_object, wasm_bindgen, DurableObject, Env, Request, Response, SqlStorage, State,
};

/// The name of the one directory object.
pub(crate) const DIRECTORY_OBJECT: &str = "sessions";

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY)";

#[derive(Deserialize)]
struct Row {
    id: String,
}

/// The directory (see the module docs). Internal paths: `POST /add?id=`,
/// `POST /remove?id=` (a deleted session), `GET /list?after=&limit=`.
#[durable_object]
pub struct SessionDirectory {
    sql: SqlStorage,
}

impl std::fmt::Debug for SessionDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionDirectory").finish_non_exhaustive()
    }
}

impl DurableObject for SessionDirectory {
    fn new(state: State, _env: Env) -> Self {
        Self {
            sql: state.storage().sql(),
        }
    }

    async fn fetch(&self, req: Request) -> worker::Result<Response> {
        self.sql.exec(SCHEMA, None)?;
        let url = req.url()?;
        match url.path() {
            "/add" => {
                let id = url
                    .query_pairs()
                    .find(|(k, _)| k == "id")
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default();
                if id.is_empty() {
                    return Response::error("no id", 400);
                }
                self.sql.exec(
                    "INSERT OR IGNORE INTO sessions (id) VALUES (?1)",
                    Some(vec![id.into()]),
                )?;
                Response::empty().map(|r| r.with_status(204))
            }
            "/remove" => {
                let id = url
                    .query_pairs()
                    .find(|(k, _)| k == "id")
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default();
                self.sql
                    .exec("DELETE FROM sessions WHERE id = ?1", Some(vec![id.into()]))?;
                Response::empty().map(|r| r.with_status(204))
            }
            "/list" => {
                // `?after=<id>&limit=<n>`: ids after `after`, by id.
                let param = |name: &str| {
                    url.query_pairs()
                        .find(|(k, _)| k == name)
                        .map(|(_, v)| v.into_owned())
                };
                let after = param("after").unwrap_or_default();
                let limit = param("limit")
                    .and_then(|v| v.parse::<i64>().ok())
                    .unwrap_or(i64::MAX);
                let rows: Vec<Row> = self
                    .sql
                    .exec(
                        "SELECT id FROM sessions WHERE id > ?1 ORDER BY id LIMIT ?2",
                        Some(vec![after.into(), limit.into()]),
                    )?
                    .to_array()?;
                let ids: Vec<String> = rows.into_iter().map(|r| r.id).collect();
                Response::from_json(&ids)
            }
            _ => Response::error("no such directory path", 404),
        }
    }
}

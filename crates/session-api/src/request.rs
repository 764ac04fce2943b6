//! Reading requests: the create body, query parameters, `Last-Event-ID`,
//! page limits; and the ack a `POST /messages` answers with.

use std::collections::HashMap;

use harness_core::actor::ServerMessage;
use harness_core::log::LogInfo;
use harness_core::query::query_pairs;
use harness_core::session::SessionConfig;
use harness_core::SessionId;
use serde::Deserialize;
use serde_json::json;

use crate::error::ApiError;

/// Frames read from a log per page (catch-up, export) and the default
/// page of `GET /frames`.
pub const PAGE: usize = harness_core::actor_driver::REPLAY_PAGE;

/// Largest page `GET /frames` returns.
pub const MAX_FRAMES_PAGE: usize = 10_000;

/// Sessions `GET /v1/sessions` answers by default.
pub const SESSIONS_PAGE: usize = 100;

/// Most sessions `GET /v1/sessions` answers at once.
pub const MAX_SESSIONS_PAGE: usize = 1_000;

/// Room for the JSON envelope around a frame body (message type, keys):
/// a request body may be this much over the frame limit.
pub const ENVELOPE_SLACK: usize = 64 * 1024;

/// Largest `POST /v1/sessions` body.
pub const MAX_CREATE_BODY: usize = 64 * 1024;

/// The largest request body that may carry a frame of `max_frame_bytes`.
pub fn body_limit(max_frame_bytes: usize) -> usize {
    max_frame_bytes.saturating_add(ENVELOPE_SLACK)
}

/// The 413 for a body over `limit`, refused while reading.
pub fn body_too_large(limit: usize) -> ApiError {
    ApiError::too_large(format!(
        "request body exceeds {limit} bytes (frame limit plus envelope)"
    ))
}

/// A session id from a path segment (400 when invalid).
pub fn session_id(raw: &str) -> Result<SessionId, ApiError> {
    SessionId::parse(raw).map_err(ApiError::from)
}

/// The id of a session created without one: `s-` and 12 hex digits taken
/// from `random_hex` (the server's randomness).
pub fn generated_session_id(random_hex: &str) -> Result<SessionId, ApiError> {
    let hex: String = random_hex
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    if hex.len() < 12 {
        return Err(ApiError::new(
            500,
            "internal",
            "not enough randomness for a session id",
        ));
    }
    session_id(&format!("s-{}", hex.to_ascii_lowercase()))
}

/// The body of `POST /v1/sessions`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// The session id (generated when absent).
    #[serde(default)]
    pub id: Option<String>,
    /// `claude-code` (default) or `codex`.
    #[serde(default)]
    pub agent: Option<String>,
    /// Sandbox provider: `local` (default), `docker`, …
    #[serde(default)]
    pub sandbox: Option<String>,
    /// Image, for providers that have images.
    #[serde(default)]
    pub image: Option<String>,
    /// Model name passed to the agent.
    #[serde(default)]
    pub model: Option<String>,
    /// Network policy of the sandbox.
    #[serde(default)]
    pub network: Option<harness_core::sandbox::NetworkPolicy>,
    /// Ask clients before tools that need permission.
    #[serde(default)]
    pub approvals: bool,
    /// The session's budget: `{"max_tokens": N, "max_spend_micros": M}`
    /// (camelCase too), over all its turns; replaces the server's.
    #[serde(default)]
    pub budget: Option<harness_core::turn::Budget>,
}

impl CreateSession {
    /// Parse a body; an empty (or all-whitespace) one asks for the defaults.
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        serde_json::from_slice(bytes)
            .map_err(|e| ApiError::invalid(format!("malformed JSON body: {e}")))
    }

    /// The session id asked for, or a generated one.
    pub fn session_id(&self, random_hex: &str) -> Result<SessionId, ApiError> {
        match &self.id {
            Some(id) => session_id(id),
            None => generated_session_id(random_hex),
        }
    }

    /// The configuration it asks for, refused (400) when it names an agent
    /// or sandbox provider the server does not offer (empty lists: any).
    pub fn config(
        &self,
        agents: &[String],
        providers: &[String],
    ) -> Result<SessionConfig, ApiError> {
        let mut config = SessionConfig::default();
        if let Some(agent) = &self.agent {
            config.agent = agent.clone();
        }
        if let Some(provider) = &self.sandbox {
            config.sandbox.provider = provider.clone();
        }
        config.sandbox.image = self.image.clone();
        if let Some(network) = &self.network {
            config.sandbox.network = network.clone();
        }
        config.model = self.model.clone();
        config.approvals = self.approvals;
        if let Some(budget) = &self.budget {
            config.budget = budget.clone();
        }
        let known = |list: &[String], name: &str| list.is_empty() || list.iter().any(|n| n == name);
        if !known(agents, &config.agent) {
            return Err(ApiError::invalid(format!(
                "unknown agent {:?}: this server runs {}",
                config.agent,
                agents.join(", ")
            )));
        }
        if !known(providers, &config.sandbox.provider) {
            return Err(ApiError::invalid(format!(
                "unknown sandbox {:?}: this server offers {}",
                config.sandbox.provider,
                providers.join(", ")
            )));
        }
        Ok(config)
    }
}

/// 409 when a create found the session already there with another
/// configuration.
pub fn check_created(info: &LogInfo, config: &SessionConfig) -> Result<(), ApiError> {
    if info.meta.config.as_ref().is_some_and(|c| c != config) {
        return Err(ApiError::new(
            409,
            "conflict",
            format!(
                "session {} already exists with another configuration",
                info.session
            ),
        ));
    }
    Ok(())
}

/// A numeric query parameter (400 when it is not a number).
pub fn param_u64(params: &HashMap<String, String>, name: &str) -> Result<Option<u64>, ApiError> {
    params
        .get(name)
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                ApiError::invalid(format!("query parameter {name}={v:?} is not a number"))
            })
        })
        .transpose()
}

/// A flag query parameter (`1`, `true`, `yes`).
pub fn param_flag(params: &HashMap<String, String>, name: &str) -> bool {
    params
        .get(name)
        .is_some_and(|v| matches!(v.as_str(), "1" | "true" | "yes"))
}

/// The seq a `Last-Event-ID` header names (400 when it names none).
pub fn last_event_id(value: Option<&[u8]>) -> Result<Option<u64>, ApiError> {
    value
        .map(|v| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| ApiError::invalid("Last-Event-ID must be a frame seq"))
        })
        .transpose()
}

/// Where `/events` starts: after `Last-Event-ID`, else `?after`, else 0.
pub fn events_after(
    last_event_id_header: Option<&[u8]>,
    params: &HashMap<String, String>,
) -> Result<u64, ApiError> {
    match last_event_id(last_event_id_header)? {
        Some(n) => Ok(n),
        None => Ok(param_u64(params, "after")?.unwrap_or(0)),
    }
}

/// `POST /v1/sessions/{id}/trim`'s body, `{"through": N}`: the last seq
/// retention removes.
pub fn trim_through(body: &[u8]) -> Result<u64, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Trim {
        through: u64,
    }
    serde_json::from_slice::<Trim>(body)
        .map(|t| t.through)
        .map_err(|e| {
            ApiError::invalid(format!(
                "a trim takes {{\"through\": N}} (the last seq to remove): {e}"
            ))
        })
}

/// `GET /frames`: `after` (default 0) and `limit` (default [`PAGE`], at
/// most [`MAX_FRAMES_PAGE`]).
pub fn frames_page(params: &HashMap<String, String>) -> Result<(u64, usize), ApiError> {
    let after = param_u64(params, "after")?.unwrap_or(0);
    let limit = param_u64(params, "limit")?
        .map_or(PAGE, |l| usize::try_from(l).unwrap_or(usize::MAX))
        .min(MAX_FRAMES_PAGE);
    Ok((after, limit))
}

/// `GET /v1/sessions`: the sessions whose id sorts after `after` (from the
/// first without it), at most `limit` of them (default [`SESSIONS_PAGE`],
/// between 1 and [`MAX_SESSIONS_PAGE`]), by id. A client pages by passing
/// the last id it got as `after` until a page comes back empty.
pub fn sessions_page(
    params: &HashMap<String, String>,
) -> Result<(Option<SessionId>, usize), ApiError> {
    let after = params
        .get("after")
        .map(|v| {
            SessionId::parse(v.as_str()).map_err(|_| {
                ApiError::invalid(format!("query parameter after={v:?} is not a session id"))
            })
        })
        .transpose()?;
    let limit = param_u64(params, "limit")?
        .map_or(SESSIONS_PAGE, |l| usize::try_from(l).unwrap_or(usize::MAX))
        .clamp(1, MAX_SESSIONS_PAGE);
    Ok((after, limit))
}

/// `GET /v1/search`: `q` (the words), and the filters `agent`,
/// `provider`, `status`, `after` / `before` (ms since the epoch) and
/// `limit`; an unknown parameter is refused (a typo must not silently
/// widen a search), and the query is checked
/// ([`SearchQuery::check`](harness_core::search::SearchQuery::check)).
pub fn search_query(
    params: &HashMap<String, String>,
) -> Result<harness_core::search::SearchQuery, ApiError> {
    const KNOWN: &[&str] = &[
        "q",
        "agent",
        "provider",
        "status",
        "after",
        "before",
        "limit",
        // The bearer token of an EventSource-style client.
        "access_token",
    ];
    if let Some(unknown) = params.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "unknown search parameter {unknown:?}: use q, agent, provider, status, after, \
             before, limit"
        )));
    }
    let text = params
        .get("q")
        .cloned()
        .ok_or_else(|| ApiError::invalid("a search needs q=<words>"))?;
    let query = harness_core::search::SearchQuery {
        text,
        agent: params.get("agent").cloned(),
        provider: params.get("provider").cloned(),
        status: params.get("status").cloned(),
        after_ms: param_u64(params, "after")?,
        before_ms: param_u64(params, "before")?,
        limit: param_u64(params, "limit")?.map(|l| usize::try_from(l).unwrap_or(usize::MAX)),
    };
    query.check()?;
    Ok(query)
}

/// `GET /export`: the last seq to export (default: the log's end; past it
/// is 400).
pub fn export_until(params: &HashMap<String, String>, info: &LogInfo) -> Result<u64, ApiError> {
    let until = param_u64(params, "until")?.unwrap_or(info.last_seq);
    if until > info.last_seq {
        return Err(ApiError::invalid(format!(
            "cannot export {} until={until}: the log ends at seq {}",
            info.session, info.last_seq
        )));
    }
    Ok(until)
}

/// What `GET /export` answers in (`format=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    /// A JSON array of frames (the default, `format=json`).
    Json,
    /// The conversation as a Markdown document (`format=markdown` or `md`;
    /// [`crate::markdown`]).
    Markdown,
}

/// The `format` parameter of `GET /export`.
pub fn export_format(params: &HashMap<String, String>) -> Result<ExportFormat, ApiError> {
    match params.get("format").map(String::as_str) {
        None | Some("json") => Ok(ExportFormat::Json),
        Some("markdown" | "md") => Ok(ExportFormat::Markdown),
        Some(other) => Err(ApiError::invalid(format!(
            "unknown export format {other:?}: use json (the default) or markdown"
        ))),
    }
}

/// The answer to `POST /messages`: the actor's ack as it sent it
/// (`{"type":"ack","seq","duplicate"}`, plus `turnId` when the stored frame
/// opened a turn).
pub fn ack(seq: u64, duplicate: bool, turn_id: Option<String>) -> serde_json::Value {
    json!(ServerMessage::Ack {
        seq,
        duplicate,
        turn_id
    })
}

/// The parameters of a query string (for servers without a framework
/// that reads them), decoded by core's one query decoder
/// ([`harness_core::query`]: `+` is a space, `%XX` a byte only with two
/// hex digits, a malformed escape kept as it is); a repeated name keeps
/// its last value.
pub fn parse_query(query: &str) -> HashMap<String, String> {
    query_pairs(query).into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_bodies_are_strict_and_default_when_empty() {
        assert!(CreateSession::parse(b"  ").unwrap().id.is_none());
        let e = CreateSession::parse(b"{\"nope\":1}").unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (400, "invalid"));
        let c = CreateSession::parse(br#"{"id":"a","agent":"codex"}"#).unwrap();
        assert_eq!(c.session_id("").unwrap().as_str(), "a");
        assert_eq!(c.config(&[], &[]).unwrap().agent, "codex");
        assert_eq!(
            c.config(&["claude-code".into()], &[]).unwrap_err().status,
            400
        );
        let generated = CreateSession::default()
            .session_id("0123456789abcdef")
            .unwrap();
        assert_eq!(generated.as_str(), "s-0123456789ab");
    }

    #[test]
    fn cursors_and_pages() {
        let p = parse_query("after=1&after=3&limit=20000&x=a%20b+c&bad=%zz&t=%4&sign=%+1");
        assert_eq!(frames_page(&p).unwrap(), (3, MAX_FRAMES_PAGE));
        let page = |pairs: &[(&str, &str)]| {
            let p: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            sessions_page(&p).map(|(a, l)| (a.map(|a| a.as_str().to_string()), l))
        };
        assert_eq!(page(&[]).unwrap(), (None, SESSIONS_PAGE));
        assert_eq!(
            page(&[("after", "s-1"), ("limit", "5")]).unwrap(),
            (Some("s-1".into()), 5)
        );
        assert_eq!(page(&[("limit", "0")]).unwrap().1, 1);
        assert_eq!(page(&[("limit", "99999")]).unwrap().1, MAX_SESSIONS_PAGE);
        assert_eq!(page(&[("limit", "x")]).unwrap_err().status, 400);
        assert_eq!(page(&[("after", "../x")]).unwrap_err().status, 400);
        assert_eq!(p["x"], "a b c");
        assert_eq!(p["bad"], "%zz");
        assert_eq!(p["t"], "%4");
        // `%+1` is no escape (two hex digits or nothing).
        assert_eq!(p["sign"], "% 1");
        assert_eq!(events_after(Some(b" 7 "), &p).unwrap(), 7);
        assert_eq!(events_after(None, &p).unwrap(), 3);
        assert_eq!(events_after(Some(b"x"), &p).unwrap_err().status, 400);
        let bad = parse_query("after=-1");
        assert_eq!(frames_page(&bad).unwrap_err().status, 400);
    }
}

/// What `GET /v1/sessions/{id}/verify` answers: the walk of the session's
/// audit chain (`harness_core::log::chain`). A broken chain is a finding,
/// not a failed request: 200 with `intact: false`, where it breaks, and
/// the same said in words.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Verified {
    /// The session.
    pub session: harness_core::SessionId,
    /// Whether the chain holds to the end.
    pub intact: bool,
    /// The break, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The walk's figures (`frames`, `unchained`, `head`, `broken`).
    #[serde(flatten)]
    pub report: harness_core::log::ChainReport,
}

impl Verified {
    /// The answer for `session`'s walk.
    pub fn new(session: harness_core::SessionId, report: harness_core::log::ChainReport) -> Self {
        Self {
            session,
            intact: report.intact(),
            problem: report.broken.as_ref().map(|b| b.to_string()),
            report,
        }
    }
}

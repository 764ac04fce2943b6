//! The broker's HTTP contract, the same on every host: the path an agent
//! calls, the token it presents, the headers that never cross, the shape of
//! a refusal, and the environment that points an agent at it.

use std::collections::BTreeMap;

/// The default Anthropic endpoint when `ANTHROPIC_BASE_URL` is unset.
pub const ANTHROPIC_DEFAULT_URL: &str = "https://api.anthropic.com";
/// The default OpenAI endpoint when `OPENAI_BASE_URL` is unset.
pub const OPENAI_DEFAULT_URL: &str = "https://api.openai.com/v1";

/// Largest request body forwarded (a long conversation with images is a
/// few MB; this leaves room and still bounds memory).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

/// Which upstream a request path names (`/s/<session>/<api>/…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Anthropic Messages (Claude Code).
    Anthropic,
    /// OpenAI Responses (Codex).
    OpenAi,
}

impl Api {
    /// The path segment's provider, if it names one.
    pub fn parse(s: &str) -> Option<Api> {
        match s {
            "anthropic" => Some(Api::Anthropic),
            "openai" => Some(Api::OpenAi),
            _ => None,
        }
    }

    /// The variable that holds this provider's real key where the broker
    /// runs.
    pub fn key_var(self) -> &'static str {
        match self {
            Api::Anthropic => "ANTHROPIC_API_KEY",
            Api::OpenAi => "OPENAI_API_KEY",
        }
    }

    /// The variable that names this provider's endpoint where the broker
    /// runs.
    pub fn url_var(self) -> &'static str {
        match self {
            Api::Anthropic => "ANTHROPIC_BASE_URL",
            Api::OpenAi => "OPENAI_BASE_URL",
        }
    }

    /// The provider's own endpoint.
    pub fn default_url(self) -> &'static str {
        match self {
            Api::Anthropic => ANTHROPIC_DEFAULT_URL,
            Api::OpenAi => OPENAI_DEFAULT_URL,
        }
    }

    /// The header that carries the real key upstream, and its value.
    pub fn key_header(self, key: &str) -> (&'static str, String) {
        match self {
            Api::Anthropic => ("x-api-key", key.to_string()),
            Api::OpenAi => ("authorization", format!("Bearer {key}")),
        }
    }
}

/// The token a request carries: `x-api-key` (Anthropic) or a bearer
/// `authorization` (OpenAI), whichever is present — given the two headers'
/// values.
pub fn presented_token<'a>(
    x_api_key: Option<&'a str>,
    authorization: Option<&'a str>,
) -> Option<&'a str> {
    if let Some(v) = x_api_key {
        return Some(v.trim());
    }
    authorization
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
}

/// Headers that describe one hop, or carry the sandbox's credentials: never
/// forwarded, either way (`name` in lower case).
pub fn is_hop_header(name: &str) -> bool {
    matches!(
        name,
        "host"
            | "connection"
            | "keep-alive"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
            | "authorization"
            | "x-api-key"
            // Ask for an identity body: the usage scanner reads it as it passes.
            | "accept-encoding"
    )
}

/// A refusal's body in the shape both SDKs print:
/// `{"type":"error","error":{"type":kind,"message":…}}`.
pub fn refusal_body(kind: &str, message: &str) -> String {
    serde_json::json!({
        "type": "error",
        "error": { "type": kind, "message": format!("harness model broker: {message}") },
    })
    .to_string()
}

/// The `model` a request body names (Anthropic's and OpenAI's both).
pub fn request_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

/// Where a request for `rest` (the path after `/<api>/`) and `query` goes
/// upstream.
pub fn upstream_url(base_url: &str, rest: &str, query: Option<&str>) -> String {
    let mut url = format!("{}/{}", base_url.trim_end_matches('/'), rest);
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        url.push('?');
        url.push_str(q);
    }
    url
}

/// What the agent's environment gets instead of the real credentials: both
/// providers' endpoints under `session_base` (the broker's
/// `…/s/<session>`, as the sandbox reaches it) and the token as both keys.
pub fn agent_env(session_base: &str, token: &str) -> BTreeMap<String, String> {
    let base = session_base.trim_end_matches('/');
    BTreeMap::from([
        (
            "ANTHROPIC_BASE_URL".to_string(),
            format!("{base}/anthropic"),
        ),
        ("ANTHROPIC_API_KEY".to_string(), token.to_string()),
        ("OPENAI_BASE_URL".to_string(), format!("{base}/openai")),
        ("OPENAI_API_KEY".to_string(), token.to_string()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_read_from_either_header() {
        assert_eq!(presented_token(Some(" hsb1_a "), None), Some("hsb1_a"));
        assert_eq!(presented_token(None, Some("Bearer hsb1_b")), Some("hsb1_b"));
        assert_eq!(presented_token(None, Some("bearer hsb1_c")), Some("hsb1_c"));
        assert_eq!(presented_token(None, Some("Basic xyz")), None);
        assert_eq!(presented_token(None, None), None);
    }

    #[test]
    fn credentials_never_cross_and_the_path_keeps_its_query() {
        for h in ["authorization", "x-api-key", "host", "accept-encoding"] {
            assert!(is_hop_header(h), "{h}");
        }
        for h in ["anthropic-version", "content-type", "anthropic-beta"] {
            assert!(!is_hop_header(h), "{h}");
        }
        assert_eq!(
            upstream_url("http://m/", "v1/messages", Some("beta=true")),
            "http://m/v1/messages?beta=true"
        );
        assert_eq!(
            upstream_url("http://m", "v1/messages", Some("")),
            "http://m/v1/messages"
        );
        let env = agent_env("http://w/v1/broker/s/a/", "tok");
        assert_eq!(
            env["ANTHROPIC_BASE_URL"],
            "http://w/v1/broker/s/a/anthropic"
        );
        assert_eq!(env["OPENAI_API_KEY"], "tok");
        let refusal: serde_json::Value =
            serde_json::from_str(&refusal_body("authentication_error", "no")).unwrap();
        assert_eq!(refusal["error"]["type"], "authentication_error");
        assert_eq!(
            request_model(br#"{"model":"claude-x","max_tokens":1}"#).as_deref(),
            Some("claude-x")
        );
    }
}

//! A sandbox's way out: one HTTP proxy per API sandbox, on the host, that
//! enforces the sandbox's network policy and applies its request
//! transformations (headers added outside the sandbox, so a key never
//! enters it).
//!
//! The sandbox reaches it as `http://127.0.0.1:47812` (a forward to a Unix
//! socket) or, for a local sandbox on the host's network, on a loopback TCP
//! port; `HTTP_PROXY`/`HTTPS_PROXY` name it. Each connection's request
//! head is read here: a plain-HTTP request (absolute form) whose target
//! matches a transformation gets its headers set; then the exchange is
//! handed, with what was read, to `harness_egress::serve_connection`, the
//! proxy that enforces `custom` policies for sessions (CONNECT tunnels,
//! absolute-form requests, the policy's decision before any connection).
//! `deny-all` is refused here; `allow-all` is `harness_egress` with every
//! address allowed but the host's loopback (where `harness serve` itself
//! listens).
//!
//! Scope: transformations apply to plain-HTTP requests that pass this
//! proxy. An HTTPS request is a CONNECT tunnel whose content the proxy
//! cannot see without interception; a tunnel to a host that has a
//! transformation is refused (403) rather than let through without it.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use harness_core::sandbox::NetworkPolicy;
use harness_core::{Error, Result};
use harness_egress::EgressPolicy;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::task::JoinHandle;

/// The network policy of an API sandbox, in the AI SDK's shape
/// (`HarnessV1NetworkPolicy`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ApiNetworkPolicy {
    /// Everything the host reaches (but the host's own loopback).
    #[default]
    AllowAll,
    /// Nothing.
    DenyAll,
    /// The listed hosts and ranges, minus the denied ranges.
    Custom {
        /// `example.com`, `*.example.com`.
        #[serde(default, rename = "allowedHosts")]
        allowed_hosts: Vec<String>,
        /// `10.0.0.0/8`.
        #[serde(default, rename = "allowedCIDRs")]
        allowed_cidrs: Vec<String>,
        /// Denied even if allowed above.
        #[serde(default, rename = "deniedCIDRs")]
        denied_cidrs: Vec<String>,
    },
}

impl ApiNetworkPolicy {
    /// Check the policy and build the proxy's rule for it (`InvalidInput`
    /// naming every bad entry).
    pub(crate) fn compile(&self) -> Result<Rule> {
        match self {
            ApiNetworkPolicy::AllowAll => Ok(Rule::Allow(allow_everything())),
            ApiNetworkPolicy::DenyAll => Ok(Rule::Deny),
            ApiNetworkPolicy::Custom {
                allowed_hosts,
                allowed_cidrs,
                denied_cidrs,
            } => {
                if allowed_hosts.is_empty() && allowed_cidrs.is_empty() {
                    return Err(Error::invalid(
                        "a custom network policy needs allowedHosts or allowedCIDRs (with neither it \
                         would be deny-all: say so)",
                    ));
                }
                let policy = EgressPolicy::from_network(&NetworkPolicy::Custom {
                    allowed_hosts: allowed_hosts.clone(),
                    allowed_cidrs: allowed_cidrs.clone(),
                    denied_cidrs: denied_cidrs.clone(),
                    allowed_ports: Vec::new(),
                })?;
                Ok(Rule::Allow(policy))
            }
        }
    }

    /// Whether the sandbox itself needs a route out for this policy.
    pub(crate) fn needs_route(&self) -> bool {
        matches!(self, ApiNetworkPolicy::AllowAll)
    }
}

/// Every address but the host's loopback: what `allow-all` lets through
/// the proxy (a proxy on the host must not hand a sandbox the host's own
/// loopback services, `harness serve` among them).
fn allow_everything() -> EgressPolicy {
    EgressPolicy::from_network(&NetworkPolicy::Custom {
        allowed_hosts: Vec::new(),
        allowed_cidrs: vec!["0.0.0.0/0".into(), "::/0".into()],
        denied_cidrs: vec!["127.0.0.0/8".into(), "::1/128".into()],
        allowed_ports: Vec::new(),
    })
    .expect("a valid policy")
}

/// What the proxy does with a connection.
#[derive(Debug, Clone)]
pub(crate) enum Rule {
    /// Hand it to `harness_egress` with this policy.
    Allow(EgressPolicy),
    /// Refuse it.
    Deny,
}

/// A matcher of a path, a query value or a header part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PartMatcher {
    /// Equal to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    /// Starting with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starts_with: Option<String>,
    /// Matching this regular expression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
}

impl PartMatcher {
    fn check(&self, what: &str) -> Result<()> {
        let set = [&self.exact, &self.starts_with, &self.regex]
            .iter()
            .filter(|m| m.is_some())
            .count();
        if set != 1 {
            return Err(Error::invalid(format!(
                "{what}: a matcher has exactly one of exact, startsWith, regex"
            )));
        }
        if let Some(re) = &self.regex {
            regex::Regex::new(re)
                .map_err(|e| Error::invalid(format!("{what}: regex {re:?}: {e}")))?;
        }
        Ok(())
    }

    fn matches(&self, value: &str) -> bool {
        if let Some(exact) = &self.exact {
            return value == exact;
        }
        if let Some(prefix) = &self.starts_with {
            return value.starts_with(prefix.as_str());
        }
        if let Some(re) = &self.regex {
            return regex::Regex::new(re).is_ok_and(|re| re.is_match(value));
        }
        false
    }
}

/// A key/value matcher (a query parameter, a header).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyValueMatcher {
    /// The name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<PartMatcher>,
    /// The value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<PartMatcher>,
}

/// Which requests a transformation applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TransformMatch {
    /// The host (`api.example.com`, or `host:port` to match a port too).
    pub host: String,
    /// The path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PartMatcher>,
    /// Methods (any when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<Vec<String>>,
    /// Every one must match some query parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_string: Option<Vec<KeyValueMatcher>>,
    /// Every one must match some header of the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<KeyValueMatcher>>,
}

/// What a transformation does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transform {
    /// Headers set on the request (replacing any of the same name).
    pub headers: std::collections::BTreeMap<String, String>,
}

/// A request transformation (`HarnessV1RequestTransformation`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestTransformation {
    /// Which requests.
    #[serde(rename = "match")]
    pub matcher: TransformMatch,
    /// What to set.
    pub transform: Transform,
}

impl RequestTransformation {
    /// Check every part (`InvalidInput` naming the first bad one).
    pub(crate) fn check(&self, index: usize) -> Result<()> {
        let what = format!("requestTransformations[{index}]");
        let host = self.matcher.host.trim();
        if host.is_empty() || host.contains(['/', ' ', '?', '#', '@']) || host.contains("://") {
            return Err(Error::invalid(format!(
                "{what}: match.host {:?} must be a host name (optionally host:port), no scheme or path",
                self.matcher.host
            )));
        }
        if let Some(path) = &self.matcher.path {
            path.check(&format!("{what}.match.path"))?;
        }
        for (i, kv) in self
            .matcher
            .query_string
            .iter()
            .flatten()
            .chain(self.matcher.headers.iter().flatten())
            .enumerate()
        {
            if kv.key.is_none() && kv.value.is_none() {
                return Err(Error::invalid(format!(
                    "{what}: matcher {i} has neither key nor value"
                )));
            }
            for part in kv.key.iter().chain(kv.value.iter()) {
                part.check(&format!("{what}.match matcher {i}"))?;
            }
        }
        if self.transform.headers.is_empty() {
            return Err(Error::invalid(format!(
                "{what}: transform.headers is empty"
            )));
        }
        for (name, value) in &self.transform.headers {
            let ok_name = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !ok_name || value.contains(['\r', '\n']) {
                return Err(Error::invalid(format!(
                    "{what}: transform header {name:?} is not a valid header"
                )));
            }
        }
        Ok(())
    }

    fn host_matches(&self, host: &str, port: u16) -> bool {
        let want = self
            .matcher
            .host
            .trim()
            .trim_end_matches('.')
            .to_ascii_lowercase();
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        match want.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') || h.starts_with('[') => {
                h == host && p.parse::<u16>().ok() == Some(port)
            }
            _ => want == host,
        }
    }

    fn matches(&self, req: &RequestHead) -> bool {
        if !self.host_matches(&req.host, req.port) {
            return false;
        }
        if let Some(methods) = &self.matcher.method {
            if !methods.iter().any(|m| m.eq_ignore_ascii_case(&req.method)) {
                return false;
            }
        }
        if let Some(path) = &self.matcher.path {
            if !path.matches(&req.path) {
                return false;
            }
        }
        let pair_matches = |m: &KeyValueMatcher, k: &str, v: &str| {
            m.key.as_ref().is_none_or(|p| p.matches(k))
                && m.value.as_ref().is_none_or(|p| p.matches(v))
        };
        for m in self.matcher.query_string.iter().flatten() {
            if !req.query.iter().any(|(k, v)| pair_matches(m, k, v)) {
                return false;
            }
        }
        for m in self.matcher.headers.iter().flatten() {
            // Header names match case-insensitively: compare lower case.
            let m = KeyValueMatcher {
                key: m.key.as_ref().map(|k| PartMatcher {
                    exact: k.exact.as_ref().map(|s| s.to_ascii_lowercase()),
                    starts_with: k.starts_with.as_ref().map(|s| s.to_ascii_lowercase()),
                    regex: k.regex.clone(),
                }),
                value: m.value.clone(),
            };
            if !req.headers.iter().any(|(k, v)| pair_matches(&m, k, v)) {
                return false;
            }
        }
        true
    }
}

/// The rules a sandbox's proxy applies, changed at run time.
#[derive(Debug, Clone)]
pub(crate) struct Rules {
    pub(crate) rule: Rule,
    pub(crate) transformations: Vec<RequestTransformation>,
}

/// How long a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest request head read.
const MAX_HEAD: usize = 64 * 1024;

/// One sandbox's proxy: its listener task and its rules.
#[derive(Debug)]
pub(crate) struct Egress {
    pub(crate) rules: Arc<RwLock<Rules>>,
    task: JoinHandle<()>,
    /// How the sandbox reaches it.
    pub(crate) listen: Listen,
}

/// Where a proxy listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Listen {
    /// A Unix socket (forwarded into the sandbox).
    Unix(std::path::PathBuf),
    /// A loopback TCP port (a sandbox on the host's network).
    Tcp(u16),
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.task.abort();
        if let Listen::Unix(path) = &self.listen {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Egress {
    /// Serve `rules` on `listen` (a TCP port 0 picks one; the answer says
    /// which).
    pub(crate) async fn start(listen: Listen, rules: Rules) -> Result<Egress> {
        let rules = Arc::new(RwLock::new(rules));
        let shared = rules.clone();
        let (task, listen) = match listen {
            Listen::Unix(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let _ = std::fs::remove_file(&path);
                let listener = tokio::net::UnixListener::bind(&path)?;
                // The sandbox's user (root in a container, anyone on the
                // host) must be able to connect.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))?;
                let task = tokio::spawn(async move {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let rules = shared.clone();
                        tokio::spawn(async move { serve(stream, rules).await });
                    }
                });
                (task, Listen::Unix(path))
            }
            Listen::Tcp(port) => {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
                let port = listener.local_addr()?.port();
                let task = tokio::spawn(async move {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let _ = stream.set_nodelay(true);
                        let rules = shared.clone();
                        tokio::spawn(async move { serve(stream, rules).await });
                    }
                });
                (task, Listen::Tcp(port))
            }
        };
        Ok(Egress {
            rules,
            task,
            listen,
        })
    }

    /// Replace the rules for every later connection.
    pub(crate) fn set(&self, update: impl FnOnce(&mut Rules)) {
        let mut rules = self.rules.write().unwrap_or_else(|e| e.into_inner());
        update(&mut rules);
    }
}

/// What the proxy reads of a request head.
#[derive(Debug)]
struct RequestHead {
    method: String,
    host: String,
    port: u16,
    path: String,
    query: Vec<(String, String)>,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    /// Whether this is a CONNECT.
    connect: bool,
}

async fn serve<S>(mut stream: S, rules: Arc<RwLock<Rules>>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut buf = Vec::with_capacity(4096);
    let head_end = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream, &mut buf)).await
    {
        Ok(Ok(Some(end))) => end,
        Ok(Ok(None)) | Ok(Err(_)) => return,
        Err(_) => {
            reply(&mut stream, 408, "the request head took too long").await;
            return;
        }
    };
    let head = match parse_head(&buf[..head_end]) {
        Ok(head) => head,
        Err(why) => {
            reply(&mut stream, 400, &why).await;
            return;
        }
    };
    let Rules {
        rule,
        transformations,
    } = rules.read().unwrap_or_else(|e| e.into_inner()).clone();
    let policy = match rule {
        Rule::Deny => {
            tracing::info!(target: "harness_sandboxes", host = %head.host, port = head.port, "refused: deny-all");
            refuse(
                &mut stream,
                &format!(
                    "{}:{}: the sandbox's network policy is deny-all",
                    head.host, head.port
                ),
            )
            .await;
            return;
        }
        Rule::Allow(policy) => policy,
    };
    let mut out = buf;
    let matching: Vec<&RequestTransformation> = transformations
        .iter()
        .filter(|t| t.matches(&head))
        .collect();
    if head.connect {
        if transformations
            .iter()
            .any(|t| t.host_matches(&head.host, head.port))
        {
            refuse(
                &mut stream,
                &format!(
                    "{}:{} has request transformations, which apply to plain-HTTP requests through \
                     this proxy; an HTTPS tunnel cannot be transformed without interception \
                     (use an http:// base URL for this host)",
                    head.host, head.port
                ),
            )
            .await;
            return;
        }
    } else if !matching.is_empty() {
        let mut set = std::collections::BTreeMap::new();
        for t in &matching {
            for (name, value) in &t.transform.headers {
                set.insert(name.to_ascii_lowercase(), (name.clone(), value.clone()));
            }
        }
        out = rewrite_head(&out, head_end, &set);
        tracing::debug!(target: "harness_sandboxes", host = %head.host, rules = matching.len(), "request transformed");
    }
    let stream = Prefixed {
        prefix: out,
        pos: 0,
        inner: stream,
    };
    if let Err(e) = harness_egress::serve_connection(stream, &policy).await {
        tracing::debug!(target: "harness_sandboxes", "egress connection: {e}");
    }
}

/// Read until the end of the request head; `Some(index after it)`.
async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
) -> io::Result<Option<usize>> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some(i + 4));
        }
        if buf.len() > MAX_HEAD {
            return Ok(None);
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn parse_head(bytes: &[u8]) -> std::result::Result<RequestHead, String> {
    let mut headers = [httparse::EMPTY_HEADER; 256];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(bytes) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("incomplete request head".into()),
        Err(e) => return Err(format!("malformed request: {e}")),
    }
    let method = req.method.unwrap_or("").to_string();
    let target = req.path.unwrap_or("").to_string();
    let headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    if method == "CONNECT" {
        let (host, port) = split_host_port(&target, 443)?;
        return Ok(RequestHead {
            method,
            host,
            port,
            path: String::new(),
            query: Vec::new(),
            headers,
            connect: true,
        });
    }
    let Some(rest) = target.strip_prefix("http://") else {
        // harness_egress answers every other form; nothing to transform.
        return Ok(RequestHead {
            method,
            host: String::new(),
            port: 0,
            path: target,
            query: Vec::new(),
            headers,
            connect: false,
        });
    };
    let (authority, path_query) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (host, port) = split_host_port(authority, 80)?;
    let (path, query) = match path_query.split_once('?') {
        Some((p, q)) => (p.to_string(), q),
        None => (path_query.to_string(), ""),
    };
    let query = query
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k.to_string(), v.to_string())
        })
        .collect();
    Ok(RequestHead {
        method,
        host,
        port,
        path,
        query,
        headers,
        connect: false,
    })
}

fn split_host_port(authority: &str, default: u16) -> std::result::Result<(String, u16), String> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("bad authority {authority:?}"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p
                .parse()
                .map_err(|_| format!("bad port in {authority:?}"))?,
            None => default,
        };
        return Ok((format!("[{host}]"), port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Ok((
            host.to_string(),
            port.parse()
                .map_err(|_| format!("bad port in {authority:?}"))?,
        )),
        None => Ok((authority.to_string(), default)),
    }
}

/// `buf` with the head's headers named in `set` replaced by `set`'s values
/// (the body bytes already read follow unchanged).
fn rewrite_head(
    buf: &[u8],
    head_end: usize,
    set: &std::collections::BTreeMap<String, (String, String)>,
) -> Vec<u8> {
    let head = String::from_utf8_lossy(&buf[..head_end - 4]);
    let mut lines = head.split("\r\n");
    let mut out = String::with_capacity(head_end + 256);
    out.push_str(lines.next().unwrap_or(""));
    out.push_str("\r\n");
    for line in lines {
        let name = line
            .split(':')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if set.contains_key(&name) {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    for (name, value) in set.values() {
        out.push_str(name);
        out.push_str(": ");
        out.push_str(value);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&buf[head_end..]);
    bytes
}

async fn refuse<S: AsyncWrite + Unpin>(stream: &mut S, why: &str) {
    reply(stream, 403, &format!("harness sandbox proxy refused {why}")).await;
}

async fn reply<S: AsyncWrite + Unpin>(stream: &mut S, status: u16, body: &str) {
    let reason = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        408 => "Request Timeout",
        _ => "Error",
    };
    let body = format!("{body}\n");
    let text = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n{}: {}\r\n\r\n{body}",
        body.len(),
        harness_egress::EGRESS_HEADER,
        if status == 403 { "refused" } else { "error" },
    );
    let _ = stream.write_all(text.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// `inner`, with `prefix` read first (what the head reader already took).
struct Prefixed<S> {
    prefix: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.pos);
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transformation(json: serde_json::Value) -> RequestTransformation {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn transformations_match_host_path_method_and_headers() {
        let t = transformation(serde_json::json!({
            "match": {"host": "model.test:8080", "path": {"startsWith": "/v1/"}, "method": ["POST"],
                      "headers": [{"key": {"exact": "X-Api-Key"}, "value": {"exact": "placeholder"}}]},
            "transform": {"headers": {"x-api-key": "real"}}
        }));
        t.check(0).unwrap();
        let head = |text: &str| parse_head(text.as_bytes()).unwrap();
        let yes = head("POST http://model.test:8080/v1/messages?beta=true HTTP/1.1\r\nHost: model.test:8080\r\nx-api-key: placeholder\r\n\r\n");
        assert!(t.matches(&yes));
        assert_eq!(yes.query, vec![("beta".to_string(), "true".to_string())]);
        for other in [
            "GET http://model.test:8080/v1/messages HTTP/1.1\r\nx-api-key: placeholder\r\n\r\n",
            "POST http://model.test:8081/v1/messages HTTP/1.1\r\nx-api-key: placeholder\r\n\r\n",
            "POST http://model.test:8080/v2/messages HTTP/1.1\r\nx-api-key: placeholder\r\n\r\n",
            "POST http://model.test:8080/v1/messages HTTP/1.1\r\nx-api-key: other\r\n\r\n",
            "POST http://evil.test:8080/v1/messages HTTP/1.1\r\nx-api-key: placeholder\r\n\r\n",
        ] {
            assert!(!t.matches(&head(other)), "{other}");
        }
    }

    #[test]
    fn the_head_is_rewritten_and_the_body_kept() {
        let raw = b"POST http://m/x HTTP/1.1\r\nHost: m\r\nX-Api-Key: placeholder\r\nContent-Length: 2\r\n\r\nhi";
        let end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let mut set = std::collections::BTreeMap::new();
        set.insert("x-api-key".into(), ("x-api-key".into(), "real".into()));
        let out = String::from_utf8(rewrite_head(raw, end, &set)).unwrap();
        assert!(out.contains("x-api-key: real\r\n"), "{out}");
        assert!(!out.contains("placeholder"), "{out}");
        assert!(out.ends_with("\r\n\r\nhi"), "{out}");
        assert!(
            out.starts_with("POST http://m/x HTTP/1.1\r\nHost: m\r\n"),
            "{out}"
        );
    }

    #[test]
    fn bad_policies_and_transformations_are_named() {
        let custom: ApiNetworkPolicy = serde_json::from_value(
            serde_json::json!({"mode": "custom", "allowedHosts": ["a:b/c"]}),
        )
        .unwrap();
        assert!(custom.compile().unwrap_err().message().contains("a:b/c"));
        let empty: ApiNetworkPolicy =
            serde_json::from_value(serde_json::json!({"mode": "custom"})).unwrap();
        assert!(empty.compile().is_err());
        assert!(
            serde_json::from_value::<ApiNetworkPolicy>(serde_json::json!({"mode": "open"}))
                .is_err()
        );
        let t = transformation(
            serde_json::json!({"match": {"host": "https://x"}, "transform": {"headers": {"a": "b"}}}),
        );
        assert!(t.check(0).is_err());
        let t = transformation(
            serde_json::json!({"match": {"host": "x", "path": {"regex": "("}}, "transform": {"headers": {"a": "b"}}}),
        );
        assert!(t.check(0).is_err());
        let t = transformation(
            serde_json::json!({"match": {"host": "x"}, "transform": {"headers": {"a": "b\r\nc: d"}}}),
        );
        assert!(t.check(0).is_err());
    }
}

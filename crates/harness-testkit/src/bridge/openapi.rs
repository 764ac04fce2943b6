//! The bridge's OpenAPI 3.1 document as a validator of requests and
//! responses.
//!
//! Operations are matched by method and path template; parameters are
//! checked against their schemas after converting the string they arrive as
//! to the schema's type; JSON bodies are checked with `jsonschema` (OpenAPI
//! 3.1 schemas are JSON Schema 2020-12). `$ref`s to `#/components/...` are
//! inlined once at load, so every schema handed to `jsonschema` stands alone.
//! The exec operation's `text/event-stream` body has no schema in the
//! document, only prose; [`check_exec_sse`] checks what that prose promises.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use base64::Engine as _;
use harness_core::query::query_pairs;
use harness_core::sse::{SseEvent, SseReader};
use http::HeaderMap;
use jsonschema::Validator;
use serde_json::Value;

/// The pinned `@cloudflare/sandbox` release (kept equal to xtask's
/// `CF_SANDBOX_VERSION`, which installs its document).
pub const CF_SANDBOX_VERSION: &str = "0.12.10";

/// The bridge's OpenAPI document, loaded with its `$ref`s resolved.
pub struct OpenApi {
    /// The document as published (served at `/v1/openapi.json`).
    raw: Value,
    operations: Vec<Operation>,
}

impl fmt::Debug for OpenApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenApi")
            .field("operations", &self.operations.len())
            .finish_non_exhaustive()
    }
}

struct Operation {
    method: String,
    template: String,
    segments: Vec<Segment>,
    params: Vec<Param>,
    /// Whether the operation needs the bearer token (`security: []` opts out).
    secured: bool,
    body: Option<RequestBody>,
    /// Status (`"200"`, `"4XX"`, `"default"`) → media type → body schema.
    responses: BTreeMap<String, BTreeMap<String, Option<Schema>>>,
}

enum Segment {
    Literal(String),
    Param(String),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Location {
    Path,
    Query,
    Header,
}

struct Param {
    name: String,
    location: Location,
    required: bool,
    schema: Schema,
}

struct RequestBody {
    required: bool,
    content: BTreeMap<String, Option<Schema>>,
}

/// A compiled schema and the JSON it came from (the type drives how a
/// parameter's string is converted before validation).
struct Schema {
    json: Value,
    validator: Validator,
}

impl Schema {
    fn compile(json: Value, what: &str) -> anyhow::Result<Self> {
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .should_validate_formats(true)
            .build(&json)
            .map_err(|e| anyhow::anyhow!("schema of {what} does not compile: {e}"))?;
        Ok(Self { json, validator })
    }

    fn errors(&self, value: &Value) -> Vec<String> {
        self.validator
            .iter_errors(value)
            .map(|e| {
                let at = e.instance_path.to_string();
                if at.is_empty() {
                    e.to_string()
                } else {
                    format!("at {at}: {e}")
                }
            })
            .collect()
    }
}

impl OpenApi {
    /// Load a document from a JSON file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the OpenAPI document {}", path.display()))?;
        let raw: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing the OpenAPI document {}", path.display()))?;
        Self::from_value(raw).with_context(|| format!("loading {}", path.display()))
    }

    /// The pinned document: `$HARNESS_CF_OPENAPI`, else
    /// `$HARNESS_CACHE/npm/cloudflare-sandbox-<version>/openapi.json`.
    pub fn pinned() -> anyhow::Result<Self> {
        let path = pinned_path();
        if !path.exists() {
            bail!(
                "the Cloudflare Sandbox bridge OpenAPI document {} is missing: run `cargo xtask deps` \
                 (it extracts it from @cloudflare/sandbox@{CF_SANDBOX_VERSION}), or point \
                 HARNESS_CF_OPENAPI at it",
                path.display()
            );
        }
        Self::load(&path)
    }

    /// Build from an already parsed document.
    pub fn from_value(raw: Value) -> anyhow::Result<Self> {
        let version = raw.get("openapi").and_then(Value::as_str).unwrap_or("");
        if !version.starts_with("3.1") {
            bail!("expected an OpenAPI 3.1 document, found openapi: {version:?}");
        }
        let resolved = resolve_refs(&raw, &raw, 0)?;
        let global_secured = resolved
            .get("security")
            .and_then(Value::as_array)
            .is_some_and(|s| !s.is_empty());
        let paths = resolved
            .get("paths")
            .and_then(Value::as_object)
            .context("the document has no paths")?;
        let mut operations = Vec::new();
        for (template, item) in paths {
            let item = item.as_object().context("a path item is not an object")?;
            let shared: Vec<Value> = item
                .get("parameters")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for (method, op) in item {
                if !matches!(
                    method.as_str(),
                    "get" | "put" | "post" | "delete" | "patch" | "head" | "options" | "trace"
                ) {
                    continue;
                }
                let what = format!("{} {template}", method.to_uppercase());
                operations.push(
                    Operation::parse(template, method, op, &shared, global_secured)
                        .with_context(|| what.clone())?,
                );
            }
        }
        Ok(Self { raw, operations })
    }

    /// The document as published.
    pub fn document(&self) -> &Value {
        &self.raw
    }

    /// Violations of a request (empty = valid), each naming method and path.
    pub fn validate_request(
        &self,
        method: &str,
        path_and_query: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Vec<String> {
        let (path, query) = split_query(path_and_query);
        let prefix = format!("request {} {path}", method.to_uppercase());
        let Some((op, path_params)) = self.find(method, path) else {
            return vec![format!(
                "{prefix}: no operation in the document matches this method and path"
            )];
        };
        let mut out = Vec::new();
        let query = parse_query(query);
        for param in &op.params {
            let value = match param.location {
                Location::Path => path_params.get(&param.name).cloned(),
                Location::Query => query.get(&param.name).cloned(),
                Location::Header => match headers.get(param.name.as_str()) {
                    Some(v) => match v.to_str() {
                        Ok(s) => Some(s.to_string()),
                        Err(_) => {
                            out.push(format!(
                                "{prefix}: header {} is not visible ASCII",
                                param.name
                            ));
                            continue;
                        }
                    },
                    None => None,
                },
            };
            match value {
                None if param.required => out.push(format!(
                    "{prefix}: required {:?} parameter {} is missing",
                    param.location, param.name
                )),
                None => {}
                Some(text) => {
                    for e in check_param(param, &text) {
                        out.push(format!(
                            "{prefix}: {:?} parameter {} = {text:?}: {e}",
                            param.location, param.name
                        ));
                    }
                }
            }
        }
        if op.secured {
            let bearer = headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer "));
            // The openapi routes also take the token as `?token=` (the
            // document's security scheme says so in prose).
            let query_token = op.template.starts_with("/v1/openapi") && query.contains_key("token");
            if !bearer && !query_token {
                out.push(format!(
                    "{prefix}: the operation needs `Authorization: Bearer <token>` and the request has none"
                ));
            }
        }
        let content_type = media_type(headers);
        match &op.body {
            None if !body.is_empty() => out.push(format!(
                "{prefix}: the operation takes no request body but got {} bytes",
                body.len()
            )),
            None => {}
            Some(rb) if body.is_empty() && rb.required => {
                out.push(format!("{prefix}: the request body is required"));
            }
            Some(_) if body.is_empty() => {}
            Some(rb) => match content_type.as_deref() {
                None => out.push(format!(
                    "{prefix}: a request body without Content-Type (declared: {})",
                    rb.content.keys().cloned().collect::<Vec<_>>().join(", ")
                )),
                Some(ct) => match rb.content.get(ct) {
                    None => out.push(format!(
                        "{prefix}: request Content-Type {ct} is not declared (declared: {})",
                        rb.content.keys().cloned().collect::<Vec<_>>().join(", ")
                    )),
                    Some(schema) => {
                        if is_json(ct) {
                            out.extend(
                                check_json(schema.as_ref(), body)
                                    .into_iter()
                                    .map(|e| format!("{prefix}: request body: {e}")),
                            );
                        }
                    }
                },
            },
        }
        out
    }

    /// Violations of a response to a request, each naming method and path.
    pub fn validate_response(
        &self,
        method: &str,
        path_and_query: &str,
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Vec<String> {
        let (path, _) = split_query(path_and_query);
        let prefix = format!("response {status} to {} {path}", method.to_uppercase());
        let Some((op, _)) = self.find(method, path) else {
            return vec![format!(
                "{prefix}: no operation in the document matches this method and path"
            )];
        };
        let mut out = Vec::new();
        let Some(content) = op.response(status) else {
            out.push(format!(
                "{prefix}: status {status} is not declared for the operation (declared: {})",
                op.responses.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
            return out;
        };
        if content.is_empty() {
            if !body.is_empty() {
                out.push(format!(
                    "{prefix}: the response declares no content but has a {}-byte body",
                    body.len()
                ));
            }
            return out;
        }
        let declared = || content.keys().cloned().collect::<Vec<_>>().join(", ");
        let Some(ct) = media_type(headers) else {
            out.push(format!(
                "{prefix}: the response has no Content-Type (declared: {})",
                declared()
            ));
            return out;
        };
        let Some(schema) = content.get(&ct) else {
            out.push(format!(
                "{prefix}: response Content-Type {ct} is not declared (declared: {})",
                declared()
            ));
            return out;
        };
        if is_json(&ct) {
            out.extend(
                check_json(schema.as_ref(), body)
                    .into_iter()
                    .map(|e| format!("{prefix}: response body: {e}")),
            );
        } else if ct == "text/event-stream" {
            out.extend(
                check_exec_sse(body)
                    .into_iter()
                    .map(|e| format!("{prefix}: event stream: {e}")),
            );
        }
        out
    }

    /// The declared media types of a response to `method path` with
    /// `status` (None when the operation or status is unknown). The server
    /// uses it to decide whether a body must be buffered for validation.
    pub(crate) fn response_media_types(
        &self,
        method: &str,
        path_and_query: &str,
        status: u16,
    ) -> Option<Vec<String>> {
        let (path, _) = split_query(path_and_query);
        let (op, _) = self.find(method, path)?;
        Some(op.response(status)?.keys().cloned().collect())
    }

    /// The operation for `method path` and its path parameters. Literal
    /// segments win over parameters; a trailing `{path}` parameter takes the
    /// rest of the path, slashes included (the file routes are `file/*` in
    /// the bridge: `file/workspace/a/b.txt`).
    fn find(&self, method: &str, path: &str) -> Option<(&Operation, BTreeMap<String, String>)> {
        let method = method.to_lowercase();
        let actual: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let mut best: Option<(usize, &Operation, BTreeMap<String, String>)> = None;
        for op in self.operations.iter().filter(|o| o.method == method) {
            if let Some((literals, params)) = op.matches(&actual) {
                if best.as_ref().is_none_or(|(l, _, _)| literals > *l) {
                    best = Some((literals, op, params));
                }
            }
        }
        best.map(|(_, op, params)| (op, params))
    }
}

/// `$HARNESS_CF_OPENAPI`, else the path `cargo xtask deps` writes.
pub fn pinned_path() -> PathBuf {
    if let Some(p) = std::env::var_os("HARNESS_CF_OPENAPI").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("HARNESS_CACHE")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/harness"));
    cache
        .join("npm")
        .join(format!("cloudflare-sandbox-{CF_SANDBOX_VERSION}"))
        .join("openapi.json")
}

impl Operation {
    fn parse(
        template: &str,
        method: &str,
        op: &Value,
        shared: &[Value],
        global_secured: bool,
    ) -> anyhow::Result<Self> {
        let segments = template
            .trim_start_matches('/')
            .split('/')
            .map(
                |s| match s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                    Some(name) => Segment::Param(name.to_string()),
                    None => Segment::Literal(s.to_string()),
                },
            )
            .collect();
        let mut params = Vec::new();
        let own = op.get("parameters").and_then(Value::as_array);
        for p in shared.iter().chain(own.into_iter().flatten()) {
            let name = p
                .get("name")
                .and_then(Value::as_str)
                .context("a parameter without name")?;
            let location = match p.get("in").and_then(Value::as_str) {
                Some("path") => Location::Path,
                Some("query") => Location::Query,
                Some("header") => Location::Header,
                // Cookie parameters: the bridge has none.
                _ => continue,
            };
            let schema = p.get("schema").cloned().unwrap_or(Value::Bool(true));
            params.push(Param {
                name: name.to_string(),
                location,
                required: location == Location::Path
                    || p.get("required").and_then(Value::as_bool).unwrap_or(false),
                schema: Schema::compile(schema, &format!("parameter {name}"))?,
            });
        }
        let body = match op.get("requestBody") {
            None => None,
            Some(rb) => Some(RequestBody {
                required: rb.get("required").and_then(Value::as_bool).unwrap_or(false),
                content: parse_content(rb.get("content"), "request body")?,
            }),
        };
        let mut responses = BTreeMap::new();
        for (status, r) in op
            .get("responses")
            .and_then(Value::as_object)
            .context("an operation without responses")?
        {
            responses.insert(
                status.clone(),
                parse_content(r.get("content"), &format!("response {status}"))?,
            );
        }
        let secured = match op.get("security").and_then(Value::as_array) {
            Some(s) => !s.is_empty(),
            None => global_secured,
        };
        Ok(Self {
            method: method.to_string(),
            template: template.to_string(),
            segments,
            params,
            secured,
            body,
            responses,
        })
    }

    /// `(number of literal segments, path params)` when `actual` matches.
    fn matches(&self, actual: &[&str]) -> Option<(usize, BTreeMap<String, String>)> {
        let mut params = BTreeMap::new();
        let mut literals = 0;
        for (i, seg) in self.segments.iter().enumerate() {
            let last = i + 1 == self.segments.len();
            match seg {
                Segment::Literal(l) => {
                    if actual.get(i) != Some(&l.as_str()) {
                        return None;
                    }
                    literals += 1;
                }
                Segment::Param(name) if last && name == "path" && actual.len() > i => {
                    params.insert(name.clone(), decode_path_segment(&actual[i..].join("/")));
                    return Some((literals, params));
                }
                Segment::Param(name) => {
                    let value = actual.get(i)?;
                    if value.is_empty() {
                        return None;
                    }
                    params.insert(name.clone(), decode_path_segment(value));
                }
            }
        }
        (actual.len() == self.segments.len()).then_some((literals, params))
    }

    fn response(&self, status: u16) -> Option<&BTreeMap<String, Option<Schema>>> {
        let exact = status.to_string();
        let range = format!("{}XX", status / 100);
        self.responses
            .get(&exact)
            .or_else(|| self.responses.get(&range))
            .or_else(|| self.responses.get("default"))
    }
}

fn parse_content(
    content: Option<&Value>,
    what: &str,
) -> anyhow::Result<BTreeMap<String, Option<Schema>>> {
    let mut out = BTreeMap::new();
    if let Some(content) = content.and_then(Value::as_object) {
        for (media, m) in content {
            let schema = match m.get("schema") {
                Some(s) if is_json(media) => {
                    Some(Schema::compile(s.clone(), &format!("{what} {media}"))?)
                }
                _ => None,
            };
            out.insert(media.to_lowercase(), schema);
        }
    }
    Ok(out)
}

/// Inline every `{"$ref": "#/..."}` (siblings of the `$ref`, allowed in 3.1,
/// are kept where the target lacks them). The bridge's document has no
/// recursive schemas; the depth cap turns one into an error, not a hang.
fn resolve_refs(value: &Value, root: &Value, depth: usize) -> anyhow::Result<Value> {
    if depth > 64 {
        bail!("$ref chain deeper than 64 (a recursive schema?)");
    }
    Ok(match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref") {
                let pointer = r
                    .strip_prefix('#')
                    .with_context(|| format!("only local $refs are supported, found {r}"))?;
                let target = root
                    .pointer(pointer)
                    .with_context(|| format!("$ref {r} points nowhere"))?;
                let mut resolved = resolve_refs(target, root, depth + 1)?;
                if let Value::Object(out) = &mut resolved {
                    for (k, v) in map {
                        if k != "$ref" && !out.contains_key(k) {
                            out.insert(k.clone(), resolve_refs(v, root, depth + 1)?);
                        }
                    }
                }
                resolved
            } else {
                let mut out = serde_json::Map::new();
                for (k, v) in map {
                    out.insert(k.clone(), resolve_refs(v, root, depth + 1)?);
                }
                Value::Object(out)
            }
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| resolve_refs(v, root, depth + 1))
                .collect::<anyhow::Result<_>>()?,
        ),
        other => other.clone(),
    })
}

/// A parameter arrives as a string; convert it to the schema's type first
/// (a tunnel port `"80"` is the integer 80, which `minimum: 1024` refuses).
fn check_param(param: &Param, text: &str) -> Vec<String> {
    let ty = param.schema.json.get("type").and_then(Value::as_str);
    let value = match ty {
        Some("integer") => match text.parse::<i64>() {
            Ok(n) => Value::from(n),
            Err(_) => return vec!["not an integer".to_string()],
        },
        Some("number") => match text.parse::<f64>() {
            Ok(n) => Value::from(n),
            Err(_) => return vec!["not a number".to_string()],
        },
        Some("boolean") => match text {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return vec!["not a boolean".to_string()],
        },
        _ => Value::String(text.to_string()),
    };
    param.schema.errors(&value)
}

fn check_json(schema: Option<&Schema>, body: &[u8]) -> Vec<String> {
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return vec![format!("not JSON: {e}")],
    };
    schema.map(|s| s.errors(&value)).unwrap_or_default()
}

/// Check an exec event stream against what the document promises: events
/// `stdout`/`stderr` (data: base64), `exit` (data: `{"exit_code": N}`) and
/// `error` (data: `{"error": "...", "code": "..."}`), every event ended by
/// a blank line, and exactly one terminal event (`exit` or `error`), last.
pub fn check_exec_sse(body: &[u8]) -> Vec<String> {
    let mut reader = SseReader::new();
    let events = match reader.push(body) {
        Ok(events) => events,
        Err(e) => return vec![e.to_string()],
    };
    let mut out = Vec::new();
    if reader.has_partial() {
        out.push("unterminated event at the end (no blank line after it)".to_string());
    }
    let mut terminal = 0;
    let mut after_terminal = false;
    for (i, SseEvent { event, data, .. }) in events.iter().enumerate() {
        if terminal > 0 {
            after_terminal = true;
        }
        match event.as_str() {
            name @ ("stdout" | "stderr") => {
                if let Err(e) = base64::engine::general_purpose::STANDARD.decode(data) {
                    out.push(format!("event #{i} ({name}): data is not base64: {e}"));
                }
            }
            "exit" => {
                terminal += 1;
                let ok = serde_json::from_str::<Value>(data).ok().is_some_and(|v| {
                    v.as_object().is_some_and(|o| {
                        o.len() == 1 && o.get("exit_code").is_some_and(|c| c.is_i64() || c.is_u64())
                    })
                });
                if !ok {
                    out.push(format!(
                        "event #{i} (exit): data is not {{\"exit_code\": <integer>}}: {data:?}"
                    ));
                }
            }
            "error" => {
                terminal += 1;
                let ok = serde_json::from_str::<Value>(data).ok().is_some_and(|v| {
                    v.get("error").is_some_and(Value::is_string)
                        && v.get("code").is_some_and(Value::is_string)
                });
                if !ok {
                    out.push(format!(
                        "event #{i} (error): data is not {{\"error\": <string>, \"code\": <string>}}: {data:?}"
                    ));
                }
            }
            other => out.push(format!(
                "event #{i}: unknown event {other:?} (expected stdout, stderr, exit or error)"
            )),
        }
    }
    if terminal == 0 {
        out.push("the stream ends without an exit or error event".to_string());
    } else if terminal > 1 {
        out.push(format!(
            "{terminal} terminal events (exit/error); expected exactly one"
        ));
    }
    if after_terminal {
        out.push("events follow the terminal exit/error event".to_string());
    }
    out
}

fn split_query(path_and_query: &str) -> (&str, &str) {
    path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""))
}

/// One value per query name (the last, when repeated), decoded by core's
/// one query decoder.
fn parse_query(query: &str) -> BTreeMap<String, String> {
    query_pairs(query).into_iter().collect()
}

/// A path segment decoded: `%XX` escapes only (`+` is itself in a path);
/// a malformed escape stays as it is.
fn decode_path_segment(segment: &str) -> String {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8_lossy()
        .into_owned()
}

/// The media type of `Content-Type`, lowercased, without parameters.
pub(crate) fn media_type(headers: &HeaderMap) -> Option<String> {
    let ct = headers.get(http::header::CONTENT_TYPE)?.to_str().ok()?;
    let media = ct.split(';').next()?.trim().to_lowercase();
    (!media.is_empty()).then_some(media)
}

fn is_json(media: &str) -> bool {
    media == "application/json" || media.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(decode_path_segment("a%20b+c"), "a b+c");
        assert_eq!(decode_path_segment("a%2"), "a%2");
        assert_eq!(decode_path_segment("%41"), "A");
        assert_eq!(decode_path_segment("100%"), "100%");
        let query = parse_query("path=a%2Fb+c&x=1&x=2&bad=%zz");
        assert_eq!(query["path"], "a/b c");
        assert_eq!(query["x"], "2", "a repeated name keeps its last value");
        assert_eq!(query["bad"], "%zz");
    }

    #[test]
    fn sse_checks() {
        assert!(check_exec_sse(
            b"event: stdout\ndata: aGk=\n\nevent: exit\ndata: {\"exit_code\":0}\n\n"
        )
        .is_empty());
        assert!(!check_exec_sse(b"event: stdout\ndata: aGk=\n\n").is_empty());
        assert!(!check_exec_sse(
            b"event: exit\ndata: {\"exit_code\":0}\n\nevent: exit\ndata: {\"exit_code\":0}\n\n"
        )
        .is_empty());
        assert!(!check_exec_sse(
            b"event: stdout\ndata: !!\n\nevent: exit\ndata: {\"exit_code\":0}\n\n"
        )
        .is_empty());
        assert!(!check_exec_sse(b"event: exit\ndata: {\"exit_code\":0}").is_empty());
    }
}

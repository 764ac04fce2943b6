//! The small amount of HTTP/1.1 the proxy speaks: request targets in
//! authority-form and absolute-form, and header-block rewriting.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::policy::validate_dns_name;

/// A destination taken from a request target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// Normalised host: lower case, no trailing dot, IPv6 without brackets.
    pub host: String,
    pub port: u16,
    /// The host if it is an IP literal.
    pub ip: Option<IpAddr>,
}

impl Target {
    /// `host:port` as shown to people, IPv6 in brackets.
    pub fn display(&self) -> String {
        match self.ip {
            Some(IpAddr::V6(_)) => format!("[{}]:{}", self.host, self.port),
            _ => format!("{}:{}", self.host, self.port),
        }
    }
}

/// Parses `host:port`, `[v6]:port`, or (with a default port) the same
/// without `:port`.
pub(crate) fn parse_authority(
    authority: &str,
    default_port: Option<u16>,
) -> Result<Target, String> {
    if authority.is_empty() {
        return Err("empty host".to_string());
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (inner, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("{authority:?}: an opening `[` needs a closing `]`"))?;
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or_else(|| format!("{authority:?}: expected `:port` after `]`"))?,
            ),
        };
        let ip: Ipv6Addr = inner
            .parse()
            .map_err(|_| format!("{authority:?}: not an IPv6 address inside `[...]`"))?;
        (HostPart::Ip(IpAddr::V6(ip)), port)
    } else {
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        };
        if host.contains(':') {
            return Err(format!(
                "{authority:?}: an IPv6 address must be written in [...]"
            ));
        }
        match host.parse::<Ipv4Addr>() {
            Ok(ip) => (HostPart::Ip(IpAddr::V4(ip)), port),
            Err(_) => {
                let name = validate_dns_name(host).map_err(|why| format!("{host:?}: {why}"))?;
                (HostPart::Name(name), port)
            }
        }
    };
    let port = match port {
        Some(text) => {
            parse_port(text).ok_or_else(|| format!("{authority:?}: bad port {text:?}"))?
        }
        None => default_port.ok_or_else(|| format!("{authority:?}: a port is required"))?,
    };
    Ok(match host {
        HostPart::Ip(ip) => Target {
            host: ip.to_string(),
            port,
            ip: Some(ip),
        },
        HostPart::Name(name) => Target {
            host: name,
            port,
            ip: None,
        },
    })
}

enum HostPart {
    Ip(IpAddr),
    Name(String),
}

fn parse_port(text: &str) -> Option<u16> {
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u16>().ok().filter(|port| *port != 0)
}

/// An absolute-form `http://` request target, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AbsoluteTarget {
    pub target: Target,
    /// The authority as written (the new `Host` header).
    pub authority: String,
    /// The origin-form target: `/path?query`, at least `/`.
    pub origin_form: String,
}

/// Splits `http://host[:port]/path?query`.
pub(crate) fn parse_absolute(uri: &str) -> Result<AbsoluteTarget, String> {
    let Some(scheme_end) = uri.find("://") else {
        return Err(format!(
            "{uri:?} is not a proxy request: use CONNECT host:port, or an absolute http:// URI"
        ));
    };
    let scheme = &uri[..scheme_end];
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(format!(
            "scheme {scheme:?} is not proxied: send http:// URIs, and use CONNECT for https and everything else"
        ));
    }
    let rest = &uri[scheme_end + 3..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    if authority.contains('@') {
        return Err("credentials in the URI (user@host) are not supported".to_string());
    }
    let target = parse_authority(authority, Some(80))?;
    let mut path = &rest[end..];
    if let Some(hash) = path.find('#') {
        path = &path[..hash];
    }
    let origin_form = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("/{path}")
    };
    Ok(AbsoluteTarget {
        target,
        authority: authority.to_string(),
        origin_form,
    })
}

/// Whether a header is hop-by-hop for a proxied request: `Connection`,
/// `Keep-Alive`, every `Proxy-*`, anything `Connection` names, and `Host`
/// (the proxy writes its own from the request target, so a request cannot
/// name one host for the policy and another for the server).
pub(crate) fn drop_request_header(name: &str, connection_tokens: &[String]) -> bool {
    let lower = name.to_ascii_lowercase();
    matches!(lower.as_str(), "connection" | "keep-alive" | "host")
        || lower.starts_with("proxy-")
        || connection_tokens.contains(&lower)
}

/// The lower-cased tokens of every `Connection` header (the headers they
/// name are hop-by-hop).
pub(crate) fn connection_tokens(headers: &[httparse::Header<'_>]) -> Vec<String> {
    headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("connection"))
        .flat_map(|h| {
            String::from_utf8_lossy(h.value)
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty())
        .collect()
}

/// The request head sent upstream: origin-form request line, the client's
/// headers minus hop-by-hop ones, `Host` from the target, `Connection: close`.
pub(crate) fn rewrite_request(
    method: &str,
    version: u8,
    target: &AbsoluteTarget,
    headers: &[httparse::Header<'_>],
) -> Vec<u8> {
    let tokens = connection_tokens(headers);
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(
        format!("{method} {} HTTP/1.{version}\r\n", target.origin_form).as_bytes(),
    );
    out.extend_from_slice(format!("Host: {}\r\n", target.authority).as_bytes());
    for header in headers {
        if drop_request_header(header.name, &tokens) {
            continue;
        }
        out.extend_from_slice(header.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(header.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// A response head rewritten for the client: the status line as it came,
/// the headers minus `Connection`, `Keep-Alive`, `Proxy-Connection` and
/// what `Connection` names, plus `Connection: close` (the proxy serves one
/// request per client connection, so the client must not reuse it).
pub(crate) fn rewrite_response_head(head: &[u8], headers: &[httparse::Header<'_>]) -> Vec<u8> {
    let line_end = head
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|p| p + 2)
        .unwrap_or(head.len());
    let tokens = connection_tokens(headers);
    let mut out = Vec::with_capacity(head.len() + 32);
    out.extend_from_slice(&head[..line_end]);
    for header in headers {
        let lower = header.name.to_ascii_lowercase();
        if matches!(
            lower.as_str(),
            "connection" | "keep-alive" | "proxy-connection"
        ) || tokens.contains(&lower)
        {
            continue;
        }
        out.extend_from_slice(header.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(header.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        let t = parse_authority("Example.COM.:443", None).unwrap();
        assert_eq!((t.host.as_str(), t.port, t.ip), ("example.com", 443, None));
        assert_eq!(t.display(), "example.com:443");
        let t = parse_authority("[::1]:8080", None).unwrap();
        assert_eq!(t.host, "::1");
        assert_eq!(t.display(), "[::1]:8080");
        assert_eq!(t.ip, Some("::1".parse().unwrap()));
        let t = parse_authority("127.0.0.1", Some(80)).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("127.0.0.1", 80));
        let t = parse_authority("[::ffff:10.0.0.1]", Some(80)).unwrap();
        assert_eq!(t.ip, Some("::ffff:10.0.0.1".parse().unwrap()));

        for bad in [
            "",
            "example.com",
            "example.com:",
            "example.com:0",
            "example.com:65536",
            "example.com:+80",
            "example.com:http",
            ":443",
            "::1:443",
            "[::1:443",
            "[::1]443",
            "[nope]:443",
            "[fe80::1%25eth0]:443",
            "exa mple.com:443",
            "evil.com#@good.com:443",
            "0x7f.1:80",
            "2130706433:80",
        ] {
            assert!(parse_authority(bad, None).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn absolute_uris() {
        let a = parse_absolute("http://127.0.0.1:8080/x?y=1#frag").unwrap();
        assert_eq!(a.target.port, 8080);
        assert_eq!(a.authority, "127.0.0.1:8080");
        assert_eq!(a.origin_form, "/x?y=1");
        let a = parse_absolute("HTTP://Example.com").unwrap();
        assert_eq!((a.target.host.as_str(), a.target.port), ("example.com", 80));
        assert_eq!(a.origin_form, "/");
        let a = parse_absolute("http://example.com?q").unwrap();
        assert_eq!(a.origin_form, "/?q");
        let a = parse_absolute("http://[::1]:81/").unwrap();
        assert_eq!(a.authority, "[::1]:81");

        for bad in [
            "/x",
            "*",
            "https://example.com/",
            "ftp://example.com/",
            "http://user:pw@example.com/",
            "http:///x",
            "http://exa_mple.com:notaport/",
        ] {
            assert!(parse_absolute(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn request_rewrite_drops_hop_by_hop_and_host() {
        let raw = b"GET http://example.com:8080/a?b HTTP/1.1\r\nHost: evil.com\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: x\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nAccept: */*\r\nContent-Length: 3\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(raw).unwrap();
        let target = parse_absolute(req.path.unwrap()).unwrap();
        let out = rewrite_request(req.method.unwrap(), 1, &target, req.headers);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /a?b HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nContent-Length: 3\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn response_rewrite_forces_close() {
        let raw = b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: 1\r\nContent-Length: 2\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(n) = resp.parse(raw).unwrap() else {
            panic!("partial")
        };
        let out = rewrite_response_head(&raw[..n], resp.headers);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
        );
    }
}

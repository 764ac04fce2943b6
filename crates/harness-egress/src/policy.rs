//! The egress policy: a validated [`NetworkPolicy::Custom`] and the pure
//! decision function the proxy asks about every destination.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use harness_core::sandbox::NetworkPolicy;
use harness_core::{Error, Result};
use ipnet::IpNet;

/// One `allowed_hosts` entry, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    /// `example.com`: that name only (normalised: lower case, no trailing dot).
    Exact(String),
    /// `*.example.com`: every name strictly under `example.com` (stored
    /// without the `*.`).
    Subdomains(String),
    /// `10.0.0.1`, `::1` or `[::1]`: that address, given literally.
    Ip(IpAddr),
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(name) => f.write_str(name),
            HostPattern::Subdomains(base) => write!(f, "*.{base}"),
            HostPattern::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// A validated `custom` network policy, ready to answer
/// [`decide`](EgressPolicy::decide).
///
/// ```
/// use harness_core::sandbox::NetworkPolicy;
/// use harness_egress::EgressPolicy;
///
/// let policy = EgressPolicy::from_network(&NetworkPolicy::Custom {
///     allowed_hosts: vec!["*.github.com".into(), "pypi.org".into()],
///     allowed_cidrs: vec![],
///     denied_cidrs: vec!["10.0.0.0/8".into(), "169.254.0.0/16".into()],
///     allowed_ports: vec![443],
/// })?;
/// let api = ["140.82.112.6".parse().unwrap()];
/// assert!(policy.decide("api.github.com", 443, &api).allowed);
/// assert!(!policy.decide("github.com", 443, &api).allowed); // the apex is not a subdomain
/// assert!(!policy.decide("api.github.com", 22, &api).allowed);
/// let inside = ["10.1.2.3".parse().unwrap()];
/// assert!(!policy.decide("pypi.org", 443, &inside).allowed); // denied wins
/// # Ok::<(), harness_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPolicy {
    hosts: Vec<HostPattern>,
    allowed_cidrs: Vec<IpNet>,
    denied_cidrs: Vec<IpNet>,
    ports: Vec<u16>,
}

/// What the policy says about one destination, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the proxy may connect.
    pub allowed: bool,
    /// A one-line, human-readable reason (shown to the agent in a refusal
    /// and logged for every decision).
    pub reason: String,
}

impl Decision {
    fn allow(reason: String) -> Self {
        Decision {
            allowed: true,
            reason,
        }
    }

    fn refuse(reason: String) -> Self {
        Decision {
            allowed: false,
            reason,
        }
    }
}

impl EgressPolicy {
    /// Validates a [`NetworkPolicy::Custom`]. Every bad entry is named in
    /// the `InvalidInput` error; any other policy is refused too (the proxy
    /// exists only for `custom`: `allow-all` and `deny-all` need none).
    pub fn from_network(policy: &NetworkPolicy) -> Result<EgressPolicy> {
        let NetworkPolicy::Custom {
            allowed_hosts,
            allowed_cidrs,
            denied_cidrs,
            allowed_ports,
        } = policy
        else {
            let mode = match policy {
                NetworkPolicy::AllowAll => "allow-all",
                NetworkPolicy::DenyAll => "deny-all",
                _ => "this",
            };
            return Err(Error::invalid(format!(
                "the egress proxy enforces only a `custom` network policy, not {mode}: \
                 allow-all needs no proxy and deny-all has nothing to let out"
            )));
        };

        let mut problems = Vec::new();
        let mut hosts = Vec::with_capacity(allowed_hosts.len());
        for entry in allowed_hosts {
            match parse_host_pattern(entry) {
                Ok(pattern) => hosts.push(pattern),
                Err(why) => problems.push(format!("allowed_hosts entry {entry:?}: {why}")),
            }
        }
        let mut parse_cidrs = |list: &[String], field: &str| {
            let mut nets = Vec::with_capacity(list.len());
            for entry in list {
                match parse_cidr(entry) {
                    Ok(net) => nets.push(net),
                    Err(why) => problems.push(format!("{field} entry {entry:?}: {why}")),
                }
            }
            nets
        };
        let allowed_nets = parse_cidrs(allowed_cidrs, "allowed_cidrs");
        let denied_nets = parse_cidrs(denied_cidrs, "denied_cidrs");
        if allowed_ports.contains(&0) {
            problems.push("allowed_ports entry 0: port 0 cannot be connected to".to_string());
        }
        if !problems.is_empty() {
            return Err(Error::invalid(format!(
                "invalid custom network policy: {}",
                problems.join("; ")
            )));
        }
        Ok(EgressPolicy {
            hosts,
            allowed_cidrs: allowed_nets,
            denied_cidrs: denied_nets,
            ports: allowed_ports.clone(),
        })
    }

    /// Decides whether `host:port` may be reached, given the addresses
    /// `host` resolved to (for an IP literal, the address itself). Pure: it
    /// resolves nothing.
    ///
    /// Allowed when the port is allowed (an empty `allowed_ports` allows
    /// every port) **and** the host matches an `allowed_hosts` entry or every
    /// resolved address is in an `allowed_cidrs` range **and** no resolved
    /// address is in a `denied_cidrs` range (denied wins, so a permitted
    /// name that resolves into a denied range is refused). An empty
    /// `resolved` is refused: there is nothing that passed the check to
    /// connect to.
    ///
    /// `host` is compared case-insensitively, without a trailing dot, and
    /// may be a bracketed IPv6 literal (`[::1]`).
    pub fn decide(&self, host: &str, port: u16, resolved: &[IpAddr]) -> Decision {
        let host = normalize_host(host);
        let shown = display_host(&host);
        if let Some(refusal) = self.port_refusal(port) {
            return refusal;
        }
        if resolved.is_empty() {
            return Decision::refuse(format!("{shown} resolved to no addresses"));
        }
        for addr in resolved {
            if let Some(net) = find_net(&self.denied_cidrs, addr) {
                let reason = if host_ip(&host) == Some(addr.to_canonical()) {
                    format!("{addr} is in denied_cidrs entry {net}")
                } else {
                    format!("{shown} resolves to {addr}, which is in denied_cidrs entry {net}")
                };
                return Decision::refuse(reason);
            }
        }
        if let Some(pattern) = self.matching_host(&host) {
            return Decision::allow(format!("{shown} matches allowed_hosts entry {pattern}"));
        }
        let mut nets = Vec::with_capacity(resolved.len());
        for addr in resolved {
            match find_net(&self.allowed_cidrs, addr) {
                Some(net) => nets.push(format!("{addr} in {net}")),
                None => {
                    let what = if self.allowed_cidrs.is_empty() {
                        "allowed_cidrs is empty".to_string()
                    } else if host_ip(&host).is_some() {
                        format!("{addr} is in no allowed_cidrs entry")
                    } else {
                        format!("it resolves to {addr}, which is in no allowed_cidrs entry")
                    };
                    return Decision::refuse(format!(
                        "{shown} matches no allowed_hosts entry and {what}"
                    ));
                }
            }
        }
        Decision::allow(format!(
            "every address of {shown} is in allowed_cidrs ({})",
            nets.join(", ")
        ))
    }

    /// A refusal that needs no name resolution, if there is one: the port is
    /// not allowed, or `host` is a name that matches no `allowed_hosts`
    /// entry while `allowed_cidrs` is empty (so no address could allow it).
    /// The proxy asks this first so that a sandbox cannot make the host
    /// look up arbitrary names (a DNS side channel) the policy would refuse
    /// anyway. Every refusal here is one [`decide`](Self::decide) would
    /// give for any resolution; `None` means "resolve and ask `decide`".
    pub fn decide_before_resolving(&self, host: &str, port: u16) -> Option<Decision> {
        if let Some(refusal) = self.port_refusal(port) {
            return Some(refusal);
        }
        let host = normalize_host(host);
        if self.allowed_cidrs.is_empty() && self.matching_host(&host).is_none() {
            return Some(Decision::refuse(format!(
                "{} matches no allowed_hosts entry and allowed_cidrs is empty",
                display_host(&host)
            )));
        }
        None
    }

    fn port_refusal(&self, port: u16) -> Option<Decision> {
        if self.ports.is_empty() || self.ports.contains(&port) {
            return None;
        }
        let list: Vec<String> = self.ports.iter().map(u16::to_string).collect();
        Some(Decision::refuse(format!(
            "port {port} is not in allowed_ports [{}]",
            list.join(", ")
        )))
    }

    /// The first `allowed_hosts` entry matching a normalised host.
    fn matching_host(&self, host: &str) -> Option<&HostPattern> {
        let ip = host_ip(host);
        self.hosts.iter().find(|pattern| match (pattern, ip) {
            (HostPattern::Ip(allowed), Some(ip)) => allowed.to_canonical() == ip,
            (HostPattern::Exact(name), None) => name == host,
            (HostPattern::Subdomains(base), None) => host
                .strip_suffix(base.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            _ => false,
        })
    }
}

/// Lower case, no trailing dot, no IPv6 brackets.
fn normalize_host(host: &str) -> String {
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let host = host.strip_suffix('.').unwrap_or(host);
    host.to_ascii_lowercase()
}

/// A host as written in messages: IPv6 literals in brackets.
fn display_host(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// The address of a normalised host that is an IP literal (canonical:
/// an IPv4-mapped IPv6 address becomes the IPv4 address).
fn host_ip(host: &str) -> Option<IpAddr> {
    IpAddr::from_str(host).ok().map(|ip| ip.to_canonical())
}

/// The first range holding `addr`, also trying its canonical form (an
/// IPv4-mapped IPv6 address reaches the IPv4 address).
fn find_net<'a>(nets: &'a [IpNet], addr: &IpAddr) -> Option<&'a IpNet> {
    let canonical = addr.to_canonical();
    nets.iter()
        .find(|net| net.contains(addr) || net.contains(&canonical))
}

fn parse_host_pattern(entry: &str) -> std::result::Result<HostPattern, String> {
    if entry.is_empty() {
        return Err("empty host".to_string());
    }
    if entry.chars().any(char::is_whitespace) {
        return Err("contains whitespace".to_string());
    }
    if let Some(inner) = entry.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or("an opening `[` needs a closing `]`")?;
        return inner
            .parse::<std::net::Ipv6Addr>()
            .map(|ip| HostPattern::Ip(IpAddr::V6(ip)))
            .map_err(|_| "not an IPv6 address inside `[...]`".to_string());
    }
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Ok(HostPattern::Ip(ip));
    }
    if entry.contains("://") {
        return Err("a host has no scheme here: write `example.com`".to_string());
    }
    if entry.contains('/') {
        return Err(if parse_cidr(entry).is_ok() {
            "a CIDR range belongs in allowed_cidrs".to_string()
        } else {
            "a host has no path here: write `example.com`".to_string()
        });
    }
    if entry.contains(':') {
        return Err(
            "a host has no port here (ports go in allowed_ports); IPv6 literals are written bare or in [...]"
                .to_string(),
        );
    }
    if let Some(base) = entry.strip_prefix("*.") {
        let base = validate_dns_name(base).map_err(|why| format!("after `*.`: {why}"))?;
        return Ok(HostPattern::Subdomains(base));
    }
    if entry.contains('*') {
        return Err(
            "a wildcard is allowed only as a whole first label: `*.example.com`".to_string(),
        );
    }
    validate_dns_name(entry).map(HostPattern::Exact)
}

/// Checks a DNS name and returns it normalised (lower case, no trailing
/// dot). Letters, digits, `-` and `_` in labels of 1 to 63 characters, at
/// most 253 in all; a label does not start or end with `-`; the last label
/// is not all digits (that would be a mangled IPv4 address).
pub(crate) fn validate_dns_name(name: &str) -> std::result::Result<String, String> {
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if trimmed.is_empty() {
        return Err("empty host name".to_string());
    }
    if trimmed.len() > 253 {
        return Err("a host name is at most 253 characters".to_string());
    }
    let labels: Vec<&str> = trimmed.split('.').collect();
    for label in &labels {
        if label.is_empty() {
            return Err("empty label (two dots in a row, or a leading dot)".to_string());
        }
        if label.len() > 63 {
            return Err(format!("label {label:?} is longer than 63 characters"));
        }
        if let Some(bad) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(format!(
                "character {bad:?} is not allowed in a host name (letters, digits, `-`, `_`)"
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("label {label:?} starts or ends with `-`"));
        }
    }
    let last = labels.last().expect("split yields at least one label");
    if last.chars().all(|c| c.is_ascii_digit()) {
        return Err(
            "not a valid IP address, and a host name does not end in a numeric label".to_string(),
        );
    }
    Ok(trimmed.to_ascii_lowercase())
}

fn parse_cidr(entry: &str) -> std::result::Result<IpNet, String> {
    if entry.is_empty() {
        return Err("empty range".to_string());
    }
    if entry.contains('/') {
        let net = IpNet::from_str(entry).map_err(|_| {
            "not a CIDR range (write `10.0.0.0/8`, `fd00::/8`, or a bare address)".to_string()
        })?;
        return Ok(net.trunc());
    }
    IpAddr::from_str(entry).map(IpNet::from).map_err(|_| {
        "not an IP address or CIDR range (write `10.0.0.0/8`, `fd00::/8`, or a bare address)"
            .to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::ErrorKind;

    fn custom(hosts: &[&str], allowed: &[&str], denied: &[&str], ports: &[u16]) -> NetworkPolicy {
        NetworkPolicy::Custom {
            allowed_hosts: hosts.iter().map(|s| s.to_string()).collect(),
            allowed_cidrs: allowed.iter().map(|s| s.to_string()).collect(),
            denied_cidrs: denied.iter().map(|s| s.to_string()).collect(),
            allowed_ports: ports.to_vec(),
        }
    }

    fn policy(hosts: &[&str], allowed: &[&str], denied: &[&str], ports: &[u16]) -> EgressPolicy {
        EgressPolicy::from_network(&custom(hosts, allowed, denied, ports)).unwrap()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn invalid(hosts: &[&str], allowed: &[&str], denied: &[&str], ports: &[u16]) -> String {
        let err = EgressPolicy::from_network(&custom(hosts, allowed, denied, ports)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        err.message().to_string()
    }

    const PUBLIC: &str = "93.184.216.34";

    #[test]
    fn only_custom_is_accepted() {
        for other in [NetworkPolicy::AllowAll, NetworkPolicy::DenyAll] {
            let err = EgressPolicy::from_network(&other).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
            assert!(err.message().contains("only a `custom`"), "{err}");
        }
        assert!(EgressPolicy::from_network(&custom(&[], &[], &[], &[])).is_ok());
    }

    #[test]
    fn bad_host_entries_are_named() {
        for (entry, why) in [
            ("", "empty host"),
            (" example.com", "whitespace"),
            ("example..com", "empty label"),
            (".example.com", "empty label"),
            ("exa mple.com", "whitespace"),
            ("exa$mple.com", "character '$'"),
            ("-example.com", "starts or ends with `-`"),
            ("example-.com", "starts or ends with `-`"),
            ("*", "wildcard"),
            ("*.", "after `*.`"),
            ("*.*.example.com", "after `*.`"),
            ("foo.*.com", "wildcard"),
            ("*example.com", "wildcard"),
            ("example.*", "wildcard"),
            ("example.com:443", "no port"),
            ("https://example.com", "no scheme"),
            ("example.com/path", "no path"),
            ("::1/128", "allowed_cidrs"),
            ("10.0.0.0/8", "allowed_cidrs"),
            ("[::1", "closing"),
            ("[example.com]", "IPv6"),
            ("1.2.3", "numeric label"),
            ("*.10.0.0.1", "after `*.`"),
        ] {
            let msg = invalid(&[entry], &[], &[], &[]);
            assert!(
                msg.contains(&format!("allowed_hosts entry {entry:?}")) && msg.contains(why),
                "{entry:?}: {msg}"
            );
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(invalid(&[&long_label], &[], &[], &[]).contains("longer than 63"));
        let long_name = format!("{}com", "abcdefghi.".repeat(26));
        assert!(invalid(&[&long_name], &[], &[], &[]).contains("253"));
    }

    #[test]
    fn bad_cidrs_and_ports_are_named_all_at_once() {
        let msg = invalid(
            &["ok.example", "bad host"],
            &["10.0.0.0/33", "10.0.0.0/8"],
            &["nope", "::1/129", ""],
            &[0, 443],
        );
        for needle in [
            "allowed_hosts entry \"bad host\"",
            "allowed_cidrs entry \"10.0.0.0/33\"",
            "denied_cidrs entry \"nope\"",
            "denied_cidrs entry \"::1/129\"",
            "denied_cidrs entry \"\"",
            "allowed_ports entry 0",
        ] {
            assert!(msg.contains(needle), "{needle}: {msg}");
        }
        assert!(!msg.contains("ok.example"), "{msg}");
        assert!(!msg.contains("\"10.0.0.0/8\""), "{msg}");
    }

    #[test]
    fn good_entries_parse() {
        let p = policy(
            &[
                "Example.COM.",
                "*.Example.org",
                "localhost",
                "10.1.2.3",
                "::1",
                "[fe80::1]",
                "my_host.internal",
            ],
            &[
                "10.0.0.0/8",
                "::1/128",
                "192.168.1.1",
                "2001:db8::1",
                "10.9.9.9/8",
            ],
            &["169.254.0.0/16", "fd00::/8"],
            &[80, 443],
        );
        assert_eq!(p.hosts.len(), 7);
        assert_eq!(p.hosts[0], HostPattern::Exact("example.com".into()));
        assert_eq!(p.hosts[1], HostPattern::Subdomains("example.org".into()));
        assert_eq!(p.allowed_cidrs[2].to_string(), "192.168.1.1/32");
        assert_eq!(p.allowed_cidrs[3].to_string(), "2001:db8::1/128");
        // Host bits are dropped: the range is what counts.
        assert_eq!(p.allowed_cidrs[4].to_string(), "10.0.0.0/8");
    }

    #[test]
    fn exact_names_are_case_insensitive_and_ignore_the_trailing_dot() {
        let p = policy(&["Example.com."], &[], &[], &[]);
        let addr = ips(&[PUBLIC]);
        for host in ["example.com", "EXAMPLE.COM", "example.com.", "Example.Com."] {
            let d = p.decide(host, 443, &addr);
            assert!(d.allowed, "{host}: {}", d.reason);
            assert!(
                d.reason.contains("matches allowed_hosts entry example.com"),
                "{}",
                d.reason
            );
        }
        for host in [
            "www.example.com",
            "example.co",
            "example.com.evil",
            "notexample.com",
        ] {
            assert!(!p.decide(host, 443, &addr).allowed, "{host}");
        }
    }

    #[test]
    fn wildcards_match_subdomains_only() {
        let p = policy(&["*.example.com"], &[], &[], &[]);
        let addr = ips(&[PUBLIC]);
        for host in ["a.example.com", "A.B.Example.COM.", "x-1.example.com"] {
            let d = p.decide(host, 443, &addr);
            assert!(d.allowed, "{host}: {}", d.reason);
            assert!(d.reason.contains("*.example.com"), "{}", d.reason);
        }
        for host in [
            "example.com",
            "example.com.",
            "badexample.com",
            ".example.com",
            "a.example.com.evil.org",
        ] {
            let d = p.decide(host, 443, &addr);
            assert!(!d.allowed, "{host}: {}", d.reason);
        }
    }

    #[test]
    fn ip_literals_in_allowed_hosts_match_literally() {
        let p = policy(&["127.0.0.1", "::1"], &[], &[], &[]);
        assert!(p.decide("127.0.0.1", 80, &ips(&["127.0.0.1"])).allowed);
        assert!(p.decide("[::1]", 80, &ips(&["::1"])).allowed);
        assert!(p.decide("::1", 80, &ips(&["::1"])).allowed);
        // The IPv4-mapped spelling of an allowed address is the same destination.
        assert!(
            p.decide("::ffff:127.0.0.1", 80, &ips(&["::ffff:127.0.0.1"]))
                .allowed
        );
        // Not a CIDR: a neighbour is not allowed, nor a name resolving to it.
        assert!(!p.decide("127.0.0.2", 80, &ips(&["127.0.0.2"])).allowed);
        let d = p.decide("localhost", 80, &ips(&["127.0.0.1"]));
        assert!(!d.allowed, "{}", d.reason);
        // And a name entry never matches an IP literal host.
        let p = policy(&["localhost"], &[], &[], &[]);
        assert!(!p.decide("127.0.0.1", 80, &ips(&["127.0.0.1"])).allowed);
    }

    #[test]
    fn ports() {
        let p = policy(&["example.com"], &[], &[], &[443, 8443]);
        let addr = ips(&[PUBLIC]);
        assert!(p.decide("example.com", 443, &addr).allowed);
        assert!(p.decide("example.com", 8443, &addr).allowed);
        let d = p.decide("example.com", 80, &addr);
        assert!(!d.allowed);
        assert_eq!(d.reason, "port 80 is not in allowed_ports [443, 8443]");
        // Empty list: any port.
        let p = policy(&["example.com"], &[], &[], &[]);
        for port in [1, 22, 80, 65535] {
            assert!(p.decide("example.com", port, &addr).allowed);
        }
    }

    #[test]
    fn cidrs_allow_when_every_address_is_inside() {
        let p = policy(&[], &["10.0.0.0/8", "2001:db8::/32"], &[], &[]);
        let d = p.decide("internal.corp", 80, &ips(&["10.1.2.3", "2001:db8::5"]));
        assert!(d.allowed, "{}", d.reason);
        assert!(d.reason.contains("10.1.2.3 in 10.0.0.0/8"), "{}", d.reason);
        let d = p.decide("10.9.9.9", 80, &ips(&["10.9.9.9"]));
        assert!(d.allowed, "{}", d.reason);
        // One address outside: refused.
        let d = p.decide("mixed.corp", 80, &ips(&["10.1.2.3", PUBLIC]));
        assert!(!d.allowed);
        assert!(
            d.reason.contains(PUBLIC) && d.reason.contains("no allowed_cidrs entry"),
            "{}",
            d.reason
        );
        let d = p.decide("11.0.0.1", 80, &ips(&["11.0.0.1"]));
        assert!(!d.allowed);
        assert_eq!(
            d.reason,
            "11.0.0.1 matches no allowed_hosts entry and 11.0.0.1 is in no allowed_cidrs entry"
        );
    }

    #[test]
    fn denied_wins_over_names_and_ranges() {
        let p = policy(
            &["localhost", "*.example.com", "10.0.0.7"],
            &["10.0.0.0/8"],
            &["127.0.0.0/8", "::1/128", "10.0.0.0/24"],
            &[],
        );
        // A permitted name resolving into a denied range (DNS rebinding).
        let d = p.decide("localhost", 80, &ips(&["127.0.0.1"]));
        assert!(!d.allowed);
        assert_eq!(
            d.reason,
            "localhost resolves to 127.0.0.1, which is in denied_cidrs entry 127.0.0.0/8"
        );
        let d = p.decide("rebind.example.com", 443, &ips(&[PUBLIC, "::1"]));
        assert!(!d.allowed);
        assert!(d.reason.contains("::1/128"), "{}", d.reason);
        // A literal allowed by name but denied by range.
        let d = p.decide("10.0.0.7", 80, &ips(&["10.0.0.7"]));
        assert!(!d.allowed);
        assert_eq!(d.reason, "10.0.0.7 is in denied_cidrs entry 10.0.0.0/24");
        // Inside allowed_cidrs but in the denied sub-range.
        assert!(!p.decide("10.0.0.9", 80, &ips(&["10.0.0.9"])).allowed);
        assert!(p.decide("10.0.1.9", 80, &ips(&["10.0.1.9"])).allowed);
        // IPv4-mapped IPv6 addresses do not slip past an IPv4 range.
        let d = p.decide("sneaky.example.com", 443, &ips(&["::ffff:127.0.0.1"]));
        assert!(!d.allowed, "{}", d.reason);
        let d = p.decide("[::ffff:10.0.0.7]", 443, &ips(&["::ffff:10.0.0.7"]));
        assert!(!d.allowed, "{}", d.reason);
    }

    #[test]
    fn port_is_checked_before_anything_else() {
        let p = policy(&["example.com"], &[], &["0.0.0.0/0"], &[443]);
        let d = p.decide("example.com", 22, &ips(&[PUBLIC]));
        assert!(d.reason.starts_with("port 22"), "{}", d.reason);
    }

    #[test]
    fn nothing_resolved_is_refused() {
        let p = policy(&["example.com"], &["0.0.0.0/0"], &[], &[]);
        let d = p.decide("example.com", 443, &[]);
        assert!(!d.allowed);
        assert_eq!(d.reason, "example.com resolved to no addresses");
    }

    #[test]
    fn empty_policy_refuses_everything() {
        let p = policy(&[], &[], &[], &[]);
        let d = p.decide("example.com", 443, &ips(&[PUBLIC]));
        assert!(!d.allowed);
        assert_eq!(
            d.reason,
            "example.com matches no allowed_hosts entry and allowed_cidrs is empty"
        );
    }

    #[test]
    fn refusals_before_resolving_agree_with_decide() {
        let names = [
            "example.com",
            "a.example.com",
            "other.org",
            "127.0.0.1",
            "[::1]",
            "localhost",
        ];
        let resolutions = [
            ips(&[PUBLIC]),
            ips(&["127.0.0.1"]),
            ips(&["::1", "10.0.0.1"]),
        ];
        for p in [
            policy(
                &["*.example.com", "localhost"],
                &[],
                &["10.0.0.0/8"],
                &[443],
            ),
            policy(&["127.0.0.1"], &[], &[], &[]),
            policy(&["example.com"], &["10.0.0.0/8"], &[], &[]),
        ] {
            for host in names {
                for port in [22, 443] {
                    if let Some(early) = p.decide_before_resolving(host, port) {
                        assert!(!early.allowed);
                        for resolved in &resolutions {
                            assert!(
                                !p.decide(host, port, resolved).allowed,
                                "{host}:{port} {p:?}"
                            );
                        }
                    }
                }
            }
        }
        let p = policy(&["*.example.com"], &[], &[], &[]);
        assert!(p
            .decide_before_resolving("exfil-data.attacker.net", 443)
            .is_some());
        assert!(p.decide_before_resolving("a.example.com", 443).is_none());
        // With ranges to check, names must be resolved first.
        let p = policy(&[], &["10.0.0.0/8"], &[], &[]);
        assert!(p.decide_before_resolving("anything.corp", 443).is_none());
    }
}

//! The proxy itself: one HTTP/1.1 proxy exchange per client connection,
//! and listeners that serve many.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness_core::Result;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{timeout, Instant};

use crate::http::{self, Target};
use crate::policy::{Decision, EgressPolicy};

/// The largest request header block the proxy reads; a longer one is
/// answered `431 Request Header Fields Too Large`.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// The most header lines in a request; more are answered `431`.
pub const MAX_HEADERS: usize = 256;
/// How long a client has to send its whole request header block; then it is
/// answered `408 Request Timeout`.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long resolving the destination, and then connecting to it, may take
/// (each); then the client is answered `502 Bad Gateway`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// After an error reply, how long the proxy keeps reading (and discarding)
/// what the client still sends, so that closing does not reset the
/// connection before the client has read the reply.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1 << 20;

/// The header every reply the proxy writes itself carries: `refused` on a
/// policy refusal, `error` on any other proxy error.
pub const EGRESS_HEADER: &str = "X-Harness-Egress";

/// How one client connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The client closed the connection before sending a request.
    Closed,
    /// The policy allowed the destination, the proxy connected to it and
    /// relayed bytes until the exchange ended (I/O errors while relaying,
    /// such as a reset, are logged, not reported).
    Allowed {
        /// `host:port` as the client asked for it.
        target: String,
        /// The address the proxy connected to (one the policy checked).
        addr: SocketAddr,
        /// Why the policy allowed it.
        reason: String,
    },
    /// The policy refused the destination (`403 Forbidden`).
    Refused {
        /// `host:port` as the client asked for it.
        target: String,
        /// Why the policy refused it.
        reason: String,
    },
    /// No connection was made for another reason: a malformed request
    /// (`400`), a slow one (`408`), an oversized header block (`431`), or
    /// a destination that could not be resolved or connected to (`502`).
    Failed {
        /// The status code the proxy replied with.
        status: u16,
        /// What went wrong.
        reason: String,
    },
}

/// Serves one client connection: reads one proxy request, asks `policy`,
/// and on success relays bytes between the client and the destination
/// until the exchange ends.
///
/// Two request kinds are understood:
///
/// - `CONNECT host:port HTTP/1.1`: the destination is resolved, checked
///   with [`EgressPolicy::decide`], and connected to at an address that
///   passed the check (never re-resolved); the reply is
///   `HTTP/1.1 200 Connection Established`, then a byte tunnel.
/// - An absolute-form request of any method, `GET http://host[:port]/path
///   HTTP/1.1`: checked and connected the same way; the request goes
///   upstream in origin-form (`GET /path HTTP/1.1`) with `Host` taken from
///   the URI, `Proxy-*` and other hop-by-hop headers dropped and
///   `Connection: close` set; the body bytes follow as the client sends
///   them and the response comes back with `Connection: close`. One
///   request per client connection.
///
/// Replies written by the proxy itself carry [`EGRESS_HEADER`] and a
/// one-line text body: `403` for a policy refusal
/// (`harness egress policy refused example.org:443: <reason>`), `400` for a
/// malformed request, `408` for a header block slower than
/// [`HEADER_TIMEOUT`], `431` for one over [`MAX_HEADER_BYTES`], `502` when
/// the destination cannot be resolved or connected to.
///
/// Returns how the connection ended; an error only when reading the
/// request from the client failed.
pub async fn serve_connection<S>(stream: S, policy: &EgressPolicy) -> Result<Outcome>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    serve(stream, policy, None).await
}

/// Counts of connections since an [`EgressProxy`] was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EgressCounts {
    /// Connections the policy allowed and the proxy connected out.
    pub allowed: u64,
    /// Connections the policy refused (`403`).
    pub refused: u64,
    /// Connections that failed otherwise: malformed, slow or oversized
    /// requests, and destinations that could not be reached.
    pub failed: u64,
}

/// Called with every decision an [`EgressProxy`] makes, as it makes it
/// (see [`EgressProxy::with_journal`]).
pub type Journal = Arc<dyn Fn(&Outcome) + Send + Sync>;

#[derive(Default)]
struct Counters {
    allowed: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    journal: Option<Journal>,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("allowed", &self.allowed)
            .field("refused", &self.refused)
            .field("failed", &self.failed)
            .field("journal", &self.journal.is_some())
            .finish()
    }
}

impl Counters {
    fn count(&self, outcome: &Outcome) {
        let counter = match outcome {
            Outcome::Closed => return,
            Outcome::Allowed { .. } => &self.allowed,
            Outcome::Refused { .. } => &self.refused,
            Outcome::Failed { .. } => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(journal) = &self.journal {
            journal(outcome);
        }
    }
}

/// An egress proxy for one policy: serves listeners, one task per
/// connection, and counts what it allowed and refused. Cheap to clone; the
/// clones share the counters.
///
/// ```no_run
/// # async fn demo(policy: harness_egress::EgressPolicy) -> std::io::Result<()> {
/// let proxy = harness_egress::EgressProxy::new(policy);
/// let listener = tokio::net::UnixListener::bind("/run/harness/egress.sock")?;
/// let task = proxy.serve_unix(listener);
/// // ... later:
/// let counts = proxy.counts();
/// println!("{} allowed, {} refused", counts.allowed, counts.refused);
/// task.abort(); // stops accepting and drops every open connection
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct EgressProxy {
    policy: Arc<EgressPolicy>,
    counters: Arc<Counters>,
}

impl EgressProxy {
    /// A proxy enforcing `policy`, with zero counts.
    pub fn new(policy: EgressPolicy) -> Self {
        EgressProxy {
            policy: Arc::new(policy),
            counters: Arc::default(),
        }
    }

    /// This proxy with `journal` called on every decision as it is made
    /// (allowed, refused, failed), before any byte is relayed: where the
    /// decisions are recorded (the broker writes them to the session's
    /// audit journal).
    pub fn with_journal(self, journal: Journal) -> Self {
        EgressProxy {
            policy: self.policy,
            counters: Arc::new(Counters {
                journal: Some(journal),
                ..Counters::default()
            }),
        }
    }

    /// The policy it enforces.
    pub fn policy(&self) -> &EgressPolicy {
        &self.policy
    }

    /// The counts so far (each counter is read atomically; the three
    /// together are not one snapshot).
    pub fn counts(&self) -> EgressCounts {
        EgressCounts {
            allowed: self.counters.allowed.load(Ordering::Relaxed),
            refused: self.counters.refused.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
        }
    }

    /// Serves one connection like [`serve_connection`], counting its
    /// outcome (the counters move as soon as the decision is made, before
    /// the relay ends).
    pub async fn serve<S>(&self, stream: S) -> Result<Outcome>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        serve(stream, &self.policy, Some(&self.counters)).await
    }

    /// Accepts connections on a Unix socket until the returned task is
    /// aborted, serving each in its own task. Aborting the task (or
    /// dropping the runtime) also ends every connection still open.
    pub fn serve_unix(&self, listener: UnixListener) -> JoinHandle<()> {
        tokio::spawn(accept_loop(self.clone(), listener))
    }

    /// [`serve_unix`](Self::serve_unix) for a TCP listener (tests, and
    /// sandboxes that share the host's network).
    pub fn serve_tcp(&self, listener: TcpListener) -> JoinHandle<()> {
        tokio::spawn(accept_loop(self.clone(), listener))
    }
}

trait Listener: Send + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept_one(&self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

impl Listener for UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_one(&self) -> io::Result<Self::Stream> {
        self.accept().await.map(|(stream, _)| stream)
    }
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    async fn accept_one(&self) -> io::Result<Self::Stream> {
        self.accept().await.map(|(stream, _)| stream)
    }
}

async fn accept_loop<L: Listener>(proxy: EgressProxy, listener: L) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept_one() => match accepted {
                Ok(stream) => {
                    let proxy = proxy.clone();
                    connections.spawn(async move {
                        if let Err(err) = proxy.serve(stream).await {
                            tracing::debug!(%err, "egress proxy connection failed");
                        }
                    });
                }
                Err(err) => {
                    // Out of file descriptors and the like: back off rather
                    // than spin.
                    tracing::warn!(%err, "egress proxy could not accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve<S>(
    mut stream: S,
    policy: &EgressPolicy,
    counters: Option<&Counters>,
) -> Result<Outcome>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    handle(&mut stream, policy, counters).await
}

async fn handle<S>(
    stream: &mut S,
    policy: &EgressPolicy,
    counters: Option<&Counters>,
) -> Result<Outcome>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut buf = Vec::with_capacity(4096);
    let head_len = match timeout(HEADER_TIMEOUT, read_request_head(stream, &mut buf)).await {
        Err(_) => {
            let reason = format!(
                "the request header block was not complete within {} s",
                HEADER_TIMEOUT.as_secs()
            );
            return Ok(fail(stream, counters, 408, "Request Timeout", reason).await);
        }
        Ok(Err(err)) => return Err(err.into()),
        Ok(Ok(Head::Closed)) => return Ok(Outcome::Closed),
        Ok(Ok(Head::Bad(status, phrase, reason))) => {
            return Ok(fail(stream, counters, status, phrase, reason).await)
        }
        Ok(Ok(Head::Complete(len))) => len,
    };

    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    if let Err(err) = request.parse(&buf[..head_len]) {
        // read_request_head parsed the same bytes already.
        return Ok(fail(
            stream,
            counters,
            400,
            "Bad Request",
            format!("malformed request: {err}"),
        )
        .await);
    }
    let method = request.method.unwrap_or_default().to_string();
    let path = request.path.unwrap_or_default().to_string();
    let version = request.version.unwrap_or(1);
    let body_start = buf[head_len..].to_vec();

    if method == "CONNECT" {
        let target = match http::parse_authority(&path, None) {
            Ok(target) => target,
            Err(why) => {
                let reason = format!("bad CONNECT target: {why}");
                return Ok(fail(stream, counters, 400, "Bad Request", reason).await);
            }
        };
        let (upstream, addr, reason) = match open(stream, policy, counters, &target).await {
            Ok(open) => open,
            Err(outcome) => return Ok(outcome),
        };
        let outcome = Outcome::Allowed {
            target: target.display(),
            addr,
            reason,
        };
        count(counters, &outcome);
        if let Err(err) = tunnel(stream, upstream, &body_start).await {
            tracing::debug!(target = %target.display(), %err, "egress tunnel ended with an error");
        }
        return Ok(outcome);
    }

    let absolute = match http::parse_absolute(&path) {
        Ok(absolute) => absolute,
        Err(why) => return Ok(fail(stream, counters, 400, "Bad Request", why).await),
    };
    let head = http::rewrite_request(&method, version, &absolute, request.headers);
    let target = absolute.target;
    let (upstream, addr, reason) = match open(stream, policy, counters, &target).await {
        Ok(open) => open,
        Err(outcome) => return Ok(outcome),
    };
    let outcome = Outcome::Allowed {
        target: target.display(),
        addr,
        reason,
    };
    count(counters, &outcome);
    if let Err(err) = relay_request(stream, upstream, &head, &body_start).await {
        tracing::debug!(target = %target.display(), %err, "egress request relay ended with an error");
    }
    Ok(outcome)
}

enum Head {
    /// EOF before any byte.
    Closed,
    /// A complete, parseable head of this many bytes at the start of the
    /// buffer.
    Complete(usize),
    /// Reply with this status and reason.
    Bad(u16, &'static str, String),
}

/// Reads until `buf` starts with a complete request head.
async fn read_request_head<S>(stream: &mut S, buf: &mut Vec<u8>) -> io::Result<Head>
where
    S: AsyncRead + Unpin,
{
    let mut chunk = [0u8; 8192];
    loop {
        let room = MAX_HEADER_BYTES + 1 - buf.len();
        let n = stream.read(&mut chunk[..room.min(8192)]).await?;
        if n == 0 {
            return Ok(if buf.is_empty() {
                Head::Closed
            } else {
                Head::Bad(
                    400,
                    "Bad Request",
                    "the connection ended inside the request header block".to_string(),
                )
            });
        }
        buf.extend_from_slice(&chunk[..n]);
        // A head ends with a line feed: parse only when one arrived.
        if chunk[..n].contains(&b'\n') {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::Request::new(&mut headers).parse(buf) {
                Ok(httparse::Status::Complete(len)) if len <= MAX_HEADER_BYTES => {
                    return Ok(Head::Complete(len))
                }
                Ok(httparse::Status::Complete(_)) => return Ok(too_large()),
                Ok(httparse::Status::Partial) => {}
                Err(httparse::Error::TooManyHeaders) => {
                    return Ok(Head::Bad(
                        431,
                        "Request Header Fields Too Large",
                        format!("more than {MAX_HEADERS} header lines"),
                    ))
                }
                Err(err) => {
                    return Ok(Head::Bad(
                        400,
                        "Bad Request",
                        format!("malformed request: {err}"),
                    ))
                }
            }
        }
        if buf.len() > MAX_HEADER_BYTES {
            return Ok(too_large());
        }
    }
}

fn too_large() -> Head {
    Head::Bad(
        431,
        "Request Header Fields Too Large",
        format!(
            "the request header block is over {} KiB",
            MAX_HEADER_BYTES / 1024
        ),
    )
}

/// Checks `target` against the policy (resolving it if it must) and
/// connects to an address that passed; on failure the client has been
/// answered and the outcome is the error.
async fn open<S>(
    stream: &mut S,
    policy: &EgressPolicy,
    counters: Option<&Counters>,
    target: &Target,
) -> std::result::Result<(TcpStream, SocketAddr, String), Outcome>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let shown = target.display();
    let (decision, addrs) = match policy.decide_before_resolving(&target.host, target.port) {
        Some(refusal) => (refusal, Vec::new()),
        None => {
            let addrs = match resolve(target).await {
                Ok(addrs) => addrs,
                Err(why) => {
                    tracing::info!(host = %target.host, port = target.port, %why, "egress destination did not resolve");
                    return Err(fail(stream, counters, 502, "Bad Gateway", why).await);
                }
            };
            (policy.decide(&target.host, target.port, &addrs), addrs)
        }
    };
    log_decision(target, &decision);
    if !decision.allowed {
        let body = format!("harness egress policy refused {shown}: {}", decision.reason);
        let outcome = Outcome::Refused {
            target: shown,
            reason: decision.reason,
        };
        count(counters, &outcome);
        reply(stream, 403, "Forbidden", "refused", &body).await;
        return Err(outcome);
    }
    match connect(&addrs, target.port).await {
        Ok((upstream, addr)) => Ok((upstream, addr, decision.reason)),
        Err(why) => {
            let reason = format!("could not connect to {shown}: {why}");
            tracing::info!(host = %target.host, port = target.port, %reason, "egress connect failed");
            Err(fail(stream, counters, 502, "Bad Gateway", reason).await)
        }
    }
}

fn log_decision(target: &Target, decision: &Decision) {
    tracing::info!(
        host = %target.host,
        port = target.port,
        allowed = decision.allowed,
        reason = %decision.reason,
        "egress decision"
    );
}

/// The addresses of `target`, in resolver order without duplicates.
async fn resolve(target: &Target) -> std::result::Result<Vec<IpAddr>, String> {
    if let Some(ip) = target.ip {
        return Ok(vec![ip]);
    }
    let lookup = tokio::net::lookup_host((target.host.as_str(), target.port));
    let found = match timeout(CONNECT_TIMEOUT, lookup).await {
        Err(_) => {
            return Err(format!(
                "resolving {} took longer than {} s",
                target.host,
                CONNECT_TIMEOUT.as_secs()
            ))
        }
        Ok(Err(err)) => return Err(format!("could not resolve {}: {err}", target.host)),
        Ok(Ok(found)) => found,
    };
    let mut addrs: Vec<IpAddr> = Vec::new();
    for addr in found {
        if !addrs.contains(&addr.ip()) {
            addrs.push(addr.ip());
        }
    }
    if addrs.is_empty() {
        return Err(format!("{} resolved to no addresses", target.host));
    }
    Ok(addrs)
}

/// Connects to the first of `addrs` that answers, all within
/// [`CONNECT_TIMEOUT`].
async fn connect(
    addrs: &[IpAddr],
    port: u16,
) -> std::result::Result<(TcpStream, SocketAddr), String> {
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    let mut errors = Vec::new();
    for ip in addrs {
        let addr = SocketAddr::new(*ip, port);
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(upstream)) => {
                let _ = upstream.set_nodelay(true);
                return Ok((upstream, addr));
            }
            Ok(Err(err)) => errors.push(format!("{addr}: {err}")),
            Err(_) => {
                errors.push(format!(
                    "{addr}: timed out after {} s",
                    CONNECT_TIMEOUT.as_secs()
                ));
                break;
            }
        }
    }
    Err(errors.join("; "))
}

async fn tunnel<S>(client: &mut S, mut upstream: TcpStream, early: &[u8]) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    client
        .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        .await?;
    client.flush().await?;
    // Bytes the client sent right after the CONNECT head (a TLS hello).
    upstream.write_all(early).await?;
    tokio::io::copy_bidirectional(client, &mut upstream).await?;
    Ok(())
}

/// Sends the rewritten request head and the body bytes already read, then
/// relays: client to upstream as it comes, and the upstream's response back
/// with its head rewritten to `Connection: close`. Ends when the upstream
/// has finished its response (or the client failed).
async fn relay_request<S>(
    client: &mut S,
    upstream: TcpStream,
    head: &[u8],
    body_start: &[u8],
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (mut upstream_read, mut upstream_write) = upstream.into_split();
    upstream_write.write_all(head).await?;
    upstream_write.write_all(body_start).await?;
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let up = async {
        let copied = tokio::io::copy(&mut client_read, &mut upstream_write).await;
        let _ = upstream_write.shutdown().await;
        copied
    };
    let down = async {
        forward_response(&mut upstream_read, &mut client_write).await?;
        client_write.shutdown().await
    };
    tokio::pin!(up, down);
    let mut up_done = false;
    loop {
        tokio::select! {
            copied = &mut up, if !up_done => {
                up_done = true;
                copied?;
            }
            done = &mut down => return done,
        }
    }
}

/// Copies the upstream's response to the client, rewriting the final
/// response head (after any `1xx` interim ones) to `Connection: close`. A
/// head that does not parse, or is over [`MAX_HEADER_BYTES`], goes through
/// untouched.
async fn forward_response<R, W>(upstream: &mut R, client: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    let mut eof = false;
    loop {
        if !buf.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let code = response.code.unwrap_or(0);
                    if (100..200).contains(&code) && code != 101 {
                        client.write_all(&buf[..len]).await?;
                        client.flush().await?;
                        buf.drain(..len);
                        continue;
                    }
                    let head = if code == 101 {
                        buf[..len].to_vec()
                    } else {
                        http::rewrite_response_head(&buf[..len], response.headers)
                    };
                    client.write_all(&head).await?;
                    client.write_all(&buf[len..]).await?;
                    break;
                }
                Ok(httparse::Status::Partial) if !eof && buf.len() <= MAX_HEADER_BYTES => {}
                _ => {
                    client.write_all(&buf).await?;
                    break;
                }
            }
        } else if eof {
            break;
        }
        let n = upstream.read(&mut chunk).await?;
        if n == 0 {
            eof = true;
        } else {
            buf.extend_from_slice(&chunk[..n]);
        }
    }
    if !eof {
        tokio::io::copy(upstream, client).await?;
    }
    client.flush().await
}

/// Replies with an error status and ends the connection.
async fn fail<S>(
    stream: &mut S,
    counters: Option<&Counters>,
    status: u16,
    phrase: &str,
    reason: String,
) -> Outcome
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    tracing::info!(status, %reason, "egress request failed");
    let body = format!("harness egress proxy: {reason}");
    let outcome = Outcome::Failed { status, reason };
    count(counters, &outcome);
    reply(stream, status, phrase, "error", &body).await;
    outcome
}

/// Counts an outcome as soon as it is known (before the reply is written
/// or the relay runs).
fn count(counters: Option<&Counters>, outcome: &Outcome) {
    if let Some(counters) = counters {
        counters.count(outcome);
    }
}

/// Writes a reply with a one-line text body, closes the writing side and
/// drains what the client still sends (for at most [`LINGER`]), so the
/// client reads the reply rather than a reset. Errors are ignored: the
/// client may be gone.
async fn reply<S>(stream: &mut S, status: u16, phrase: &str, marker: &str, body: &str)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let body = format!("{}\n", body.replace(['\r', '\n'], " "));
    let head = format!(
        "HTTP/1.1 {status} {phrase}\r\n{EGRESS_HEADER}: {marker}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.flush().await?;
        stream.shutdown().await
    };
    if timeout(LINGER, write).await.is_err() {
        return;
    }
    let _ = timeout(LINGER, async {
        let mut sink = [0u8; 8192];
        let mut drained = 0;
        while drained < LINGER_BYTES {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
}

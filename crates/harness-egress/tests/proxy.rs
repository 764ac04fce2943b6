//! The proxy end to end, on loopback only: test servers on 127.0.0.1 (and
//! ::1 where the machine has it), the proxy on a TCP or Unix listener, and
//! clients written here or the real curl.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_core::sandbox::NetworkPolicy;
use harness_egress::{serve_connection, EgressCounts, EgressPolicy, EgressProxy, Outcome};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;

const STEP: Duration = Duration::from_secs(10);

fn policy(hosts: &[&str], allowed: &[&str], denied: &[&str], ports: &[u16]) -> EgressPolicy {
    EgressPolicy::from_network(&NetworkPolicy::Custom {
        allowed_hosts: hosts.iter().map(|s| s.to_string()).collect(),
        allowed_cidrs: allowed.iter().map(|s| s.to_string()).collect(),
        denied_cidrs: denied.iter().map(|s| s.to_string()).collect(),
        allowed_ports: ports.to_vec(),
    })
    .unwrap()
}

struct Proxy {
    proxy: EgressProxy,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start_proxy(policy: EgressPolicy) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = EgressProxy::new(policy);
    let task = proxy.serve_tcp(listener);
    Proxy { proxy, addr, task }
}

/// A TCP echo server that counts the connections it accepted.
struct Echo {
    port: u16,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start_echo(bind: &str) -> Echo {
    let listener = TcpListener::bind(bind).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    Echo {
        port,
        accepted,
        task,
    }
}

/// What the HTTP test server received: the head as text and the body.
#[derive(Debug, Clone)]
struct Seen {
    head: String,
    body: Vec<u8>,
}

/// An HTTP/1.1 server answering `hello from <name> <path>` with a
/// keep-alive response head (it never says `Connection: close` itself).
struct Web {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl Drop for Web {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Web {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn start_web(name: &'static str) -> Web {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let length = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                let mut body = buf[head_end..].to_vec();
                while body.len() < length {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => body.extend_from_slice(&chunk[..n]),
                    }
                }
                let path = head.split(' ').nth(1).unwrap_or("").to_string();
                let close = head
                    .lines()
                    .any(|l| l.eq_ignore_ascii_case("connection: close"));
                log.lock().unwrap().push(Seen { head, body });
                let answer = format!("hello from {name} {path}");
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nKeep-Alive: timeout=60\r\nContent-Length: {}\r\n\r\n{answer}",
                    answer.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                // Like a real server, close after the response when the
                // request says `Connection: close` (never saying so in the
                // response itself); otherwise keep the connection.
                if close {
                    return;
                }
                while let Ok(n) = stream.read(&mut chunk).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    Web { port, seen, task }
}

/// Sends `request`, reads until the proxy closes, returns the text.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, request: &[u8]) -> String {
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    timeout(STEP, stream.read_to_end(&mut out))
        .await
        .expect("the proxy answered in time")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

async fn tcp_exchange(proxy: SocketAddr, request: &[u8]) -> String {
    exchange(TcpStream::connect(proxy).await.unwrap(), request).await
}

/// Reads a response head (up to the blank line) from a stream left open.
async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = timeout(STEP, stream.read(&mut byte))
            .await
            .expect("a response head in time")
            .unwrap();
        assert!(
            n > 0,
            "EOF inside the head: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

/// CONNECTs through `stream` and checks that bytes round-trip the tunnel.
async fn tunnel_round_trip<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, authority: &str) {
    // The first tunnel bytes ride along with the CONNECT head, as a TLS
    // client hello would.
    let request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\nearly;");
    stream.write_all(request.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await;
    assert_eq!(head, "HTTP/1.1 200 Connection Established\r\n\r\n");
    stream.write_all(b"ping").await.unwrap();
    let mut got = [0u8; 10];
    timeout(STEP, stream.read_exact(&mut got))
        .await
        .expect("echo in time")
        .unwrap();
    assert_eq!(&got, b"early;ping");
}

fn status(response: &str) -> &str {
    response.lines().next().unwrap_or("")
}

fn body(response: &str) -> &str {
    response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or("")
}

fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    let head = response
        .split_once("\r\n\r\n")
        .map(|(h, _)| h)
        .unwrap_or(response);
    head.lines().skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Gives a connection the proxy might (wrongly) have opened time to land.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_an_allowed_port_reaches_the_server() {
    let echo = start_echo("127.0.0.1:0").await;
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[echo.port])).await;
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    tunnel_round_trip(stream, &format!("127.0.0.1:{}", echo.port)).await;
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(
        proxy.proxy.counts(),
        EgressCounts {
            allowed: 1,
            refused: 0,
            failed: 0
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_disallowed_port_is_refused_and_never_dialled() {
    let echo = start_echo("127.0.0.1:0").await;
    let other = echo.port.wrapping_add(1).max(1);
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[other])).await;
    let response = tcp_exchange(
        proxy.addr,
        format!(
            "CONNECT 127.0.0.1:{0} HTTP/1.1\r\nHost: 127.0.0.1:{0}\r\n\r\n",
            echo.port
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
    assert_eq!(header(&response, "x-harness-egress"), Some("refused"));
    assert_eq!(
        body(&response),
        format!(
            "harness egress policy refused 127.0.0.1:{0}: port {0} is not in allowed_ports [{other}]\n",
            echo.port
        )
    );
    settle().await;
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 0);
    assert_eq!(proxy.proxy.counts().refused, 1);
    assert_eq!(proxy.proxy.counts().allowed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_get_is_sent_in_origin_form() {
    let web = start_web("web").await;
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[])).await;
    let request = format!(
        "GET http://127.0.0.1:{}/x?y=1 HTTP/1.1\r\nHost: fronted.example\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic c2VjcmV0\r\nUser-Agent: test\r\nAccept: */*\r\n\r\n",
        web.port
    );
    let response = tcp_exchange(proxy.addr, request.as_bytes()).await;
    assert_eq!(status(&response), "HTTP/1.1 200 OK", "{response}");
    assert_eq!(body(&response), "hello from web /x?y=1");
    // The proxy serves one request per connection and says so.
    assert_eq!(header(&response, "connection"), Some("close"));
    assert_eq!(header(&response, "keep-alive"), None);
    assert_eq!(header(&response, "content-type"), Some("text/plain"));

    let seen = web.seen();
    assert_eq!(seen.len(), 1);
    let head = &seen[0].head;
    assert!(head.starts_with("GET /x?y=1 HTTP/1.1\r\n"), "{head}");
    // Host comes from the request target, never from the client's header.
    assert_eq!(
        header(head, "host"),
        Some(format!("127.0.0.1:{}", web.port).as_str())
    );
    assert!(!head.contains("fronted.example"), "{head}");
    assert_eq!(header(head, "connection"), Some("close"));
    assert_eq!(header(head, "proxy-connection"), None);
    assert_eq!(header(head, "proxy-authorization"), None);
    assert_eq!(header(head, "user-agent"), Some("test"));
    assert_eq!(proxy.proxy.counts().allowed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_post_forwards_the_body() {
    let web = start_web("web").await;
    let proxy = start_proxy(policy(&[], &["127.0.0.0/8"], &[], &[web.port])).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    // The head and the first body bytes in one write, the rest later.
    let head = format!(
        "POST http://127.0.0.1:{}/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 11\r\n\r\nhello",
        web.port
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let response = exchange(stream, b" world").await;
    assert_eq!(status(&response), "HTTP/1.1 200 OK", "{response}");
    assert_eq!(body(&response), "hello from web /upload");
    let seen = web.seen();
    assert!(
        seen[0].head.starts_with("POST /upload HTTP/1.1\r\n"),
        "{}",
        seen[0].head
    );
    assert_eq!(seen[0].body, b"hello world");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localhost_is_allowed_by_name() {
    let echo = start_echo("127.0.0.1:0").await;
    let proxy = start_proxy(policy(&["localhost"], &[], &[], &[])).await;
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    tunnel_round_trip(stream, &format!("LocalHost.:{}", echo.port)).await;
    assert_eq!(proxy.proxy.counts().allowed, 1);

    // The name allows the name, not the address it resolves to.
    let response = tcp_exchange(
        proxy.addr,
        format!("CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", echo.port).as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
    assert!(
        body(&response).contains("matches no allowed_hosts entry"),
        "{response}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_into_a_denied_range_is_refused() {
    let echo = start_echo("127.0.0.1:0").await;
    let web = start_web("web").await;
    let proxy = start_proxy(policy(
        &["localhost"],
        &[],
        &["127.0.0.0/8", "::1/128"],
        &[],
    ))
    .await;
    let response = tcp_exchange(
        proxy.addr,
        format!("CONNECT localhost:{} HTTP/1.1\r\n\r\n", echo.port).as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
    assert_eq!(header(&response, "x-harness-egress"), Some("refused"));
    let text = body(&response);
    assert!(
        text.starts_with(&format!(
            "harness egress policy refused localhost:{}: localhost resolves to ",
            echo.port
        )),
        "{text}"
    );
    assert!(text.contains("which is in denied_cidrs entry"), "{text}");

    let response = tcp_exchange(
        proxy.addr,
        format!("GET http://localhost:{}/ HTTP/1.1\r\n\r\n", web.port).as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
    settle().await;
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 0);
    assert!(web.seen().is_empty());
    assert_eq!(proxy.proxy.counts().refused, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcards_cover_subdomains_but_not_the_apex() {
    let echo = start_echo("127.0.0.1:0").await;
    let proxy = start_proxy(policy(&["*.localhost"], &[], &[], &[])).await;
    // The apex is refused before any lookup.
    let response = tcp_exchange(
        proxy.addr,
        format!("CONNECT localhost:{} HTTP/1.1\r\n\r\n", echo.port).as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
    assert!(
        body(&response)
            .contains("localhost matches no allowed_hosts entry and allowed_cidrs is empty"),
        "{response}"
    );
    // A subdomain passes the policy: it is connected if this machine's
    // resolver answers `*.localhost` names, and a 502 (no such name) if not;
    // never a 403.
    let response = tcp_exchange(
        proxy.addr,
        format!("CONNECT api.LOCALHOST:{} HTTP/1.1\r\n\r\n", echo.port).as_bytes(),
    )
    .await;
    match status(&response) {
        "HTTP/1.1 200 Connection Established" => {}
        "HTTP/1.1 502 Bad Gateway" => {
            assert_eq!(header(&response, "x-harness-egress"), Some("error"));
            assert!(body(&response).contains("api.localhost"), "{response}");
        }
        other => panic!("unexpected {other}: {response}"),
    }
    assert_eq!(proxy.proxy.counts().refused, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_400_and_the_proxy_keeps_serving() {
    let echo = start_echo("127.0.0.1:0").await;
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[])).await;
    let cases: &[&[u8]] = &[
        b"this is not http\r\n\r\n",
        b"GET /origin-form HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n",
        b"CONNECT [::1:443 HTTP/1.1\r\n\r\n",
        b"CONNECT bad_host!:443 HTTP/1.1\r\n\r\n",
        b"GET https://127.0.0.1/ HTTP/1.1\r\n\r\n",
        b"GET http://user:pw@127.0.0.1/ HTTP/1.1\r\n\r\n",
        b"GET http://127.0.0.1:99999/ HTTP/1.1\r\n\r\n",
        b"GET http://127.0.0.1/ HTTP/1.1\r\nBad Header\r\n\r\n",
        b"GET http://127.0.0.1/ HTTP/1.1\r\n", // the client stops half way
    ];
    for (i, request) in cases.iter().enumerate() {
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        stream.shutdown().await.unwrap();
        let response = exchange(stream, b"").await;
        assert_eq!(
            status(&response),
            "HTTP/1.1 400 Bad Request",
            "case {i}: {response}"
        );
        assert_eq!(
            header(&response, "x-harness-egress"),
            Some("error"),
            "case {i}"
        );
        assert!(
            body(&response).starts_with("harness egress proxy: "),
            "case {i}: {response}"
        );
    }
    // The next connection is served as usual.
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    tunnel_round_trip(stream, &format!("127.0.0.1:{}", echo.port)).await;
    let counts = proxy.proxy.counts();
    assert_eq!(counts.failed, cases.len() as u64);
    assert_eq!(counts.allowed, 1);
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_431() {
    let web = start_web("web").await;
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[])).await;

    let mut big = format!("GET http://127.0.0.1:{}/ HTTP/1.1\r\nX-Big: ", web.port).into_bytes();
    big.extend(std::iter::repeat_n(b'a', 70 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    let response = tcp_exchange(proxy.addr, &big).await;
    assert_eq!(
        status(&response),
        "HTTP/1.1 431 Request Header Fields Too Large",
        "{response}"
    );
    assert!(body(&response).contains("over 64 KiB"), "{response}");

    // Many small header lines are the same thing.
    let mut many = format!("GET http://127.0.0.1:{}/ HTTP/1.1\r\n", web.port);
    for i in 0..300 {
        many.push_str(&format!("X-{i}: 1\r\n"));
    }
    many.push_str("\r\n");
    let response = tcp_exchange(proxy.addr, many.as_bytes()).await;
    assert_eq!(
        status(&response),
        "HTTP/1.1 431 Request Header Fields Too Large",
        "{response}"
    );

    // Just under the limit is fine.
    let mut fits = format!("GET http://127.0.0.1:{}/ok HTTP/1.1\r\nX-Big: ", web.port).into_bytes();
    fits.extend(std::iter::repeat_n(b'a', 60 * 1024));
    fits.extend_from_slice(b"\r\n\r\n");
    let response = tcp_exchange(proxy.addr, &fits).await;
    assert_eq!(
        status(&response),
        "HTTP/1.1 200 OK",
        "{}",
        &response[..80.min(response.len())]
    );
    assert_eq!(web.seen().len(), 1);
    assert_eq!(proxy.proxy.counts().failed, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_destination_is_502() {
    // A port nothing listens on: bind one, then free it.
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap().port()
    };
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[])).await;
    let response = tcp_exchange(
        proxy.addr,
        format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 502 Bad Gateway", "{response}");
    assert_eq!(header(&response, "x-harness-egress"), Some("error"));
    assert!(
        body(&response).contains(&format!("could not connect to 127.0.0.1:{port}")),
        "{response}"
    );
    assert_eq!(
        proxy.proxy.counts(),
        EgressCounts {
            allowed: 0,
            refused: 0,
            failed: 1
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_loopback_through_allowed_cidrs() {
    let Ok(listener) = std::net::TcpListener::bind("[::1]:0") else {
        eprintln!("no IPv6 loopback here; skipping");
        return;
    };
    drop(listener);
    let echo = start_echo("[::1]:0").await;
    let proxy = start_proxy(policy(&[], &["::1/128"], &[], &[])).await;
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    tunnel_round_trip(stream, &format!("[::1]:{}", echo.port)).await;
    // 127.0.0.1 is not in the range.
    let response = tcp_exchange(
        proxy.addr,
        format!("CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", echo.port).as_bytes(),
    )
    .await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_connection_works_on_any_stream() {
    let policy = policy(&["example.com"], &[], &[], &[443]);
    let (mut client, server) = tokio::io::duplex(64 * 1024);
    let serving = tokio::spawn(async move { serve_connection(server, &policy).await });
    client
        .write_all(b"CONNECT example.com:22 HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    timeout(STEP, client.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let response = String::from_utf8(out).unwrap();
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");
    drop(client);
    let outcome = timeout(STEP, serving).await.unwrap().unwrap().unwrap();
    assert_eq!(
        outcome,
        Outcome::Refused {
            target: "example.com:22".into(),
            reason: "port 22 is not in allowed_ports [443]".into(),
        }
    );

    // A client that leaves without a word.
    let policy = self::policy(&[], &[], &[], &[]);
    let (client, server) = tokio::io::duplex(1024);
    drop(client);
    let outcome = serve_connection(server, &policy).await.unwrap();
    assert_eq!(outcome, Outcome::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let echo = start_echo("127.0.0.1:0").await;
    let web = start_web("unix").await;
    let proxy = EgressProxy::new(policy(&["127.0.0.1"], &[], &[], &[echo.port, web.port]));
    let task = proxy.serve_unix(listener);

    let stream = UnixStream::connect(&path).await.unwrap();
    tunnel_round_trip(stream, &format!("127.0.0.1:{}", echo.port)).await;

    let stream = UnixStream::connect(&path).await.unwrap();
    let response = exchange(
        stream,
        format!(
            "GET http://127.0.0.1:{}/via-unix HTTP/1.1\r\n\r\n",
            web.port
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(body(&response), "hello from unix /via-unix", "{response}");
    assert!(web.seen()[0].head.starts_with("GET /via-unix HTTP/1.1\r\n"));

    let stream = UnixStream::connect(&path).await.unwrap();
    let response = exchange(stream, b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(&response), "HTTP/1.1 403 Forbidden", "{response}");

    assert_eq!(
        proxy.counts(),
        EgressCounts {
            allowed: 2,
            refused: 1,
            failed: 0
        }
    );

    // Aborting the serving task stops the proxy.
    task.abort();
    let _ = task.await;
    let refused_or_closed = match UnixStream::connect(&path).await {
        Err(_) => true,
        Ok(mut stream) => {
            let _ = stream
                .write_all(b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n")
                .await;
            let mut out = Vec::new();
            matches!(
                timeout(STEP, stream.read_to_end(&mut out)).await,
                Ok(Ok(0)) | Ok(Err(_))
            )
        }
    };
    assert!(refused_or_closed);
}

/// Runs the real curl through the proxy (no proxy variables of our own).
async fn curl(args: &[&str]) -> (bool, String, String) {
    let output = timeout(
        Duration::from_secs(20),
        tokio::process::Command::new("/usr/bin/curl")
            .args(["-sS", "--max-time", "10"])
            .args(args)
            .env_remove("http_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("https_proxy")
            .env_remove("HTTPS_PROXY")
            .env_remove("all_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("no_proxy")
            .env_remove("NO_PROXY")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("curl finished in time")
    .expect("/usr/bin/curl runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_curl_goes_through() {
    if !std::path::Path::new("/usr/bin/curl").exists() {
        eprintln!("no /usr/bin/curl; skipping");
        return;
    }
    let a = start_web("a").await;
    let b = start_web("b").await;
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap().port()
    };
    let proxy = start_proxy(policy(&["127.0.0.1"], &[], &[], &[a.port, b.port])).await;
    let proxy_url = format!("http://127.0.0.1:{}", proxy.addr.port());

    // Absolute-form.
    let url = format!("http://127.0.0.1:{}/hello", a.port);
    let (ok, out, err) = curl(&["-x", &proxy_url, &url]).await;
    assert!(ok, "{err}");
    assert_eq!(out, "hello from a /hello");
    assert!(
        a.seen()[0].head.starts_with("GET /hello HTTP/1.1\r\n"),
        "{}",
        a.seen()[0].head
    );

    // Two servers in one curl run: curl must not reuse the proxy connection
    // of the first request for the second.
    let url_a = format!("http://127.0.0.1:{}/one", a.port);
    let url_b = format!("http://127.0.0.1:{}/two", b.port);
    let (ok, out, err) = curl(&["-x", &proxy_url, &url_a, &url_b]).await;
    assert!(ok, "{err}");
    assert_eq!(out, "hello from a /onehello from b /two");

    // CONNECT (curl's --proxytunnel).
    let url = format!("http://127.0.0.1:{}/tunnelled", b.port);
    let (ok, out, err) = curl(&["-p", "-x", &proxy_url, &url]).await;
    assert!(ok, "{err}");
    assert_eq!(out, "hello from b /tunnelled");

    // Refused: curl shows the proxy's reply.
    let url = format!("http://127.0.0.1:{closed}/");
    let (_, out, _) = curl(&["-x", &proxy_url, &url]).await;
    assert_eq!(
        out,
        format!(
            "harness egress policy refused 127.0.0.1:{closed}: port {closed} is not in allowed_ports [{}, {}]\n",
            a.port, b.port
        )
    );
    let (ok, _, err) = curl(&["-p", "-x", &proxy_url, &url]).await;
    assert!(!ok);
    assert!(err.contains("403"), "{err}");

    let counts = proxy.proxy.counts();
    assert_eq!((counts.allowed, counts.refused, counts.failed), (4, 2, 0));
}

#[tokio::test(start_paused = true)]
async fn a_slow_request_head_is_408() {
    let policy = policy(&["example.com"], &[], &[], &[]);
    let (mut client, server) = tokio::io::duplex(64 * 1024);
    let serving = tokio::spawn(async move { serve_connection(server, &policy).await });
    // Half a head, then nothing: the paused clock jumps to the deadline.
    client
        .write_all(b"CONNECT example.com:443 HTTP/1.1\r\nHost: exa")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut out = Vec::new();
    client.read_to_end(&mut out).await.unwrap();
    assert!(started.elapsed() >= harness_egress::HEADER_TIMEOUT);
    let response = String::from_utf8(out).unwrap();
    assert_eq!(
        status(&response),
        "HTTP/1.1 408 Request Timeout",
        "{response}"
    );
    assert_eq!(header(&response, "x-harness-egress"), Some("error"));
    drop(client);
    let outcome = serving.await.unwrap().unwrap();
    assert!(
        matches!(outcome, Outcome::Failed { status: 408, .. }),
        "{outcome:?}"
    );
}

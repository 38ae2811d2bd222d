//! The gateway's upstream keep-alive pool, seen from the backend: a stream read to its end gives
//! its connection back for the next request, and a stream the client abandons mid-way closes its
//! connection instead of handing a half-read one to the next request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use support::{Router, completion, read_until, request, route, send};
use understudy_router::gateway::GatewayConfig;

/// Marks a request whose stream the backend keeps going (an event every few milliseconds) until
/// its connection is closed.
const ENDLESS: &str = "endless";

/// A backend that answers every request with a short SSE stream, one chunk per event, and counts
/// the connections it accepted and saw closed.
struct CountingBackend {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
}

impl CountingBackend {
    fn start() -> CountingBackend {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (a, c) = (Arc::clone(&accepted), Arc::clone(&closed));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                a.fetch_add(1, SeqCst);
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    serve_connection(stream);
                    c.fetch_add(1, SeqCst);
                });
            }
        });
        CountingBackend {
            addr,
            accepted,
            closed,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(SeqCst)
    }

    /// Waits (20 s at most) until `n` connections have been seen closed; false if they never were.
    fn wait_closed(&self, n: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.closed.load(SeqCst) < n {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }
}

/// Serves requests on one keep-alive connection until it closes.
fn serve_connection(mut s: TcpStream) {
    let mut buf = Vec::new();
    loop {
        let Some((head, body)) = read_request(&mut s, &mut buf) else {
            return;
        };
        let _ = head;
        let endless = String::from_utf8_lossy(&body).contains(ENDLESS);
        let ok = s
            .write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            )
            .is_ok();
        if !ok {
            return;
        }
        let events = if endless { 4_000 } else { 8 };
        for i in 0..events {
            let event = format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n");
            if write_chunk(&mut s, event.as_bytes()).is_err() {
                return;
            }
            if endless {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if write_chunk(&mut s, b"data: [DONE]\n\n").is_err() || s.write_all(b"0\r\n\r\n").is_err() {
            return;
        }
    }
}

fn write_chunk(s: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(format!("{:x}\r\n", data.len()).as_bytes())?;
    s.write_all(data)?;
    s.write_all(b"\r\n")
}

/// Reads one request (head and `content-length` body); `None` once the connection is closed.
fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    while buf.len() < end + length {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let body = buf[end..end + length].to_vec();
    buf.drain(..end + length);
    Some((head, body))
}

fn router_in_front_of(backend: &CountingBackend) -> Router {
    let r = Router::start(GatewayConfig::default(), None);
    assert_eq!(r.put_route(&route("a", 1, &[backend.addr])).status, 200);
    r
}

#[test]
fn streams_read_to_their_end_give_their_upstream_connection_back_for_the_next_request() {
    let backend = CountingBackend::start();
    let r = router_in_front_of(&backend);
    let streams = 20;
    for _ in 0..streams {
        let reply = request(r.public, "POST", "/v1/completions", &[], &completion(8, true));
        assert_eq!(reply.status, 200);
        assert!(reply.text().ends_with("data: [DONE]\n\n"), "{}", reply.text());
    }
    assert_eq!(
        backend.accepted(),
        1,
        "{streams} sequential streams should all ride one keep-alive connection"
    );
}

#[test]
fn a_stream_the_client_abandons_mid_way_closes_its_upstream_connection_instead_of_giving_it_back() {
    let backend = CountingBackend::start();
    let r = router_in_front_of(&backend);
    let reply = request(r.public, "POST", "/v1/completions", &[], &completion(8, true));
    assert_eq!(reply.status, 200);
    assert_eq!(backend.accepted(), 1);

    // The next stream takes that connection; the client reads a little of it and goes away.
    let body = completion(8, true).replace("The capital", ENDLESS);
    let mut client = send(r.public, "POST", "/v1/completions", &[], &body);
    read_until(&mut client, "\"t1\"");
    drop(client);
    assert!(
        backend.wait_closed(1),
        "the abandoned stream's upstream connection was never closed"
    );

    // A half-read connection is never reused: the next request needs a new one.
    let reply = request(r.public, "POST", "/v1/completions", &[], &completion(8, true));
    assert_eq!(reply.status, 200);
    assert!(reply.text().ends_with("data: [DONE]\n\n"), "{}", reply.text());
    assert_eq!(backend.accepted(), 2);
}

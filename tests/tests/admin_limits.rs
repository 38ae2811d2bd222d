//! The operator's and the prober's admin ports are served within limits, over real sockets: a
//! client that sends half a head is disconnected once the head's deadline passes, and a
//! connection over the cap is answered 503 with `Retry-After` while the others are served.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use understudy_listener::Limits;
use understudy_operator::admin::{self as operator_admin, Readiness};
use understudy_operator::metrics::Metrics;
use understudy_operator::watchdog::Watchdog;
use understudy_prober::admin::{self as prober_admin, Published};

/// One connection at a time, and a head within a second.
const TIGHT: Limits = Limits {
    header_read_timeout: Duration::from_secs(1),
    max_header_bytes: 1024,
    max_connections: 1,
    peer_in_extensions: false,
};

async fn bound() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// Everything the server sends until it closes the connection.
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the server never closed the connection");
    String::from_utf8_lossy(&answer).into_owned()
}

async fn get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    read_to_close(&mut stream).await
}

/// The limits, checked against one admin server at `addr` whose `/live` answers 200.
async fn check_limits(addr: SocketAddr) {
    // Half a head takes the one slot…
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /live HTTP/1.1\r\nHost: adm").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;

    // …so the next connection is turned away, with a time to come back…
    let refused = get(addr, "/live").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1"),
        "{refused}"
    );

    // …until the slow one is cut off at its deadline, with no answer to its half request.
    let cut = read_to_close(&mut slow).await;
    assert!(!cut.contains("200 OK"), "{cut}");

    // The slot is free again. (The slow connection's task may take a moment to let it go.)
    let mut served = String::new();
    for _ in 0..100 {
        served = get(addr, "/live").await;
        if served.starts_with("HTTP/1.1 200") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");

    // A head over the size limit is refused outright.
    let mut big = TcpStream::connect(addr).await.unwrap();
    let padding = "x".repeat(2048);
    let request = format!("GET /live HTTP/1.1\r\nHost: admin\r\nX-Padding: {padding}\r\n\r\n");
    big.write_all(request.as_bytes()).await.unwrap();
    let too_big = read_to_close(&mut big).await;
    assert!(too_big.starts_with("HTTP/1.1 431"), "{too_big}");
}

async fn serving(addr: SocketAddr, server: impl Future<Output = ()> + Send + 'static) {
    let task = tokio::spawn(server);
    check_limits(addr).await;
    task.abort();
}

#[tokio::test]
async fn the_operators_admin_port_has_limits() {
    let (listener, addr) = bound().await;
    let server = operator_admin::serve(
        listener,
        TIGHT,
        Arc::new(Metrics::new()),
        Readiness::default(),
        Watchdog::default(),
    );
    serving(addr, server).await;
}

#[tokio::test]
async fn the_probers_admin_port_has_limits() {
    let (listener, addr) = bound().await;
    serving(addr, prober_admin::serve(listener, TIGHT, Published::default())).await;
}

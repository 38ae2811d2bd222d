//! Connections to one upstream endpoint: HTTP/1.1 keep-alive connections, each handshaken once,
//! driven by one task of the gateway's runtime for its whole life, and reused while idle.
//!
//! Why not hyper-util's pooled client: it spawns a task per request to wait for the connection to
//! become idle again. Here the response body hands the connection back itself when it has read
//! the response to its end ([`Pool::put_back`]), so a request costs no task at all.
//!
//! What this module must never do: hand out a connection another response is still using, hold
//! its lock across an await, or resend a request a connection may have taken (it resends only a
//! request that hyper gives back unsent; what else is retryable is the gateway's decision).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The request body the gateway sends: read once, kept for retries.
pub type UpstreamBody = Full<Bytes>;

/// One idle-or-leased HTTP/1.1 connection's sending half.
pub type Connection = http1::SendRequest<UpstreamBody>;

/// Idle connections kept per endpoint, at most.
const MAX_IDLE: usize = 1024;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a request got no response head, by what the endpoint did.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be made (refused, unreachable, or not within the connect timeout):
    /// the request never reached the endpoint.
    #[error("connecting to {addr} failed: {reason}")]
    Refused {
        /// The endpoint.
        addr: SocketAddr,
        /// What the connect said.
        reason: std::io::Error,
    },
    /// The connection broke before a response head arrived.
    #[error("the connection broke before a response: {0}")]
    Reset(#[source] hyper::Error),
}

/// The idle connections to one endpoint, most recently used last.
#[derive(Debug, Default)]
pub struct Pool {
    // A lock for a push or a pop, never held across an await; uncontended on a current-thread
    // runtime. An atomic cannot hold a connection.
    idle: Mutex<VecDeque<Idle>>,
}

#[derive(Debug)]
struct Idle {
    connection: Connection,
    since: Instant,
}

impl Pool {
    /// Sends `req` over an idle connection, or a new one to `addr`; the response comes with the
    /// connection that carries its body, to be put back once the body has been read to its end.
    pub async fn send(
        &self,
        addr: SocketAddr,
        connect_timeout: Duration,
        mut req: Request<UpstreamBody>,
    ) -> Result<(Response<Incoming>, Connection), SendError> {
        while let Some(mut connection) = self.take_idle() {
            if connection.ready().await.is_err() {
                continue;
            }
            match connection.try_send_request(req).await {
                Ok(resp) => return Ok((resp, connection)),
                Err(mut e) => match e.take_message() {
                    // Closed by the endpoint while idle, before it took the request: try the next.
                    Some(unsent) => req = unsent,
                    None => return Err(SendError::Reset(e.into_error())),
                },
            }
        }
        let mut connection = connect(addr, connect_timeout).await?;
        match connection.send_request(req).await {
            Ok(resp) => Ok((resp, connection)),
            Err(e) => Err(SendError::Reset(e)),
        }
    }

    /// Keeps `connection` for the next request; its response has been read to the end.
    pub fn put_back(&self, connection: Connection) {
        if connection.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while idle
            .front()
            .is_some_and(|i| now.saturating_duration_since(i.since) > IDLE_TIMEOUT)
        {
            idle.pop_front();
        }
        if idle.len() < MAX_IDLE {
            idle.push_back(Idle {
                connection,
                since: now,
            });
        }
    }

    /// The most recently used idle connection that is still open and not too old.
    fn take_idle(&self) -> Option<Connection> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(i) = idle.pop_back() {
            if !i.connection.is_closed() && now.saturating_duration_since(i.since) <= IDLE_TIMEOUT {
                return Some(i.connection);
            }
        }
        None
    }

    /// Idle connections now.
    #[must_use]
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// Connects, without Nagle, and starts the connection's task.
async fn connect(addr: SocketAddr, timeout: Duration) -> Result<Connection, SendError> {
    let refused = |reason| SendError::Refused { addr, reason };
    let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(refused(e)),
        Err(_) => return Err(refused(std::io::ErrorKind::TimedOut.into())),
    };
    stream.set_nodelay(true).map_err(refused)?;
    let (connection, driver) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(SendError::Reset)?;
    tokio::spawn(async move {
        if let Err(e) = driver.await {
            tracing::debug!(error = %e, %addr, "upstream connection ended with an error");
        }
    });
    Ok(connection)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// A server that answers `per_connection` requests on each connection, then closes it;
    /// returns its address and how many connections it accepted.
    async fn server(per_connection: usize) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Relaxed);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    for _ in 0..per_connection {
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            let mut chunk = [0u8; 1024];
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.clear();
                        s.write_all(ANSWER).await.unwrap();
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn get(addr: SocketAddr) -> Request<UpstreamBody> {
        Request::builder()
            .uri("/v1/models")
            .header(http::header::HOST, addr.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    async fn round_trip(pool: &Pool, addr: SocketAddr) -> Result<Bytes, SendError> {
        let (resp, connection) = pool.send(addr, Duration::from_secs(1), get(addr)).await?;
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        pool.put_back(connection);
        Ok(body)
    }

    #[tokio::test]
    async fn a_connection_read_to_its_end_carries_the_next_request() {
        let (addr, accepted) = server(usize::MAX).await;
        let pool = Pool::default();
        for _ in 0..5 {
            assert_eq!(round_trip(&pool, addr).await.unwrap(), "ok");
        }
        assert_eq!(accepted.load(Relaxed), 1);
        assert_eq!(pool.idle(), 1);
    }

    #[tokio::test]
    async fn a_connection_the_endpoint_closed_while_idle_is_replaced_not_failed() {
        let (addr, accepted) = server(1).await;
        let pool = Pool::default();
        for _ in 0..5 {
            assert_eq!(round_trip(&pool, addr).await.unwrap(), "ok");
        }
        assert_eq!(accepted.load(Relaxed), 5);
    }

    #[tokio::test]
    async fn nothing_listening_is_refused() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let pool = Pool::default();
        assert!(matches!(
            pool.send(addr, Duration::from_secs(1), get(addr)).await,
            Err(SendError::Refused { .. })
        ));
    }
}

//! Connections to one upstream endpoint, and the HTTP/1.1 the gateway speaks on them.
//!
//! The gateway is its own HTTP/1.1 client ([`codec`]), driven inside the request's task: it
//! writes a request in one write (two when the body is over 16 KiB), reads the response head, and hands the connection to the
//! response body, which decodes the body straight from the connection's read buffer and gives
//! everything already read to the client as one frame. When the body has been read to its end,
//! the connection goes back to the endpoint's idle connections ([`Pool::put_back`]).
//!
//! Why not hyper's client: it runs each connection in a task of its own, decodes one chunk per
//! frame and hands every frame across to the request's task. For a 16-token SSE stream that was
//! two thirds of the router's instructions per request (router/benches/instructions.sh).
//!
//! What this module must never do: hand out a connection another response is still using, hold
//! its lock across an await, reuse a connection that carried anything it could not account for,
//! or resend a request a connection may have taken (it resends only when writing to a connection
//! that was idle fails; what else is retryable is the gateway's decision, and a response that
//! broke after its first byte is not).

pub mod codec;

use std::collections::VecDeque;
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use socket2::SockRef;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use codec::{Decoder, Gathered, Head};
pub use codec::{Malformed, Outgoing};

/// Idle connections kept per endpoint, at most.
const MAX_IDLE: usize = 1024;
/// An idle connection older than this is closed instead of reused. Below the 5 s after which
/// vLLM's API server (uvicorn, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) closes an idle connection, so the
/// router does not send on a connection the replica is closing.
const IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Room made in a connection's read buffer before each read.
const READ_BYTES: usize = 8 * 1024;
/// The most body bytes gathered into one frame.
const GATHER_LIMIT: usize = 64 * 1024;

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
        reason: io::Error,
    },
    /// The connection broke before any byte of a response arrived.
    #[error("the connection broke before a response: {0}")]
    Reset(#[source] io::Error),
    /// What came back is not an HTTP/1.1 response head the gateway can forward.
    #[error("the upstream's response is malformed: {0}")]
    Malformed(#[source] Malformed),
}

/// Why a response body ended before its end.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The upstream closed the connection inside the body.
    #[error("the upstream closed the connection before the body's end")]
    Closed,
    /// Reading from the upstream failed.
    #[error("reading the upstream failed: {0}")]
    Io(#[source] io::Error),
    /// The body's framing is broken.
    #[error("the upstream's body is malformed: {0}")]
    Malformed(#[source] Malformed),
}

/// One HTTP/1.1 connection to an endpoint, with the bytes read from it and not yet decoded.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    buf: BytesMut,
}

impl Connection {
    /// Connects, without Nagle.
    async fn open(addr: SocketAddr, timeout: Duration) -> Result<Self, SendError> {
        let refused = |reason| SendError::Refused { addr, reason };
        let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(refused(e)),
            Err(_) => return Err(refused(io::ErrorKind::TimedOut.into())),
        };
        stream.set_nodelay(true).map_err(refused)?;
        Ok(Connection {
            stream,
            buf: BytesMut::with_capacity(READ_BYTES),
        })
    }

    async fn write(&mut self, req: &Outgoing) -> io::Result<()> {
        for part in req.parts() {
            if !part.is_empty() {
                self.stream.write_all(part).await?;
            }
        }
        Ok(())
    }

    /// Reads what has arrived into the buffer; `Ok(0)` at the end of the connection.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_BYTES / 2 {
            self.buf.reserve(READ_BYTES);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.buf)
    }

    /// Reads the response head; the body follows in the buffer and on the connection. A
    /// connection that breaks before any byte of answer is a reset (retryable); one that breaks
    /// after (inside the head, or after an interim 1xx) is a malformed answer, not retried.
    async fn read_head(&mut self) -> Result<Head, SendError> {
        let mut answered = false;
        loop {
            if let Some(head) = codec::parse_head(&mut self.buf).map_err(SendError::Malformed)? {
                return Ok(head);
            }
            let read = std::future::poll_fn(|cx| self.poll_fill(cx)).await;
            match read {
                Ok(0) | Err(_) if answered => {
                    return Err(SendError::Malformed(Malformed(
                        "the upstream closed the connection inside its response head",
                    )));
                }
                Ok(0) => {
                    return Err(SendError::Reset(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection before answering",
                    )));
                }
                Ok(_) => answered = true,
                Err(e) => return Err(SendError::Reset(e)),
            }
        }
    }

    /// True when the connection is open and nothing arrived on it while it was idle. Asks the
    /// kernel (a non-blocking peek), not the runtime's readiness, which may not have seen a close
    /// yet, or may still show a read that was already taken.
    fn quiet(&self) -> bool {
        let mut byte = [MaybeUninit::uninit()];
        self.buf.is_empty()
            && matches!(SockRef::from(&self.stream).peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
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
    /// Sends `req` over an idle connection, or a new one to `addr`, and reads the response head;
    /// the body comes with the connection that carries it.
    pub async fn send(
        &self,
        addr: SocketAddr,
        connect_timeout: Duration,
        req: &Outgoing,
    ) -> Result<(http::response::Parts, ResponseBody), SendError> {
        let mut connection = loop {
            let Some(mut connection) = self.take_idle() else {
                let mut connection = Connection::open(addr, connect_timeout).await?;
                connection.write(req).await.map_err(SendError::Reset)?;
                break connection;
            };
            // Closed by the endpoint as the request went out: it cannot have taken the request
            // whole, and will not answer it. The next idle connection, or a new one.
            if connection.write(req).await.is_ok() {
                break connection;
            }
        };
        let head = connection.read_head().await?;
        let body = ResponseBody {
            connection: Some(connection),
            decoder: Decoder::new(head.framing),
            keep_alive: head.keep_alive,
            failed: None,
        };
        Ok((head.parts, body))
    }

    /// Keeps `connection` for the next request; its response has been read to the end.
    pub fn put_back(&self, connection: Connection) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let expired = take_expired(&mut idle, now);
        if idle.len() < MAX_IDLE {
            idle.push_back(Idle {
                connection,
                since: now,
            });
        }
        // Closed (system calls) once the lock is released, as is `connection` when not kept.
        drop(idle);
        drop(expired);
    }

    /// The most recently used idle connection that is still open and quiet, and not too old.
    /// Each is checked (a system call) with the lock released.
    fn take_idle(&self) -> Option<Connection> {
        loop {
            let candidate = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_back()?;
            if Instant::now().saturating_duration_since(candidate.since) <= IDLE_TIMEOUT
                && candidate.connection.quiet()
            {
                return Some(candidate.connection);
            }
        }
    }

    /// Closes the idle connections kept longer than the idle timeout. The gateway calls it now
    /// and then, so that an endpoint no request goes to does not keep sockets open.
    pub fn close_expired(&self) {
        let expired = take_expired(
            &mut self.idle.lock().unwrap_or_else(PoisonError::into_inner),
            Instant::now(),
        );
        drop(expired);
    }

    /// Idle connections now.
    #[must_use]
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// Takes out the connections at the front (the least recently used) that have been idle too
/// long, for the caller to close once it has released the lock. Allocates only when some have.
fn take_expired(idle: &mut VecDeque<Idle>, now: Instant) -> Vec<Idle> {
    let mut expired = Vec::new();
    while idle
        .front()
        .is_some_and(|i| now.saturating_duration_since(i.since) > IDLE_TIMEOUT)
    {
        expired.extend(idle.pop_front());
    }
    expired
}

/// A response body, decoded from the connection that carries it.
#[derive(Debug)]
pub struct ResponseBody {
    /// Gone once the body failed (the connection is closed with it) or was handed back.
    connection: Option<Connection>,
    decoder: Decoder,
    keep_alive: bool,
    /// A failure met after data that went out first.
    failed: Option<BodyError>,
}

impl ResponseBody {
    /// Everything of the body that has arrived, as one piece (gathering stops past 64 KiB); `None`
    /// at its end. Reads until the connection has nothing more, never waits once it has data.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        if let Some(e) = self.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Ready(None);
        };
        let mut out = Gathered::default();
        let failure = loop {
            if let Err(e) = self.decoder.decode(&mut connection.buf, &mut out, GATHER_LIMIT) {
                break BodyError::Malformed(e);
            }
            if self.decoder.is_done() || out.len() >= GATHER_LIMIT {
                return Poll::Ready((!out.is_empty()).then(|| Ok(out.take())));
            }
            match connection.poll_fill(cx) {
                Poll::Ready(Ok(0)) if self.decoder.closed() => {
                    self.keep_alive = false;
                    return Poll::Ready((!out.is_empty()).then(|| Ok(out.take())));
                }
                Poll::Ready(Ok(0)) => break BodyError::Closed,
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => break BodyError::Io(e),
                Poll::Pending if out.is_empty() => return Poll::Pending,
                Poll::Pending => return Poll::Ready(Some(Ok(out.take()))),
            }
        };
        self.connection = None;
        if out.is_empty() {
            return Poll::Ready(Some(Err(failure)));
        }
        self.failed = Some(failure);
        Poll::Ready(Some(Ok(out.take())))
    }

    /// Ready once some of the body has arrived, or the connection ended, without taking what
    /// came: a stream's head can come long before its first event (vLLM sends a stream's 200 at
    /// once and its first event with the engine's first output).
    pub fn poll_arrived(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.failed.is_some() || self.decoder.is_done() {
            return Poll::Ready(());
        }
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Ready(());
        };
        if !connection.buf.is_empty() {
            return Poll::Ready(());
        }
        match connection.poll_fill(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(_)) => Poll::Ready(()),
            Poll::Ready(Err(e)) => {
                self.connection = None;
                self.failed = Some(BodyError::Io(e));
                Poll::Ready(())
            }
        }
    }

    /// True once the body has been read to its end.
    #[must_use]
    pub fn is_end_stream(&self) -> bool {
        self.decoder.is_done() && self.failed.is_none()
    }

    /// The connection, once the body has been read to its end and the connection may carry the
    /// next request; `None` otherwise (it is closed when the body is dropped).
    pub fn take_reusable(&mut self) -> Option<Connection> {
        if !(self.keep_alive && self.is_end_stream()) {
            return None;
        }
        self.connection.take().filter(|c| c.buf.is_empty())
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.get_mut()
            .poll_data(cx)
            .map(|o| o.map(|r| r.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        ResponseBody::is_end_stream(self)
    }

    fn size_hint(&self) -> SizeHint {
        self.decoder
            .remaining()
            .map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// A scripted endpoint on loopback.
    struct Scripted {
        addr: SocketAddr,
        /// Requests read, on all connections.
        requests: Arc<AtomicUsize>,
        /// Connections accepted.
        accepted: Arc<AtomicUsize>,
    }

    /// An endpoint that answers each request it reads, on whatever connection, with the next
    /// step: the bytes to write, and whether to close the connection after them. With no step
    /// left it closes the connection.
    async fn scripted(steps: &[(&'static [u8], bool)]) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let steps = Arc::new(Mutex::new(steps.iter().copied().collect::<VecDeque<_>>()));
        let (requests, accepted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r, a) = (Arc::clone(&requests), Arc::clone(&accepted));
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Relaxed);
                let (steps, r) = (Arc::clone(&steps), Arc::clone(&r));
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            let mut chunk = [0u8; 1024];
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.clear();
                        r.fetch_add(1, Relaxed);
                        let Some((answer, close)) = steps.lock().unwrap().pop_front() else {
                            return;
                        };
                        s.write_all(answer).await.unwrap();
                        if close {
                            return;
                        }
                    }
                });
            }
        });
        Scripted {
            addr,
            requests,
            accepted,
        }
    }

    fn get(addr: SocketAddr) -> Outgoing {
        let host = http::HeaderValue::from_str(&addr.to_string()).unwrap();
        Outgoing::new(
            &http::Method::GET,
            "/v1/models",
            &http::HeaderMap::new(),
            &host,
            &Bytes::new(),
        )
    }

    async fn next(body: &mut ResponseBody) -> Option<Result<Bytes, BodyError>> {
        std::future::poll_fn(|cx| body.poll_data(cx)).await
    }

    /// Sends a GET and reads its body to the end, handing the connection back when it may be
    /// reused.
    async fn round_trip(pool: &Pool, addr: SocketAddr) -> Result<Bytes, SendError> {
        let (_, mut body) = pool.send(addr, Duration::from_secs(1), &get(addr)).await?;
        let data = next(&mut body).await.unwrap().unwrap();
        assert!(next(&mut body).await.is_none());
        if let Some(c) = body.take_reusable() {
            pool.put_back(c);
        }
        Ok(data)
    }

    #[tokio::test]
    async fn a_connection_read_to_its_end_carries_the_next_request() {
        let endpoint = scripted(&[(OK, false); 5]).await;
        let pool = Pool::default();
        for _ in 0..5 {
            assert_eq!(round_trip(&pool, endpoint.addr).await.unwrap(), "ok");
        }
        assert_eq!(endpoint.accepted.load(Relaxed), 1);
        assert_eq!(pool.idle(), 1);
    }

    #[tokio::test]
    async fn a_connection_the_endpoint_closed_while_idle_is_replaced_not_failed() {
        let endpoint = scripted(&[(OK, true); 5]).await;
        let pool = Pool::default();
        for _ in 0..5 {
            assert_eq!(round_trip(&pool, endpoint.addr).await.unwrap(), "ok");
        }
        assert_eq!(endpoint.accepted.load(Relaxed), 5);
    }

    /// The runtime is kept from running (a blocking sleep) while the endpoint closes the idle
    /// connection, so only the kernel knows it is closed when the next request goes out.
    #[tokio::test]
    async fn a_close_the_runtime_has_not_seen_yet_is_caught_before_the_request_goes_out() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let served = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut requests = 0;
            for (i, s) in listener.incoming().take(2).enumerate() {
                let mut s = s.unwrap();
                let mut buf = [0u8; 1024];
                let mut head = Vec::new();
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut buf).unwrap();
                    head.extend_from_slice(&buf[..n]);
                }
                requests += 1;
                s.write_all(OK).unwrap();
                if i == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                    drop(s);
                } else {
                    return requests;
                }
            }
            requests
        });
        let pool = Pool::default();
        assert_eq!(round_trip(&pool, addr).await.unwrap(), "ok");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(round_trip(&pool, addr).await.unwrap(), "ok");
        assert_eq!(served.join().unwrap(), 2, "one request per connection, none lost");
    }

    #[tokio::test]
    async fn a_request_the_endpoint_read_and_dropped_is_a_reset_and_not_resent() {
        let endpoint = scripted(&[(OK, false), (b"", true)]).await;
        let pool = Pool::default();
        assert_eq!(round_trip(&pool, endpoint.addr).await.unwrap(), "ok");
        let second = round_trip(&pool, endpoint.addr).await;
        assert!(matches!(second, Err(SendError::Reset(_))), "{second:?}");
        assert_eq!(endpoint.requests.load(Relaxed), 2);
        assert_eq!(endpoint.accepted.load(Relaxed), 1);
    }

    #[tokio::test]
    async fn an_answer_that_breaks_after_its_first_byte_is_malformed_not_a_reset() {
        for answer in [
            &b"HTTP/1.1 100 Continue\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-",
            b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        ] {
            let endpoint = scripted(&[(answer, true)]).await;
            let sent = round_trip(&Pool::default(), endpoint.addr).await;
            assert!(matches!(sent, Err(SendError::Malformed(_))), "{sent:?}");
            assert_eq!(endpoint.requests.load(Relaxed), 1);
        }
    }

    #[tokio::test]
    async fn a_connection_is_reused_only_after_a_clean_keep_alive_end() {
        for first in [
            &b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"[..],
            b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5, 2\r\n\r\nok",
        ] {
            let endpoint = scripted(&[(first, false), (OK, false)]).await;
            let pool = Pool::default();
            let _ = round_trip(&pool, endpoint.addr).await;
            assert_eq!(round_trip(&pool, endpoint.addr).await.unwrap(), "ok");
            assert_eq!(
                endpoint.accepted.load(Relaxed),
                2,
                "{}",
                String::from_utf8_lossy(first)
            );
        }
    }

    #[tokio::test]
    async fn a_body_gives_what_arrived_and_then_the_cut() {
        let endpoint = scripted(&[(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n",
            true,
        )])
        .await;
        let pool = Pool::default();
        let (head, mut body) = pool
            .send(endpoint.addr, Duration::from_secs(1), &get(endpoint.addr))
            .await
            .unwrap();
        assert_eq!(head.status, http::StatusCode::OK);
        let mut data = Vec::new();
        let cut = loop {
            match next(&mut body).await.unwrap() {
                Ok(piece) => data.extend_from_slice(&piece),
                Err(e) => break e,
            }
        };
        assert_eq!(data, b"abcdef");
        assert!(matches!(cut, BodyError::Closed), "{cut}");
        assert!(!body.is_end_stream());
        assert!(body.take_reusable().is_none());
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
            pool.send(addr, Duration::from_secs(1), &get(addr)).await,
            Err(SendError::Refused { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_past_the_idle_timeout_are_closed() {
        let endpoint = scripted(&[(OK, false), (OK, false)]).await;
        let pool = Pool::default();
        round_trip(&pool, endpoint.addr).await.unwrap();
        assert_eq!(pool.idle(), 1);
        tokio::time::advance(IDLE_TIMEOUT).await;
        pool.close_expired();
        assert_eq!(pool.idle(), 1, "not past the timeout yet");
        tokio::time::advance(Duration::from_millis(1)).await;
        pool.close_expired();
        assert_eq!(pool.idle(), 0);
        round_trip(&pool, endpoint.addr).await.unwrap();
        assert_eq!(endpoint.accepted.load(Relaxed), 2);
    }
}

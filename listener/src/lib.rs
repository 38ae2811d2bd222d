//! Serving HTTP/1.1 on a listener: accept, set `TCP_NODELAY`, and run each connection's requests
//! through a handler that always answers, within [`Limits`]; and stopping without dropping a
//! request: on `stop`, no new connection is taken, every open one finishes the request it is in
//! and closes, and [`serve_until`] returns once the last has.
//!
//! Every server in understudy runs on it: the router's gateway and admin ports and the fence, the
//! prober's and the operator's admin ports, the GPU agent and the vLLM emulator. It is a crate of
//! its own so that none of them links the data path for a listener.
//!
//! This crate must never decide anything about a request; it only moves connections. It must
//! never let a client hold a connection open without sending (a head has a deadline, and so has
//! the wait for the next one), nor take more connections than its cap.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How a listener bounds its clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A request's head must arrive within this, and so must the next one on a kept-alive
    /// connection; the connection is closed otherwise. Zero turns it off.
    pub header_read_timeout: Duration,
    /// The largest request head (start line and headers), in bytes: 431 beyond.
    pub max_header_bytes: usize,
    /// Connections served at once. One more is answered 503 with `Retry-After` and closed.
    pub max_connections: usize,
    /// Whether each request carries its client's address as a [`Peer`] extension (for an access
    /// log); off, a request allocates nothing for it.
    pub peer_in_extensions: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            max_connections: 4096,
            peer_in_extensions: false,
        }
    }
}

/// The client's address, in a request's extensions when [`Limits::peer_in_extensions`] says so:
/// what an access log names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(pub SocketAddr);

/// The answer to a connection over the cap, written before it is closed.
const OVER_CAPACITY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 84\r\n\r\n\
{\"error\": {\"message\": \"too many connections\", \"type\": \"over_capacity\", \"code\": 503}}";

/// Serves `listener` with `handle` within the default [`Limits`], until the process ends.
pub async fn serve<F, Fut, B>(listener: TcpListener, handle: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_until(listener, handle, Limits::default(), CancellationToken::new()).await;
}

/// Serves `listener` with `handle` within `limits` until `stop`; then takes no new connection,
/// lets each open one finish its request and close, and returns when all have.
///
/// Any response body will do, so the admin ports of the other binaries (axum routers) are
/// served within the same limits as the gateway.
pub async fn serve_until<F, Fut, B>(listener: TcpListener, handle: F, limits: Limits, stop: CancellationToken)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout((!limits.header_read_timeout.is_zero()).then_some(limits.header_read_timeout))
        .max_header_size(limits.max_header_bytes);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off a little instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        while connections.try_join_next().is_some() {}
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            connections.spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (handle, builder, stop) = (handle.clone(), Arc::clone(&builder), stop.clone());
        connections.spawn(async move {
            let _slot = slot;
            let service = service_fn(move |mut req: Request<Incoming>| {
                if limits.peer_in_extensions {
                    req.extensions_mut().insert(Peer(peer));
                }
                let answer = handle(req);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                () = stop.cancelled() => {
                    // The request in progress is answered; an idle connection closes now.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Serves `listener` with a tower service (an axum `Router`) within `limits` until `stop`, as
/// [`serve_until`] does.
pub async fn serve_service_until<S, B>(
    listener: TcpListener,
    service: S,
    limits: Limits,
    stop: CancellationToken,
) where
    S: tower_service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let handle = move |req| {
        let mut service = service.clone();
        async move {
            let ready = std::future::poll_fn(|cx| service.poll_ready(cx)).await;
            let Ok(()) = ready;
            let Ok(answer) = service.call(req).await;
            answer
        }
    };
    serve_until(listener, handle, limits, stop).await;
}

/// Answers a connection over the cap and closes it.
async fn refuse(mut stream: TcpStream) {
    tracing::warn!("connection refused: too many connections");
    let _ = stream.write_all(OVER_CAPACITY).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_over_capacity_answer_is_well_formed() {
        let text = std::str::from_utf8(OVER_CAPACITY).unwrap_or_default();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
        assert!(head.contains("retry-after: 1"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert!(serde_json::from_str::<serde_json::Value>(body).is_ok(), "{body}");
    }
}

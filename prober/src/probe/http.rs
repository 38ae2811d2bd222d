//! One HTTP/1.1 exchange per fresh connection (hyper 1), bounded by a deadline, reporting what
//! broke in the terms a probe needs: refused, reset, timed out, or garbled.
//!
//! A fresh connection per probe means a probe never rides a pooled connection that a dead
//! replica left half-open, and "refused" means what it says. The first bytes read are kept so
//! that a status code hyper refuses to parse (`99`, `1000`) is still reported as sent. This module
//! must never retry, follow redirects, or read more than the caller's cap.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Endpoint;

/// How many response bytes are kept for reading a garbled status line.
const HEAD_BYTES_KEPT: usize = 256;

/// Why an exchange gave no response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    Refused,
    Reset,
    Timeout,
    /// A status line with a code hyper will not accept, as sent.
    BadStatus(u16),
}

/// A response whose body is still to be read.
#[derive(Debug)]
pub struct Exchange {
    pub status: u16,
    pub fenced: bool,
    /// The answer says it is a server-sent event stream (`content-type: text/event-stream`).
    pub event_stream: bool,
    pub body: Incoming,
    _connection: AbortOnDrop,
}

/// The connection task dies with the exchange, so nothing outlives a probe.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A TCP stream that keeps the first bytes it reads.
struct HeadRecorder {
    inner: TcpStream,
    head: Arc<Mutex<Vec<u8>>>,
}

impl AsyncRead for HeadRecorder {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let fresh = &buf.filled()[before..];
            let mut head = self.head.lock().unwrap_or_else(|e| e.into_inner());
            let room = HEAD_BYTES_KEPT.saturating_sub(head.len()).min(fresh.len());
            head.extend_from_slice(&fresh[..room]);
        }
        polled
    }
}

impl AsyncWrite for HeadRecorder {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The code on a status line hyper refused: `HTTP/1.1 99 OK` gives 99.
fn status_as_sent(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let rest = line.strip_prefix("HTTP/")?;
    let code = rest.split_whitespace().nth(1)?;
    if code.is_empty() || code.len() > 5 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    code.parse::<u32>()
        .ok()
        .map(|c| u16::try_from(c).unwrap_or(u16::MAX))
}

/// Sends one request on a fresh connection and waits (until `deadline`) for the response head.
pub async fn send(
    endpoint: &Endpoint,
    method: http::Method,
    path: &str,
    json_body: Option<Vec<u8>>,
    extra_headers: &[(&str, &str)],
    deadline: Instant,
) -> Result<Exchange, Failure> {
    let connect = TcpStream::connect((endpoint.host.as_str(), endpoint.port));
    let stream = match tokio::time::timeout_at(deadline, connect).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => return Err(Failure::Refused),
        Ok(Err(_)) => return Err(Failure::Reset),
        Ok(Ok(s)) => s,
    };
    let _ = stream.set_nodelay(true);
    let head = Arc::new(Mutex::new(Vec::new()));
    let io = TokioIo::new(HeadRecorder {
        inner: stream,
        head: Arc::clone(&head),
    });
    let handshake = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(io);
    let (mut sender, connection) = match tokio::time::timeout_at(deadline, handshake).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(_)) => return Err(Failure::Reset),
        Ok(Ok(pair)) => pair,
    };
    let connection = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let mut request = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, endpoint.authority());
    for (name, value) in extra_headers {
        request = request.header(*name, *value);
    }
    if let Some(bearer) = &endpoint.bearer {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {}", bearer.secret()));
    }
    let body = match json_body {
        Some(b) => {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
            Full::new(Bytes::from(b))
        }
        None => Full::new(Bytes::new()),
    };
    // The path and headers are the prober's own constants; a failure here is a bug upstream.
    let request = request.body(body).map_err(|_| Failure::Reset)?;
    let response = match tokio::time::timeout_at(deadline, sender.send_request(request)).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) if e.is_parse() => {
            let kept = head.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Err(status_as_sent(&kept).map_or(Failure::Reset, Failure::BadStatus));
        }
        Ok(Err(_)) => return Err(Failure::Reset),
        Ok(Ok(r)) => r,
    };
    let fenced = response.headers().contains_key(super::FENCE_HEADER);
    let event_stream = response
        .headers()
        .get(::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        });
    Ok(Exchange {
        status: response.status().as_u16(),
        fenced,
        event_stream,
        body: response.into_body(),
        _connection: connection,
    })
}

/// How reading a whole (small) body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyRead {
    Complete(Vec<u8>),
    Broken,
    Timeout,
}

/// Reads a body to its end, at most `cap` bytes (more is `Broken`), until `deadline`.
pub async fn read_body(exchange: &mut Exchange, cap: usize, deadline: Instant) -> BodyRead {
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, exchange.body.frame()).await {
            Err(_) => return BodyRead::Timeout,
            Ok(None) => return BodyRead::Complete(out),
            Ok(Some(Err(_))) => return BodyRead::Broken,
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if out.len() + data.len() > cap {
                        return BodyRead::Broken;
                    }
                    out.extend_from_slice(data);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_hyper_refuses_is_read_back_as_sent() {
        assert_eq!(status_as_sent(b"HTTP/1.1 99 OK\r\n"), Some(99));
        assert_eq!(status_as_sent(b"HTTP/1.1 1000 Weird\r\n"), Some(1000));
        assert_eq!(status_as_sent(b"HTTP/1.1 99999999 Weird\r\n"), None);
        assert_eq!(status_as_sent(b"hello there\r\n"), None);
        assert_eq!(status_as_sent(b""), None);
    }
}

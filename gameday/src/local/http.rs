//! One HTTP/1.1 exchange on a fresh loopback connection, as any OpenAI client or admin caller
//! would make it: the status, the body, when its first byte came, and whether it ended cleanly.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// What came back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
    /// From sending to the first body byte.
    pub first_byte: Option<Duration>,
    /// The body ended as its framing says, rather than being cut.
    pub complete: bool,
}

/// Why no answer came.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    #[error("connect: {0}")]
    Connect(String),
    #[error("no answer: {0}")]
    NoAnswer(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Sends one request and reads the whole answer, within `limit`.
pub async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
    limit: Duration,
) -> Result<Answer, ExchangeError> {
    match tokio::time::timeout(limit, exchange_unbounded(addr, method, path, headers, body)).await {
        Ok(result) => result,
        Err(_) => Err(ExchangeError::Timeout(limit)),
    }
}

async fn exchange_unbounded(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Answer, ExchangeError> {
    let started = Instant::now();
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| ExchangeError::Connect(e.to_string()))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| ExchangeError::Connect(e.to_string()))?;
    tokio::spawn(connection);
    let mut request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(body))
        .map_err(|e| ExchangeError::NoAnswer(e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| ExchangeError::NoAnswer(e.to_string()))?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut collected = BytesMut::new();
    let mut first_byte = None;
    let complete = loop {
        match body.frame().await {
            None => break true,
            Some(Err(_)) => break false,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if first_byte.is_none() && !data.is_empty() {
                        first_byte = Some(started.elapsed());
                    }
                    collected.extend_from_slice(&data);
                }
            }
        }
    };
    Ok(Answer {
        status,
        body: collected.freeze(),
        first_byte,
        complete,
    })
}

//! One HTTP/1.1 request on a fresh connection: how the operator calls the routers' admin APIs,
//! and how the operator and the local game day call the replicas' vLLM dev endpoints.
//!
//! This module must never wait on its own account: every caller bounds a call with a timeout. It
//! must never log or return the bearer token it is given.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;

/// The most of an answer that is read.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// What to send where.
#[derive(Debug)]
pub struct Call<'a> {
    pub host: &'a str,
    pub port: u16,
    pub method: http::Method,
    /// The path and query, as `/route` or `/wake_up?tags=weights`.
    pub target: &'a str,
    pub bearer: Option<&'a str>,
    /// A JSON body, when there is one.
    pub json: Option<Bytes>,
}

/// Makes `call` on a fresh connection; the status and up to [`MAX_ANSWER_BYTES`] of the answer,
/// or why there is none. No timeout here, the caller bounds it.
pub async fn exchange(call: Call<'_>) -> Result<(http::StatusCode, Bytes), String> {
    exchange_up_to(call, MAX_ANSWER_BYTES).await
}

/// [`exchange`], keeping up to `limit` bytes of the answer.
pub async fn exchange_up_to(call: Call<'_>, limit: usize) -> Result<(http::StatusCode, Bytes), String> {
    let stream = tokio::net::TcpStream::connect((call.host, call.port))
        .await
        .map_err(|error| format!("cannot connect: {error}"))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(|error| format!("HTTP handshake failed: {error}"))?;
    let connection = tokio::spawn(connection);
    let mut request = http::Request::builder()
        .method(call.method)
        .uri(call.target)
        .header(http::header::HOST, authority(call.host, call.port));
    if let Some(token) = call.bearer {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    if call.json.is_some() {
        request = request.header(http::header::CONTENT_TYPE, "application/json");
    }
    let answer = match request.body(Full::new(call.json.unwrap_or_default())) {
        Err(error) => Err(format!("the request cannot be built: {error}")),
        Ok(request) => match sender.send_request(request).await {
            Err(error) => Err(format!("the request failed: {error}")),
            Ok(response) => {
                let status = response.status();
                let body = Limited::new(response.into_body(), limit)
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                Ok((status, body))
            }
        },
    };
    connection.abort();
    answer
}

/// The `Host` header value: an IPv6 address in brackets.
fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_is_bracketed_in_the_host_header() {
        assert_eq!(authority("::1", 9091), "[::1]:9091");
        assert_eq!(
            authority("router-admin.serving", 9091),
            "router-admin.serving:9091"
        );
    }
}

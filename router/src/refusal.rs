//! The answers the router gives on its own, classified by type: each refusal knows its status
//! code, its metrics outcome, and its `Retry-After`. Bodies are OpenAI-style error JSON so
//! clients' existing error handling reads them.
//!
//! This module must never describe a failure by string matching, and never hide which side
//! failed: 4xx is the client's request, 429/503 is capacity, 502/504 is the upstream.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::admission::Shed;
use crate::body::RouterBody;
use crate::metrics::RequestOutcome;
use crate::waiting_room::Turnaway;

/// Why the router answered a request itself.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Not a path the public port serves.
    #[error("no such route")]
    NotFound,
    /// This router serves several policies and none of their routes takes the model asked for.
    #[error(
        "no route here serves {}; name a model one of its policies serves",
        .0.as_ref().map_or_else(|| "a request that names no model".to_owned(), |m| format!("model {m}"))
    )]
    NoRouteForModel(Option<String>),
    /// A vLLM control or development endpoint: never reachable through the public port.
    #[error("control endpoints are not served on the public port")]
    ControlEndpoint,
    /// Only GET and POST are forwarded.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The request body is larger than the limit.
    #[error("request body larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The request could not be read or is not what the API takes.
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    /// The request body did not arrive within the body-read timeout.
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    /// Admission control shed it.
    #[error("shed by admission control ({})", reason.as_str())]
    Shed {
        /// Why.
        reason: Shed,
        /// Seconds before trying again.
        retry_after_s: u64,
    },
    /// Nothing could take it in time.
    #[error("no serving endpoint: {reason}")]
    Unavailable {
        /// Full room or deadline.
        reason: Turnaway,
        /// Seconds before trying again.
        retry_after_s: u64,
    },
    /// Every try failed before any response byte and no retry was left.
    #[error("upstream failed before answering ({0}) and the retry budget is spent")]
    UpstreamFailed(&'static str),
    /// The upstream's answer could not be read as HTTP; not retried, the replica may have done
    /// the work.
    #[error("upstream sent a malformed response: {0}")]
    UpstreamMalformed(&'static str),
    /// No response headers within the first-byte timeout; not retried, the replica may be working.
    #[error("upstream did not answer in time")]
    UpstreamTimeout,
}

impl Refusal {
    /// The status code.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::NotFound | Refusal::NoRouteForModel(_) => StatusCode::NOT_FOUND,
            Refusal::ControlEndpoint => StatusCode::FORBIDDEN,
            Refusal::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Malformed(_) => StatusCode::BAD_REQUEST,
            Refusal::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Refusal::Shed { .. } => StatusCode::TOO_MANY_REQUESTS,
            Refusal::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::UpstreamFailed(_) | Refusal::UpstreamMalformed(_) => StatusCode::BAD_GATEWAY,
            Refusal::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The metrics outcome.
    #[must_use]
    pub fn outcome(&self) -> RequestOutcome {
        match self {
            Refusal::NotFound
            | Refusal::NoRouteForModel(_)
            | Refusal::ControlEndpoint
            | Refusal::MethodNotAllowed
            | Refusal::TooLarge { .. }
            | Refusal::Malformed(_)
            | Refusal::BodyTimeout(_) => RequestOutcome::Rejected,
            Refusal::Shed { .. } => RequestOutcome::Shed,
            Refusal::Unavailable { .. } => RequestOutcome::Unavailable,
            Refusal::UpstreamFailed(_) | Refusal::UpstreamMalformed(_) | Refusal::UpstreamTimeout => {
                RequestOutcome::UpstreamFailed
            }
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Refusal::NotFound => "not_found",
            Refusal::NoRouteForModel(_) => "model_not_found",
            Refusal::ControlEndpoint => "control_endpoint",
            Refusal::MethodNotAllowed => "method_not_allowed",
            Refusal::TooLarge { .. } => "request_too_large",
            Refusal::Malformed(_) => "invalid_request",
            Refusal::BodyTimeout(_) => "request_timeout",
            Refusal::Shed { .. } => "shed",
            Refusal::Unavailable { .. } => "unavailable",
            Refusal::UpstreamFailed(_) | Refusal::UpstreamMalformed(_) => "upstream_failed",
            Refusal::UpstreamTimeout => "upstream_timeout",
        }
    }

    /// The response.
    #[must_use]
    pub fn into_response(self) -> Response<RouterBody> {
        let mut resp = error_response(self.status(), self.kind(), &self.to_string());
        let retry_after = match self {
            Refusal::Shed { retry_after_s, .. } | Refusal::Unavailable { retry_after_s, .. } => {
                Some(retry_after_s)
            }
            _ => None,
        };
        if let Some(s) = retry_after {
            resp.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// An error in the OpenAI shape (`{"error": {"message", "type", "code"}}`) as JSON with `status`:
/// every answer the router or the fence makes up itself looks like this.
#[must_use]
pub fn error_response(status: StatusCode, kind: &str, message: &str) -> Response<RouterBody> {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    let mut resp = Response::new(RouterBody::from(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

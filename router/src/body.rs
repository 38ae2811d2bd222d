//! The response body the router sends back: a small answer of its own, or an upstream body passed
//! through frame by frame with no buffering. When an upstream stream breaks after bytes went to
//! the client, the stream contract decides what the client sees: for an SSE stream, one error
//! event marked `"retryable": true` and then the end, never a `[DONE]`; for anything else the
//! connection is cut, so the client sees an incomplete body rather than a finished one.
//!
//! This module must never buffer a stream, retry after a byte went out, or end a cut stream the
//! way a finished one ends.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::admission::{Admission, Permit};
use crate::endpoint::{EjectionPolicy, Endpoint, Outcome};
use crate::metrics::Metrics;
use crate::retry::RetryBudget;

/// The error a cut non-SSE stream ends with (hyper then aborts the connection).
#[derive(Debug, thiserror::Error)]
#[error("the upstream stream was cut: {0}")]
pub struct StreamCut(#[source] hyper::Error);

/// The SSE event that ends a cut stream under the `retryable-error` contract.
pub const RETRYABLE_ERROR_EVENT: &[u8] =
    b"data: {\"error\": {\"message\": \"the replica serving this stream failed; \
the answer is incomplete, retry the request\", \"type\": \"upstream_stream_cut\", \"code\": 503, \
\"retryable\": true}}\n\n";

/// A request's place in the data path while its response streams: the endpoint's outstanding
/// count, the retry budget's active count, the admission permit. Given back on drop.
#[derive(Debug)]
pub struct InFlight {
    /// The endpoint serving it.
    pub endpoint: Arc<Endpoint>,
    /// Its admission permit.
    pub permit: Option<Permit>,
    /// The route's admission, for first-token samples.
    pub admission: Arc<Admission>,
    /// The retry budget it counts in, and the retries it holds.
    pub budget: Arc<RetryBudget>,
    /// Retries this request took.
    pub retries: usize,
    /// Where cuts and ejections are counted.
    pub metrics: Arc<Metrics>,
    /// How a cut endpoint is ejected.
    pub ejection: EjectionPolicy,
    /// When the request was sent upstream, for the first-token sample.
    pub sent_at: Instant,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.endpoint.end();
        self.budget.finish(self.retries);
    }
}

/// A proxied upstream body.
#[derive(Debug)]
pub struct Proxied {
    inner: Incoming,
    in_flight: Option<InFlight>,
    sse: bool,
    first_frame_seen: bool,
    ended: bool,
}

impl Proxied {
    /// Streams `inner` under `in_flight`; `sse` says whether the response is an event stream.
    #[must_use]
    pub fn new(inner: Incoming, in_flight: InFlight, sse: bool) -> Self {
        Proxied {
            inner,
            in_flight: Some(in_flight),
            sse,
            first_frame_seen: false,
            ended: false,
        }
    }
}

/// The router's response body.
#[derive(Debug)]
pub enum RouterBody {
    /// An answer the router wrote itself (or nothing).
    Full(Option<Bytes>),
    /// An upstream body under the gateway's accounting and stream contract.
    Proxied(Box<Proxied>),
    /// An upstream body passed through as is (the fence sidecar).
    Plain(Incoming),
}

impl RouterBody {
    /// An empty body.
    #[must_use]
    pub fn empty() -> Self {
        RouterBody::Full(None)
    }
}

impl From<Bytes> for RouterBody {
    fn from(b: Bytes) -> Self {
        RouterBody::Full((!b.is_empty()).then_some(b))
    }
}

impl From<String> for RouterBody {
    fn from(s: String) -> Self {
        Bytes::from(s).into()
    }
}

impl Body for RouterBody {
    type Data = Bytes;
    type Error = StreamCut;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        match self.get_mut() {
            RouterBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RouterBody::Plain(inner) => Pin::new(inner).poll_frame(cx).map_err(StreamCut),
            RouterBody::Proxied(p) => p.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RouterBody::Full(b) => b.is_none(),
            RouterBody::Plain(inner) => inner.is_end_stream(),
            RouterBody::Proxied(p) => p.ended || (p.in_flight.is_some() && p.inner.is_end_stream()),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RouterBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            RouterBody::Plain(inner) => inner.size_hint(),
            RouterBody::Proxied(p) => p.inner.size_hint(),
        }
    }
}

impl Proxied {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if !self.first_frame_seen && frame.is_data() {
                    self.first_frame_seen = true;
                    if let Some(f) = &self.in_flight {
                        let ttft = f.sent_at.elapsed();
                        f.endpoint.record_ttft(ttft);
                        f.admission.record_ttft(ttft);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                self.ended = true;
                self.in_flight = None;
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                self.ended = true;
                if let Some(f) = self.in_flight.take() {
                    f.metrics.stream_cut();
                    if f.endpoint.record(Outcome::Cut, &f.ejection, Instant::now()) {
                        f.metrics.ejection();
                    }
                }
                if self.sse {
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(RETRYABLE_ERROR_EVENT)))))
                } else {
                    Poll::Ready(Some(Err(StreamCut(e))))
                }
            }
        }
    }
}

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
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
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

/// The most bytes gathered from frames already at hand before they are sent on.
const GATHER_LIMIT: usize = 64 * 1024;
/// Turns without a new frame before what was gathered goes out. Measured with strace: hyper's
/// client connection task needs two turns to hand over the next chunk it has already read.
const TURNS_FOR_UPSTREAM: u8 = 2;

/// A proxied upstream body.
///
/// Frames that are already at hand are gathered into one before they go out: hyper's client
/// hands a body over one chunk per turn of its connection task, and hyper's server flushes
/// whenever the body is not ready, so passing frames on one by one cost one `writev` per SSE
/// event (18 for a 16-token stream that arrived in one read; now 1). Gathering waits at most
/// [`TURNS_FOR_UPSTREAM`] scheduler turns without a new frame for the connection task to decode
/// what it has already read; it never waits for the network.
#[derive(Debug)]
pub struct Proxied {
    inner: Incoming,
    in_flight: Option<InFlight>,
    sse: bool,
    first_frame_seen: bool,
    ended: bool,
    gathered: Gathered,
    /// Turns yielded in a row, without a new frame, to let the upstream connection task run.
    yielded: u8,
    /// What comes after the gathered bytes have gone out: the end, or the cut.
    after: Option<After>,
}

#[derive(Debug)]
enum After {
    End,
    Cut(hyper::Error),
    Trailers(Frame<Bytes>),
}

/// Data frames gathered so far: the first kept as is (no copy), later ones appended.
#[derive(Debug, Default)]
struct Gathered {
    first: Option<Bytes>,
    more: BytesMut,
}

impl Gathered {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.more.len()
    }

    fn is_empty(&self) -> bool {
        self.first.is_none() && self.more.is_empty()
    }

    fn push(&mut self, data: Bytes) {
        match &mut self.first {
            None if self.more.is_empty() => self.first = Some(data),
            first => {
                if let Some(f) = first.take() {
                    self.more.reserve(f.len() + data.len() * 4);
                    self.more.extend_from_slice(&f);
                }
                self.more.extend_from_slice(&data);
            }
        }
    }

    fn take(&mut self) -> Bytes {
        match self.first.take() {
            Some(b) => b,
            None => self.more.split().freeze(),
        }
    }
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
            gathered: Gathered::default(),
            yielded: 0,
            after: None,
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
            RouterBody::Proxied(p) => {
                p.ended
                    || (p.gathered.is_empty()
                        && (matches!(p.after, Some(After::End))
                            || (p.after.is_none() && p.in_flight.is_some() && p.inner.is_end_stream())))
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RouterBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            RouterBody::Plain(inner) => inner.size_hint(),
            RouterBody::Proxied(p) if p.gathered.is_empty() && p.after.is_none() => p.inner.size_hint(),
            RouterBody::Proxied(_) => SizeHint::default(),
        }
    }
}

impl Proxied {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.after.is_some() {
            return self.poll_after();
        }
        loop {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if !self.first_frame_seen {
                            self.first_frame_seen = true;
                            if let Some(f) = &self.in_flight {
                                let ttft = f.sent_at.elapsed();
                                f.endpoint.record_ttft(ttft);
                                f.admission.record_ttft(ttft);
                            }
                        }
                        self.yielded = 0;
                        self.gathered.push(data);
                        if self.gathered.len() >= GATHER_LIMIT {
                            return Poll::Ready(Some(Ok(Frame::data(self.gathered.take()))));
                        }
                    }
                    Err(trailers) => return self.send_gathered_then(After::Trailers(trailers)),
                },
                Poll::Ready(None) => return self.send_gathered_then(After::End),
                Poll::Ready(Some(Err(e))) => return self.send_gathered_then(After::Cut(e)),
                Poll::Pending if self.gathered.is_empty() => return Poll::Pending,
                Poll::Pending if self.yielded < TURNS_FOR_UPSTREAM => {
                    // Our poll just asked the connection task for the next chunk; let it run
                    // before sending what we have.
                    self.yielded += 1;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Pending => {
                    self.yielded = 0;
                    return Poll::Ready(Some(Ok(Frame::data(self.gathered.take()))));
                }
            }
        }
    }

    fn send_gathered_then(&mut self, after: After) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        if self.gathered.is_empty() {
            self.after = Some(after);
            return self.poll_after();
        }
        self.after = Some(after);
        Poll::Ready(Some(Ok(Frame::data(self.gathered.take()))))
    }

    fn poll_after(&mut self) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        match self.after.take() {
            Some(After::End) | None => self.end(),
            Some(After::Cut(e)) => self.cut(e),
            Some(After::Trailers(t)) => Poll::Ready(Some(Ok(t))),
        }
    }

    fn end(&mut self) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        self.ended = true;
        self.in_flight = None;
        Poll::Ready(None)
    }

    fn cut(&mut self, e: hyper::Error) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
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

//! The response body the router sends back: a small answer of its own, or an upstream body passed
//! through as it arrives, with no buffering (each poll sends on everything read so far). When an
//! upstream stream breaks after bytes went to the client, the stream contract decides what the
//! client sees: for an SSE stream, one error event marked `"retryable": true` and then the end,
//! never a `[DONE]`, or under `continuation` the rest of a completions stream from another
//! endpoint; for anything else the connection is cut, so the client sees an incomplete body rather
//! than a finished one.
//!
//! This module must never buffer a stream, retry after a byte went out, or end a cut stream the
//! way a finished one ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::admission::{Admission, Permit};
use crate::continuation::{Delivered, Events, follow_up, restamp};
use crate::endpoint::{EjectionPolicy, Outcome, Outstanding};
use crate::metrics::Metrics;
use crate::retry::RetryBudget;
use crate::upstream::{BodyError, ResponseBody};

/// The error a cut non-SSE stream ends with (hyper then aborts the connection).
#[derive(Debug, thiserror::Error)]
#[error("the upstream stream was cut: {0}")]
pub struct StreamCut(#[source] Box<dyn std::error::Error + Send + Sync>);

/// The SSE event that ends a cut stream under the `retryable-error` contract.
pub const RETRYABLE_ERROR_EVENT: &[u8] =
    b"data: {\"error\": {\"message\": \"the replica serving this stream failed; \
the answer is incomplete, retry the request\", \"type\": \"upstream_stream_cut\", \"code\": 503, \
\"retryable\": true}}\n\n";

/// A request's place in the data path while its response streams: the endpoint's outstanding
/// count, the retry budget's active count, the admission permit. Given back on drop.
#[derive(Debug)]
pub struct InFlight {
    /// The endpoint serving it, counting the request as outstanding.
    pub endpoint: Outstanding,
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
    /// When the client's request arrived, for the router's time-to-first-token histogram; `None`
    /// for a continuation's follow-up, whose client had its first token already.
    pub arrived: Option<Instant>,
    /// Cancelled when the router, stopping, has waited long enough: the stream then ends as a
    /// cut one does (the retryable error event for SSE), never as a finished one.
    pub stopping: CancellationToken,
}

impl InFlight {
    /// `body` was read to its end: its connection goes back to the endpoint's idle ones, if it
    /// may carry the next request.
    fn finish_clean(self, body: &mut ResponseBody) {
        if let Some(c) = body.take_reusable() {
            self.endpoint.connections().put_back(c);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.budget.finish(self.retries);
    }
}

/// A proxied upstream body.
#[derive(Debug)]
pub struct Proxied {
    inner: ResponseBody,
    in_flight: Option<InFlight>,
    sse: bool,
    first_frame_seen: bool,
    ended: bool,
    /// Under the `continuation` contract: what was delivered and how to carry on.
    follow: Option<Box<Follow>>,
    /// Wakes the stream when the router stops it; made the first time it waits for the replica.
    stopped: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
}

/// Sends the follow-up request (body, the endpoint to avoid) to another endpoint of the route;
/// `None` when none answered with a stream.
pub type Resend = Box<dyn FnOnce(Bytes, std::net::SocketAddr) -> FollowUp + Send>;

/// A follow-up on its way: the new stream and its place in the data path, if one answered.
pub type FollowUp = Pin<Box<dyn Future<Output = Option<(ResponseBody, InFlight)>> + Send>>;

/// A completions stream under the `continuation` contract.
pub struct Follow {
    request: serde_json::Value,
    resend: Option<Resend>,
    events: Events,
    delivered: Delivered,
    sending: Option<FollowUp>,
    /// The follow-up's events are re-stamped with the first stream's identity.
    following: bool,
}

impl std::fmt::Debug for Follow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Follow")
            .field("delivered_tokens", &self.delivered.tokens)
            .field("following", &self.following)
            .finish_non_exhaustive()
    }
}

impl Follow {
    /// Follows the stream answering `request` (its JSON body), resending with `resend` on a cut.
    #[must_use]
    pub fn new(request: serde_json::Value, resend: Resend) -> Box<Self> {
        Box::new(Follow {
            request,
            resend: Some(resend),
            events: Events::default(),
            delivered: Delivered::default(),
            sending: None,
            following: false,
        })
    }

    /// Passes `data` through the event record: complete events only, re-stamped when following.
    fn pass(&mut self, data: &Bytes) -> Bytes {
        let Follow {
            events,
            delivered,
            following,
            ..
        } = self;
        if !*following {
            return events.push(data, |e| delivered.record(e));
        }
        let mut out = Vec::with_capacity(data.len() + 64);
        let stamp = delivered.stamp.clone();
        events.push(data, |e| {
            delivered.record(e);
            match &stamp {
                Some(st) => out.extend_from_slice(&restamp(e, st)),
                None => {
                    out.extend_from_slice(e);
                    out.extend_from_slice(b"\n\n");
                }
            }
        });
        Bytes::from(out)
    }
}

impl Proxied {
    /// Streams `inner` under `in_flight`; `sse` says whether the response is an event stream.
    #[must_use]
    pub fn new(inner: ResponseBody, in_flight: InFlight, sse: bool) -> Self {
        Proxied {
            inner,
            in_flight: Some(in_flight),
            sse,
            first_frame_seen: false,
            ended: false,
            follow: None,
            stopped: None,
        }
    }

    /// Carries the stream on under the `continuation` contract.
    #[must_use]
    pub fn following(mut self, follow: Box<Follow>) -> Self {
        self.follow = Some(follow);
        self
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
    /// A generation passed through by the fence sidecar, cut once `cut` is ready (its pool has
    /// been fenced for the whole drain).
    Drained { inner: Incoming, cut: Cut },
}

/// When a drained generation is cut ([`RouterBody::Drained`]).
pub struct Cut(pub Pin<Box<dyn Future<Output = ()> + Send>>);

impl std::fmt::Debug for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cut")
    }
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
            RouterBody::Plain(inner) => Pin::new(inner).poll_frame(cx).map_err(|e| StreamCut(e.into())),
            RouterBody::Drained { inner, cut } => {
                if cut.0.as_mut().poll(cx).is_ready() {
                    let why = "its pool lost the epoch Lease and the drain ran out";
                    return Poll::Ready(Some(Err(StreamCut(why.into()))));
                }
                Pin::new(inner).poll_frame(cx).map_err(|e| StreamCut(e.into()))
            }
            RouterBody::Proxied(p) => p.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RouterBody::Full(b) => b.is_none(),
            RouterBody::Plain(inner) | RouterBody::Drained { inner, .. } => inner.is_end_stream(),
            RouterBody::Proxied(p) => {
                p.ended || (p.follow.is_none() && p.in_flight.is_some() && p.inner.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RouterBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            RouterBody::Plain(inner) | RouterBody::Drained { inner, .. } => inner.size_hint(),
            RouterBody::Proxied(p) if p.follow.is_none() => p.inner.size_hint(),
            RouterBody::Proxied(_) => SizeHint::default(),
        }
    }
}

impl Drop for Proxied {
    fn drop(&mut self) {
        // hyper stops polling a body that says it has ended, so its end may never be polled.
        if let Some(f) = self.in_flight.take()
            && self.inner.is_end_stream()
        {
            f.finish_clean(&mut self.inner);
        }
    }
}

impl Proxied {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        loop {
            if let Some(f) = &mut self.follow
                && let Some(sending) = &mut f.sending
            {
                let Some((inner, in_flight)) = ready!(sending.as_mut().poll(cx)) else {
                    f.sending = None;
                    return self.end_with_error();
                };
                f.sending = None;
                f.following = true;
                in_flight.metrics.continuation();
                self.inner = inner;
                self.in_flight = Some(in_flight);
            }
            let stopping = self.in_flight.as_ref().map(|f| &f.stopping);
            if stopping.is_some_and(CancellationToken::is_cancelled) {
                return self.stop();
            }
            let Poll::Ready(next) = self.inner.poll_data(cx) else {
                // Waiting for the replica: be woken too if the router stops the stream.
                if let Some(stopping) = stopping {
                    let stopped = self
                        .stopped
                        .get_or_insert_with(|| Box::pin(stopping.clone().cancelled_owned()));
                    if stopped.as_mut().poll(cx).is_ready() {
                        return self.stop();
                    }
                }
                return Poll::Pending;
            };
            match next {
                Some(Ok(data)) => {
                    let data = self.take_data(data);
                    // Under `continuation`, a half event waits for the rest of it.
                    if !data.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                None => return self.end(),
                Some(Err(e)) => return self.cut(e, cx),
            }
        }
    }

    fn take_data(&mut self, data: Bytes) -> Bytes {
        if !self.first_frame_seen {
            self.first_frame_seen = true;
            if let Some(f) = &self.in_flight {
                let ttft = f.sent_at.elapsed();
                f.endpoint.record_ttft(ttft);
                f.admission.record_ttft(ttft);
                if let Some(arrived) = f.arrived {
                    f.metrics.ttft(arrived.elapsed());
                }
            }
        }
        match &mut self.follow {
            Some(f) => f.pass(&data),
            None => data,
        }
    }

    fn end(&mut self) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        self.ended = true;
        if let Some(f) = self.in_flight.take() {
            f.finish_clean(&mut self.inner);
        }
        Poll::Ready(None)
    }

    fn cut(&mut self, e: BodyError, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        let failed = self.in_flight.take().map(|f| {
            f.metrics.stream_cut();
            if f.endpoint.record(Outcome::Cut, &f.ejection, Instant::now()) {
                f.metrics.ejection();
            }
            f.endpoint.addr()
        });
        if let Some(failed) = failed
            && let Some(follow) = &mut self.follow
            && !follow.following
            && !follow.delivered.finished
            && !follow.events.overflowed()
            && let Some(body) = follow_up(&follow.request, &follow.delivered)
            && let Some(resend) = follow.resend.take()
        {
            // The half event the replica died in never went out; the follow-up starts clean.
            follow.events.clear();
            follow.sending = Some(resend(body, failed));
            return self.poll(cx);
        }
        if self.sse {
            self.end_with_error()
        } else {
            self.ended = true;
            Poll::Ready(Some(Err(StreamCut(e.into()))))
        }
    }

    /// The router is stopping and has waited long enough: the stream ends as a cut one does,
    /// without a follow-up (the router is going away), and the replica's connection is dropped.
    fn stop(&mut self) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        if let Some(f) = self.in_flight.take() {
            f.metrics.stream_cut();
        }
        if self.sse {
            self.end_with_error()
        } else {
            self.ended = true;
            Poll::Ready(Some(Err(StreamCut("the router stopped".into()))))
        }
    }

    /// Ends with the retryable error event, never a `[DONE]`.
    fn end_with_error(&mut self) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        self.ended = true;
        self.in_flight = None;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(RETRYABLE_ERROR_EVENT)))))
    }
}

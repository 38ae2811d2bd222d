//! The fence sidecar, which refuses generation when its pool lost the epoch Lease. It runs beside
//! vLLM in each serving pod, proxies to it, watches the policy's epoch Lease, and refuses every
//! path but the probes with 503 and `x-understudy-fenced: <epoch>` whenever its own pool does not
//! hold the Lease (generation is not only `/v1/...`: `/invocations`, `/inference/v1/generate` and
//! `/pooling` generate too). Probes (`/health`, `/metrics`, `/is_sleeping`, ...) pass to anyone;
//! vLLM's control calls (`/sleep`, `/wake_up`, `/collective_rpc`, ...) pass, fenced or not, only
//! with the operator's token, which is not forwarded. So a fenced replica can be watched, put to
//! sleep and woken by the operator, and by nobody else. A generation that carries the operator's
//! token passes fenced or not, its token taken off: it is the operator's probe, which proves a
//! standby through the same door its clients will use, and serves nobody. The game-day faults
//! ([`crate::fence_fault`]) are set with the same token. Paths a server further in might read as
//! another (`//`, `..`, percent-encoding) are refused (400).
//!
//! A generation already running when the pool loses the Lease is let finish: a planned move
//! drains the old primary. One still running after the drain (`--drain-ms`, the policy's
//! `stream.drainFor`) is cut, and the gateway ends it for its client as its stream contract says
//! (the retryable error event, or the rest from another endpoint).
//!
//! Until the first successful read, and when no Lease exists, the sidecar is fenced: it fails
//! closed. When the Lease store is unreachable it keeps its last verdict (a store outage is not a
//! failover: the operator pauses control actions, and the data path keeps serving), and the first read after the outage decides, so a
//! partitioned old primary that comes back fences itself before it serves again.
//!
//! Under grants (`--grants`, [`crate::grant`]) the sidecar reads no Lease: the operator pushes it
//! the right to serve an epoch until a deadline, and it is fenced the moment the deadline passes
//! (checked by every request, not only by the task that keeps the grant) unless the grantor
//! renewed it or the other pool's fences vouched for an extension.
//!
//! What this module must never do: let a client's generation through while fenced, let a
//! control call through without the token, or refuse a probe or the operator's control call
//! because of the fence.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::time::Duration;

use tokio::sync::watch;

use http::header::{AUTHORIZATION, HeaderValue, WWW_AUTHENTICATE};
use http::{Request, Response, StatusCode, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use understudy_api::lease::{EpochLease, LeaseError, LeaseRecord};
use understudy_core::Epoch;

use crate::admin::AdminToken;
use crate::body::{Cut, RouterBody};
use crate::fence_fault::{FAULT_PATH, Faults, FenceFault, wrong_answer};
use crate::gateway::strip_hop_by_hop;
use crate::grant::{GRANT_PATH, Granted};
use crate::path::{FencePath, classify_for_fence};
use crate::refusal::error_response;

/// The header on the sidecar's refusals, carrying the current epoch.
pub const FENCE_HEADER: &str = "x-understudy-fenced";

/// Marks an answer the fence made itself because no byte of an answer came from its replica:
/// `fenced`, `refused` (the replica refused the connection: crashed, not started) or `reset`
/// (the connection closed before the replica answered: it died holding the request). The
/// gateway treats the first two as a refused connection and the last as a reset one, exactly as
/// it would with no fence between them, and retries each on another endpoint; without the mark a
/// dead replica behind a live fence would look like a replica's own 502.
pub const NOT_SERVED_HEADER: &str = "x-understudy-not-served";

/// Names the pool whose replica answered a client's generation: behind a gateway that is not
/// understudy's router, what tells a client (and a test) which pool served it.
pub const SERVED_BY_HEADER: &str = "x-understudy-served-by";

/// Where the sidecar reads the Lease. Every [`EpochLease`] is one; tests add partitions.
pub trait LeaseSource: Send + Sync + 'static {
    /// The Lease now, or `None` when it does not exist.
    fn read_lease(&self) -> impl Future<Output = Result<Option<LeaseRecord>, LeaseError>> + Send;
}

impl<T: EpochLease + 'static> LeaseSource for T {
    fn read_lease(&self) -> impl Future<Output = Result<Option<LeaseRecord>, LeaseError>> + Send {
        self.read()
    }
}

/// The sidecar's verdict for its pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FenceVerdict {
    /// This pool holds the Lease at this epoch: serve.
    Serving(Epoch),
    /// Another pool holds it (or nobody does): refuse generation.
    Fenced {
        /// The Lease's epoch (0 when there is no Lease).
        epoch: Epoch,
    },
}

/// The verdict for `pool` from what the Lease says. Pure.
#[must_use]
pub fn verdict(pool: &str, lease: Option<&LeaseRecord>) -> FenceVerdict {
    match lease {
        Some(r) if r.holder == pool => FenceVerdict::Serving(r.epoch),
        Some(r) => FenceVerdict::Fenced { epoch: r.epoch },
        None => FenceVerdict::Fenced { epoch: Epoch(0) },
    }
}

/// The sidecar's current verdict, read by every request without a lock.
#[derive(Debug)]
pub struct FenceState {
    pool: String,
    fenced: AtomicBool,
    epoch: AtomicU64,
    /// Under a grant: the deadline, in milliseconds from `base`, past which it is fenced whatever
    /// the verdict says; `u64::MAX` for none. Read by every request, so a grant runs out on time
    /// even when the task that keeps it runs late.
    until_ms: AtomicU64,
    base: tokio::time::Instant,
    /// Whether it is fenced, for the generations running to wait on.
    fenced_watch: watch::Sender<bool>,
}

impl FenceState {
    /// Fenced until the first read says otherwise.
    #[must_use]
    pub fn new(pool: impl Into<String>) -> Self {
        FenceState {
            pool: pool.into(),
            fenced: AtomicBool::new(true),
            epoch: AtomicU64::new(0),
            until_ms: AtomicU64::new(u64::MAX),
            base: tokio::time::Instant::now(),
            fenced_watch: watch::Sender::new(true),
        }
    }

    /// Takes a verdict that holds until `until` at the latest (`None`: until the next one).
    pub fn set_until(&self, v: &FenceVerdict, until: Option<tokio::time::Instant>) {
        let ms = until.map_or(u64::MAX, |until| {
            u64::try_from(until.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
        });
        // The verdict first, the deadline after it with Release, read first with Acquire: a
        // request that sees the new deadline sees the new verdict, and one that sees the old
        // deadline is fenced by it once it has passed.
        self.set(v);
        self.until_ms.store(ms, Release);
    }

    /// Takes a verdict.
    pub fn set(&self, v: &FenceVerdict) {
        let (fenced, epoch) = match v {
            FenceVerdict::Serving(e) => (false, *e),
            FenceVerdict::Fenced { epoch } => (true, *epoch),
        };
        self.epoch.store(epoch.0, Relaxed);
        self.fenced.store(fenced, Relaxed);
        self.fenced_watch
            .send_if_modified(|was| std::mem::replace(was, fenced) != fenced);
    }

    /// Returns once the pool has been fenced for `drain` without a break: a generation that
    /// started while it served is cut then.
    pub fn fenced_for(&self, drain: Duration) -> impl Future<Output = ()> + Send + 'static {
        let mut fenced = self.fenced_watch.subscribe();
        async move {
            loop {
                if fenced.wait_for(|f| *f).await.is_err() {
                    return std::future::pending().await;
                }
                // Serving again within the drain: it waits for the next time it is fenced.
                let served_again = match tokio::time::timeout(drain, fenced.wait_for(|f| !*f)).await {
                    Err(_) => false,
                    Ok(read) => read.is_ok(),
                };
                if !served_again {
                    return;
                }
            }
        }
    }

    /// `Some(epoch)` while fenced.
    #[must_use]
    pub fn fenced_at(&self) -> Option<Epoch> {
        let until = self.until_ms.load(Acquire);
        let ran_out = until != u64::MAX
            && u128::from(until)
                <= tokio::time::Instant::now()
                    .saturating_duration_since(self.base)
                    .as_millis();
        (self.fenced.load(Relaxed) || ran_out).then(|| Epoch(self.epoch.load(Relaxed)))
    }
}

/// Reads the Lease every `interval` and updates `state`, forever.
pub async fn watch_lease<L: LeaseSource>(lease: L, state: Arc<FenceState>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match lease.read_lease().await {
            Ok(record) => {
                let v = verdict(&state.pool, record.as_ref());
                if state.fenced_at().is_none() != matches!(v, FenceVerdict::Serving(_)) {
                    tracing::info!(pool = %state.pool, verdict = ?v, "fence changed");
                }
                state.set(&v);
            }
            Err(e) => tracing::warn!(error = %e, "lease unreadable; keeping the last verdict"),
        }
    }
}

/// The sidecar's client to its local replica: HTTP/1.1, pooled keep-alive connections, no Nagle.
/// It streams each request body through without buffering it, which the gateway's own pool
/// (`upstream::Pool`, bodies read once and kept for a retry) does not; the price is a task per
/// request inside hyper-util's pool.
type UpstreamClient = Client<HttpConnector, Incoming>;

fn upstream_client(connect_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// The sidecar's proxy to its local replica.
#[derive(Debug, Clone)]
pub struct Fence {
    state: Arc<FenceState>,
    upstream: http::uri::Authority,
    client: UpstreamClient,
    /// The operator's token for control calls; without one they are all refused.
    control_token: Option<AdminToken>,
    /// Set when the fence is stopping: it answers `/health` 503 itself, so callers stop sending.
    draining: Arc<AtomicBool>,
    /// The game-day fault in play, if any.
    faults: Arc<Faults>,
    /// How long a generation running when the pool loses the Lease may go on.
    drain: Duration,
    /// The serving grant, when the fence serves under grants instead of reading the Lease.
    grants: Option<Arc<Granted>>,
}

/// How long a generation running when its pool loses the Lease may go on, unless the fence is
/// told otherwise: the policy's `stream.drainFor` default.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(60);

impl Fence {
    /// A sidecar for the replica at `upstream`.
    #[must_use]
    pub fn new(state: Arc<FenceState>, upstream: SocketAddr) -> Self {
        Fence {
            state,
            upstream: upstream
                .to_string()
                .parse()
                .unwrap_or_else(|_| http::uri::Authority::from_static("127.0.0.1")),
            client: upstream_client(Duration::from_secs(1)),
            control_token: None,
            draining: Arc::new(AtomicBool::new(false)),
            faults: Arc::default(),
            drain: DEFAULT_DRAIN,
            grants: None,
        }
    }

    /// Lets a generation running when the pool loses the Lease go on for `drain`, then cuts it.
    #[must_use]
    pub fn with_drain(mut self, drain: Duration) -> Self {
        self.drain = drain;
        self
    }

    /// Serves under `grants` (which must keep the same state) instead of a Lease.
    #[must_use]
    pub fn with_grants(mut self, grants: Arc<Granted>) -> Self {
        self.grants = Some(grants);
        self
    }

    /// Fails `/health` while `draining` is set.
    #[must_use]
    pub fn with_draining(mut self, draining: Arc<AtomicBool>) -> Self {
        self.draining = draining;
        self
    }

    /// Lets control calls through when they carry `token`.
    #[must_use]
    pub fn with_control_token(mut self, token: Option<AdminToken>) -> Self {
        self.control_token = token;
        self
    }

    /// Handles one request: probes pass, control calls pass with the token, anything else only
    /// while the pool holds the Lease or with the token; then the fault in play, if any.
    pub async fn handle(self, mut req: Request<Incoming>) -> Response<RouterBody> {
        if req.uri().path() == FAULT_PATH {
            if let Some(refusal) = self.refuse_control(&req) {
                return refusal;
            }
            return self.faults.call(req).await;
        }
        if req.uri().path() == GRANT_PATH {
            let Some(grants) = &self.grants else {
                let message = "this fence reads the epoch Lease; it takes no grants";
                return error_response(StatusCode::NOT_FOUND, "not_found", message);
            };
            if req.method() != http::Method::GET
                && let Some(refusal) = self.refuse_control(&req)
            {
                return refusal;
            }
            return grants.call(req).await;
        }
        match classify_for_fence(req.uri().path()) {
            FencePath::Probe
                if self.draining.load(Relaxed) && req.uri().path().trim_end_matches('/') == "/health" =>
            {
                let message = "the fence is stopping";
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "draining", message);
            }
            FencePath::Probe => self.hang_if_asked().await,
            FencePath::Control => {
                if let Some(refusal) = self.refuse_control(&req) {
                    return refusal;
                }
                // The token is the fence's business; vLLM never sees it.
                req.headers_mut().remove(AUTHORIZATION);
            }
            FencePath::Serving => {
                let operator = self
                    .control_token
                    .as_ref()
                    .is_some_and(|token| token.admits(req.headers().get(AUTHORIZATION)));
                if operator {
                    req.headers_mut().remove(AUTHORIZATION);
                } else if let Some(epoch) = self.state.fenced_at() {
                    let message = format!("pool {} does not hold epoch {epoch}: fenced", self.state.pool);
                    let mut resp = error_response(StatusCode::SERVICE_UNAVAILABLE, "fenced", &message);
                    resp.headers_mut()
                        .insert(FENCE_HEADER, HeaderValue::from(epoch.0));
                    resp.headers_mut()
                        .insert(NOT_SERVED_HEADER, HeaderValue::from_static("fenced"));
                    return resp;
                }
                let mut fault = self.faults.current();
                if fault == Some(FenceFault::Hang) {
                    self.faults.hang().await;
                    fault = self.faults.current();
                }
                if fault == Some(FenceFault::WrongAnswers) {
                    return match wrong_answer(req).await {
                        Ok(wrong) => wrong,
                        Err(req) => self.forward(req).await,
                    };
                }
                if !operator {
                    // A client's generation: it may finish within the drain once the pool is fenced.
                    let cut = self.state.fenced_for(self.drain);
                    let pool = HeaderValue::from_str(&self.state.pool).ok();
                    let mut resp = self.forward(req).await;
                    if let Some(pool) = pool.filter(|_| !resp.headers().contains_key(NOT_SERVED_HEADER)) {
                        resp.headers_mut().insert(SERVED_BY_HEADER, pool);
                    }
                    let body = std::mem::replace(resp.body_mut(), RouterBody::empty());
                    *resp.body_mut() = match body {
                        RouterBody::Plain(inner) => RouterBody::Drained {
                            inner,
                            cut: Cut(Box::pin(cut)),
                        },
                        other => other,
                    };
                    return resp;
                }
            }
            FencePath::Garbled => {
                let message = "a path with `//`, `..` or percent-encoding is not served";
                return error_response(StatusCode::BAD_REQUEST, "invalid_path", message);
            }
        }
        self.forward(req).await
    }

    /// Holds the request while a `hang` fault is in play.
    async fn hang_if_asked(&self) {
        if self.faults.current() == Some(FenceFault::Hang) {
            self.faults.hang().await;
        }
    }

    /// Why a control call may not pass, if it may not.
    fn refuse_control(&self, req: &Request<Incoming>) -> Option<Response<RouterBody>> {
        let Some(token) = &self.control_token else {
            let message = "control calls are closed: this fence has no control token";
            return Some(error_response(StatusCode::FORBIDDEN, "forbidden", message));
        };
        if token.admits(req.headers().get(AUTHORIZATION)) {
            return None;
        }
        let message = "a control call needs the operator's bearer token";
        let mut resp = error_response(StatusCode::UNAUTHORIZED, "unauthorized", message);
        resp.headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        Some(resp)
    }

    async fn forward(self, req: Request<Incoming>) -> Response<RouterBody> {
        let (mut parts, body) = req.into_parts();
        let mut uri = Uri::builder().scheme("http").authority(self.upstream.clone());
        if let Some(pq) = parts.uri.path_and_query() {
            uri = uri.path_and_query(pq.clone());
        }
        parts.uri = uri.build().unwrap_or_default();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(http::header::HOST);
        match self.client.request(Request::from_parts(parts, body)).await {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Response::from_parts(head, RouterBody::Plain(body))
            }
            Err(e) => {
                let why = if e.is_connect() {
                    "connection refused"
                } else {
                    "connection failed"
                };
                let message = format!("local replica unreachable: {why}");
                let mut resp = error_response(StatusCode::BAD_GATEWAY, "upstream_failed", &message);
                // A refused connection never reached the replica; a failed one may have, but
                // sent nothing back, which the gateway retries as it does a reset.
                let mark = if e.is_connect() { "refused" } else { "reset" };
                resp.headers_mut()
                    .insert(NOT_SERVED_HEADER, HeaderValue::from_static(mark));
                resp
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_generation_is_cut_only_once_its_pool_has_been_fenced_for_the_whole_drain() {
        use std::task::{Context, Waker};
        /// Whether `cut` is ready when polled now.
        fn ready(cut: std::pin::Pin<&mut impl Future<Output = ()>>) -> bool {
            cut.poll(&mut Context::from_waker(Waker::noop())).is_ready()
        }
        let state = FenceState::new("a");
        state.set(&FenceVerdict::Serving(Epoch(1)));
        let cut = state.fenced_for(Duration::from_secs(10));
        tokio::pin!(cut);
        let step = |secs| tokio::time::advance(Duration::from_secs(secs));
        state.set(&FenceVerdict::Fenced { epoch: Epoch(2) });
        assert!(!ready(cut.as_mut()));
        step(6).await;
        // Serving again before the drain ran out (the lease came back): the clock starts over.
        state.set(&FenceVerdict::Serving(Epoch(3)));
        assert!(!ready(cut.as_mut()));
        step(30).await;
        assert!(!ready(cut.as_mut()), "never cut while serving");
        state.set(&FenceVerdict::Fenced { epoch: Epoch(4) });
        assert!(!ready(cut.as_mut()));
        step(9).await;
        assert!(!ready(cut.as_mut()));
        step(1).await;
        assert!(ready(cut.as_mut()), "fenced for the whole ten seconds");
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_fences_every_request_past_it_even_when_nothing_flips_the_verdict() {
        let state = FenceState::new("a");
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        state.set_until(&FenceVerdict::Serving(Epoch(1)), Some(until));
        assert_eq!(state.fenced_at(), None);
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert_eq!(state.fenced_at(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            state.fenced_at(),
            Some(Epoch(1)),
            "no task ran, the deadline alone fences"
        );
        state.set_until(&FenceVerdict::Serving(Epoch(1)), None);
        assert_eq!(
            state.fenced_at(),
            None,
            "a verdict without a deadline holds until the next"
        );
    }

    fn rec(holder: &str, epoch: u64) -> LeaseRecord {
        LeaseRecord {
            holder: holder.into(),
            epoch: Epoch(epoch),
            version: "1".into(),
        }
    }

    #[test]
    fn a_pool_serves_only_while_it_holds_the_lease() {
        assert_eq!(verdict("a", Some(&rec("a", 3))), FenceVerdict::Serving(Epoch(3)));
        assert_eq!(
            verdict("a", Some(&rec("b", 4))),
            FenceVerdict::Fenced { epoch: Epoch(4) }
        );
        assert_eq!(verdict("a", None), FenceVerdict::Fenced { epoch: Epoch(0) });
    }

    #[test]
    fn the_state_starts_fenced_and_follows_verdicts() {
        let s = FenceState::new("a");
        assert_eq!(s.fenced_at(), Some(Epoch(0)));
        s.set(&FenceVerdict::Serving(Epoch(3)));
        assert_eq!(s.fenced_at(), None);
        s.set(&FenceVerdict::Fenced { epoch: Epoch(4) });
        assert_eq!(s.fenced_at(), Some(Epoch(4)));
    }
}

//! The gateway's request path: classify the path, read the body once (bounded), admit, pick an
//! endpoint of the current epoch, send, retry refused connections and resets before any response
//! byte on another endpoint within the retry budget, wait in the waiting room when nothing can
//! take the request, and stream the answer back as it arrives.
//!
//! When the route moves to another pool, a request still waiting for its first byte from the old
//! pool is sent to the new one: the old pool is fenced, and a generation has no effect but its
//! cost (spent twice when the old pool was working on it). A hung replica therefore loses nothing
//! it took once the failover routes around it. Moving is not retrying: the retry budget limits
//! retries within a pool, and a request it stops waits for the next route instead of failing. A
//! fence that answers "not served, fenced" has not read the new epoch yet: its endpoint is held
//! back for a moment, not ejected, and the try does not count (unless the fence keeps saying so
//! past its patience, when it is stuck and refuses).
//!
//! What this path must never do: forward a control endpoint; retry once a response byte went to
//! the client, or retry on the same route a request that timed out (the replica may be working on
//! it); keep the request body past the moment its response headers arrive; hold a lock across an
//! await, or wait on anything but the upstream, the route and the waiting room.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderMap};
use http::request::Parts;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use understudy_api::route::StreamContract;

use crate::admission::{
    Admission, Ask, DEADLINE_HEADER, PRIORITY_HEADER, Permit, Priority, Shed, estimate_prompt_tokens,
};
use crate::balance::{self, Tried};
use crate::body::{Follow, InFlight, Proxied, Resend, RouterBody};
use crate::continuation;
use crate::endpoint::{EjectionPolicy, Endpoint, Outcome, Outstanding};
use crate::fence_sidecar::NOT_SERVED_HEADER;
use crate::metrics::{Metrics, RequestOutcome};
use crate::path::{PublicPath, classify};
use crate::refusal::Refusal;
use crate::retry::{RetryBudget, RetryLimits};
use crate::shapes::{PROBE_HEADER, Shapes};
use crate::table::{RouteSet, RouteTable, Routed};
use crate::upstream::codec::is_hop_by_hop;
use crate::upstream::{Outgoing, ResponseBody, SendError};
use crate::waiting_room::{self, Turnaway, WaitingRoom, WaitingRoomConfig};

/// How the gateway behaves.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The largest request body taken (413 beyond).
    pub max_body_bytes: usize,
    /// How long the whole request body may take to arrive (408 beyond).
    pub body_read_timeout: Duration,
    /// The header that tells tenants apart for admission control: the API key by default.
    pub tenant_header: http::HeaderName,
    /// The waiting room's bound and deadline.
    pub waiting_room: WaitingRoomConfig,
    /// How long an upstream may take to send response headers, and a stream its first byte of
    /// body (504 beyond, not retried).
    pub first_byte_timeout: Duration,
    /// How long a connection attempt may take before it counts as refused.
    pub connect_timeout: Duration,
    /// How endpoints are ejected.
    pub ejection: EjectionPolicy,
    /// How many tries may be made again on another endpoint, before any response byte.
    pub retries: RetryLimits,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            max_body_bytes: 4 * 1024 * 1024,
            body_read_timeout: Duration::from_secs(30),
            tenant_header: http::header::AUTHORIZATION,
            waiting_room: WaitingRoomConfig::default(),
            first_byte_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(1),
            ejection: EjectionPolicy::default(),
            retries: RetryLimits::default(),
        }
    }
}

/// The gateway: route table, counters, the retry budget and the waiting room.
#[derive(Debug)]
pub struct Gateway {
    config: GatewayConfig,
    routes: Arc<RouteTable>,
    budget: Arc<RetryBudget>,
    room: Arc<WaitingRoom>,
    metrics: Arc<Metrics>,
    /// Cancelled to end the streams still open when the router stops ([`Gateway::stop_streams`]).
    stopping: CancellationToken,
    /// Hashes what names a tenant, with a key of this process's own.
    tenant_hasher: std::hash::RandomState,
    /// The shapes of the requests routed, per policy, for load proofs.
    shapes: Arc<Shapes>,
}

/// Removes the connection-scoped headers before a message crosses the proxy.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none (or only Transfer-Encoding): look before removing, since each
    // removal by name hashes it.
    while let Some(name) = headers.keys().find(|n| is_hop_by_hop(n)).cloned() {
        headers.remove(name);
    }
}

impl Gateway {
    /// A gateway over `routes`.
    #[must_use]
    pub fn new(config: GatewayConfig, routes: Arc<RouteTable>, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Gateway {
            room: Arc::new(WaitingRoom::new(config.waiting_room)),
            budget: Arc::new(RetryBudget::new(config.retries)),
            config,
            routes,
            metrics,
            stopping: CancellationToken::new(),
            tenant_hasher: std::hash::RandomState::new(),
            shapes: Arc::new(Shapes::default()),
        })
    }

    /// Ends every stream still open as a cut one ends (the retryable error event for SSE): the
    /// router is stopping and has waited for them as long as it may.
    pub fn stop_streams(&self) {
        self.stopping.cancel();
    }

    /// The route table.
    #[must_use]
    pub fn routes(&self) -> &Arc<RouteTable> {
        &self.routes
    }

    /// The shapes of the requests it routed, for `GET /shapes`.
    #[must_use]
    pub fn shapes(&self) -> &Arc<Shapes> {
        &self.shapes
    }

    /// Closes the current route's idle upstream connections that have waited past their
    /// timeout. Run now and then ([`housekeeping`]).
    pub fn close_expired_connections(&self) {
        for routed in self.routes.routes().routes() {
            for e in &routed.endpoints {
                e.connections().close_expired();
            }
        }
    }

    /// Handles one public request; never fails, refusals are answers.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<RouterBody> {
        let arrived = Instant::now();
        // The routes as the request arrives: read once here, and again only after it waited.
        let routes = self.routes.routes();
        // Classed by the route it arrives under, and again by each new route it is sent under.
        let mut priority = routes.for_model(None).map_or_else(
            || Priority::from_header(req.headers().get(PRIORITY_HEADER).map(|v| v.as_bytes())),
            |routed| routed.priority_of(req.headers()).0,
        );
        match self.forward(req, routes, &mut priority, arrived).await {
            Ok(resp) => resp,
            Err(refusal) => {
                self.metrics.request(refusal.outcome(), priority);
                if let Refusal::Shed { reason, .. } = refusal {
                    self.metrics.shed(reason, priority);
                }
                refusal.into_response()
            }
        }
    }

    /// Reads the request, checks what can be checked before it is sent, and says which model it
    /// asks for when that decides its route (this router serves several policies).
    async fn read_request(
        &self,
        req: Request<Incoming>,
        several: bool,
    ) -> Result<(Parts, Bytes, Option<String>), Refusal> {
        match classify(req.uri().path()) {
            PublicPath::Api => {}
            PublicPath::Control => return Err(Refusal::ControlEndpoint),
            PublicPath::Unknown => return Err(Refusal::NotFound),
        }
        if req.method() != Method::GET && req.method() != Method::POST {
            return Err(Refusal::MethodNotAllowed);
        }
        let limit = self.config.max_body_bytes;
        let declared = req
            .headers()
            .get(CONTENT_LENGTH)
            .map(|v| v.to_str().ok().and_then(|s| s.parse::<u64>().ok()));
        match declared {
            Some(None) => return Err(Refusal::Malformed("Content-Length is not a number")),
            Some(Some(n)) if n > limit as u64 => return Err(Refusal::TooLarge { limit }),
            _ => {}
        }
        let (parts, body) = req.into_parts();
        // Most bodies arrived with the head: read them without arming a timer.
        let mut collect = std::pin::pin!(Limited::new(body, limit).collect());
        let read = match std::future::poll_fn(|cx| Poll::Ready(collect.as_mut().poll(cx))).await {
            Poll::Ready(read) => Ok(read),
            Poll::Pending => tokio::time::timeout(self.config.body_read_timeout, collect).await,
        };
        let body = match read {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(Refusal::TooLarge { limit });
            }
            Ok(Err(_)) => return Err(Refusal::Malformed("the request body could not be read")),
            Err(_) => return Err(Refusal::BodyTimeout(self.config.body_read_timeout)),
        };
        let not_json = || Refusal::Malformed("the request body is not JSON");
        if parts.method != Method::POST {
            return Ok((parts, body, None));
        }
        if body.is_empty() {
            return Err(not_json());
        }
        if !several {
            serde_json::from_slice::<serde::de::IgnoredAny>(&body).map_err(|_| not_json())?;
            return Ok((parts, body, None));
        }
        let model = model_of(&body).map_err(|_| not_json())?;
        Ok((parts, body, model))
    }

    fn upstream_request(parts: &Parts, body: &Bytes, host: &http::HeaderValue) -> Outgoing {
        // Origin form, as the client sent it: the connection already names the endpoint.
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        Outgoing::new(&parts.method, target, &parts.headers, host, body)
    }

    async fn forward(
        self: &Arc<Self>,
        req: Request<Incoming>,
        arrived_under: Arc<RouteSet>,
        priority: &mut Priority,
        arrived: Instant,
    ) -> Result<Response<RouterBody>, Refusal> {
        let (parts, body, mut ask, mut model) = self
            .read_ask(req, arrived_under.several(), *priority, arrived)
            .await?;
        let mut arrived_under = Some(arrived_under);
        // Read with the body when the router served several policies then; read once more, in
        // the loop, if it comes to serve several while the request is here.
        let mut model_read = model.is_some();
        self.budget.start();
        let mut held = Held {
            budget: &self.budget,
            retries: 0,
        };
        // A request leaves the room at the room's deadline, or its client's when that is sooner.
        let room_deadline = self.room.deadline(arrived);
        let mut stay = Stay {
            seat: None,
            leave_by: ask
                .deadline
                .map_or(room_deadline, |d| room_deadline.min(Instant::now() + d)),
            priority: ask.priority,
        };
        let mut permit = None;
        let mut admitted_by: Option<Arc<Admission>> = None;
        let mut tries = Tries::new();
        // A probe is no user's traffic: a load proof must not replay it.
        let mut shape_recorded = parts.headers.contains_key(PROBE_HEADER);
        loop {
            // The routes it arrived under on the first pass; the routes now after any wait.
            let set = arrived_under.take().unwrap_or_else(|| self.routes.routes());
            if !model_read && set.several() && parts.method == Method::POST {
                // The router came to serve several policies while the request waited: its model
                // says which route is its own now.
                model = model_of(&body).ok().flatten();
                model_read = true;
            }
            let Some(state) = set.for_model(model.as_deref()) else {
                if !set.is_empty() && !set.awaits_a_route() {
                    return Err(Refusal::NoRouteForModel(model));
                }
                self.wait_in_room(&mut stay, model.as_deref(), None, Until::ANewRoute)
                    .await?;
                continue;
            };
            let state = &Arc::clone(state);
            if !admitted_by
                .as_ref()
                .is_some_and(|a| Arc::ptr_eq(a, &state.admission))
            {
                // A new route (a new epoch, or new admission settings): a fresh start, not a
                // retry, under its admission. What happened on the old pool says nothing of this
                // one.
                admitted_by = Some(Arc::clone(&state.admission));
                tries = Tries::new();
                permit = None;
                (ask.priority, ask.shed_listed) = state.priority_of(&parts.headers);
                *priority = ask.priority;
                stay.priority = ask.priority;
                if !shape_recorded && parts.method == Method::POST && generates(&parts) {
                    self.shapes
                        .record(&state.route.policy, &body, ask.priority, Instant::now());
                    shape_recorded = true;
                }
            }
            let now = Instant::now();
            if permit.is_none() {
                permit = Some(Self::admit(state, ask, now)?);
            }
            let Some(i) = balance::pick(
                &state.endpoints,
                tries.tried,
                now,
                self.config.ejection.panic_below_percent,
            ) else {
                self.wait_in_room(&mut stay, model.as_deref(), Some(state), Until::AnEndpoint)
                    .await?;
                // Endpoints back from ejection may be tried again. Waiting is not retrying: the
                // request sent nothing while it waited, so its tries start afresh, as under a new
                // route; the ejection back-off, not the retry budget, paces how often a dead
                // endpoint is tried.
                tries.start_afresh();
                continue;
            };
            if tries.attempts > 0 && !self.take_retry(&mut held) {
                if !tries.reached_a_replica {
                    // Every try was refused, so nothing was sent anywhere: waiting for an
                    // endpoint's return or a new route adds no load, where failing would turn a
                    // dead pool's refusals into the client's errors. A request held through a
                    // promotion wakes with every other one at each return, and the budget must
                    // not fail them all.
                    self.wait_in_room(&mut stay, model.as_deref(), Some(state), Until::AnEndpoint)
                        .await?;
                    tries.start_afresh();
                    continue;
                }
                // A replica may have taken it and died: no more tries on this pool beyond the
                // budget, but the move to a new one is no retry. Wait for the next route.
                self.wait_in_room(&mut stay, model.as_deref(), Some(state), Until::ANewRoute)
                    .await
                    .map_err(|_| Refusal::UpstreamFailed(tries.last_failure))?;
                continue;
            }
            let retry = tries.attempts > 0;
            tries.attempts += 1;
            let endpoint = Outstanding::begin(&state.endpoints[i]);
            let upstream = Self::upstream_request(&parts, &body, endpoint.host());
            let sent_at = Instant::now();
            let failure = match self.send_unless_moved(&endpoint, &upstream, state).await {
                Sent::Moved => {
                    // Nothing came back from the old pool, which is fenced now: the request goes
                    // to the new route, afresh.
                    self.metrics.moved();
                    continue;
                }
                // The fence answered for a replica that sent nothing: as the fence saw it.
                Sent::Answer(Ok((ref head, _))) if let Some(mark) = head.headers.get(NOT_SERVED_HEADER) => {
                    match self.not_served(&endpoint, mark) {
                        Some(failure) => failure,
                        None => {
                            // No try at all: the fence sent nothing on. A retry taken for it
                            // goes back to the budget.
                            tries.attempts -= 1;
                            if retry {
                                self.budget.give_back();
                                held.retries -= 1;
                            }
                            continue;
                        }
                    }
                }
                Sent::Answer(Ok(answer)) => {
                    drop(stay.seat.take());
                    let handover = Handover {
                        endpoint,
                        permit: permit.take(),
                        held,
                        sent_at,
                        arrived,
                    };
                    return Ok(self.respond(answer, handover, state, parts, &body, *priority));
                }
                Sent::Answer(Err(SendError::Refused { .. })) => Outcome::Refused,
                Sent::Answer(Err(SendError::Reset(_))) => Outcome::Reset,
                Sent::Answer(Err(SendError::Malformed(m))) => {
                    // Not retried: the endpoint answered, and may have done the work.
                    self.record(&endpoint, Outcome::ServerError);
                    return Err(Refusal::UpstreamMalformed(m.0));
                }
                Sent::TimedOut => Outcome::Timeout,
            };
            drop(endpoint);
            self.record(&state.endpoints[i], failure);
            if failure == Outcome::Timeout {
                return Err(Refusal::UpstreamTimeout);
            }
            tries.failed(i, failure);
        }
    }

    /// Reads the request, and what it asks of admission control.
    async fn read_ask(
        &self,
        req: Request<Incoming>,
        several: bool,
        priority: Priority,
        arrived: Instant,
    ) -> Result<(Parts, Bytes, Ask, Option<String>), Refusal> {
        let tenant = self.tenant_of(req.headers());
        let deadline = deadline_of(req.headers())?;
        let (parts, body, model) = self.read_request(req, several).await?;
        let ask = Ask {
            tenant,
            priority,
            prompt_tokens: estimate_prompt_tokens(body.len()),
            deadline: deadline.map(|d| d.saturating_sub(arrived.elapsed())),
            shed_listed: false,
        };
        Ok((parts, body, ask, model))
    }

    /// The tenant a request counts against in admission control. Hashed at once: the key itself
    /// is never kept.
    fn tenant_of(&self, headers: &HeaderMap) -> u64 {
        headers.get(&self.config.tenant_header).map_or(0, |name| {
            std::hash::BuildHasher::hash_one(&self.tenant_hasher, name.as_bytes())
        })
    }

    /// Admits the request under the route's admission control, or sheds it.
    fn admit(state: &Routed, ask: Ask, now: Instant) -> Result<Permit, Refusal> {
        state
            .admission
            .try_admit(ask, now)
            .map_err(|reason| Refusal::Shed {
                reason,
                retry_after_s: state.admission.retry_after_s(now),
            })
    }

    /// Takes a retry from the budget and counts it on the request; false when the budget is spent.
    fn take_retry(&self, held: &mut Held<'_>) -> bool {
        if !self.budget.try_retry() {
            self.metrics.retry_overflow();
            return false;
        }
        held.retries += 1;
        self.metrics.retry();
        true
    }

    /// Records how a try on `endpoint` went, counting the ejection it may cause.
    fn record(&self, endpoint: &Endpoint, outcome: Outcome) {
        if endpoint.record(outcome, &self.config.ejection, Instant::now()) {
            self.metrics.ejection();
        }
    }

    /// Streams the upstream's answer back to the client. What the request held goes over to the
    /// response body, which gives it back when the stream ends; an event stream under a
    /// continuation route is followed up on another endpoint if it is cut.
    fn respond(
        self: &Arc<Self>,
        (mut head, incoming): (http::response::Parts, ResponseBody),
        handover: Handover<'_>,
        state: &Routed,
        parts: Parts,
        body: &Bytes,
        priority: Priority,
    ) -> Response<RouterBody> {
        let Handover {
            endpoint,
            permit,
            mut held,
            sent_at,
            arrived,
        } = handover;
        let upstream_time = sent_at.elapsed();
        let status = head.status;
        let outcome = if status.is_server_error() {
            Outcome::ServerError
        } else {
            Outcome::Ok
        };
        self.record(&endpoint, outcome);
        let metric = if status.is_server_error() {
            RequestOutcome::UpstreamError
        } else {
            RequestOutcome::Forwarded
        };
        self.metrics.request(metric, priority);
        let sse = is_event_stream(&head.headers);
        let in_flight = InFlight {
            endpoint,
            permit,
            admission: Arc::clone(&state.admission),
            budget: Arc::clone(&self.budget),
            retries: std::mem::take(&mut held.retries),
            metrics: Arc::clone(&self.metrics),
            ejection: self.config.ejection,
            sent_at,
            arrived: Some(arrived),
            stopping: self.stopping.clone(),
        };
        std::mem::forget(held);
        let mut proxied = Proxied::new(incoming, in_flight, sse);
        if sse
            && status.is_success()
            && state.route.stream_contract == StreamContract::Continuation
            && let Ok(request) = serde_json::from_slice::<serde_json::Value>(body)
            && continuation::continuable(parts.uri.path(), &request)
        {
            let gateway = Arc::clone(self);
            let policy = state.route.policy.clone();
            let resend: Resend = Box::new(move |body, avoid| {
                Box::pin(async move { gateway.follow_up(&policy, parts, body, avoid).await })
            });
            proxied = proxied.following(Follow::new(request, resend));
            // Re-stamped and followed events change the length; the stream is chunked.
            head.headers.remove(CONTENT_LENGTH);
        }
        let body = RouterBody::Proxied(Box::new(proxied));
        self.metrics
            .added_latency(arrived.elapsed().saturating_sub(upstream_time));
        Response::from_parts(head, body)
    }

    /// Sends a continuation's follow-up to an endpoint of `policy`'s current route other than `avoid`,
    /// trying each at most once; `None` when none answered 2xx in time. Not admitted anew: it
    /// carries on a request that was.
    async fn follow_up(
        self: Arc<Self>,
        policy: &str,
        parts: Parts,
        body: Bytes,
        avoid: std::net::SocketAddr,
    ) -> Option<(ResponseBody, InFlight)> {
        let state = Arc::clone(self.routes.routes().of_policy(policy)?);
        let mut tried = Tried::default();
        for (i, e) in state.endpoints.iter().enumerate() {
            if e.addr() == avoid {
                tried.insert(i);
            }
        }
        loop {
            let i = balance::pick(
                &state.endpoints,
                tried,
                Instant::now(),
                self.config.ejection.panic_below_percent,
            )?;
            tried.insert(i);
            let endpoint = Arc::clone(&state.endpoints[i]);
            let upstream = Self::upstream_request(&parts, &body, endpoint.host());
            self.budget.start();
            let sent_at = Instant::now();
            let in_flight = InFlight {
                endpoint: Outstanding::begin(&endpoint),
                permit: None,
                admission: Arc::clone(&state.admission),
                budget: Arc::clone(&self.budget),
                retries: 0,
                metrics: Arc::clone(&self.metrics),
                ejection: self.config.ejection,
                sent_at,
                arrived: None,
                stopping: self.stopping.clone(),
            };
            let answer = tokio::time::timeout(
                self.config.first_byte_timeout,
                self.send_to_first_byte(&endpoint, &upstream),
            )
            .await;
            let outcome = match answer {
                Ok(Ok((head, body))) if head.status.is_success() => {
                    endpoint.record(Outcome::Ok, &self.config.ejection, Instant::now());
                    return Some((body, in_flight));
                }
                Ok(Ok((ref head, _))) if let Some(mark) = head.headers.get(NOT_SERVED_HEADER) => {
                    match self.not_served(&endpoint, mark) {
                        Some(failure) => failure,
                        None => continue,
                    }
                }
                Ok(Ok(_) | Err(SendError::Malformed(_))) => Outcome::ServerError,
                Ok(Err(SendError::Refused { .. })) => Outcome::Refused,
                Ok(Err(SendError::Reset(_))) => Outcome::Reset,
                Err(_) => Outcome::Timeout,
            };
            if endpoint.record(outcome, &self.config.ejection, Instant::now()) {
                self.metrics.ejection();
            }
        }
    }

    /// How a try the fence answered for went, as the fence saw it: the replica sent nothing.
    /// `None` for `fenced` while the endpoint's patience lasts: the fence has not read the epoch
    /// this route is at (or its pool lost it, and a new route is on its way), which is no failure
    /// of the endpoint; it is held back for a moment. Past its patience a fence that still says
    /// so is stuck, and refuses.
    fn not_served(&self, endpoint: &Endpoint, mark: &http::HeaderValue) -> Option<Outcome> {
        match mark.as_bytes() {
            b"fenced" if endpoint.hold_back(Instant::now()) => {
                self.metrics.fence_hold();
                None
            }
            b"reset" => Some(Outcome::Reset),
            _ => Some(Outcome::Refused),
        }
    }

    /// Sends `upstream` to `endpoint` and waits for its answer's head and, for a stream, its
    /// first byte of body, up to the first-byte timeout, unless the route moves away from the
    /// endpoint first. A stream's head says nothing of the engine: vLLM sends it before the
    /// engine has produced anything, so a hung engine's streams have a head and no body, and
    /// until their first byte they may still move to a new route.
    async fn send_unless_moved(&self, endpoint: &Endpoint, upstream: &Outgoing, routed: &Routed) -> Sent {
        let send = tokio::time::timeout(
            self.config.first_byte_timeout,
            self.send_to_first_byte(endpoint, upstream),
        );
        tokio::select! {
            biased;
            answer = send => answer.map_or(Sent::TimedOut, Sent::Answer),
            () = self.moved_away(routed, endpoint.addr()) => Sent::Moved,
        }
    }

    /// Resolves once the route served for `routed`'s policy is at another epoch and no longer
    /// lists `addr`: the pool that holds a request has lost the route. A route re-taken at a new
    /// epoch by the same endpoints keeps its requests.
    async fn moved_away(&self, routed: &Routed, addr: std::net::SocketAddr) {
        let mut routes = self.routes.subscribe();
        loop {
            let moved = routes
                .borrow_and_update()
                .of_policy(&routed.route.policy)
                .is_some_and(|now| {
                    now.route.epoch != routed.route.epoch && !now.route.endpoints.contains(&addr)
                });
            if moved {
                return;
            }
            if routes.changed().await.is_err() {
                // The table is gone with the router: the answer decides.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Sends `req` to `endpoint` and waits for its answer's head and, for a stream, its first
    /// byte of body (see [`Gateway::send_unless_moved`]).
    async fn send_to_first_byte(
        &self,
        endpoint: &Endpoint,
        req: &Outgoing,
    ) -> Result<(http::response::Parts, ResponseBody), SendError> {
        let mut answer = self.send(endpoint, req).await;
        if let Ok((head, body)) = &mut answer
            && head.status.is_success()
            && is_event_stream(&head.headers)
        {
            std::future::poll_fn(|cx| body.poll_arrived(cx)).await;
        }
        answer
    }

    async fn send(
        &self,
        endpoint: &Endpoint,
        req: &Outgoing,
    ) -> Result<(http::response::Parts, ResponseBody), SendError> {
        endpoint
            .connections()
            .send(endpoint.addr(), self.config.connect_timeout, req)
            .await
    }

    /// Waits in the room, taking a seat the first time, until the route for `model` is no longer `routed`
    /// (a route arrives, or a new one), until `until` says an endpoint of it may take the
    /// request again, or until the request's deadline.
    async fn wait_in_room(
        &self,
        stay: &mut Stay,
        model: Option<&str>,
        routed: Option<&Arc<Routed>>,
        until: Until,
    ) -> Result<(), Refusal> {
        if stay.seat.is_none() {
            let seat = self
                .room
                .enter(stay.priority, &self.metrics)
                .map_err(|reason| match reason {
                    Turnaway::Full => Refusal::Shed {
                        reason: Shed::WaitingRoom,
                        retry_after_s: SHED_RETRY_AFTER_S,
                    },
                    Turnaway::Closed | Turnaway::Deadline => Refusal::Unavailable {
                        reason,
                        retry_after_s: self.config.waiting_room.deadline.as_secs().clamp(1, 30),
                    },
                })?;
            stay.seat = Some(seat);
        }
        let wake_at = match (until, routed) {
            (Until::AnEndpoint, Some(routed)) => {
                balance::next_return(&routed.endpoints, Tried::default(), Instant::now())
            }
            _ => None,
        };
        waiting_room::wait(self.routes.subscribe(), model, routed, wake_at, stay.leave_by)
            .await
            .map_err(|reason| Refusal::Unavailable {
                reason,
                retry_after_s: self.config.waiting_room.deadline.as_secs().clamp(1, 30),
            })
    }
}

/// What a request in the waiting room waits for, besides a new route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Until {
    /// An endpoint of the route back from ejection or its fence's hold-back.
    AnEndpoint,
    /// Nothing else: only a new route (or the deadline) ends the wait.
    ANewRoute,
}

/// A request's place in the waiting room: its seat once it took one, when it must leave, and the
/// class whose share of the room it may take a seat within.
struct Stay {
    seat: Option<waiting_room::Seat>,
    leave_by: Instant,
    priority: Priority,
}

/// The `Retry-After` of a request shed because the waiting room holds its class's share: a
/// promotion routes within seconds.
const SHED_RETRY_AFTER_S: u64 = 2;

/// Runs for as long as `gateway` serves: every half second, closes the idle upstream connections
/// past their timeout. It also keeps a timer due within a second at all times: tokio wakes its
/// driver (an eventfd write, a system call) whenever a timer is armed that is due before every
/// other one, and with this one always sooner, arming each request's first-byte timeout is a
/// plain insert into the timer wheel.
pub async fn housekeeping(gateway: Arc<Gateway>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        gateway.close_expired_connections();
    }
}

/// The request's count in the retry budget until its response body takes it over.
struct Held<'a> {
    budget: &'a RetryBudget,
    retries: usize,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.budget.finish(self.retries);
    }
}

/// Whether a request asks for generation: a completion or a chat completion, the requests a load
/// proof replays.
fn generates(parts: &Parts) -> bool {
    matches!(parts.uri.path(), "/v1/completions" | "/v1/chat/completions")
}

/// The model a request's JSON body asks for, if it names one as a string; `Err` when the body is
/// not JSON.
fn model_of(body: &[u8]) -> Result<Option<String>, serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<serde_json::Value>,
    }
    serde_json::from_slice::<Named>(body).map(|named| match named.model {
        Some(serde_json::Value::String(model)) => Some(model),
        _ => None,
    })
}

/// The client's deadline, when it sent one.
fn deadline_of(headers: &HeaderMap) -> Result<Option<Duration>, Refusal> {
    let deadline_header = headers.get(DEADLINE_HEADER).map(|v| {
        v.to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(Duration::from_millis)
    });
    match deadline_header {
        Some(None) => Err(Refusal::Malformed(
            "x-understudy-deadline-ms is not a number of milliseconds",
        )),
        Some(Some(d)) => Ok(Some(d)),
        None => Ok(None),
    }
}

/// Whether an answer is a server-sent event stream.
fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// How one send went. Returned once per try and matched at once: boxing the answer would cost an
/// allocation per request for nothing.
#[allow(clippy::large_enum_variant)]
enum Sent {
    /// The upstream answered, or failed to, before the first-byte timeout.
    Answer(Result<(http::response::Parts, ResponseBody), SendError>),
    /// No response head, or no first byte of a stream, within the first-byte timeout.
    TimedOut,
    /// The route moved to another pool before the first byte.
    Moved,
}

/// The tries one request has made on the current route.
struct Tries {
    /// The endpoints tried since the tries last started afresh.
    tried: Tried,
    /// How many tries since they last started afresh: any after the first is a retry.
    attempts: u32,
    /// How the last try failed, for the answer when the retry budget runs out.
    last_failure: &'static str,
    /// Whether a try may have reached a replica (a reset): such a request is not held again.
    reached_a_replica: bool,
}

impl Tries {
    fn new() -> Self {
        Tries {
            tried: Tried::default(),
            attempts: 0,
            last_failure: "refused",
            reached_a_replica: false,
        }
    }

    /// Every endpoint may be tried again, and the next try is not a retry; how earlier tries
    /// failed is kept.
    fn start_afresh(&mut self) {
        self.tried = Tried::default();
        self.attempts = 0;
    }

    /// A try on endpoint `i` failed before any response byte.
    fn failed(&mut self, i: usize, failure: Outcome) {
        self.last_failure = if failure == Outcome::Refused {
            "refused"
        } else {
            self.reached_a_replica = true;
            "reset"
        };
        self.tried.insert(i);
    }
}

/// What a request holds when the upstream answers, handed over to its response body.
struct Handover<'a> {
    endpoint: Outstanding,
    permit: Option<Permit>,
    held: Held<'a>,
    sent_at: Instant,
    arrived: Instant,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn connection_scoped_headers_are_stripped_and_the_rest_kept() {
        let mut headers = HeaderMap::new();
        for name in [
            "connection",
            "Keep-Alive",
            "proxy-connection",
            "proxy-authenticate",
            "proxy-authorization",
            "te",
            "trailer",
            "upgrade",
            "transfer-encoding",
            "content-type",
            "authorization",
            "x-understudy-priority",
        ] {
            headers.append(http::HeaderName::try_from(name).unwrap(), "v".parse().unwrap());
        }
        strip_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(http::HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type", "x-understudy-priority"]);
    }
}

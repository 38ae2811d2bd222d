//! Pushes a promotion's route to the routers: the new primary's endpoints under the new epoch,
//! with the policy's admission settings and stream contract, as one `PUT /route` to each router's
//! admin API. The routers refuse anything below the highest epoch they have seen, and open the
//! admission window when they take a route at a new epoch.
//!
//! Between promotions the same route is kept in place ([`RouterPush::keep_route`]): each router
//! is asked for what it holds (`GET /route`) and is sent the route only when it holds none, an
//! older epoch, or other endpoints, so that an equal route is never pushed again.
//!
//! A router that stays ahead of us or keeps refusing the route is told in a Warning Event the
//! first time, then again only after a back-off ([`WarningBackoff`]), as client-go's event
//! correlator does for repeated Events; what is pushed and reported otherwise does not change.
//!
//! This module must never report a route pushed that a router did not answer 200 to, send a
//! request without a timeout, or print the admin token.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::future::{BoxFuture, join_all};
use kube::ResourceExt;
use tokio::time::Instant;
use understudy_api::route::{AdmissionSettings, Route, RouterHolds};
use understudy_core::Epoch;
use understudy_core::failover::Step;

use crate::crd::{FailoverPolicy, PoolSpec};
use crate::peers::{PolicyClusters, Routers};
use crate::ports::ReplicaEndpoints;
use crate::ports::{
    HandOffToComponents, RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest,
};
use crate::router_admin::{RouterAdminUrl, RouterAnswer, RouterToken, get_route, policy_key, put_route};

/// Who carries the route and admission steps when routers are configured.
pub const CARRIED_BY: &str = "router";

/// The longest one push to one router may take, connection included.
pub const DEFAULT_PUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a Warning about a router is not told again after it is first told; each time it is
/// told again the quiet time doubles, up to the longest, which stays well inside the hour the API
/// server keeps Events, so a condition that lasts always has a recent Event to `kubectl describe`.
const WARNING_FIRST_QUIET: Duration = Duration::from_secs(30);
const WARNING_LONGEST_QUIET: Duration = Duration::from_secs(600);

/// The route and admission steps, pushed to the routers; every other step as
/// [`HandOffToComponents`] hands it off.
pub struct RouterPush {
    routers: Routers,
    token: RouterToken,
    replicas: Arc<dyn ReplicaEndpoints>,
    timeout: Duration,
    /// The Warnings told about the routers, by policy (`namespace/name`): one policy's are never
    /// held back by another's.
    warnings: Mutex<HashMap<String, WarningBackoff>>,
    /// The model names each pool (`namespace/pool`) was last read to serve.
    models: Mutex<HashMap<String, Vec<String>>>,
    /// Whether the pools' fences serve only under the operator's grants, so that a region whose
    /// routers cannot be reached keeps no pool serving past its grant.
    granted: bool,
}

impl fmt::Debug for RouterPush {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterPush")
            .field("routers", &self.routers)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RouterPush {
    /// Pushes to `routers` with `token`, resolving a pool's endpoints through `replicas`.
    #[must_use]
    pub fn new(routers: Routers, token: RouterToken, replicas: Arc<dyn ReplicaEndpoints>) -> Self {
        RouterPush {
            routers,
            token,
            replicas,
            timeout: DEFAULT_PUSH_TIMEOUT,
            warnings: Mutex::default(),
            models: Mutex::default(),
            granted: false,
        }
    }

    /// The pools' fences serve under the operator's grants: a Route step goes on without the
    /// routers of a cluster that cannot be listed, whose fences refuse the old primary's work once
    /// their grants run out. Without grants nothing would stop those routers from routing the old
    /// primary, and the step waits for them until the promotion's deadline.
    #[must_use]
    pub fn with_grants(mut self, granted: bool) -> Self {
        self.granted = granted;
        self
    }

    /// The longest one push to one router may take.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Puts `route` to each of `routers` at once; each answer beside the router that gave it.
    pub async fn push<'a>(
        &self,
        routers: &'a [RouterAdminUrl],
        route: &Route,
    ) -> Vec<(&'a RouterAdminUrl, RouterAnswer)> {
        let body = route_bytes(route);
        let pushes = routers.iter().map(|router| {
            let body = body.clone();
            async move { (router, self.put_one(router, body).await) }
        });
        join_all(pushes).await
    }

    /// One `PUT /route` to one router, under the timeout.
    async fn put_one(&self, router: &RouterAdminUrl, body: Bytes) -> RouterAnswer {
        match tokio::time::timeout(self.timeout, put_route(router, &self.token, body)).await {
            Ok(answer) => answer,
            Err(_) => RouterAnswer::Unavailable {
                why: format!("no answer within {:?}", self.timeout),
            },
        }
    }

    /// The route that makes `pool` primary at `epoch`, with the endpoints of its running
    /// replicas that are known to pass the generating probe (`serving`; every running one when
    /// nothing is known), and every running replica's endpoint beside it; `Err` says why there is
    /// none to push yet.
    async fn route_for(
        &self,
        policy: &FailoverPolicy,
        pool: &PoolSpec,
        epoch: Epoch,
        serving: Option<&BTreeSet<String>>,
    ) -> Result<(Route, Vec<SocketAddr>), String> {
        let name = &pool.name;
        let namespace = policy.namespace().unwrap_or_default();
        let resolved = self
            .replicas
            .resolve(&namespace, pool)
            .await
            .map_err(|error| format!("the endpoints of {name} cannot be read: {error}"))?;
        if resolved.is_empty() {
            return Err(format!("{name} has no running replica to route to yet"));
        }
        let address = |e: &understudy_prober::probe::Endpoint| {
            Some(SocketAddr::new(e.host.parse::<IpAddr>().ok()?, e.port))
        };
        let running: Vec<SocketAddr> = resolved.iter().filter_map(address).collect();
        let endpoints: Vec<SocketAddr> = resolved
            .iter()
            .filter(|e| serving.is_none_or(|serving| serving.contains(&e.authority())))
            .filter_map(address)
            .collect();
        if endpoints.is_empty() {
            return Err(format!(
                "none of the {} running replica(s) of {name} has answered a generating probe yet",
                resolved.len()
            ));
        }
        let models = self.served_models(&namespace, pool).await;
        let route = Route::for_pool(&policy_key(policy), &policy.spec, name, models, endpoints, epoch);
        Ok((route, running))
    }

    /// The names `pool` answers to, from its template; while the template cannot be told (a
    /// rollout under way, a read that fails or takes longer than a push may), the names last
    /// read, or none (the route then takes any model) when there never were any.
    async fn served_models(&self, namespace: &str, pool: &PoolSpec) -> Vec<String> {
        let key = format!("{namespace}/{}", pool.name);
        let read = tokio::time::timeout(self.timeout, self.replicas.serving_config(namespace, pool)).await;
        let mut known = self.models.lock().unwrap_or_else(PoisonError::into_inner);
        match read {
            Ok(Ok(Some(config))) => {
                let models = config.served_models();
                known.insert(key, models.clone());
                models
            }
            _ => known.get(&key).cloned().unwrap_or_default(),
        }
    }

    async fn route(&self, request: StepRequest<'_>) -> StepReport {
        let route = match self
            .route_for(request.policy, request.pool, request.epoch, request.serving)
            .await
        {
            Ok((route, _)) => route,
            Err(reason) => return StepReport::NotYet { reason },
        };
        let namespace = request.policy.namespace().unwrap_or_default();
        let clusters = PolicyClusters::of(&namespace, request.policy);
        let (routers, left_out) = match self.routers.resolve_all(Some(clusters)).await {
            Ok(found) => found,
            Err(reason) => return StepReport::NotYet { reason },
        };
        if !left_out.is_empty() && !self.granted && request.overdue.is_none() {
            return StepReport::NotYet {
                reason: format!(
                    "the routers of {} cannot be found; with no serving grants they would go on routing the \
                     old primary, so the route waits for them until the promotion's deadline",
                    left_out.join("; ")
                ),
            };
        }
        let answers = self.push(&routers, &route).await;
        let mut report = judge(request.step, &route, &answers, request.overdue);
        if let (StepReport::Done { note, .. }, false) = (&mut report, left_out.is_empty()) {
            let left = format!(
                "left out the routers of {}, which keep the old route until they are reached (the old \
                 primary's fences refuse it once their grants run out)",
                left_out.join("; ")
            );
            *note = Some(match note.take() {
                Some(said) => format!("{said}; {left}"),
                None => left,
            });
        }
        let now = Instant::now();
        self.with_warnings(request.policy, |warnings| {
            hold_back(report, &answers, warnings, now)
        })
    }

    /// Runs `f` on `policy`'s Warning back-off; a policy whose routers all agree again is
    /// forgotten, so that nothing is kept for it.
    fn with_warnings<T>(&self, policy: &FailoverPolicy, f: impl FnOnce(&mut WarningBackoff) -> T) -> T {
        let key = policy_key(policy);
        let mut all = self.warnings.lock().unwrap_or_else(PoisonError::into_inner);
        let warnings = all.entry(key.clone()).or_default();
        let out = f(warnings);
        if warnings.told.is_empty() {
            all.remove(&key);
        }
        out
    }

    /// Makes every router hold `request`'s route, asking each first and pushing only to those
    /// that lack it; one router's failure never keeps the route from the others.
    pub async fn keep_route(&self, request: RouteSyncRequest<'_>) -> RouteSyncReport {
        let (route, running) = match self
            .route_for(request.policy, request.pool, request.epoch, request.serving)
            .await
        {
            Ok(found) => found,
            Err(reason) => {
                // Nothing to route to is not news between promotions; the next reconcile looks again.
                tracing::debug!(%reason, "no route to keep on the routers yet");
                return RouteSyncReport::default();
            }
        };
        let namespace = request.policy.namespace().unwrap_or_default();
        let clusters = PolicyClusters::of(&namespace, request.policy);
        let routers = match self.routers.resolve(Some(clusters)).await {
            Ok(routers) => routers,
            Err(why) => {
                tracing::debug!(%why, "the routers cannot be found; the route is kept on them later");
                return RouteSyncReport::default();
            }
        };
        let (route, running) = (&route, running.as_slice());
        let kept = join_all(
            routers
                .iter()
                .map(|router| async move { (router, self.keep_on(router, route, running).await) }),
        )
        .await;
        for (router, sync) in &kept {
            match sync {
                RouterSync::Pushed { had } => {
                    tracing::info!(%router, pool = %route.pool, epoch = %route.epoch, %had, "route pushed to a router that lacked it");
                }
                RouterSync::Failed(RouterAnswer::Unavailable { why }) => {
                    tracing::debug!(%router, %why, "router unavailable; the route is kept on it later");
                }
                _ => {}
            }
        }
        let now = Instant::now();
        self.with_warnings(request.policy, |warnings| judge_sync(route, &kept, warnings, now))
    }

    /// Asks `router` what it holds, and pushes `route` when that is not it. What it holds of the
    /// same route and still `running` stays in it ([`keeping_held`]).
    async fn keep_on(&self, router: &RouterAdminUrl, route: &Route, running: &[SocketAddr]) -> RouterSync {
        let held =
            match tokio::time::timeout(self.timeout, get_route(router, &self.token, &route.policy)).await {
                Ok(Ok(held)) => held,
                Ok(Err(answer)) => return RouterSync::Failed(answer),
                Err(_) => {
                    return RouterSync::Failed(RouterAnswer::Unavailable {
                        why: format!("no answer within {:?}", self.timeout),
                    });
                }
            };
        let route = &keeping_held(route, &held, running);
        let body = match plan(&held, route) {
            Plan::InPlace => return RouterSync::InPlace,
            Plan::Ahead { epoch, pool } => return RouterSync::Ahead { epoch, pool },
            Plan::Push(body) => body,
        };
        match self.put_one(router, route_bytes(&body)).await {
            RouterAnswer::Taken => RouterSync::Pushed { had: describe(&held) },
            // Moved on between the question and the push.
            RouterAnswer::Stale { highest, pool } => RouterSync::Ahead {
                epoch: highest.map(Epoch),
                pool,
            },
            failed => RouterSync::Failed(failed),
        }
    }
}

/// A route as JSON. Serializing plain numbers, strings and addresses cannot fail.
fn route_bytes(route: &Route) -> Bytes {
    Bytes::from(serde_json::to_vec(route).unwrap_or_default())
}

impl StepExecutor for RouterPush {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport> {
        match request.step {
            // The admission window opens when a router takes a route at a new epoch; pushing the
            // same route again is answered 200 by a router that holds it and leaves a running
            // window as it is, so a 200 from every router means the window is open on each.
            Step::Route | Step::OpenAdmission => Box::pin(self.route(request)),
            _ => HandOffToComponents.carry_out(request),
        }
    }

    fn keep_route<'a>(&'a self, request: RouteSyncRequest<'a>) -> BoxFuture<'a, RouteSyncReport> {
        Box::pin(RouterPush::keep_route(self, request))
    }
}

/// `route` with the endpoints a router already holds of it (the same policy, pool and epoch) that
/// still run. Between promotions a route only grows as replicas pass: one that missed a round,
/// or that a restarted operator has not seen pass yet, is not taken out of it; a replica leaves
/// the route when its pod goes, and the routers eject one that fails under them.
#[must_use]
pub fn keeping_held(route: &Route, held: &RouterHolds, running: &[SocketAddr]) -> Route {
    let mut route = route.clone();
    if let Some(held) = &held.route
        && held.policy == route.policy
        && held.pool == route.pool
        && held.epoch == route.epoch
    {
        let running: HashSet<&SocketAddr> = running.iter().collect();
        route
            .endpoints
            .extend(held.endpoints.iter().filter(|e| running.contains(e)));
        route.endpoints.sort_unstable();
        route.endpoints.dedup();
    }
    route
}

/// What a router held, for a log line.
fn describe(held: &RouterHolds) -> String {
    match (&held.route, &held.highest) {
        (Some(r), _) => format!(
            "{} at epoch {}, {} endpoint(s)",
            r.pool,
            r.epoch,
            r.endpoints.len()
        ),
        (None, Some(h)) => format!("no route (epoch {} for {} seen)", h.epoch, h.pool),
        (None, None) => "no route".to_owned(),
    }
}

/// What to do about one router.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// It holds the route: send nothing, so that nothing it keeps (its admission window, its
    /// endpoints' counters) is disturbed.
    InPlace,
    /// It lacks the route: push this.
    Push(Route),
    /// It has seen a higher epoch than ours, or another pool at ours: our view is stale.
    Ahead {
        epoch: Option<Epoch>,
        pool: Option<String>,
    },
}

/// What `route` means for a router that holds `held`.
///
/// At the same epoch and pool the route is pushed again only for other endpoints (pods come and
/// go) or another stream contract, and with the admission settings the router holds: they scale
/// with the number of endpoints, and a router restarts its window on other settings, which would
/// throttle a pool at full speed back to its initial budget because a replica came or went.
#[must_use]
pub fn plan(held: &RouterHolds, route: &Route) -> Plan {
    let seen = held
        .highest
        .iter()
        .map(|h| (h.epoch, h.pool.as_str()))
        .chain(held.route.iter().map(|r| (r.epoch, r.pool.as_str())));
    for (epoch, pool) in seen {
        if epoch > route.epoch || (epoch == route.epoch && pool != route.pool) {
            return Plan::Ahead {
                epoch: Some(epoch),
                pool: Some(pool.to_owned()),
            };
        }
    }
    let Some(current) = held.route.as_ref().filter(|r| r.epoch == route.epoch) else {
        // None, or an older epoch: the route is new to this router.
        return Plan::Push(route.clone());
    };
    let endpoints = |e: &[SocketAddr]| e.iter().copied().collect::<BTreeSet<_>>();
    let same_endpoints = endpoints(&current.endpoints) == endpoints(&route.endpoints);
    let same_contract = current.stream_contract == route.stream_contract;
    let same_models = current.models == route.models;
    // How requests are classed holds all the time, not only in the window: kept current.
    let same_classes = current.admission.priority_header == route.admission.priority_header
        && current.admission.shed_priorities == route.admission.shed_priorities;
    if same_endpoints && same_contract && same_models && same_classes {
        return Plan::InPlace;
    }
    let mut refreshed = route.clone();
    // The budgets the router holds stay: a router started its window with them.
    refreshed.admission = AdmissionSettings {
        priority_header: route.admission.priority_header.clone(),
        shed_priorities: route.admission.shed_priorities.clone(),
        ..current.admission.clone()
    };
    Plan::Push(refreshed)
}

/// How keeping the route on one router went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterSync {
    /// It held the route; nothing was sent.
    InPlace,
    /// It lacked the route and took it; `had` is what it held before.
    Pushed { had: String },
    /// It has seen a higher epoch, or another pool at ours; nothing was pushed.
    Ahead {
        epoch: Option<Epoch>,
        pool: Option<String>,
    },
    /// Its answer to the question or the push.
    Failed(RouterAnswer),
}

/// When a Warning about a router is told: at once the first time the router shows a reason, then
/// again only once a quiet time has passed, which doubles from 30 s to at most 10 minutes while
/// the router keeps showing that reason. Once the router agrees with us again, whatever it shows
/// next is told at once.
///
/// Repeats are held back the way client-go's event correlator holds them back: a router that stays
/// ahead of the Lease is looked at every couple of seconds, and one Event each time would bury the
/// policy's other Events and spend the API server's writes on what was already said.
#[derive(Clone, Debug, Default)]
pub struct WarningBackoff {
    told: HashMap<(RouterAdminUrl, &'static str), Told>,
}

/// When a Warning was last told, and how long it is not told again.
#[derive(Clone, Copy, Debug)]
struct Told {
    until: Instant,
    quiet: Duration,
}

impl WarningBackoff {
    /// Whether a Warning with `reason` about `router` is to be told at `now`; when it is, it is
    /// taken as told.
    pub fn due(&mut self, router: &RouterAdminUrl, reason: &'static str, now: Instant) -> bool {
        let key = (router.clone(), reason);
        let quiet = match self.told.get(&key) {
            None => WARNING_FIRST_QUIET,
            Some(told) if now < told.until => return false,
            Some(told) => told.quiet.saturating_mul(2).min(WARNING_LONGEST_QUIET),
        };
        self.told.insert(
            key,
            Told {
                until: now + quiet,
                quiet,
            },
        );
        true
    }

    /// `router` holds our route again: whatever it shows next is news.
    pub fn agrees(&mut self, router: &RouterAdminUrl) {
        self.told.retain(|(told, _), _| told != router);
    }
}

/// What the routers' answers mean: a stale view when any is ahead, and a Warning for each router
/// ahead of us or refusing us that `warnings` says is due at `now`. A router that holds the route
/// is news again the next time it differs; one that cannot be reached is left for the next
/// reconcile, and its back-off as it was.
#[must_use]
pub fn judge_sync(
    route: &Route,
    kept: &[(&RouterAdminUrl, RouterSync)],
    warnings: &mut WarningBackoff,
    now: Instant,
) -> RouteSyncReport {
    let (pool, epoch) = (&route.pool, route.epoch);
    let mut report = RouteSyncReport::default();
    for (router, sync) in kept {
        let ahead = |theirs: Option<Epoch>, held: Option<&str>| {
            (
                "RouterAhead",
                format!(
                    "router {router} has seen epoch {} (pool {}); ours is {epoch} for {pool}; nothing was \
                     pushed to it, and the Lease is read again",
                    theirs.map_or_else(|| "?".to_owned(), |e| e.to_string()),
                    held.unwrap_or("?"),
                ),
            )
        };
        let warning = match sync {
            RouterSync::InPlace | RouterSync::Pushed { .. } => {
                warnings.agrees(router);
                continue;
            }
            RouterSync::Failed(RouterAnswer::Unavailable { .. } | RouterAnswer::Taken) => continue,
            RouterSync::Ahead {
                epoch: theirs,
                pool: held,
            } => {
                report.view_stale = true;
                ahead(*theirs, held.as_deref())
            }
            RouterSync::Failed(RouterAnswer::Stale { highest, pool: held }) => {
                report.view_stale = true;
                ahead(highest.map(Epoch), held.as_deref())
            }
            RouterSync::Failed(RouterAnswer::Unauthorized) => (
                "RouteRejected",
                format!(
                    "router {router} refused the admin token (401); check --router-token-file; it is not \
                     kept on {pool} at epoch {epoch}"
                ),
            ),
            RouterSync::Failed(RouterAnswer::Rejected { status, message }) => (
                "RouteRejected",
                format!(
                    "router {router} answered {status}: {message}; it is not kept on {pool} at epoch {epoch}"
                ),
            ),
        };
        if warnings.due(router, warning.0, now) {
            report.warnings.push(warning);
        }
    }
    report
}

/// `report` on `answers` as the back-off lets it be told: a refusal is told when the Warning about
/// any router it names is due at `now` (see [`WarningBackoff`]), and is otherwise left as
/// [`StepReport::NotYet`], which the promotion waits at just as it waits at a refusal, without the
/// Event. A router that took the route is news again the next time it refuses.
#[must_use]
pub fn hold_back(
    report: StepReport,
    answers: &[(&RouterAdminUrl, RouterAnswer)],
    warnings: &mut WarningBackoff,
    now: Instant,
) -> StepReport {
    let refused = match &report {
        StepReport::Refused { reason, .. } => Some(*reason),
        _ => None,
    };
    let mut due = false;
    for (router, answer) in answers {
        // As `judge` names them.
        let shows = match answer {
            RouterAnswer::Taken => {
                warnings.agrees(router);
                continue;
            }
            RouterAnswer::Unavailable { .. } => continue,
            RouterAnswer::Stale { .. } => "RouteStale",
            RouterAnswer::Unauthorized | RouterAnswer::Rejected { .. } => "RouteRejected",
        };
        // A router the refusal does not name (one that rejects while another is ahead) keeps its
        // back-off as it was. Every named router is asked, so each one's back-off moves on.
        if refused == Some(shows) {
            due |= warnings.due(router, shows, now);
        }
    }
    match report {
        StepReport::Refused { note, .. } if !due => StepReport::NotYet {
            reason: format!("{note} (told in a Warning already, not again yet)"),
        },
        report => report,
    }
}

/// What keeps a router from holding a route, worst first: a router ahead of us refuses the
/// promotion itself, one that will not take this route needs a person, one that did not answer is
/// tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Trouble {
    Stale,
    Rejected,
    Unavailable,
}

/// `router`'s answer to `route` as a trouble and the line that tells it; `None` when it took it.
fn trouble(router: &RouterAdminUrl, answer: &RouterAnswer, route: &Route) -> Option<(Trouble, String)> {
    let (pool, epoch) = (&route.pool, route.epoch);
    Some(match answer {
        RouterAnswer::Taken => return None,
        RouterAnswer::Stale { highest, pool: held } => (
            Trouble::Stale,
            format!(
                "router {router} has seen epoch {} (pool {}); ours is {epoch} for {pool}",
                highest.map_or_else(|| "?".to_owned(), |h| h.to_string()),
                held.as_deref().unwrap_or("?"),
            ),
        ),
        RouterAnswer::Unauthorized => (
            Trouble::Rejected,
            format!("router {router} refused the admin token (401); check --router-token-file"),
        ),
        RouterAnswer::Rejected { status, message } => (
            Trouble::Rejected,
            format!("router {router} answered {status}: {message}"),
        ),
        RouterAnswer::Unavailable { why } => (Trouble::Unavailable, format!("router {router}: {why}")),
    })
}

/// What the routers' answers to `route` mean for `step`: done when every router took it, or, once
/// the promotion is `overdue`, when one did and none has seen a newer epoch (the others are
/// brought in line between promotions).
#[must_use]
pub fn judge(
    step: Step,
    route: &Route,
    answers: &[(&RouterAdminUrl, RouterAnswer)],
    overdue: Option<Duration>,
) -> StepReport {
    let (pool, epoch) = (&route.pool, route.epoch);
    let troubles: Vec<(Trouble, String)> = answers
        .iter()
        .filter_map(|(router, answer)| trouble(router, answer, route))
        .collect();
    let took = answers.len() - troubles.len();
    let worst = troubles.iter().map(|(kind, _)| *kind).min();
    if let Some(deadline) = overdue
        && took > 0
        && worst.is_some()
        && worst != Some(Trouble::Stale)
    {
        let lines: Vec<&str> = troubles.iter().map(|(_, line)| line.as_str()).collect();
        return StepReport::Done {
            carried_by: CARRIED_BY,
            note: Some(format!(
                "past the promotion's deadline of {deadline:?}, it goes on with {took} of {} router(s) \
                 holding {pool} at epoch {epoch}, {} endpoint(s); the rest get the route between \
                 promotions: {}",
                answers.len(),
                route.endpoints.len(),
                lines.join("; ")
            )),
        };
    }
    // The worst trouble speaks for the step, with a line for each router that has it.
    if let Some(worst) = worst {
        let lines: Vec<&str> = troubles
            .iter()
            .filter(|(kind, _)| *kind == worst)
            .map(|(_, line)| line.as_str())
            .collect();
        let lines = lines.join("; ");
        return match worst {
            Trouble::Stale => StepReport::Refused {
                carried_by: CARRIED_BY,
                reason: "RouteStale",
                note: format!(
                    "the route was refused as stale: {lines}; the Lease is read again before anything else is done"
                ),
            },
            Trouble::Rejected => StepReport::Refused {
                carried_by: CARRIED_BY,
                reason: "RouteRejected",
                note: format!("the route to {pool} at epoch {epoch} was not taken: {lines}"),
            },
            Trouble::Unavailable => StepReport::NotYet {
                reason: format!("the route to {pool} at epoch {epoch} is not on every router yet: {lines}"),
            },
        };
    }
    let routers = answers.len();
    let note = match step {
        Step::OpenAdmission => {
            let a = &route.admission;
            format!(
                "the route at epoch {epoch} carried the admission settings and all {routers} router(s) \
                 hold it, so their window is open: {}s, {} to {} concurrent requests, {} to {} prompt \
                 tokens",
                a.window_s,
                a.initial_concurrency,
                a.max_concurrency,
                a.initial_prefill_tokens,
                a.max_prefill_tokens
            )
        }
        _ => format!(
            "pushed to all {routers} router(s): {pool} at epoch {epoch}, {} endpoint(s)",
            route.endpoints.len()
        ),
    };
    StepReport::Done {
        carried_by: CARRIED_BY,
        note: Some(note),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::atomic::Ordering;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;
    use understudy_api::route::HeldEpoch;
    use understudy_prober::probe::Endpoint;

    use super::*;
    use crate::crd::FailoverPolicy;
    use crate::replicas::FixedReplicas;

    const TOKEN: &str = "s3cret";

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn policy() -> FailoverPolicy {
        serde_yaml::from_str(
            r"
apiVersion: understudy.dev/v1alpha1
kind: FailoverPolicy
metadata: {name: chat, namespace: serving}
spec:
  pools:
    - {name: east, workload: {kind: Deployment, name: chat-east}, replicas: 2}
    - {name: west, workload: {kind: Deployment, name: chat-west}, replicas: 2}
  recoveryObjective: 1m
  admission: {window: 90s, initialConcurrency: 3, maxConcurrency: 40}
  stream: {contract: continuation}
",
        )
        .unwrap()
    }

    /// A request as a test router received it.
    #[derive(Debug)]
    struct Received {
        head: String,
        body: serde_json::Value,
    }

    impl Received {
        fn header(&self, name: &str) -> Option<&str> {
            self.head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name).then_some(v.trim())
            })
        }
    }

    /// A router that answers every request with `status` and `body`, and hands over what it got.
    async fn router(status: u16, body: &'static str) -> (RouterAdminUrl, mpsc::UnboundedReceiver<Received>) {
        router_answering(move |_| (status, body)).await
    }

    /// A router that answers `GET /route` with 200 and `held`, and takes every `PUT`.
    async fn router_holding(held: &'static str) -> (RouterAdminUrl, mpsc::UnboundedReceiver<Received>) {
        router_answering(move |head| {
            if head.starts_with("GET ") {
                (200, held)
            } else {
                (200, r#"{"applied":"new_epoch"}"#)
            }
        })
        .await
    }

    /// A router that answers each request as `answer` says from its head, and hands over what it
    /// got before it answers, so that a test that has the answer finds the request already handed.
    async fn router_answering(
        answer: impl Fn(&str) -> (u16, &'static str) + Send + 'static,
    ) -> (RouterAdminUrl, mpsc::UnboundedReceiver<Received>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut raw = Vec::new();
                let mut buf = [0u8; 4096];
                let (head, request_body) = loop {
                    let n = stream.read(&mut buf).await.unwrap();
                    assert!(n > 0, "closed before a whole request");
                    raw.extend_from_slice(&buf[..n]);
                    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    if raw.len() >= end + 4 + length {
                        break (head, raw[end + 4..end + 4 + length].to_vec());
                    }
                };
                let (status, body) = answer(&head);
                let _ = tx.send(Received {
                    head,
                    body: serde_json::from_slice(&request_body).unwrap_or_default(),
                });
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                stream.write_all(answer.as_bytes()).await.unwrap();
            }
        });
        (url, rx)
    }

    /// An address where nothing listens.
    async fn nobody() -> RouterAdminUrl {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(listener);
        url
    }

    fn push_to(routers: Vec<RouterAdminUrl>) -> RouterPush {
        let replicas = FixedReplicas::default().with_pool(
            "west",
            vec![Endpoint::new("10.0.0.1", 8000), Endpoint::new("10.0.0.2", 8000)],
        );
        RouterPush::new(
            Routers::At(routers),
            RouterToken::new(TOKEN).unwrap(),
            Arc::new(replicas),
        )
    }

    async fn carry_out(push: &RouterPush, step: Step, epoch: u64) -> StepReport {
        let policy = policy();
        let request = StepRequest {
            policy: &policy,
            step,
            pool: &policy.spec.pools[1],
            epoch: Epoch(epoch),
            serving: None,
            overdue: None,
        };
        push.carry_out(request).await
    }

    #[tokio::test]
    async fn a_route_taken_by_every_router_is_done_and_carries_pool_endpoints_epoch_and_admission() {
        let (one, mut got_one) = router(200, r#"{"applied":"new_epoch","epoch":3,"pool":"west"}"#).await;
        let (two, mut got_two) = router(200, r#"{"applied":"same_epoch","epoch":3,"pool":"west"}"#).await;
        let report = carry_out(&push_to(vec![one, two]), Step::Route, 3).await;
        let StepReport::Done { carried_by, note } = report else {
            panic!("not done: {report:?}");
        };
        assert_eq!(carried_by, "router");
        assert!(note.unwrap().contains("all 2 router(s)"));
        for got in [&mut got_one, &mut got_two] {
            let got = got.recv().await.unwrap();
            assert!(got.head.starts_with("PUT /route HTTP/1.1"), "{}", got.head);
            assert_eq!(got.header("authorization"), Some("Bearer s3cret"));
            assert_eq!(got.header("content-type"), Some("application/json"));
            let body = &got.body;
            assert_eq!(body["pool"], "west");
            assert_eq!(body["epoch"], 3);
            assert_eq!(
                body["endpoints"],
                serde_json::json!(["10.0.0.1:8000", "10.0.0.2:8000"])
            );
            assert_eq!(body["stream_contract"], "continuation");
            // Per replica in the policy, for the whole route at the router.
            assert_eq!(body["admission"]["window_s"], 90.0);
            assert_eq!(body["admission"]["initial_concurrency"], 6);
            assert_eq!(body["admission"]["max_concurrency"], 80);
        }
    }

    #[tokio::test]
    async fn a_route_holds_only_the_replicas_that_passed_and_grows_as_the_rest_pass() {
        let policy = policy();
        fn west<'a>(policy: &'a FailoverPolicy, serving: Option<&'a BTreeSet<String>>) -> StepRequest<'a> {
            StepRequest {
                policy,
                step: Step::Route,
                pool: &policy.spec.pools[1],
                epoch: Epoch(3),
                serving,
                overdue: None,
            }
        }
        // Neither replica has answered yet: nothing to route to, and nothing is pushed.
        let (router, mut got) = router(200, r#"{"applied":"new_epoch","epoch":3,"pool":"west"}"#).await;
        let push = push_to(vec![router]);
        let none = BTreeSet::new();
        let report = push.carry_out(west(&policy, Some(&none))).await;
        let StepReport::NotYet { reason } = report else {
            panic!("{report:?}")
        };
        assert_eq!(
            reason,
            "none of the 2 running replica(s) of west has answered a generating probe yet"
        );
        assert!(requests(&mut got).await.is_empty());
        // One has: the route moves with it alone.
        let first = BTreeSet::from(["10.0.0.1:8000".to_owned()]);
        let report = push.carry_out(west(&policy, Some(&first))).await;
        assert!(matches!(report, StepReport::Done { .. }), "{report:?}");
        let body = &got.recv().await.unwrap().body;
        assert_eq!(body["endpoints"], serde_json::json!(["10.0.0.1:8000"]));
        assert_eq!(
            body["admission"]["initial_concurrency"], 3,
            "budgets for one replica"
        );

        // Between promotions, the second passes: the route is pushed again with both.
        let held = r#"{"route": {"pool": "west", "endpoints": ["10.0.0.1:8000"], "epoch": 3,
            "admission": {"window_s": 90.0, "initial_concurrency": 3, "max_concurrency": 40},
            "stream_contract": "continuation"}, "highest": {"epoch": 3, "pool": "west"}}"#;
        let (router, mut got) = router_holding(held).await;
        let push = push_to(vec![router]);
        let keep = |serving| {
            let request = RouteSyncRequest {
                policy: &policy,
                pool: &policy.spec.pools[1],
                epoch: Epoch(3),
                serving,
            };
            push.keep_route(request)
        };
        assert_eq!(keep(Some(&first)).await, RouteSyncReport::default());
        assert_eq!(
            lines(&requests(&mut got).await),
            ["GET /route?policy=serving%2Fchat HTTP/1.1"]
        );
        let both = BTreeSet::from(["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()]);
        assert_eq!(keep(Some(&both)).await, RouteSyncReport::default());
        let requests = requests(&mut got).await;
        assert_eq!(lines(&requests)[1], "PUT /route HTTP/1.1");
        assert_eq!(
            requests[1].body["endpoints"],
            serde_json::json!(["10.0.0.1:8000", "10.0.0.2:8000"])
        );
    }

    #[test]
    fn a_kept_route_keeps_what_a_router_holds_of_it_while_those_replicas_run() {
        let a: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:8000".parse().unwrap();
        let c: SocketAddr = "10.0.0.3:8000".parse().unwrap();
        let ours = west_at(3);
        let mut route = ours.clone();
        route.endpoints = vec![a];
        let holding = |endpoints: Vec<SocketAddr>, epoch: u64| RouterHolds {
            route: Some(Route {
                endpoints,
                epoch: Epoch(epoch),
                ..ours.clone()
            }),
            highest: None,
        };
        // b missed this round (or a restarted operator has not seen it pass): it stays; c's pod
        // is gone: it goes.
        let kept = keeping_held(&route, &holding(vec![b, c], 3), &[a, b]);
        assert_eq!(kept.endpoints, [a, b]);
        // What a router holds at another epoch says nothing of this route.
        let kept = keeping_held(&route, &holding(vec![b], 2), &[a, b]);
        assert_eq!(kept.endpoints, [a]);
    }

    #[tokio::test]
    async fn open_admission_pushes_the_same_route_and_says_the_window_came_with_it() {
        let (one, mut got) = router(200, r#"{"applied":"same_epoch","epoch":3,"pool":"west"}"#).await;
        let report = carry_out(&push_to(vec![one]), Step::OpenAdmission, 3).await;
        let StepReport::Done { note: Some(note), .. } = report else {
            panic!("not done with a note: {report:?}");
        };
        assert!(note.contains("carried the admission settings"), "{note}");
        assert!(note.contains("90s, 6 to 80 concurrent requests"), "{note}");
        assert_eq!(got.recv().await.unwrap().body["epoch"], 3);
    }

    #[tokio::test]
    async fn a_router_at_a_higher_epoch_refuses_the_route_as_stale_naming_both_epochs() {
        let (taken, _) = router(200, r#"{"applied":"new_epoch"}"#).await;
        let (stale, _) = router(
            409,
            r#"{"error":"stale epoch","epoch":3,"highest_epoch":5,"pool":"east"}"#,
        )
        .await;
        let shown = stale.to_string();
        let report = carry_out(&push_to(vec![taken, stale]), Step::Route, 3).await;
        let StepReport::Refused {
            carried_by,
            reason,
            note,
        } = report
        else {
            panic!("not refused: {report:?}");
        };
        assert_eq!((carried_by, reason), ("router", "RouteStale"));
        assert!(note.contains(&shown), "{note}");
        assert!(note.contains("epoch 5 (pool east); ours is 3 for west"), "{note}");
    }

    #[tokio::test]
    async fn a_wrong_token_is_refused_with_a_hint_at_the_token_file() {
        let (router, _) = router(401, r#"{"error":"a valid bearer token is required"}"#).await;
        let report = carry_out(&push_to(vec![router]), Step::Route, 1).await;
        let StepReport::Refused { reason, note, .. } = report else {
            panic!("not refused: {report:?}");
        };
        assert_eq!(reason, "RouteRejected");
        assert!(
            note.contains("401") && note.contains("--router-token-file"),
            "{note}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_or_failing_router_leaves_the_step_to_be_tried_again() {
        let (failing, _) = router(500, r#"{"error":"could not persist the epoch"}"#).await;
        let report = carry_out(&push_to(vec![nobody().await, failing]), Step::Route, 1).await;
        let StepReport::NotYet { reason } = report else {
            panic!("not left for later: {report:?}");
        };
        assert!(reason.contains("cannot connect"), "{reason}");
        assert!(
            reason.contains("answered 500: could not persist the epoch"),
            "{reason}"
        );
    }

    #[tokio::test]
    async fn past_the_deadline_a_route_one_router_took_is_done_and_a_stale_one_still_is_not() {
        let policy = policy();
        let request = |step| StepRequest {
            policy: &policy,
            step,
            pool: &policy.spec.pools[1],
            epoch: Epoch(3),
            serving: None,
            overdue: Some(secs(255)),
        };
        let (took, _) = router(200, r#"{"applied":"new_epoch","epoch":3,"pool":"west"}"#).await;
        let down = nobody().await;
        let push = push_to(vec![took.clone(), down.clone()]);
        let report = push.carry_out(request(Step::Route)).await;
        let StepReport::Done { note: Some(note), .. } = report else {
            panic!("{report:?}")
        };
        assert!(
            note.starts_with(
                "past the promotion's deadline of 255s, it goes on with 1 of 2 router(s) holding west at \
                 epoch 3, 2 endpoint(s); the rest get the route between promotions: router"
            ),
            "{note}"
        );
        // Nobody took it: nothing to go on with.
        let report = push_to(vec![down.clone()]).carry_out(request(Step::Route)).await;
        assert!(matches!(report, StepReport::NotYet { .. }), "{report:?}");
        // A router ahead of us means our view is stale, deadline or not.
        let (ahead, _) = router(409, r#"{"error":"stale","highest":4,"pool":"east"}"#).await;
        let report = push_to(vec![took, ahead])
            .carry_out(request(Step::OpenAdmission))
            .await;
        assert!(
            matches!(
                report,
                StepReport::Refused {
                    reason: "RouteStale",
                    ..
                }
            ),
            "{report:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_router_that_never_answers_is_given_up_on_after_the_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: RouterAdminUrl = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        // Accepts the connection and says nothing.
        let _held = tokio::spawn(async move {
            let kept = listener.accept().await;
            std::future::pending::<()>().await;
            drop(kept);
        });
        let push = push_to(vec![url]).with_timeout(Duration::from_secs(3));
        let report = carry_out(&push, Step::Route, 1).await;
        let StepReport::NotYet { reason } = report else {
            panic!("not left for later: {report:?}");
        };
        assert!(reason.contains("no answer within 3s"), "{reason}");
    }

    #[tokio::test]
    async fn a_pool_with_no_running_replica_is_not_routed_to() {
        let (router, mut got) = router(200, "{}").await;
        let push = RouterPush::new(
            Routers::At(vec![router]),
            RouterToken::new(TOKEN).unwrap(),
            Arc::new(FixedReplicas::default()),
        );
        let report = carry_out(&push, Step::Route, 1).await;
        assert!(matches!(report, StepReport::NotYet { .. }), "{report:?}");
        assert!(got.try_recv().is_err(), "a route with no endpoints was pushed");
    }

    #[tokio::test]
    async fn steps_that_are_not_the_routers_are_still_handed_off() {
        let report = carry_out(&push_to(vec![nobody().await]), Step::FenceOld, 1).await;
        assert!(
            matches!(
                report,
                StepReport::HandedOff {
                    carried_by: "fence-sidecar",
                    ..
                }
            ),
            "{report:?}"
        );
    }

    /// Keeps west at `epoch` on `push`'s routers, as a reconcile between promotions would.
    async fn keep(push: &RouterPush, epoch: u64) -> RouteSyncReport {
        let policy = policy();
        let request = RouteSyncRequest {
            policy: &policy,
            pool: &policy.spec.pools[1],
            epoch: Epoch(epoch),
            serving: None,
        };
        push.keep_route(request).await
    }

    /// West as a router holding it would answer `GET /route`: the endpoints in another order, and
    /// admission settings of its own that a refresh must carry back.
    const HOLDS_WEST_AT_3: &str = r#"{
        "route": {"pool": "west", "endpoints": ["10.0.0.2:8000", "10.0.0.1:8000"], "epoch": 3,
                  "admission": {"window_s": 90.0, "initial_concurrency": 5, "max_concurrency": 77,
                                "initial_prefill_tokens": 100, "max_prefill_tokens": 1000, "ttft_buffer": 0.25},
                  "stream_contract": "continuation"},
        "highest": {"epoch": 3, "pool": "west"}
    }"#;

    /// The requests a router got, by their first line.
    async fn requests(got: &mut mpsc::UnboundedReceiver<Received>) -> Vec<Received> {
        let mut all = Vec::new();
        while let Ok(one) = got.try_recv() {
            all.push(one);
        }
        all
    }

    fn lines(requests: &[Received]) -> Vec<&str> {
        requests
            .iter()
            .map(|r| r.head.lines().next().unwrap_or_default())
            .collect()
    }

    #[tokio::test]
    async fn a_router_with_no_route_is_asked_and_then_sent_the_route() {
        let (router, mut got) = router_holding(r#"{"route": null, "highest": null}"#).await;
        let report = keep(&push_to(vec![router]), 0).await;
        assert_eq!(report, RouteSyncReport::default());
        let requests = requests(&mut got).await;
        assert_eq!(
            lines(&requests),
            ["GET /route?policy=serving%2Fchat HTTP/1.1", "PUT /route HTTP/1.1"]
        );
        assert_eq!(requests[0].header("authorization"), Some("Bearer s3cret"));
        let body = &requests[1].body;
        assert_eq!((&body["pool"], &body["epoch"]), (&"west".into(), &0.into()));
        assert_eq!(
            body["endpoints"],
            serde_json::json!(["10.0.0.1:8000", "10.0.0.2:8000"])
        );
        assert_eq!(body["admission"]["initial_concurrency"], 6);
    }

    #[tokio::test]
    async fn a_router_that_holds_the_route_is_sent_nothing() {
        let (router, mut got) = router_holding(HOLDS_WEST_AT_3).await;
        let report = keep(&push_to(vec![router]), 3).await;
        assert_eq!(report, RouteSyncReport::default());
        assert_eq!(
            lines(&requests(&mut got).await),
            ["GET /route?policy=serving%2Fchat HTTP/1.1"]
        );
    }

    #[tokio::test]
    async fn a_router_at_a_lower_epoch_is_sent_the_route_with_the_policys_admission() {
        let (router, mut got) = router_holding(HOLDS_WEST_AT_3).await;
        let report = keep(&push_to(vec![router]), 4).await;
        assert_eq!(report, RouteSyncReport::default());
        let requests = requests(&mut got).await;
        assert_eq!(
            lines(&requests),
            ["GET /route?policy=serving%2Fchat HTTP/1.1", "PUT /route HTTP/1.1"]
        );
        assert_eq!(requests[1].body["epoch"], 4);
        // A new epoch opens a new window, with the policy's settings.
        assert_eq!(requests[1].body["admission"]["initial_concurrency"], 6);
    }

    #[tokio::test]
    async fn other_endpoints_at_the_same_epoch_are_pushed_with_the_admission_the_router_holds() {
        let (router, mut got) = router_holding(HOLDS_WEST_AT_3).await;
        let replicas = FixedReplicas::default().with_pool(
            "west",
            vec![Endpoint::new("10.0.0.1", 8000), Endpoint::new("10.0.0.3", 8000)],
        );
        let push = RouterPush::new(
            Routers::At(vec![router]),
            RouterToken::new(TOKEN).unwrap(),
            Arc::new(replicas),
        );
        assert_eq!(keep(&push, 3).await, RouteSyncReport::default());
        let requests = requests(&mut got).await;
        assert_eq!(
            lines(&requests),
            ["GET /route?policy=serving%2Fchat HTTP/1.1", "PUT /route HTTP/1.1"]
        );
        let body = &requests[1].body;
        assert_eq!(
            body["endpoints"],
            serde_json::json!(["10.0.0.1:8000", "10.0.0.3:8000"])
        );
        // The router's own settings: other ones would restart its admission window.
        assert_eq!(body["admission"]["initial_concurrency"], 5);
        assert_eq!(body["admission"]["max_concurrency"], 77);
    }

    #[tokio::test]
    async fn a_router_at_a_higher_epoch_is_sent_nothing_and_said_to_be_ahead() {
        let (router, mut got) = router_holding(HOLDS_WEST_AT_3).await;
        let shown = router.to_string();
        let report = keep(&push_to(vec![router]), 2).await;
        assert!(report.view_stale);
        let [(reason, note)] = &report.warnings[..] else {
            panic!("not one warning: {report:?}");
        };
        assert_eq!(*reason, "RouterAhead");
        assert!(note.contains(&shown), "{note}");
        assert!(note.contains("epoch 3 (pool west); ours is 2 for west"), "{note}");
        assert_eq!(
            lines(&requests(&mut got).await),
            ["GET /route?policy=serving%2Fchat HTTP/1.1"]
        );
    }

    #[tokio::test]
    async fn a_router_that_is_down_does_not_keep_the_route_from_the_others_and_is_not_warned_of() {
        let (up, mut got) = router_holding(r#"{"route": null, "highest": null}"#).await;
        let report = keep(&push_to(vec![nobody().await, up]), 1).await;
        assert_eq!(report, RouteSyncReport::default());
        let requests = requests(&mut got).await;
        assert_eq!(
            lines(&requests),
            ["GET /route?policy=serving%2Fchat HTTP/1.1", "PUT /route HTTP/1.1"]
        );
        assert_eq!(requests[1].body["epoch"], 1);
    }

    #[tokio::test]
    async fn a_router_that_refuses_the_token_is_warned_of_and_the_others_still_get_the_route() {
        let (refusing, _) = router(401, r#"{"error":"a valid bearer token is required"}"#).await;
        let (up, mut got) = router_holding(r#"{"route": null, "highest": null}"#).await;
        let report = keep(&push_to(vec![refusing, up]), 1).await;
        assert!(!report.view_stale);
        let [(reason, note)] = &report.warnings[..] else {
            panic!("not one warning: {report:?}");
        };
        assert_eq!(*reason, "RouteRejected");
        assert!(note.contains("--router-token-file"), "{note}");
        assert_eq!(requests(&mut got).await.len(), 2);
    }

    fn west_at(epoch: u64) -> Route {
        let endpoints = vec![SocketAddr::from(([10, 0, 0, 1], 8000))];
        Route::for_pool(
            "serving/chat",
            &policy().spec,
            "west",
            Vec::new(),
            endpoints,
            Epoch(epoch),
        )
    }

    fn admin(name: &str) -> RouterAdminUrl {
        format!("http://{name}:9091").parse().unwrap()
    }

    fn ahead_at_3() -> RouterSync {
        RouterSync::Ahead {
            epoch: Some(Epoch(3)),
            pool: Some("west".into()),
        }
    }

    /// The reasons of the Warnings `judge_sync` tells for `kept` at `at`, and whether it still
    /// calls the view stale.
    fn told(
        kept: &[(&RouterAdminUrl, RouterSync)],
        warnings: &mut WarningBackoff,
        at: Instant,
    ) -> (Vec<&'static str>, bool) {
        let report = judge_sync(&west_at(2), kept, warnings, at);
        let reasons = report.warnings.iter().map(|(reason, _)| *reason).collect();
        (reasons, report.view_stale)
    }

    #[test]
    fn a_router_that_stays_ahead_is_warned_of_at_once_then_after_a_quiet_time_that_doubles_to_ten_minutes() {
        let router = admin("r1");
        let mut warnings = WarningBackoff::default();
        let start = Instant::now();
        let mut told_at = Vec::new();
        // Forty minutes of reconciles two seconds apart, the router ahead at every one.
        for s in (0..2400).step_by(2) {
            let (reasons, view_stale) = told(&[(&router, ahead_at_3())], &mut warnings, start + secs(s));
            // Only the Event is held back: the Lease is read again soon every time.
            assert!(view_stale, "at {s}s");
            if !reasons.is_empty() {
                assert_eq!(reasons, ["RouterAhead"], "at {s}s");
                told_at.push(s);
            }
        }
        // Quiet for 30 s, 60 s, 2 min, 4 min, 8 min, then 10 min each time.
        assert_eq!(told_at, [0, 30, 90, 210, 450, 930, 1530, 2130]);
    }

    #[test]
    fn a_router_that_agrees_again_is_warned_of_at_once_when_it_is_ahead_again() {
        let router = admin("r1");
        let mut warnings = WarningBackoff::default();
        let start = Instant::now();
        let ahead = [(&router, ahead_at_3())];
        assert_eq!(told(&ahead, &mut warnings, start).0, ["RouterAhead"]);
        assert!(told(&ahead, &mut warnings, start + secs(2)).0.is_empty());
        let agrees = [(&router, RouterSync::InPlace)];
        assert_eq!(told(&agrees, &mut warnings, start + secs(4)), (vec![], false));
        assert_eq!(told(&ahead, &mut warnings, start + secs(6)).0, ["RouterAhead"]);
        // And the back-off starts again from its first quiet time.
        assert!(told(&ahead, &mut warnings, start + secs(35)).0.is_empty());
        assert_eq!(told(&ahead, &mut warnings, start + secs(36)).0, ["RouterAhead"]);
    }

    #[test]
    fn a_router_unreachable_for_a_while_is_not_news_when_it_is_ahead_again_but_another_reason_is() {
        let router = admin("r1");
        let mut warnings = WarningBackoff::default();
        let start = Instant::now();
        assert_eq!(
            told(&[(&router, ahead_at_3())], &mut warnings, start).0,
            ["RouterAhead"]
        );
        let down = RouterSync::Failed(RouterAnswer::Unavailable {
            why: "cannot connect".into(),
        });
        assert_eq!(
            told(&[(&router, down)], &mut warnings, start + secs(2)),
            (vec![], false)
        );
        assert!(
            told(&[(&router, ahead_at_3())], &mut warnings, start + secs(4))
                .0
                .is_empty()
        );
        let refusing = RouterSync::Failed(RouterAnswer::Unauthorized);
        assert_eq!(
            told(&[(&router, refusing)], &mut warnings, start + secs(6)).0,
            ["RouteRejected"]
        );
    }

    #[test]
    fn each_router_has_its_own_back_off() {
        let (one, two) = (admin("r1"), admin("r2"));
        let mut warnings = WarningBackoff::default();
        let start = Instant::now();
        assert_eq!(
            told(&[(&one, ahead_at_3())], &mut warnings, start).0,
            ["RouterAhead"]
        );
        let both = [(&one, ahead_at_3()), (&two, ahead_at_3())];
        let report = judge_sync(&west_at(2), &both, &mut warnings, start + secs(2));
        let [(_, note)] = &report.warnings[..] else {
            panic!("not one warning: {report:?}");
        };
        assert!(note.contains("router http://r2:9091"), "{note}");
    }

    /// The route step's answer from routers that all refuse it as stale, at `at`.
    fn refused_as_stale(
        routers: &[&RouterAdminUrl],
        warnings: &mut WarningBackoff,
        at: Instant,
    ) -> StepReport {
        let stale = RouterAnswer::Stale {
            highest: Some(3),
            pool: Some("east".into()),
        };
        let answers: Vec<_> = routers.iter().map(|r| (*r, stale.clone())).collect();
        let route = west_at(2);
        hold_back(judge(Step::Route, &route, &answers, None), &answers, warnings, at)
    }

    #[test]
    fn a_route_refused_again_within_the_back_off_waits_without_a_warning_until_it_is_due() {
        let router = admin("r1");
        let mut warnings = WarningBackoff::default();
        let start = Instant::now();
        let first = refused_as_stale(&[&router], &mut warnings, start);
        assert!(
            matches!(
                first,
                StepReport::Refused {
                    reason: "RouteStale",
                    ..
                }
            ),
            "{first:?}"
        );
        let again = refused_as_stale(&[&router], &mut warnings, start + secs(2));
        let StepReport::NotYet { reason } = again else {
            panic!("told again at once: {again:?}");
        };
        assert!(reason.contains("ours is 2 for west"), "{reason}");
        let due = refused_as_stale(&[&router], &mut warnings, start + secs(30));
        assert!(matches!(due, StepReport::Refused { .. }), "{due:?}");
        // A router new to the refusal is news, and the note names both.
        let other = admin("r2");
        let with_other = refused_as_stale(&[&router, &other], &mut warnings, start + secs(32));
        let StepReport::Refused { note, .. } = with_other else {
            panic!("a new router was not told: {with_other:?}");
        };
        assert!(note.contains("r1") && note.contains("r2"), "{note}");
    }

    #[test]
    fn a_router_that_took_the_route_is_warned_of_at_once_when_it_refuses_again() {
        let router = admin("r1");
        let mut warnings = WarningBackoff::default();
        let start = Instant::now();
        assert!(matches!(
            refused_as_stale(&[&router], &mut warnings, start),
            StepReport::Refused { .. }
        ));
        let taken = [(&router, RouterAnswer::Taken)];
        let route = west_at(2);
        let done = hold_back(
            judge(Step::Route, &route, &taken, None),
            &taken,
            &mut warnings,
            start + secs(2),
        );
        assert!(matches!(done, StepReport::Done { .. }), "{done:?}");
        let again = refused_as_stale(&[&router], &mut warnings, start + secs(4));
        assert!(matches!(again, StepReport::Refused { .. }), "{again:?}");
    }

    #[tokio::test]
    async fn a_router_kept_ahead_is_warned_of_once_and_again_at_once_after_it_held_our_route() {
        let holds_ours = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let restarted = holds_ours.clone();
        // Ahead of us at first; then restarted without its state, when it takes our route.
        let (router, _) = router_answering(move |head| {
            match (head.starts_with("GET "), restarted.load(Ordering::SeqCst)) {
                (true, false) => (200, HOLDS_WEST_AT_3),
                (true, true) => (200, r#"{"route": null, "highest": null}"#),
                (false, _) => (200, r#"{"applied":"new_epoch"}"#),
            }
        })
        .await;
        let push = push_to(vec![router]);
        let reasons = |report: &RouteSyncReport| report.warnings.iter().map(|w| w.0).collect::<Vec<_>>();

        let first = keep(&push, 2).await;
        assert_eq!((reasons(&first), first.view_stale), (vec!["RouterAhead"], true));
        let again = keep(&push, 2).await;
        assert_eq!((reasons(&again), again.view_stale), (vec![], true));

        holds_ours.store(true, Ordering::SeqCst);
        assert_eq!(keep(&push, 2).await, RouteSyncReport::default());
        holds_ours.store(false, Ordering::SeqCst);
        let ahead_again = keep(&push, 2).await;
        assert_eq!(reasons(&ahead_again), ["RouterAhead"]);
    }

    #[tokio::test]
    async fn a_stale_refusal_is_told_once_per_policy_and_the_promotion_waits_at_the_route_each_time() {
        let (stale, _) = router(
            409,
            r#"{"error":"stale epoch","epoch":3,"highest_epoch":5,"pool":"east"}"#,
        )
        .await;
        let push = push_to(vec![stale]);
        let first = carry_out(&push, Step::Route, 3).await;
        assert!(
            matches!(
                first,
                StepReport::Refused {
                    reason: "RouteStale",
                    ..
                }
            ),
            "{first:?}"
        );
        let again = carry_out(&push, Step::Route, 3).await;
        assert!(matches!(again, StepReport::NotYet { .. }), "{again:?}");
        // Another policy's Events are its own.
        let mut other = policy();
        other.metadata.name = Some("embed".into());
        let request = StepRequest {
            policy: &other,
            step: Step::Route,
            pool: &other.spec.pools[1],
            epoch: Epoch(3),
            serving: None,
            overdue: None,
        };
        let theirs = push.carry_out(request).await;
        assert!(matches!(theirs, StepReport::Refused { .. }), "{theirs:?}");
    }

    #[test]
    fn a_route_held_with_other_models_or_priority_classes_is_refreshed_keeping_the_routers_budgets() {
        let ours = Route {
            models: vec!["llama".to_owned()],
            ..west_at(3)
        };
        let mut held_route = ours.clone();
        held_route.admission.initial_concurrency = 99;
        let holds = |route: &Route| RouterHolds {
            route: Some(route.clone()),
            highest: None,
        };
        assert_eq!(
            plan(&holds(&held_route), &ours),
            Plan::InPlace,
            "only the budgets differ"
        );
        held_route.models = Vec::new();
        let Plan::Push(pushed) = plan(&holds(&held_route), &ours) else {
            panic!("other models were not refreshed");
        };
        assert_eq!(pushed.models, ["llama"]);
        assert_eq!(
            pushed.admission.initial_concurrency, 99,
            "the router's window keeps its budgets"
        );
        held_route.models = ours.models.clone();
        held_route.admission.shed_priorities = vec!["low".to_owned()];
        let Plan::Push(pushed) = plan(&holds(&held_route), &ours) else {
            panic!("other priority classes were not refreshed");
        };
        assert!(pushed.admission.shed_priorities.is_empty());
        assert_eq!(pushed.admission.initial_concurrency, 99);
    }

    #[test]
    fn a_router_restarted_with_its_epoch_but_no_route_is_sent_it_and_another_pool_at_ours_is_ahead() {
        let route = Route::for_pool(
            "serving/chat",
            &policy().spec,
            "west",
            Vec::new(),
            vec![SocketAddr::from(([10, 0, 0, 1], 8000))],
            Epoch(3),
        );
        let restarted = RouterHolds {
            route: None,
            highest: Some(HeldEpoch {
                policy: "serving/chat".into(),
                epoch: Epoch(3),
                pool: "west".into(),
            }),
        };
        assert_eq!(plan(&restarted, &route), Plan::Push(route.clone()));
        let other_pool = RouterHolds {
            route: None,
            highest: Some(HeldEpoch {
                policy: "serving/chat".into(),
                epoch: Epoch(3),
                pool: "east".into(),
            }),
        };
        assert_eq!(
            plan(&other_pool, &route),
            Plan::Ahead {
                epoch: Some(Epoch(3)),
                pool: Some("east".into())
            }
        );
    }
}

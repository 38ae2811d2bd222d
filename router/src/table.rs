//! The route table: the route of each policy the gateway serves now, each swapped whole when a
//! newer epoch of it arrives, and the fencing record, per policy, that decides whether an update
//! is newer. Policies behind one router set never touch each other: each has its own epoch, and a
//! request takes the route whose models name the model it asks for ([`RouteSet::for_model`]).
//! A route also says how its requests' priority is read (the policy's header, and the values shed
//! in its window).
//!
//! Readers on the hot path take the route set as one `Arc` clone from a `watch` channel (a read
//! lock held for that clone only, never contended but by a route update), and waiters in the
//! waiting room are woken by the same channel. What this module must never do: publish a route
//! before its epoch is on disk, publish anything for a stale update, or let one policy's update
//! change another's route or epoch.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::watch;
use tokio::time::Instant;
use understudy_api::route::{HeldEpoch, InvalidRoute, Route};

use crate::admission::{Admission, PRIORITY_HEADER, Priority};
use crate::endpoint::Endpoint;
use crate::highest_epoch::{DEFAULT_MAX_EPOCH_JUMP, StateFile, StateFileError, Verdict, judge};

/// One policy's route as served now, with its live endpoints and admission.
#[derive(Debug)]
pub struct Routed {
    /// The route as pushed.
    pub route: Route,
    /// One per route endpoint, same order.
    pub endpoints: Vec<Arc<Endpoint>>,
    /// Admission control since the route arrived.
    pub admission: Arc<Admission>,
    /// The header its requests' priority is read from.
    priority_header: HeaderName,
}

impl Routed {
    fn new(route: Route, endpoints: Vec<Arc<Endpoint>>, admission: Arc<Admission>) -> Self {
        // Validated with the route; the default only if that check and this one ever disagree.
        let priority_header = HeaderName::from_bytes(route.admission.priority_header.as_bytes())
            .unwrap_or(HeaderName::from_static(PRIORITY_HEADER));
        Routed {
            route,
            endpoints,
            admission,
            priority_header,
        }
    }

    /// A request's class by this route's priority header, and whether its value is one the
    /// route sheds while its admission window is open.
    #[must_use]
    pub fn priority_of(&self, headers: &HeaderMap) -> (Priority, bool) {
        let value = headers.get(&self.priority_header).map(HeaderValue::as_bytes);
        let listed = value.is_some_and(|v| {
            self.route
                .admission
                .shed_priorities
                .iter()
                .any(|p| p.as_bytes() == v)
        });
        (Priority::from_header(value), listed)
    }
}

/// Every route served now, one per policy, ordered by policy.
#[derive(Debug, Default)]
pub struct RouteSet {
    routes: Vec<Arc<Routed>>,
    /// Policies this router has taken a route for (its state file says so) that have none yet:
    /// after a restart, until the operator gives each its route again.
    awaited: usize,
}

impl RouteSet {
    /// Every route, ordered by policy.
    #[must_use]
    pub fn routes(&self) -> &[Arc<Routed>] {
        &self.routes
    }

    /// True before the first route.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// True when more than one policy is served, or awaited: requests are told apart by their
    /// model.
    #[must_use]
    pub fn several(&self) -> bool {
        self.routes.len() + self.awaited > 1
    }

    /// True while a policy this router served has no route again yet: a request no route takes
    /// may be that policy's, and waits for it.
    #[must_use]
    pub fn awaits_a_route(&self) -> bool {
        self.awaited > 0
    }

    /// `policy`'s route, if it has one.
    #[must_use]
    pub fn of_policy(&self, policy: &str) -> Option<&Arc<Routed>> {
        self.routes.iter().find(|r| r.route.policy == policy)
    }

    /// The route a request for `model` takes: the only one when one policy is served (vLLM
    /// answers a model it does not serve); otherwise the one whose models name it, else the one
    /// that names no model; `None` when none takes it.
    #[must_use]
    pub fn for_model(&self, model: Option<&str>) -> Option<&Arc<Routed>> {
        if let ([only], 0) = (self.routes.as_slice(), self.awaited) {
            return Some(only);
        }
        model
            .and_then(|m| self.routes.iter().find(|r| r.route.models.iter().any(|x| x == m)))
            .or_else(|| self.routes.iter().find(|r| r.route.models.is_empty()))
    }

    /// This set with `routed` in place of its policy's route, awaiting the policies of `known`
    /// that have none.
    fn with(&self, routed: Arc<Routed>, known: &BTreeMap<String, HeldEpoch>) -> RouteSet {
        let mut routes: Vec<Arc<Routed>> = self
            .routes
            .iter()
            .filter(|r| r.route.policy != routed.route.policy)
            .cloned()
            .collect();
        routes.push(routed);
        routes.sort_by(|a, b| a.route.policy.cmp(&b.route.policy));
        let awaited = known
            .keys()
            .filter(|policy| !routes.iter().any(|r| r.route.policy == **policy))
            .count();
        RouteSet { routes, awaited }
    }

    /// Another policy's route that takes a request `route` would take too: one naming a model it
    /// names, or, when it names none, one that names none either.
    fn overlap(&self, route: &Route) -> Option<RouteError> {
        for other in self.routes.iter().filter(|r| r.route.policy != route.policy) {
            if route.models.is_empty() && other.route.models.is_empty() {
                return Some(RouteError::Overlap {
                    policy: other.route.policy.clone(),
                    model: None,
                });
            }
            if let Some(model) = route.models.iter().find(|m| other.route.models.contains(m)) {
                return Some(RouteError::Overlap {
                    policy: other.route.policy.clone(),
                    model: Some(model.clone()),
                });
            }
        }
        None
    }
}

/// How an accepted update changed the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A new epoch: the route was swapped and admission starts over.
    NewEpoch,
    /// The same epoch and pool: endpoints and settings refreshed, admission carries on.
    SameEpoch,
}

/// Why an update was not taken.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The route itself is wrong.
    #[error("invalid route: {0}")]
    Invalid(#[from] InvalidRoute),
    /// Older than the highest epoch seen for its policy, or another pool at that epoch.
    #[error("stale route: epoch {highest} (pool {pool}) has been seen")]
    Stale {
        /// The highest epoch seen.
        highest: understudy_core::Epoch,
        /// The pool at it.
        pool: String,
    },
    /// Further above the highest epoch seen for its policy than the table allows without force.
    #[error(
        "epoch {epoch} is more than {limit} above the highest epoch seen ({}); a person can force it \
         with PUT /route?force=true",
        .highest.map_or_else(|| "none yet, so 0".to_owned(), |e| e.to_string())
    )]
    TooFar {
        /// The epoch refused.
        epoch: understudy_core::Epoch,
        /// The highest epoch seen, if any.
        highest: Option<understudy_core::Epoch>,
        /// How far above it an update may go.
        limit: u64,
    },
    /// Another policy's route takes the same requests: two policies behind one router set must
    /// serve different models, and at most one may take every model.
    #[error(
        "{}: policy {policy:?} routes it already; policies behind one router set must serve models of \
         their own",
        .model.as_ref().map_or_else(|| "a route that names no model takes every request".to_owned(), |m| format!("model {m:?} is taken")),
    )]
    Overlap {
        /// The other policy.
        policy: String,
        /// The model both name, or `None` when neither names one.
        model: Option<String>,
    },
    /// The epoch could not be made durable, so it was not taken.
    #[error(transparent)]
    Persist(#[from] StateFileError),
}

/// The route table.
#[derive(Debug)]
pub struct RouteTable {
    current: watch::Sender<Arc<RouteSet>>,
    fence: Mutex<FenceBook>,
}

#[derive(Debug)]
struct FenceBook {
    /// The highest epoch taken, by policy.
    highest: BTreeMap<String, HeldEpoch>,
    file: Option<StateFile>,
    max_jump: u64,
}

impl RouteTable {
    /// An empty table that remembers its highest epochs in `file` (if any), read back now.
    pub fn new(file: Option<StateFile>) -> Result<Self, StateFileError> {
        let highest = match &file {
            Some(f) => f.load()?,
            None => Vec::new(),
        };
        Ok(RouteTable {
            current: watch::Sender::new(Arc::new(RouteSet {
                routes: Vec::new(),
                awaited: highest.len(),
            })),
            fence: Mutex::new(FenceBook {
                highest: highest.into_iter().map(|h| (h.policy.clone(), h)).collect(),
                file,
                max_jump: DEFAULT_MAX_EPOCH_JUMP,
            }),
        })
    }

    /// Takes updates at most `jump` epochs above the highest seen without force.
    #[must_use]
    pub fn with_max_epoch_jump(self, jump: u64) -> Self {
        self.fence.lock().unwrap_or_else(PoisonError::into_inner).max_jump = jump;
        self
    }

    /// Every route now.
    #[must_use]
    pub fn routes(&self) -> Arc<RouteSet> {
        Arc::clone(&self.current.borrow())
    }

    /// The route a request for `model` takes now ([`RouteSet::for_model`]).
    #[must_use]
    pub fn current_for(&self, model: Option<&str>) -> Option<Arc<Routed>> {
        self.current.borrow().for_model(model).cloned()
    }

    /// A receiver that wakes when any route changes.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<Arc<RouteSet>> {
        self.current.subscribe()
    }

    /// The highest epoch seen for `policy`, and its pool.
    #[must_use]
    pub fn highest(&self, policy: &str) -> Option<HeldEpoch> {
        self.book().highest.get(policy).cloned()
    }

    /// The highest epoch seen for every policy.
    #[must_use]
    pub fn highest_of_all(&self) -> Vec<HeldEpoch> {
        self.book().highest.values().cloned().collect()
    }

    fn book(&self) -> std::sync::MutexGuard<'_, FenceBook> {
        self.fence.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes an update if its epoch allows it.
    pub fn update(&self, route: Route) -> Result<Applied, RouteError> {
        self.apply(route, false)
    }

    /// Takes an update however far above the highest seen its epoch is: a person's call, never
    /// the operator's.
    pub fn force_update(&self, route: Route) -> Result<Applied, RouteError> {
        self.apply(route, true)
    }

    fn apply(&self, route: Route, force: bool) -> Result<Applied, RouteError> {
        route.validate()?;
        // Held across the file write and the publication, so that two updates cannot interleave
        // their checks, and each publishes over the set the other published.
        let mut book = self.book();
        if let Some(overlap) = self.routes().overlap(&route) {
            return Err(overlap);
        }
        let limit = (!force).then_some(book.max_jump);
        match judge(book.held_for(&route.policy), route.epoch, &route.pool, limit) {
            Verdict::Stale { highest, pool } => Err(RouteError::Stale { highest, pool }),
            Verdict::TooFar { highest, limit } => Err(RouteError::TooFar {
                epoch: route.epoch,
                highest,
                limit,
            }),
            Verdict::Newer => {
                book.take(&route)?;
                let endpoints = route
                    .endpoints
                    .iter()
                    .map(|a| Arc::new(Endpoint::new(*a)))
                    .collect();
                let admission = Arc::new(Admission::new(route.admission.clone(), Instant::now()));
                self.publish(Routed::new(route, endpoints, admission), &book.highest);
                Ok(Applied::NewEpoch)
            }
            Verdict::SameEpoch => {
                if !book.highest.contains_key(&route.policy) {
                    // Judged against the unnamed record it takes over.
                    book.take(&route)?;
                }
                let set = self.routes();
                let old = set.of_policy(&route.policy);
                // Endpoints kept by the refresh keep their counters and ejections.
                let endpoints = route
                    .endpoints
                    .iter()
                    .map(|a| {
                        old.and_then(|o| o.endpoints.iter().find(|e| e.addr() == *a).cloned())
                            .unwrap_or_else(|| Arc::new(Endpoint::new(*a)))
                    })
                    .collect();
                // The window is the route's: new settings at the same epoch keep its start.
                let admission = match old {
                    Some(o) if o.route.admission == route.admission => Arc::clone(&o.admission),
                    Some(o) => Arc::new(Admission::new(route.admission.clone(), o.admission.start())),
                    None => Arc::new(Admission::new(route.admission.clone(), Instant::now())),
                };
                self.publish(Routed::new(route, endpoints, admission), &book.highest);
                Ok(Applied::SameEpoch)
            }
        }
    }

    /// Publishes `routed` in place of its policy's route. Called with the fence book held.
    fn publish(&self, routed: Routed, known: &BTreeMap<String, HeldEpoch>) {
        let next = self.routes().with(Arc::new(routed), known);
        self.current.send_replace(Arc::new(next));
    }
}

impl FenceBook {
    /// Records `route`'s epoch as its policy's highest, on disk first. The unnamed record a
    /// router of one policy kept, which [`Self::held_for`] judged it against, was this policy's:
    /// taken over, not kept beside it.
    fn take(&mut self, route: &Route) -> Result<(), StateFileError> {
        let record = HeldEpoch {
            policy: route.policy.clone(),
            epoch: route.epoch,
            pool: route.pool.clone(),
        };
        let adopts =
            self.held_for(&record.policy).is_some_and(|h| h.policy.is_empty()) && !record.policy.is_empty();
        if let Some(file) = &self.file {
            let others = self
                .highest
                .values()
                .filter(|h| h.policy != record.policy && !(adopts && h.policy.is_empty()));
            file.store(others.chain([&record]))?;
        }
        if adopts {
            self.highest.remove("");
        }
        self.highest.insert(record.policy.clone(), record);
        Ok(())
    }

    /// The highest epoch `policy` has taken; for a named policy that has none, the record of the
    /// unnamed one when that is the only record there is: the file a router of one policy wrote
    /// before routes named their policy, whose epoch a named route must not go below.
    fn held_for(&self, policy: &str) -> Option<&HeldEpoch> {
        self.highest.get(policy).or_else(|| match self.highest.len() {
            1 if !policy.is_empty() => self.highest.get(""),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use understudy_core::Epoch;

    fn route(pool: &str, epoch: u64, port: u16) -> Route {
        serde_json::from_value(serde_json::json!({
            "pool": pool, "endpoints": [format!("127.0.0.1:{port}")], "epoch": epoch
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn a_request_is_classed_by_the_routes_priority_header_and_its_shed_values() {
        let t = RouteTable::new(None).unwrap();
        let mut r = route("b", 1, 1);
        r.admission.priority_header = "x-tier".to_owned();
        r.admission.shed_priorities = vec!["low".to_owned(), "batch".to_owned()];
        t.update(r).unwrap();
        let routed = t.current_for(None).unwrap();
        let headers = |pairs: &[(&'static str, &'static str)]| {
            pairs
                .iter()
                .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
                .collect::<HeaderMap>()
        };
        assert_eq!(
            routed.priority_of(&headers(&[("x-tier", "interactive")])),
            (Priority::Interactive, false)
        );
        assert_eq!(
            routed.priority_of(&headers(&[("x-tier", "low")])),
            (Priority::Default, true)
        );
        assert_eq!(
            routed.priority_of(&headers(&[("x-tier", "batch")])),
            (Priority::Batch, true)
        );
        // The default header means nothing to a route that names another.
        assert_eq!(
            routed.priority_of(&headers(&[(PRIORITY_HEADER, "batch")])),
            (Priority::Default, false)
        );
    }

    fn of_policy(policy: &str, models: &[&str], pool: &str, epoch: u64, port: u16) -> Route {
        Route {
            policy: policy.to_owned(),
            models: models.iter().map(|m| (*m).to_owned()).collect(),
            ..route(pool, epoch, port)
        }
    }

    #[tokio::test]
    async fn two_policies_keep_their_own_epochs_and_requests_find_theirs_by_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fence.json");
        let t = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        t.update(of_policy("ns/chat", &["llama"], "east", 7, 1)).unwrap();
        // Another policy at a lower epoch is not stale: its epochs are its own.
        t.update(of_policy("ns/code", &["coder"], "west", 2, 2)).unwrap();
        let port = |model| t.current_for(model).map(|r| r.endpoints[0].addr().port());
        assert_eq!(port(Some("llama")), Some(1));
        assert_eq!(port(Some("coder")), Some(2));
        assert_eq!(
            port(Some("other")),
            None,
            "no route names it and none takes any model"
        );
        assert_eq!(port(None), None);
        // One policy's promotion leaves the other's route and its endpoints' state alone.
        let code_before = Arc::clone(t.routes().of_policy("ns/code").unwrap());
        t.update(of_policy("ns/chat", &["llama"], "west-chat", 8, 3))
            .unwrap();
        assert!(Arc::ptr_eq(
            t.routes().of_policy("ns/code").unwrap(),
            &code_before
        ));
        assert!(matches!(
            t.update(of_policy("ns/chat", &["llama"], "east", 7, 1)),
            Err(RouteError::Stale { .. })
        ));
        // A route that names no model takes the requests no other route names.
        t.update(of_policy("ns/any", &[], "any", 1, 4)).unwrap();
        assert_eq!(port(Some("other")), Some(4));
        // Every policy's epoch survives a restart.
        drop(t);
        let restarted = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        let highest: Vec<(String, u64)> = restarted
            .highest_of_all()
            .into_iter()
            .map(|h| (h.policy, h.epoch.0))
            .collect();
        assert_eq!(
            highest,
            [
                ("ns/any".to_owned(), 1),
                ("ns/chat".to_owned(), 8),
                ("ns/code".to_owned(), 2)
            ]
        );
    }

    #[tokio::test]
    async fn a_route_that_would_take_another_policys_requests_is_refused() {
        let t = RouteTable::new(None).unwrap();
        t.update(of_policy("ns/chat", &["llama", "chat"], "east", 1, 1))
            .unwrap();
        let same_model = t.update(of_policy("ns/other", &["chat"], "x", 1, 2)).unwrap_err();
        assert!(
            matches!(same_model, RouteError::Overlap { ref policy, model: Some(ref m) } if policy == "ns/chat" && m == "chat")
        );
        assert!(
            same_model.to_string().contains("model \"chat\" is taken"),
            "{same_model}"
        );
        // One route may take every model; a second may not.
        t.update(of_policy("ns/any", &[], "y", 1, 3)).unwrap();
        assert!(matches!(
            t.update(of_policy("ns/also-any", &[], "z", 1, 4)),
            Err(RouteError::Overlap { model: None, .. })
        ));
        // A policy's own route never overlaps itself.
        t.update(of_policy("ns/chat", &["llama", "chat"], "west", 2, 5))
            .unwrap();
        assert_eq!(t.routes().routes().len(), 2);
    }

    #[tokio::test]
    async fn after_a_restart_a_policy_without_its_route_yet_is_awaited_not_given_the_others_requests() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fence.json");
        let t = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        t.update(of_policy("ns/chat", &["chat"], "east", 3, 1)).unwrap();
        t.update(of_policy("ns/code", &["code"], "east", 5, 2)).unwrap();
        drop(t);
        let restarted = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        assert!(
            restarted.routes().several(),
            "two policies known before any route"
        );
        restarted
            .update(of_policy("ns/chat", &["chat"], "east", 3, 1))
            .unwrap();
        let set = restarted.routes();
        assert!(set.awaits_a_route());
        assert!(set.for_model(Some("chat")).is_some());
        assert!(
            set.for_model(Some("code")).is_none(),
            "code's requests wait for code's route"
        );
        restarted
            .update(of_policy("ns/code", &["code"], "east", 5, 2))
            .unwrap();
        assert!(!restarted.routes().awaits_a_route());
    }

    #[tokio::test]
    async fn a_named_route_after_a_one_policy_state_file_is_judged_against_its_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fence.json");
        // What a router of one policy wrote before routes named their policy.
        std::fs::write(&path, br#"{"epoch":7,"pool":"b"}"#).unwrap();
        let t = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        assert!(matches!(
            t.update(of_policy("ns/chat", &[], "a", 6, 1)),
            Err(RouteError::Stale { .. })
        ));
        // The same epoch and pool, as the operator's route sync sends after an upgrade: taken over
        // at once, so nothing waits for an unnamed policy that will never come back.
        t.update(of_policy("ns/chat", &[], "b", 7, 1)).unwrap();
        assert!(!t.routes().awaits_a_route());
        t.update(of_policy("ns/chat", &[], "a", 8, 1)).unwrap();
        // The unnamed record was the policy's: taken over, not kept beside it.
        let held: Vec<(String, u64)> = t
            .highest_of_all()
            .into_iter()
            .map(|h| (h.policy, h.epoch.0))
            .collect();
        assert_eq!(held, [("ns/chat".to_owned(), 8)]);
        assert_eq!(StateFile::new(&path).load().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_stale_update_changes_nothing() {
        let t = RouteTable::new(None).unwrap();
        t.update(route("b", 5, 1)).unwrap();
        assert!(matches!(
            t.update(route("a", 4, 2)),
            Err(RouteError::Stale { .. })
        ));
        assert!(matches!(
            t.update(route("a", 5, 2)),
            Err(RouteError::Stale { .. })
        ));
        let now = t.current_for(None).unwrap();
        assert_eq!((now.route.pool.as_str(), now.route.epoch), ("b", Epoch(5)));
        assert_eq!(now.endpoints[0].addr().port(), 1);
    }

    #[tokio::test]
    async fn an_epoch_far_above_is_taken_only_when_forced_and_the_last_one_never() {
        let t = RouteTable::new(None).unwrap().with_max_epoch_jump(5);
        t.update(route("a", 2, 1)).unwrap();
        let refused = t.update(route("b", 8, 2)).unwrap_err();
        assert!(matches!(refused, RouteError::TooFar { limit: 5, .. }));
        assert!(refused.to_string().contains("force=true"), "{refused}");
        assert_eq!(t.highest("").unwrap().epoch, Epoch(2), "nothing changed");
        assert_eq!(t.force_update(route("b", 8, 2)).unwrap(), Applied::NewEpoch);
        // Then the usual jump is counted from the forced epoch.
        t.update(route("a", 13, 3)).unwrap();
        for take in [RouteTable::update, RouteTable::force_update] {
            assert!(matches!(
                take(&t, route("b", u64::MAX, 4)),
                Err(RouteError::Invalid(InvalidRoute::LastEpoch(_)))
            ));
        }
        assert_eq!(t.current_for(None).unwrap().route.epoch, Epoch(13));
    }

    #[tokio::test]
    async fn the_highest_epoch_survives_a_restart_through_the_state_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fence.json");
        let t = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        t.update(route("b", 7, 1)).unwrap();
        drop(t);
        let restarted = RouteTable::new(Some(StateFile::new(&path))).unwrap();
        assert!(
            restarted.current_for(None).is_none(),
            "endpoints come from the operator again"
        );
        assert!(matches!(
            restarted.update(route("a", 6, 2)),
            Err(RouteError::Stale { .. })
        ));
        assert_eq!(restarted.update(route("b", 7, 3)).unwrap(), Applied::SameEpoch);
    }

    #[tokio::test]
    async fn an_epoch_that_cannot_be_persisted_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let t = RouteTable::new(Some(StateFile::new(dir.path().join("missing-dir/fence.json")))).unwrap();
        assert!(matches!(t.update(route("b", 1, 1)), Err(RouteError::Persist(_))));
        assert!(t.current_for(None).is_none());
        assert!(t.highest("").is_none());
    }
}

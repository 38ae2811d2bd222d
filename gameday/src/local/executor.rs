//! The local home's executor: core's [`Executor`] carried out against processes on this machine.
//!
//! The lease lives in the runner and is compare-and-set like the Kubernetes Lease; fences read it
//! on their own; a pilot light grows in the background ([`Growth`]); the new primary's replicas
//! are proven by the prober's own generating probe, and routes hold only the replicas that passed
//! it, going to every router's admin API with its token. The same `drive` the operator calls
//! decides which of these runs when.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use understudy_api::crd::AdmissionSpec;
use understudy_api::grant::GrantRound;
use understudy_api::lease::{EpochLease, FileLease, LeaseError, LeaseRecord, Unreachable};
use understudy_api::route::{AdmissionSettings, Route, StreamContract};
use understudy_core::drive::{
    Completion, Executor, LeaseClaim, ScaleOrder, ServingOrder, StepOutcome, Target, WakeOrder,
};
use understudy_core::{Epoch, Pool};
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{Endpoint, ProbeReport, ProbeSpec, probe_round};
use understudy_prober::sleep::{
    ReplicaWake, WakeTimeouts, wake_enough, wake_replica_at_its_level, went_on_without,
};

use super::grants::Granter;
use super::http::exchange;
use super::lock;
use super::pilot::{ColdStart, Growth};
use super::replicas::Replica;
use super::system::FenceAddrs;

/// Who the timeline names for a step this executor carried out.
pub const CARRIED_BY: &str = "local game day";

/// The policy a local game day's routes are for, as the routers key them.
pub const LOCAL_POLICY: &str = "local/game-day";

/// The lease holder's name for a pool, as fences and routers know it.
#[must_use]
pub fn pool_name(pool: Pool) -> &'static str {
    match pool {
        Pool::A => "a",
        Pool::B => "b",
    }
}

/// The lease as the failover logic reaches it: the runner's store, from which a `lost-lease`
/// fault cuts the logic off while the fences go on reading it.
#[derive(Debug)]
pub struct LogicLease {
    pub store: FileLease,
    cut: AtomicBool,
}

impl LogicLease {
    #[must_use]
    pub fn new(store: FileLease) -> LogicLease {
        LogicLease {
            store,
            cut: AtomicBool::new(false),
        }
    }

    /// Cuts the logic off from the store (`true`) or gives it back (`false`).
    pub fn cut_off(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
    }

    fn reachable(&self) -> Result<(), LeaseError> {
        if self.cut.load(Ordering::SeqCst) {
            Err(LeaseError::Unreachable(Unreachable::MemoryStoreDown))
        } else {
            Ok(())
        }
    }
}

impl EpochLease for LogicLease {
    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        self.reachable()?;
        self.store.read().await
    }

    async fn create(&self, holder: &str, epoch: Epoch) -> Result<LeaseRecord, LeaseError> {
        self.reachable()?;
        self.store.create(holder, epoch).await
    }

    async fn compare_and_set(
        &self,
        expected: &LeaseRecord,
        holder: &str,
        epoch: Epoch,
    ) -> Result<LeaseRecord, LeaseError> {
        self.reachable()?;
        self.store.compare_and_set(expected, holder, epoch).await
    }
}

/// One pool as the executor reaches it: its replicas' APIs (through the run's links), and the
/// fences in front of them.
#[derive(Clone, Debug, Default)]
pub struct PoolAddrs {
    pub replicas: Vec<SocketAddr>,
    pub fences: Vec<FenceAddrs>,
}

/// One router's admin API.
#[derive(Clone, Debug)]
pub struct RouterAdmin {
    pub addr: SocketAddr,
    pub token: String,
}

/// The replicas whose probe in `reports` passed.
#[must_use]
pub fn passed(reports: &[ProbeReport]) -> Vec<SocketAddr> {
    reports
        .iter()
        .filter(|r| matches!(r.outcome, ProbeOutcome::Ok { .. }))
        .filter_map(|r| Some(SocketAddr::new(r.endpoint.host.parse().ok()?, r.endpoint.port)))
        .collect()
}

/// The route the routers were last given: its pool and epoch, and the replicas behind its fences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routed {
    pub pool: Pool,
    pub epoch: Epoch,
    pub replicas: Vec<SocketAddr>,
}

/// The local executor over one run's lease, pools and routers.
#[derive(Debug)]
pub struct ProcessExecutor<'a> {
    pub lease: &'a LogicLease,
    /// The fences' grantor.
    pub granter: &'a Granter,
    /// The pools as they run now: a grown pilot light joins its pool here.
    pub pools: &'a Mutex<[PoolAddrs; 2]>,
    pub routers: &'a [RouterAdmin],
    pub probe: &'a ProbeSpec,
    /// The policy's admission control on a promoted pool, per replica; `None` is off.
    pub admission: Option<&'a AdmissionSpec>,
    /// Every replica process, where a grown one is kept (and killed at the end).
    pub replicas: &'a Mutex<Vec<Replica>>,
    /// The cold starts of the replicas a promotion started or woke.
    pub cold_starts: &'a Mutex<Vec<ColdStart>>,
    /// The pilot light, when the run has one.
    pub growth: Option<&'a Growth>,
    /// The route the routers hold, once one was pushed.
    pub routed: &'a Mutex<Option<Routed>>,
    /// The replicas of the new primary that passed AwaitServing's probe, for the Route step.
    pub serving: Option<Vec<SocketAddr>>,
    /// How long the replicas' own work took in the steps this executor carried out (waking a
    /// warm tier, starting a pilot light): the stage time, which the rest of the promotion's
    /// time is orchestration around.
    pub stage: Option<Duration>,
}

type Outcome = StepOutcome<String>;

const CALL_LIMIT: Duration = Duration::from_secs(5);

fn done(note: String) -> Outcome {
    StepOutcome::Done(Completion::noted(CARRIED_BY, note))
}

impl ProcessExecutor<'_> {
    fn pool(&self, pool: Pool) -> PoolAddrs {
        lock(self.pools)[pool.index()].clone()
    }

    /// The name of the replica behind `endpoint`.
    fn replica_name(&self, endpoint: &Endpoint) -> String {
        lock(self.replicas)
            .iter()
            .find(|r| {
                let at = r.link.unwrap_or(r.api);
                at.port() == endpoint.port && at.ip().to_string() == endpoint.host
            })
            .map_or_else(
                || format!("{}:{}", endpoint.host, endpoint.port),
                |r| r.name.clone(),
            )
    }

    /// Whether `pool`'s fences serve at `epoch` (one is enough), by the last grant round or a
    /// new one; why not, when they do not.
    async fn fences_serve(&self, pool: Pool, epoch: Epoch) -> Result<(), String> {
        let serves = |round: &GrantRound| {
            round.epoch == epoch && round.holder == pool_name(pool) && round.holder_serves()
        };
        if self.granter.last().as_ref().is_some_and(serves) {
            return Ok(());
        }
        match self.granter.round(self.lease, self.pools).await {
            Ok(round) if serves(&round) => Ok(()),
            Ok(round) => Err(format!(
                "{}'s fences do not serve yet: {}",
                pool_name(pool),
                round.summary()
            )),
            Err(why) => Err(format!("no grant round: {why}")),
        }
    }

    fn add_stage(&mut self, took: Duration) {
        self.stage = Some(self.stage.unwrap_or_default() + took);
    }

    fn endpoints(&self, pool: Pool) -> Vec<Endpoint> {
        self.pool(pool)
            .replicas
            .iter()
            .map(|addr| Endpoint::new(addr.ip().to_string(), addr.port()))
            .collect()
    }

    /// The route that makes `pool` primary at `epoch` through the fences of its `replicas`, with
    /// the policy's admission budgets for that many replicas.
    #[must_use]
    pub fn route_for(&self, pool: Pool, epoch: Epoch, replicas: &[SocketAddr]) -> Route {
        let addrs = self.pool(pool);
        let endpoints: Vec<SocketAddr> = addrs
            .replicas
            .iter()
            .zip(&addrs.fences)
            .filter(|(replica, _)| replicas.contains(replica))
            .map(|(_, fence)| fence.data)
            .collect();
        Route {
            // One policy per run, so one route: it takes every model.
            policy: LOCAL_POLICY.to_owned(),
            models: Vec::new(),
            pool: pool_name(pool).to_owned(),
            admission: self.admission_for(endpoints.len()),
            endpoints,
            epoch,
            stream_contract: StreamContract::RetryableError,
        }
    }

    fn admission_for(&self, replicas: usize) -> AdmissionSettings {
        self.admission.map_or_else(AdmissionSettings::default, |spec| {
            AdmissionSettings::for_replicas(spec, replicas)
        })
    }

    /// Routes `pool` at `epoch` through the fences of `replicas` ([`Self::route_for`]), as
    /// [`Self::push`]es it, and keeps what the routers hold once they do.
    pub async fn route_to(
        &self,
        pool: Pool,
        epoch: Epoch,
        replicas: Vec<SocketAddr>,
        overdue: Option<Duration>,
    ) -> Outcome {
        let route = self.route_for(pool, epoch, &replicas);
        let outcome = self.push(&route, overdue).await;
        if matches!(outcome, StepOutcome::Done(_)) {
            *lock(self.routed) = Some(Routed {
                pool,
                epoch,
                replicas,
            });
        }
        outcome
    }

    /// The replicas of `pool` that answer a generating probe right now. One that says it is
    /// asleep (a wake the promotion went on without, or one that failed) is woken again on a task
    /// of its own; one whose wake is still under way is not called twice.
    pub async fn passing(&self, pool: Pool) -> Vec<SocketAddr> {
        let reports = probe_round(&self.endpoints(pool), self.probe, 0, 0, Duration::ZERO).await;
        for report in reports.iter().filter(|r| r.outcome == ProbeOutcome::Asleep) {
            let endpoint = report.endpoint.clone();
            tokio::spawn(async move {
                // Its own metrics say its level; the deepest wake otherwise, which serves both.
                wake_replica_at_its_level(&endpoint, 2, WakeTimeouts::default()).await;
            });
        }
        passed(&reports)
    }

    /// Marks the first token of each started or woken replica among `passed` that has none yet.
    pub fn first_tokens(&self, passed: &[SocketAddr]) {
        let names: Vec<String> = passed
            .iter()
            .map(|addr| self.replica_name(&Endpoint::new(addr.ip().to_string(), addr.port())))
            .collect();
        let now = jiff::Timestamp::now();
        for cold in lock(self.cold_starts).iter_mut() {
            if names.contains(&cold.replica) {
                cold.first_token(now);
            }
        }
    }

    /// Pushes `route` to every router; done when every one holds it, or, once the promotion is
    /// `overdue`, when one does and none has seen a newer epoch (409).
    pub async fn push(&self, route: &Route, overdue: Option<Duration>) -> Outcome {
        let body = Bytes::from(serde_json::to_vec(route).unwrap_or_default());
        let mut failed = Vec::new();
        let mut stale = false;
        for router in self.routers {
            let bearer = format!("Bearer {}", router.token);
            let answer = exchange(
                router.addr,
                "PUT",
                "/route",
                &[("authorization", &bearer)],
                body.clone(),
                CALL_LIMIT,
            )
            .await;
            match answer {
                Ok(answer) if answer.status == 200 => {}
                Ok(answer) => {
                    stale |= answer.status == 409;
                    failed.push(format!(
                        "router {} answered {}: {}",
                        router.addr,
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    ));
                }
                Err(error) => failed.push(format!("router {}: {error}", router.addr)),
            }
        }
        let took = self.routers.len() - failed.len();
        let holding = format!(
            "{} at epoch {}, {} endpoint(s)",
            route.pool,
            route.epoch,
            route.endpoints.len()
        );
        match overdue {
            _ if failed.is_empty() => done(format!(
                "pushed to all {} router(s): {holding}",
                self.routers.len()
            )),
            Some(deadline) if took > 0 && !stale => done(format!(
                "past the promotion's deadline of {deadline:?}, it goes on with {took} of {} router(s) \
                 holding {holding}; the rest: {}",
                self.routers.len(),
                failed.join("; ")
            )),
            _ => StepOutcome::NotYet(failed.join("; ")),
        }
    }
}

impl Executor for ProcessExecutor<'_> {
    type Wait = String;

    async fn acquire_lease(&mut self, claim: LeaseClaim) -> Outcome {
        let holder = pool_name(claim.holder);
        let current = match self.lease.read().await {
            Ok(Some(current)) => current,
            Ok(None) => return StepOutcome::NotYet("the lease does not exist".to_owned()),
            Err(error) => return StepOutcome::Unreachable(error.to_string()),
        };
        if current.epoch == claim.epoch && current.holder == holder {
            return done(format!(
                "the lease already names {holder} at epoch {}",
                claim.epoch
            ));
        }
        if current.epoch != claim.expected {
            return StepOutcome::LostRace;
        }
        match self.lease.compare_and_set(&current, holder, claim.epoch).await {
            Ok(_) => StepOutcome::Done(Completion::by(CARRIED_BY)),
            Err(LeaseError::LostRace) => StepOutcome::LostRace,
            Err(error) if error.is_unreachable() => StepOutcome::Unreachable(error.to_string()),
            Err(error) => StepOutcome::NotYet(error.to_string()),
        }
    }

    /// Grants the new epoch to every fence at once: the old primary's fences that answer are
    /// fenced now, and the ones that do not stop when their grants run out, which the new
    /// primary's fences wait out. Never waits itself.
    async fn fence_old(&mut self, old: Target) -> Outcome {
        let note = match self.granter.round(self.lease, self.pools).await {
            Ok(round) => format!("granted epoch {}: {}", old.epoch, round.summary()),
            Err(why) => format!(
                "no grant round ({why}); {}'s fences stop when their grants run out",
                pool_name(old.pool)
            ),
        };
        StepOutcome::Done(Completion::noted("fence", note))
    }

    async fn wake(&mut self, order: WakeOrder) -> Outcome {
        let name = pool_name(order.pool);
        if order.replicas == 0 {
            return done(format!(
                "{name} has no warm tier: nothing sleeps, no replica was called"
            ));
        }
        let endpoints = self.endpoints(order.pool);
        let began = tokio::time::Instant::now();
        let began_at = jiff::Timestamp::now();
        // Once as many are awake as the serving quorum needs, the step goes on and the rest wake
        // on their own; past the deadline it goes on with what is awake.
        let tolerated = usize::try_from(order.replicas - order.needed).unwrap_or(usize::MAX);
        // Not past the deadline, however long the wakes take; once past it, only as long as it
        // takes to hear which replicas are awake already.
        let timeouts = WakeTimeouts::default();
        let patience = order.left.max(timeouts.query);
        let wake = wake_enough(&endpoints, order.level, timeouts, tolerated, patience).await;
        let took = began.elapsed();
        for w in &wake.finished {
            if w.outcome == ReplicaWake::Woken {
                let name = self.replica_name(w.endpoint);
                let at = began_at.checked_add(w.took).unwrap_or(began_at);
                lock(self.cold_starts).push(ColdStart::woken(&name, began_at, at));
            }
        }
        let woken = wake
            .finished
            .iter()
            .filter(|w| w.outcome == ReplicaWake::Woken)
            .count();
        let not_awake = wake.behind();
        if not_awake.len() > tolerated && order.overdue.is_none() {
            return StepOutcome::NotYet(format!("not yet awake: {}", not_awake.join("; ")));
        }
        self.add_stage(took);
        let mut note = format!(
            "woke {woken} replica(s) of {name} from level-{} sleep; the wake calls took {:.0} ms",
            order.level,
            took.as_secs_f64() * 1e3
        );
        if let Some(without) = went_on_without(&not_awake, tolerated, order.overdue) {
            note.push_str(&format!("; {without}"));
        }
        done(note)
    }

    async fn scale(&mut self, order: ScaleOrder) -> Outcome {
        let name = pool_name(order.pool);
        let growth = self.growth.filter(|g| g.pilot.pool == order.pool);
        let running = u32::try_from(self.pool(order.pool).replicas.len()).unwrap_or(u32::MAX);
        let starting = growth.map_or(0, Growth::starting);
        if running + starting >= order.replicas {
            return done(if order.pilot_light == 0 {
                format!("every replica of {name} runs: nothing to grow")
            } else {
                format!("all {} replica(s) of {name} run or are starting", order.replicas)
            });
        }
        let Some(growth) = growth else {
            let short = format!(
                "{name} runs {running} of {} replica(s) and has no pilot light to grow",
                order.replicas
            );
            return match order.overdue {
                Some(deadline) => done(format!(
                    "past the promotion's deadline of {deadline:?}, it goes on with the replicas that run: {short}"
                )),
                None => StepOutcome::NotYet(short),
            };
        };
        // Every missing replica starts at once, each a process with its modelled startup, and
        // joins the pool when it is ready: the promotion goes on without waiting for it.
        for i in running + starting..order.replicas {
            growth.start(format!("{name}-{i}"));
        }
        done(format!(
            "started {} pilot-light replica(s) of {name}, each a new process; each joins the pool \
             when it is ready and the route when it answers a generating probe",
            order.replicas - running - starting
        ))
    }

    async fn await_serving(&mut self, order: ServingOrder) -> Outcome {
        let passed = self.passing(order.pool).await;
        let serving = passed.len();
        let name = pool_name(order.pool);
        let enough = serving >= order.quorum as usize;
        if enough || (serving > 0 && order.overdue.is_some()) {
            self.first_tokens(&passed);
            // When grown replicas are among those the route moves with, the route waited for
            // their cold start: the replicas' own work since the first was started.
            let grown = self.growth.and_then(Growth::began).filter(|_| {
                let cold = lock(self.cold_starts);
                passed.iter().any(|addr| {
                    let name = self.replica_name(&Endpoint::new(addr.ip().to_string(), addr.port()));
                    cold.iter().any(|c| c.replica == name && c.tier == "pilot-light")
                })
            });
            if let Some(began) = grown {
                self.add_stage(began.elapsed());
            }
            self.serving = Some(passed);
            let note = format!(
                "{serving} of {} replica(s) of {name} answered a generating probe",
                order.replicas
            );
            return done(match order.overdue {
                Some(deadline) if !enough => format!(
                    "past the promotion's deadline of {deadline:?}, the route moves to what serves: \
                     {note}, below the {} needed; the rest join the route as they pass",
                    order.quorum
                ),
                _ => note,
            });
        }
        let failures = self.growth.map(Growth::failures).unwrap_or_default();
        let failed = if failures.is_empty() {
            String::new()
        } else {
            format!("; pilot-light starts that failed: {}", failures.join("; "))
        };
        let overdue = order.overdue.map_or_else(String::new, |deadline| {
            format!(
                "; past the promotion's deadline of {deadline:?}, the routers keep the waiting room \
                 closed, answering with Retry-After, and the promotion keeps trying"
            )
        });
        StepOutcome::NotYet(format!(
            "{serving} of {} replica(s) of {name} serve, {} needed{failed}{overdue}",
            order.replicas, order.quorum
        ))
    }

    async fn route(&mut self, new: Target) -> Outcome {
        // The replicas AwaitServing found passing, or (in a later round) those passing now.
        let serving = match self.serving.take() {
            Some(serving) => serving,
            None => self.passing(new.pool).await,
        };
        if serving.is_empty() {
            return StepOutcome::NotYet(format!(
                "no replica of {} answers a generating probe to route to",
                pool_name(new.pool)
            ));
        }
        // A route to fences that refuse serves nobody: it waits for their grants, which is at
        // most the old holder's grant plus the skew margin.
        if let Err(why) = self.fences_serve(new.pool, new.epoch).await {
            return StepOutcome::NotYet(why);
        }
        self.route_to(new.pool, new.epoch, serving, new.overdue).await
    }

    async fn open_admission(&mut self, new: Target) -> Outcome {
        let replicas = self.pool(new.pool).fences.len();
        let window = self.admission_for(replicas).window();
        done(if window.is_zero() {
            format!(
                "no admission window: {} takes all traffic at once",
                pool_name(new.pool)
            )
        } else {
            format!(
                "the route opened a {:?} admission window on {}",
                window,
                pool_name(new.pool)
            )
        })
    }
}

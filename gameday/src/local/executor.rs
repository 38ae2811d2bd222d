//! The local home's executor: core's [`Executor`] carried out against processes on this machine.
//!
//! The lease lives in the runner and is compare-and-set like the Kubernetes Lease; fences read it
//! on their own; the new primary's replicas are proven by the prober's own generating probe; routes go to every router's admin API with its token. The
//! same `drive` the operator calls decides which of these runs when.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use understudy_api::crd::AdmissionSpec;
use understudy_api::lease::{EpochLease, LeaseError, MemoryLease};
use understudy_api::route::{AdmissionSettings, Route, StreamContract};
use understudy_core::drive::{
    Completion, Executor, LeaseClaim, ScaleOrder, ServingOrder, StepOutcome, Target, WakeOrder,
};
use understudy_core::{Epoch, Pool};
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::probe::{Endpoint, ProbeSpec, probe_round};
use understudy_prober::sleep::{ReplicaWake, WakeTimeouts, wake_replicas};

use super::http::exchange;

/// Who the timeline names for a step this executor carried out.
pub const CARRIED_BY: &str = "local game day";

/// The lease holder's name for a pool, as fences and routers know it.
#[must_use]
pub fn pool_name(pool: Pool) -> &'static str {
    match pool {
        Pool::A => "a",
        Pool::B => "b",
    }
}

/// One pool as the executor reaches it: its replicas' APIs, and the fences in front of them.
#[derive(Clone, Debug, Default)]
pub struct PoolAddrs {
    pub replicas: Vec<SocketAddr>,
    pub fences: Vec<SocketAddr>,
}

/// One router's admin API.
#[derive(Clone, Debug)]
pub struct RouterAdmin {
    pub addr: SocketAddr,
    pub token: String,
}

/// The local executor over one run's lease, pools and routers.
#[derive(Debug)]
pub struct ProcessExecutor<'a> {
    pub lease: &'a MemoryLease,
    pub pools: &'a [PoolAddrs; 2],
    pub routers: &'a [RouterAdmin],
    pub probe: &'a ProbeSpec,
    /// The policy's admission control on a promoted pool, per replica; `None` is off.
    pub admission: Option<&'a AdmissionSpec>,
    /// How long the replicas' own work took in the last step that woke them: the stage time,
    /// which the rest of the promotion's time is orchestration around.
    pub stage: Option<Duration>,
}

type Outcome = StepOutcome<String>;

const CALL_LIMIT: Duration = Duration::from_secs(5);

fn done(note: String) -> Outcome {
    StepOutcome::Done(Completion::noted(CARRIED_BY, note))
}

impl ProcessExecutor<'_> {
    fn endpoints(&self, pool: Pool) -> Vec<Endpoint> {
        self.pools[pool.index()]
            .replicas
            .iter()
            .map(|addr| Endpoint::new(addr.ip().to_string(), addr.port()))
            .collect()
    }

    /// The route that makes `pool` primary at `epoch`, through its fences, with the policy's
    /// admission budgets for that many replicas.
    #[must_use]
    pub fn route_for(&self, pool: Pool, epoch: Epoch) -> Route {
        let endpoints = self.pools[pool.index()].fences.clone();
        Route {
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

    /// Pushes `route` to every router; done only when every one holds it.
    pub async fn push(&self, route: &Route) -> Outcome {
        let body = Bytes::from(serde_json::to_vec(route).unwrap_or_default());
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
                    return StepOutcome::NotYet(format!(
                        "router {} answered {}: {}",
                        router.addr,
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    ));
                }
                Err(error) => return StepOutcome::NotYet(format!("router {}: {error}", router.addr)),
            }
        }
        done(format!(
            "pushed to all {} router(s): {} at epoch {}, {} endpoint(s)",
            self.routers.len(),
            route.pool,
            route.epoch,
            route.endpoints.len()
        ))
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

    async fn fence_old(&mut self, old: Target) -> Outcome {
        StepOutcome::Done(Completion::handed_off(
            "fence",
            format!(
                "left to {}'s fences, which refuse work below epoch {} once they read the lease; no call was made",
                pool_name(old.pool),
                old.epoch
            ),
        ))
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
        let outcomes = wake_replicas(&endpoints, order.level, WakeTimeouts::default()).await;
        let took = began.elapsed();
        let woken = outcomes.iter().filter(|(_, o)| *o == ReplicaWake::Woken).count();
        let not_awake: Vec<String> = outcomes
            .iter()
            .filter(|(_, o)| !o.is_awake())
            .map(|(e, o)| format!("{}:{} {o:?}", e.host, e.port))
            .collect();
        if !not_awake.is_empty() {
            return StepOutcome::NotYet(format!("not yet awake: {}", not_awake.join("; ")));
        }
        self.stage = Some(took);
        done(format!(
            "woke {woken} replica(s) of {name} from level-{} sleep; the wake calls took {:.0} ms",
            order.level,
            took.as_secs_f64() * 1e3
        ))
    }

    async fn scale(&mut self, order: ScaleOrder) -> Outcome {
        let name = pool_name(order.pool);
        if order.pilot_light == 0 {
            return done(format!("every replica of {name} runs: nothing to grow"));
        }
        StepOutcome::NotYet(format!(
            "{name} has {} pilot-light replica(s), and growing them is not built into the local game day yet",
            order.pilot_light
        ))
    }

    async fn await_serving(&mut self, order: ServingOrder) -> Outcome {
        let reports = probe_round(&self.endpoints(order.pool), self.probe, 0, 0, Duration::ZERO).await;
        let serving = reports
            .iter()
            .filter(|r| matches!(r.outcome, ProbeOutcome::Ok { .. }))
            .count();
        let name = pool_name(order.pool);
        if serving >= order.quorum as usize {
            done(format!(
                "{serving} of {} replica(s) of {name} answered a generating probe",
                order.replicas
            ))
        } else {
            StepOutcome::NotYet(format!(
                "{serving} of {} replica(s) of {name} serve, {} needed",
                order.replicas, order.quorum
            ))
        }
    }

    async fn route(&mut self, new: Target) -> Outcome {
        let route = self.route_for(new.pool, new.epoch);
        self.push(&route).await
    }

    async fn open_admission(&mut self, new: Target) -> Outcome {
        let replicas = self.pools[new.pool.index()].fences.len();
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

//! The ports of the operator: what its controllers consume, as traits and the plain types that
//! cross them, with no Kubernetes client behind any of them. The controllers import these and the
//! adapters implement them (the probing rounds in [`crate::observe`], the replicas in
//! [`crate::replicas`], the routers in [`crate::route_push`]), so that the controllers sit on top
//! and every import runs downward.
//!
//! What this module must never do: call anything. It holds contracts, the wall clock
//! ([`SystemClock`]), and the two implementations that do nothing on purpose ([`NoObservations`],
//! [`HandOffToComponents`]).

use std::collections::BTreeSet;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
pub use understudy_core::failover::Observation;
use understudy_core::failover::Step;
use understudy_core::{Epoch, Pool};
use understudy_prober::probe::{Endpoint, ProbeReport};

use crate::clusters::ClusterError;
use crate::crd::{FailoverPolicy, GoldenAnswer, ParityStatus, PoolSpec, WorkloadKind};
use crate::parity::ServingConfig;
use crate::standby::HostRoom;

/// The controller's clock: time since the Unix epoch, so that times recorded in status mean the
/// same thing to a restarted operator.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> Duration;
}

/// The wall clock as it read when this clock was made, advanced by the monotonic clock since:
/// times in status are wall times, but a step of the node's wall clock (NTP, a person) can
/// neither shorten nor stretch a dwell or a hold while the operator runs. (Across a restart the
/// wall clock is read again; the state machine's record then carries the times.)
#[derive(Clone, Copy, Debug)]
pub struct SystemClock {
    wall_at_start: Duration,
    start: tokio::time::Instant,
}

impl SystemClock {
    /// Reads the wall clock once, now.
    #[must_use]
    pub fn new() -> Self {
        // A clock before 1970 is a broken node; zero keeps the machine's arithmetic sound.
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Self::anchored(wall, tokio::time::Instant::now())
    }

    /// A clock that read `wall` at `start`.
    #[must_use]
    pub fn anchored(wall: Duration, start: tokio::time::Instant) -> Self {
        SystemClock {
            wall_at_start: wall,
            start,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.wall_at_start + self.start.elapsed()
    }
}

/// Where probe results and data-path signals come from. Observations only: commands and the
/// Lease reach the state machine through the reconciler, never through here.
///
/// The reconciler calls [`track`](Self::track) with every valid policy it runs and
/// [`forget`](Self::forget) when one is deleted, so that a source that probes knows what to probe;
/// neither may block, as both run inside a reconcile.
pub trait ObservationSource: Send + Sync + fmt::Debug {
    /// Everything observed about `policy` since the last call, oldest first.
    fn drain(&self, policy: &ObjectRef<FailoverPolicy>) -> Vec<Observation>;

    /// `policy`, as just read, is being run: observe it from now on, by its latest spec.
    fn track(&self, _policy: &FailoverPolicy) {}

    /// `policy` is deleted: stop observing it and drop what was kept for it.
    fn forget(&self, _policy: &ObjectRef<FailoverPolicy>) {}

    /// When the replica at `endpoint` (`host:port`) first answered a probe right, as far as this
    /// source saw: a new replica's first token, for its cold start.
    fn first_answered(&self, _endpoint: &str) -> Option<Timestamp> {
        None
    }
}

/// Observes nothing, for tests that script their observations otherwise. The operator itself
/// runs [`crate::observe::ProbingObservations`]; under this source the state machine sees no
/// check results, so it never promotes on its own, and with no standby ever seen to pass,
/// failover happens only on a `force-failover` command.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoObservations;

impl ObservationSource for NoObservations {
    fn drain(&self, _: &ObjectRef<FailoverPolicy>) -> Vec<Observation> {
        Vec::new()
    }
}

/// What the probing rounds found that status keeps: the golden answer a policy's probes judge by
/// (`status.goldenAnswer`), whether the replicas take the probe (`ProbeAccepted`), and the last
/// comparison of the pools (`status.parity`, `ParityHolds`). The operator's is its
/// [`crate::observe::ProbingObservations`].
pub trait ProbeFindings: Send + Sync + fmt::Debug {
    /// The golden answer kept for `policy` now; `None` when there is none, yet or any more.
    fn golden_answer(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer>;

    /// What the probes of `policy` learned of the probe itself: `Some(Ok(()))` when replicas
    /// answered it in the last round, `Some(Err(why))` when they refused it as wrong, `None`
    /// before any round.
    fn probe_accepted(&self, _policy: &ObjectRef<FailoverPolicy>) -> Option<Result<(), String>> {
        None
    }

    /// The last comparison of `policy`'s pools; `None` before one finished, or with parity off.
    fn parity(&self, _policy: &ObjectRef<FailoverPolicy>) -> Option<ParityStatus> {
        None
    }

    /// The replicas (`host:port`) of `policy`'s `pool` that have passed a generating probe and
    /// still run; `None` before the pool's first round, when nothing is known.
    fn passed(&self, _policy: &ObjectRef<FailoverPolicy>, _pool: Pool) -> Option<BTreeSet<String>> {
        None
    }

    /// `policy`'s `pool`'s replicas that said they were asleep in its last round.
    fn asleep(&self, _policy: &ObjectRef<FailoverPolicy>, _pool: Pool) -> Vec<Endpoint> {
        Vec::new()
    }

    /// The level each of those sleeps at, by its metrics (`None`: they do not say).
    fn asleep_levels(&self, _policy: &ObjectRef<FailoverPolicy>, _pool: Pool) -> Vec<Option<u8>> {
        Vec::new()
    }

    /// Host memory for `policy`'s `pool`'s level-1 sleepers, as its last round read the nodes;
    /// empty (no refusal) when nothing was read.
    fn host_room(&self, _policy: &ObjectRef<FailoverPolicy>, _pool: Pool) -> HostRoom {
        HostRoom::default()
    }

    /// `reports` are probes of `policy`'s `pool` made outside a round (a promotion's
    /// AwaitServing): what they found counts as a round's would for [`Self::passed`].
    fn note_probed(&self, _policy: &ObjectRef<FailoverPolicy>, _pool: Pool, _reports: &[ProbeReport]) {}
}

/// Why a pool's replicas could not be found this round.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The workload could not be read.
    #[error("reading {kind:?} {name:?}: {source}")]
    Workload {
        kind: WorkloadKind,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The workload's selector selects nothing usable: no labels, or an operator kube cannot
    /// write. Listing with it could select every pod of the namespace.
    #[error("{kind:?} {name:?} has no usable pod selector: {reason}")]
    Selector {
        kind: WorkloadKind,
        name: String,
        reason: String,
    },
    /// The workload's pods could not be listed.
    #[error("listing the pods of {kind:?} {name:?}: {source}")]
    Pods {
        kind: WorkloadKind,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The pool's cluster cannot be reached: its kubeconfig cannot be read or used.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// Where a pool's replicas can be reached.
pub trait ReplicaEndpoints: Send + Sync + fmt::Debug {
    /// The endpoints of `pool`'s replicas in `namespace` that can be probed now; empty when the
    /// pool has none. An error means the answer is unknown, not that the pool is empty.
    fn resolve<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<Endpoint>, ResolveError>>;

    /// The names of `pool`'s replicas that [`Self::resolve`] gives endpoints for (its Running
    /// pods); empty when they cannot be told, which matches them to no GPU.
    fn replica_names<'a>(
        &'a self,
        _namespace: &'a str,
        _pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<String>, ResolveError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Every fence of `pool` that may hold a serving grant, to grant to, and whether the list is
    /// complete: every pod that may run a fence, terminating ones too, whatever their readiness.
    /// A fence left out of an incomplete list can never be counted as revoked. By default, the
    /// probed replicas, not known to be complete.
    fn fences<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<(Vec<Endpoint>, bool), ResolveError>> {
        Box::pin(async move { Ok((self.resolve(namespace, pool).await?, false)) })
    }

    /// How `pool`'s workload starts vLLM, from its pod template once every replica runs it;
    /// `None` when that cannot be told (a rollout under way, a LeaderWorkerSet). Its model is the
    /// one the pool is set to serve: a recorded golden answer is kept only while the primary
    /// serves the model it was recorded from.
    fn serving_config<'a>(
        &'a self,
        _namespace: &'a str,
        _pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Option<ServingConfig>, ResolveError>> {
        Box::pin(async { Ok(None) })
    }

    /// Where the model files of each of `pool`'s Running replicas lie; none when that cannot be
    /// told.
    fn model_places<'a>(
        &'a self,
        _namespace: &'a str,
        _pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<ModelPlace>, ResolveError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// Where one running replica's model files lie, for parity to read them there: its node, and
/// the model's directory as the node names it (`Err`: why that cannot be told, such as a model
/// on a volume that is not the node's own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPlace {
    pub pod: String,
    /// The replica's `host:port`.
    pub endpoint: String,
    pub node: String,
    pub path: Result<String, String>,
}

/// A step the controller hands to another component.
#[derive(Clone, Copy, Debug)]
pub struct StepRequest<'a> {
    pub policy: &'a FailoverPolicy,
    pub step: Step,
    /// The pool the step acts on: the old primary for fencing, the new one otherwise.
    pub pool: &'a PoolSpec,
    pub epoch: Epoch,
    /// The pool's replicas (`host:port`) known to pass the generating probe: a route holds only
    /// these of its running replicas. `None` when nothing is known yet (a new operator before
    /// its first round): every running replica is routed.
    pub serving: Option<&'a BTreeSet<String>>,
    /// The promotion's deadline, once it has passed ([`understudy_core::drive`]): a route held
    /// by some routers is enough.
    pub overdue: Option<Duration>,
}

/// What became of a step given to the executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepReport {
    /// `carried_by` made the call and it is done; `note`, when given, is what the status timeline
    /// shows beside the step.
    Done {
        carried_by: &'static str,
        note: Option<String>,
    },
    /// Nobody was called: the step is left to `carried_by`, which acts on its own or is not part
    /// of this version. The promotion moves on; `note` says what that means, in a sentence that
    /// status and Events show as it is.
    HandedOff { carried_by: &'static str, note: String },
    /// Not done yet; the promotion waits at this step and the reconciler comes back.
    NotYet { reason: String },
    /// `carried_by` refused the step in a way somebody should look at (a stale epoch, a wrong
    /// token): the promotion waits at this step as for [`StepReport::NotYet`], and a Warning Event
    /// with `reason` and `note` says why.
    Refused {
        carried_by: &'static str,
        reason: &'static str,
        note: String,
    },
}

/// The route the routers should hold between promotions: the primary at the current epoch.
#[derive(Clone, Copy, Debug)]
pub struct RouteSyncRequest<'a> {
    pub policy: &'a FailoverPolicy,
    /// The primary pool, as the Lease names it.
    pub pool: &'a PoolSpec,
    pub epoch: Epoch,
    /// As [`StepRequest::serving`]: the route grows as more of the pool's replicas pass.
    pub serving: Option<&'a BTreeSet<String>>,
}

/// What keeping the route in place found that somebody should hear of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteSyncReport {
    /// Warning Events to publish, as `(reason, note)`.
    pub warnings: Vec<(&'static str, String)>,
    /// A router has seen an epoch this operator has not: the Lease should be read again soon.
    pub view_stale: bool,
}

/// Carries out fencing, waking, routing and opening admission.
pub trait StepExecutor: Send + Sync + fmt::Debug {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport>;

    /// Makes whatever serves the route hold `request`'s route, outside a promotion, so that a
    /// router that lost its route or never had one learns it. Without routers there is nothing to
    /// keep in place: no call is made and nothing is reported.
    fn keep_route<'a>(&'a self, _request: RouteSyncRequest<'a>) -> BoxFuture<'a, RouteSyncReport> {
        Box::pin(async { RouteSyncReport::default() })
    }
}

/// The executor that calls nothing: it hands every step off. The fence sidecar reads the epoch
/// Lease itself, so fencing follows the Lease on its own; routing waits for routers given to the
/// operator (`--router-admin`), and waking for an operator that reaches the replicas
/// ([`crate::controller::Context::with_replicas`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct HandOffToComponents;

impl StepExecutor for HandOffToComponents {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport> {
        let (pool, epoch) = (&request.pool.name, request.epoch);
        let (carried_by, note) = match request.step {
            Step::FenceOld => (
                "fence-sidecar",
                format!(
                    "left to {pool}'s fence sidecars, which refuse work below epoch {epoch} once they \
                     read the Lease; no call was made"
                ),
            ),
            Step::Wake => (
                "operator",
                format!("no executor that wakes replicas is configured; no replica of {pool} was woken"),
            ),
            Step::Route => (
                "router",
                format!("no router is configured; no route was pushed to {pool} at epoch {epoch}"),
            ),
            Step::OpenAdmission => (
                "router",
                format!("no router is configured; no admission window was opened on {pool}"),
            ),
            Step::AcquireLease | Step::Scale | Step::AwaitServing => (
                "operator",
                format!(
                    "{:?} is the operator's own step and was not carried out here",
                    request.step
                ),
            ),
        };
        Box::pin(async move { StepReport::HandedOff { carried_by, note } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_clock_reads_the_wall_once_and_then_runs_on_the_monotonic_clock() {
        let wall = Duration::from_secs(1_717_243_200);
        let clock = SystemClock::anchored(wall, tokio::time::Instant::now());
        assert_eq!(clock.now(), wall);
        tokio::time::advance(Duration::from_secs(90)).await;
        // Whatever the wall clock did meanwhile, ninety seconds passed.
        assert_eq!(clock.now(), wall + Duration::from_secs(90));
        let fresh = SystemClock::new().now();
        assert!(
            fresh > Duration::from_secs(1_600_000_000),
            "{fresh:?} is not a wall time"
        );
    }
}

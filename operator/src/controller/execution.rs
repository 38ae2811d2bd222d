//! The components the Kubernetes executor ([`super::executor`]) hands steps to, the workloads it
//! scales, and where the controller's observations and time come from.
//!
//! The lease step, scaling and waiting for replicas to serve are the executor's own, against the
//! epoch Lease and the workload's scale subresource and status ([`Workload`]), and so is waking
//! the new primary's warm replicas where the operator reaches them ([`crate::wake`]). Routing and
//! opening admission are pushed to the routers by
//! [`crate::route_push::RouterPush`] when routers are configured. Fencing, and routing without
//! routers, belong to other components (the fence sidecar, the router); [`HandOffToComponents`]
//! reports them handed off, never done: the promotion moves on, and an Event and the status
//! timeline say which component carries each out and that this operator made no call. It must
//! never claim a call it did not make.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use understudy_api::FIELD_MANAGER;
use understudy_core::Epoch;
use understudy_core::failover::{Observation, Step};

use crate::crd::{FailoverPolicy, PoolSpec, WorkloadKind, WorkloadRef};

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

/// A step the controller hands to another component.
#[derive(Clone, Copy, Debug)]
pub struct StepRequest<'a> {
    pub policy: &'a FailoverPolicy,
    pub step: Step,
    /// The pool the step acts on: the old primary for fencing, the new one otherwise.
    pub pool: &'a PoolSpec,
    pub epoch: Epoch,
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
/// ([`super::Context::with_replicas`]).
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

/// A pool's workload, through its scale subresource and status.
#[derive(Clone)]
pub struct Workload {
    api: Api<DynamicObject>,
    name: String,
}

impl fmt::Debug for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Workload")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Workload {
    /// The workload `workload` names in `namespace`.
    #[must_use]
    pub fn new(client: kube::Client, namespace: &str, workload: &WorkloadRef) -> Self {
        let (group, version, plural) = match workload.kind {
            WorkloadKind::Deployment => ("apps", "v1", "deployments"),
            WorkloadKind::StatefulSet => ("apps", "v1", "statefulsets"),
            WorkloadKind::LeaderWorkerSet => ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
        };
        let kind = format!("{:?}", workload.kind);
        let resource =
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, &kind), plural);
        Workload {
            api: Api::namespaced_with(client, namespace, &resource),
            name: workload.name.clone(),
        }
    }

    /// Raise the desired replicas to `replicas`; never lowers them. Returns whether it wrote.
    ///
    /// A JSON merge patch on the scale subresource, as `kubectl scale` sends, rather than
    /// server-side apply: applying would take ownership of `spec.replicas` away from whoever
    /// deploys the workload, and their next apply would either conflict or scale the new primary
    /// back down.
    pub async fn scale_up_to(&self, replicas: u32) -> Result<bool, kube::Error> {
        if self.desired_replicas().await? >= i64::from(replicas) {
            return Ok(false);
        }
        self.set_replicas(replicas).await?;
        Ok(true)
    }

    /// Lower the desired replicas to `replicas`; never raises them. Returns the replicas it
    /// lowered from, or `None` when there was nothing to lower. The same patch as
    /// [`Workload::scale_up_to`].
    pub async fn scale_down_to(&self, replicas: u32) -> Result<Option<u32>, kube::Error> {
        let desired = self.desired_replicas().await?;
        match u32::try_from(desired) {
            Ok(from) if from > replicas => {
                self.set_replicas(replicas).await?;
                Ok(Some(from))
            }
            _ => Ok(None),
        }
    }

    /// `spec.replicas` of the scale subresource.
    async fn desired_replicas(&self) -> Result<i64, kube::Error> {
        let scale = self.api.get_scale(&self.name).await?;
        Ok(i64::from(scale.spec.and_then(|s| s.replicas).unwrap_or(0)))
    }

    async fn set_replicas(&self, replicas: u32) -> Result<(), kube::Error> {
        let patch = serde_json::json!({ "spec": { "replicas": replicas } });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        self.api
            .patch_scale(&self.name, &params, &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// The workload as it is stored, pod template included.
    pub async fn get(&self) -> Result<DynamicObject, kube::Error> {
        self.api.get(&self.name).await
    }

    /// How many replicas are ready, from the workload's `status.readyReplicas`.
    pub async fn ready_replicas(&self) -> Result<u32, kube::Error> {
        let object = self.api.get(&self.name).await?;
        Ok(object
            .data
            .get("status")
            .and_then(|s| s.get("readyReplicas"))
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0))
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

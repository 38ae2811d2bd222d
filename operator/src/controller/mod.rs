//! The FailoverPolicy controller: drives the failover state machine from Kubernetes.
//!
//! Each reconcile is a typed pipeline (`pipeline.rs`): validate the spec (pure, [`crate::policy`])
//! → dereference what status recorded → observe the epoch Lease (creating it when missing) and
//! the pools → decide on a command and a tick → execute the promotion's steps through core's
//! driver and the Kubernetes executor (`executor.rs`) → keep the GPU reserve where the Lease says
//! the standby is (`gpu_reserve.rs`) → apply the status → publish its events and count what
//! finished (`events.rs`) → between promotions, keep the Lease's route on the routers → requeue.
//!
//! The epoch Lease has no owner reference and outlives its policy: routers and fence sidecars
//! refuse anything below the highest epoch they have seen, so a policy deleted and created again
//! must carry on from the Lease's epoch, never start again at 0.
//!
//! What this controller must never do:
//! - let an epoch go back: a Lease found below the recorded epoch is reported (`Ready=False`,
//!   reason `LeaseRegressed`) and nothing is acted on until it is restored;
//! - write anything after losing a compare-and-set on the epoch Lease: the loser acts on nothing,
//!   not even its own status, until it has read the Lease again;
//! - tell or count what no status records: Events and the failover counter follow a successful
//!   status write, so a reconcile that fails and runs again does not report a step twice;
//! - fail over because the Lease cannot be read: an unreachable API server pauses control actions
//!   and commands wait, while the data path keeps its primary;
//! - crash-loop on a policy it cannot read: a malformed object or spec is reported as a Warning
//!   Event and `Ready=False` (reason `InvalidSpec`), and nothing else is touched;
//! - scale a pool down, or stop serving when a policy is deleted;
//! - apply a GPU reserve for the pool that holds the epoch Lease, or touch a reserve while the
//!   Lease cannot be read or was lost;
//! - apply over or delete a Deployment that is not labelled as a reserve and owned by the policy.

mod command;
mod events;
mod execution;
mod executor;
mod gpu_reserve;
mod invalid;
mod pipeline;
mod status;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::finalizer::{self, Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
pub use understudy_core::failover::Observation;
use understudy_core::failover::{FailoverState, Phase, Step};
use understudy_prober::probe::Expectation;

pub use self::command::{COMMAND_ANNOTATION, COMMAND_WORDS, CommandRequest, HandledCommand, pending_command};
pub use self::execution::{
    Clock, HandOffToComponents, NoObservations, ObservationSource, RouteSyncReport, RouteSyncRequest,
    StepExecutor, StepReport, StepRequest, SystemClock, Workload,
};
use self::invalid::{release_unreadable, report_invalid, stored_ready};
use self::pipeline::apply;
pub use self::status::{
    HandedOffStep, OperatorRecord, StatusFacts, StoredRecord, desired_status, invalid_spec_patch,
    load_record, merge_conditions, phase_name, rfc3339, step_name, timeline,
};
use crate::crd::{FailoverPolicy, GoldenAnswer, ParityStatus};
use crate::lease::LeaseError;
use crate::metrics::Metrics;
use crate::observe::{ReplicaEndpoints, fixed_expectation};
use crate::policy;
use crate::reserve::{ReserveConfig, ReserveError};
use crate::watchdog::{Reconciler, Watchdog};

/// The finalizer the controller puts on every FailoverPolicy it runs.
pub const FINALIZER: &str = "understudy.dev/cleanup";

/// The name Events are reported under.
pub const CONTROLLER_NAME: &str = "understudy-operator";

/// How soon a policy is looked at again while a promotion is under way.
const PROMOTING_REQUEUE: Duration = Duration::from_secs(2);

/// The longest wait between retries of a failing reconcile of a policy that cannot run (its spec
/// does not validate), so that nothing shorter bounds it.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// The `Ready` reason for a Lease whose epoch went below the recorded one.
const LEASE_REGRESSED: &str = "LeaseRegressed";

/// Why a reconcile failed. One variant per phase of the pipeline.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object lacks a namespace, name or uid; the API server always sets them.
    #[error("the object has no {0}")]
    MissingObjectKey(&'static str),
    /// The epoch Lease is malformed or the API server refused a Lease request.
    #[error("epoch lease: {0}")]
    Lease(#[source] LeaseError),
    /// The epoch Lease names a holder that is neither pool of the policy (a pool was renamed).
    #[error("the epoch lease names {holder:?}, which is neither of the policy's pools")]
    LeaseHolderUnknown { holder: String },
    /// Somebody else moved the epoch Lease first. Nothing was written after it.
    #[error("lost the compare-and-set on the epoch lease; acting on nothing until it is read again")]
    LostRace,
    /// The Lease could not be read or written: control actions are paused.
    #[error("the control plane cannot be reached, control actions are paused: {0}")]
    ControlPlaneUnreachable(#[source] LeaseError),
    /// Scaling a pool's workload or reading its replicas failed.
    #[error("{step:?} on workload {workload}: {source}")]
    Workload {
        step: Step,
        workload: String,
        #[source]
        source: kube::Error,
    },
    /// The status could not be written.
    #[error("status patch: {0}")]
    StatusPatch(#[source] kube::Error),
    /// The status patch got no answer in time.
    #[error("status patch got no answer within {0:?}")]
    StatusTimeout(Duration),
    /// Reading the standby's workload, or applying or deleting a GPU reserve, failed.
    #[error("GPU reserve: {object}: {source}")]
    Reserve {
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The standby's workload does not say what a replica requests.
    #[error("GPU reserve: {0}")]
    ReserveShape(#[source] ReserveError),
    /// A Deployment that is not this policy's reserve already has the reserve's name; it is left
    /// as it is.
    #[error(
        "GPU reserve: Deployment {deployment} exists and is not this policy's reserve; it is left as \
         it is, and no GPUs are held until it is renamed or removed"
    )]
    ReserveNameTaken { deployment: String },
    /// The operator's record could not be serialized.
    #[error("the operator's record cannot be serialized: {0}")]
    Record(#[source] serde_json::Error),
    /// Adding or removing the finalizer failed, or the wrapped reconcile did.
    #[error("{0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
}

impl Error {
    /// The phase that failed, from a closed list: a metrics label and an Event reason.
    #[must_use]
    pub fn category(&self) -> &'static str {
        match self {
            Error::MissingObjectKey(_) => "object",
            Error::Lease(_) => "lease",
            Error::LeaseHolderUnknown { .. } => "lease_holder",
            Error::LostRace => "lost_race",
            Error::ControlPlaneUnreachable(_) => "control_plane_unreachable",
            Error::Workload { .. } => "workload",
            Error::Reserve { .. } | Error::ReserveShape(_) | Error::ReserveNameTaken { .. } => "reserve",
            Error::StatusPatch(_) | Error::StatusTimeout(_) => "status",
            Error::Record(_) => "record",
            Error::Finalizer(inner) => match inner.as_ref() {
                finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e.category(),
                _ => "finalizer",
            },
        }
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
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub observations: Arc<dyn ObservationSource>,
    /// Without one, a golden answer in status is kept while it fits the probe.
    pub findings: Option<Arc<dyn ProbeFindings>>,
    pub steps: Arc<dyn StepExecutor>,
    pub clock: Arc<dyn Clock>,
    /// The longest a status patch or an Event may take.
    pub write_timeout: Duration,
    /// How GPU reserves' placeholder pods run.
    pub reserve: ReserveConfig,
    /// Where each reconcile records that it runs, so that a stuck one is noticed.
    pub watchdog: Watchdog,
    /// How the pools' replicas are reached by the reconciles themselves: to keep the standby in
    /// its shape between promotions ([`crate::standby`]) and to count the promoted pool's
    /// replicas that pass the generating probe. Without it the standby is left as it runs and
    /// serving is counted by ready pods.
    pub replicas: Option<Arc<dyn ReplicaEndpoints>>,
    /// Consecutive failures per policy, for the error policy's backoff.
    failures: Mutex<HashMap<(String, String), u32>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("observations", &self.observations)
            .field("findings", &self.findings)
            .field("steps", &self.steps)
            .field("clock", &self.clock)
            .field("write_timeout", &self.write_timeout)
            .field("reserve", &self.reserve)
            .field("watchdog", &self.watchdog)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context that observes nothing, hands steps to their components, and reads the wall clock.
    #[must_use]
    pub fn new(client: Client, metrics: Arc<Metrics>, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.to_owned(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            observations: Arc::new(NoObservations),
            findings: None,
            steps: Arc::new(HandOffToComponents),
            clock: Arc::new(SystemClock::new()),
            write_timeout: Duration::from_secs(10),
            reserve: ReserveConfig::default(),
            watchdog: Watchdog::default(),
            replicas: None,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Reaches the pools' replicas through `replicas`: the standby is kept in its shape between
    /// promotions, and a promoted pool serves when enough replicas pass the generating probe.
    #[must_use]
    pub fn with_replicas(mut self, replicas: Arc<dyn ReplicaEndpoints>) -> Self {
        self.replicas = Some(replicas);
        self
    }

    /// What a replica's answer must be: the policy's expectation, or the golden answer recorded
    /// from the primary; `None` while neither is known.
    pub(crate) fn expectation(&self, policy: &FailoverPolicy) -> Option<Expectation> {
        let golden = match &self.findings {
            Some(source) => source.golden_answer(&ObjectRef::from_obj(policy)),
            None => policy.status.as_ref().and_then(|s| s.golden_answer.clone()),
        };
        fixed_expectation(&policy.spec.probe.expect, golden.as_ref())
    }

    #[must_use]
    pub fn with_observations(mut self, observations: Arc<dyn ObservationSource>) -> Self {
        self.observations = observations;
        self
    }

    #[must_use]
    pub fn with_findings(mut self, findings: Arc<dyn ProbeFindings>) -> Self {
        self.findings = Some(findings);
        self
    }

    #[must_use]
    pub fn with_steps(mut self, steps: Arc<dyn StepExecutor>) -> Self {
        self.steps = steps;
        self
    }

    #[must_use]
    pub fn with_reserve(mut self, reserve: ReserveConfig) -> Self {
        self.reserve = reserve;
        self
    }

    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    #[must_use]
    pub fn with_watchdog(mut self, watchdog: Watchdog) -> Self {
        self.watchdog = watchdog;
        self
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), u32>> {
        // A poisoned map only loses backoff counts; carry on with it.
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn policy_key(meta: &ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Reconciles one FailoverPolicy, including ones that do not deserialize.
pub async fn reconcile(
    object: Arc<DeserializeGuard<FailoverPolicy>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started();
    let _reconciling = ctx
        .watchdog
        .reconciling(Reconciler::FailoverPolicy, object.meta());
    let result = reconcile_guarded(&object, &ctx).await;
    if result.is_ok() {
        ctx.failures().remove(&policy_key(object.meta()));
    }
    result
}

async fn reconcile_guarded(
    object: &DeserializeGuard<FailoverPolicy>,
    ctx: &Context,
) -> Result<Action, Error> {
    let namespace = object
        .meta()
        .namespace
        .clone()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let policy = match &object.0 {
        Ok(policy) => policy,
        Err(invalid) => {
            if invalid.metadata.deletion_timestamp.is_some() {
                return release_unreadable(ctx, &invalid.metadata, &namespace).await;
            }
            // The guard keeps only the metadata; the stored Ready condition is read on its own so
            // that its transition time holds while the object stays unreadable.
            let previous_ready = stored_ready(ctx, &invalid.metadata, &namespace).await;
            return report_invalid(
                ctx,
                &invalid.metadata,
                &namespace,
                &invalid.error,
                previous_ready.as_ref(),
            )
            .await;
        }
    };
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.client.clone(), &namespace);
    finalizer(&api, FINALIZER, Arc::new(policy.clone()), |event| async {
        match event {
            FinalizerEvent::Apply(policy) => apply(&policy, ctx, &namespace).await,
            FinalizerEvent::Cleanup(policy) => cleanup(&policy, ctx, &namespace),
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Requeues a failed reconcile with exponential backoff and counts the failure.
pub fn error_policy(
    object: Arc<DeserializeGuard<FailoverPolicy>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics.reconcile_failed(error.category());
    let key = policy_key(object.meta());
    let failures = {
        let mut map = ctx.failures();
        let count = map.entry(key.clone()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    };
    let delay = backoff(failures, retry_cap(&object));
    tracing::warn!(namespace = %key.0, policy = %key.1, category = error.category(), %error, ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// One second after the first failure, doubling up to `cap`.
#[must_use]
pub fn backoff(consecutive_failures: u32, cap: Duration) -> Duration {
    let exponent = consecutive_failures.saturating_sub(1).min(16);
    Duration::from_secs(1u64 << exponent).min(cap)
}

/// The longest a failed reconcile of `object` waits before it is tried again: no longer than a
/// successful one would, so that a promotion under way is not left for minutes at a step (the
/// promoting requeue while the recorded phase is Promoting, the probe interval otherwise).
#[must_use]
pub fn retry_cap(object: &DeserializeGuard<FailoverPolicy>) -> Duration {
    let Ok(policy) = &object.0 else {
        return MAX_BACKOFF;
    };
    let Ok(validated) = policy::validate(&policy.spec) else {
        return MAX_BACKOFF;
    };
    let interval = validated.probe.interval;
    match load_record(policy.status.as_ref()).machine {
        Ok(Some(FailoverState {
            phase: Phase::Promoting(_),
            ..
        })) => PROMOTING_REQUEUE.min(interval),
        _ => interval,
    }
}

/// Runs the controller over one namespace or all of them until the stream ends.
pub async fn run(ctx: Arc<Context>, namespace: Option<&str>) {
    let policies: Api<DeserializeGuard<FailoverPolicy>> = match namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    // The epoch Leases are not watched: a label-less watch on Leases would stream every node's
    // heartbeat. The requeue at the probe interval reads each Lease instead.
    Controller::new(policies, watcher::Config::default().any_semantic())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|outcome| async move {
            match outcome {
                Ok((policy, _)) => tracing::debug!(%policy, "reconciled"),
                Err(error) => tracing::debug!(%error, "reconcile attempt"),
            }
        })
        .await;
}

/// A deleted policy leaves its pools as they are, and its epoch Lease too: serving must not stop
/// because a policy was removed, and a policy created again under the same name must carry on
/// from the Lease's epoch rather than start again at 0. Its GPU reserve, which holds GPUs and
/// serves nothing, goes with it through its owner reference.
fn cleanup(policy: &FailoverPolicy, ctx: &Context, namespace: &str) -> Result<Action, Error> {
    ctx.observations.forget(&ObjectRef::from_obj(policy));
    ctx.metrics.forget_policy(namespace, &policy.name_any());
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use understudy_core::failover::{Promotion, TransitionKind};
    use understudy_core::{Epoch, Pool};

    use super::*;

    #[test]
    fn backoff_doubles_from_one_second_and_stops_at_its_cap() {
        assert_eq!(backoff(1, MAX_BACKOFF), Duration::from_secs(1));
        assert_eq!(backoff(2, MAX_BACKOFF), Duration::from_secs(2));
        assert_eq!(backoff(5, MAX_BACKOFF), Duration::from_secs(16));
        assert_eq!(backoff(9, MAX_BACKOFF), Duration::from_secs(256));
        assert_eq!(backoff(10, MAX_BACKOFF), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX, MAX_BACKOFF), MAX_BACKOFF);
        assert_eq!(backoff(9, Duration::from_secs(10)), Duration::from_secs(10));
    }

    fn guarded(status: serde_json::Value) -> DeserializeGuard<FailoverPolicy> {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "understudy.dev/v1alpha1",
            "kind": "FailoverPolicy",
            "metadata": {"name": "llama", "namespace": "serving"},
            "spec": {
                "recoveryObjective": "5m",
                "probe": {"interval": "15s"},
                "pools": [
                    {"name": "us-east", "workload": {"kind": "Deployment", "name": "vllm-east"}, "replicas": 4},
                    {"name": "us-west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4},
                ],
            },
            "status": status,
        }))
        .unwrap_or_else(|e| panic!("fixture: {e}"))
    }

    #[test]
    fn a_failing_reconcile_waits_no_longer_than_a_successful_one_would() {
        let serving = serde_json::to_value(OperatorRecord {
            machine: FailoverState::new(),
            handled_command: None,
            handed_off: Vec::new(),
        })
        .unwrap_or_default();
        let promoting = serde_json::to_value(OperatorRecord {
            machine: FailoverState {
                phase: Phase::Promoting(Promotion {
                    kind: TransitionKind::Manual,
                    from: Pool::A,
                    to: Pool::B,
                    epoch: Epoch(1),
                    step: Step::Scale,
                    started_at: Duration::ZERO,
                    done: Vec::new(),
                    fault_seen_at: None,
                }),
                ..FailoverState::new()
            },
            handled_command: None,
            handed_off: Vec::new(),
        })
        .unwrap_or_default();
        let cap = |status| retry_cap(&guarded(status));
        assert_eq!(cap(serde_json::json!({"failover": promoting})), PROMOTING_REQUEUE);
        assert_eq!(
            cap(serde_json::json!({"failover": serving})),
            Duration::from_secs(15)
        );
        assert_eq!(cap(serde_json::json!({})), Duration::from_secs(15));
        // A garbled record is not a promotion under way.
        assert_eq!(
            cap(serde_json::json!({"failover": {"machine": 7}})),
            Duration::from_secs(15)
        );
        let unreadable: DeserializeGuard<FailoverPolicy> = serde_json::from_value(serde_json::json!({
            "apiVersion": "understudy.dev/v1alpha1", "kind": "FailoverPolicy",
            "metadata": {"name": "llama", "namespace": "serving"}, "spec": {"pools": 7},
        }))
        .unwrap_or_else(|e| panic!("fixture: {e}"));
        assert_eq!(retry_cap(&unreadable), MAX_BACKOFF);
    }

    #[test]
    fn a_failed_apply_is_counted_under_its_own_phase_not_the_finalizer() {
        let wrapped = Error::Finalizer(Box::new(finalizer::Error::ApplyFailed(Error::LostRace)));
        assert_eq!(wrapped.category(), "lost_race");
        let unnamed = Error::Finalizer(Box::new(finalizer::Error::UnnamedObject));
        assert_eq!(unnamed.category(), "finalizer");
    }
}

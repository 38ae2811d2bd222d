//! The FailoverPolicy controller: drives the failover state machine from Kubernetes.
//!
//! Each reconcile is a typed pipeline: validate the spec (pure, [`crate::policy`]) → read the
//! policy's epoch Lease, creating it when missing → load the state machine from
//! `status.failover` (or start afresh, and let the Lease's epoch be adopted) → feed it the Lease,
//! observations, a command from the annotation and a tick → carry out the promotion step it asks
//! for, one after the other → apply the status → publish its events and count what finished →
//! between promotions, keep the Lease's route on the routers → requeue. Before the status is
//! applied, the GPU reserve is kept where the Lease says the standby is ([`crate::reserve`]):
//! placeholder pods for the standby's pilot-light groups with `reserveGpus`, none for the primary
//! beyond the hand-over: a new primary's reserve stays until its own replicas are ready.
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
mod execution;
mod executor;
mod status;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions,
};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{self, Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use understudy_api::FIELD_MANAGER;
use understudy_core::drive::{Driven, StepOutcome, drive};
pub use understudy_core::failover::Observation;
use understudy_core::failover::{
    Action as MachineAction, ControlPlane, Event as MachineEvent, FailoverConfig, FailoverState, Input,
    Phase, Promotion, Step, TransitionKind,
};
use understudy_core::{Epoch, Pool};

pub use self::command::{COMMAND_ANNOTATION, COMMAND_WORDS, CommandRequest, HandledCommand, pending_command};
pub use self::execution::{
    Clock, HandOffToComponents, NoObservations, ObservationSource, RouteSyncReport, RouteSyncRequest,
    StepExecutor, StepReport, StepRequest, SystemClock, Workload,
};
use self::executor::{KubeExecutor, Waiting};
pub use self::status::{
    HandedOffStep, OperatorRecord, StatusFacts, StoredRecord, desired_status, invalid_spec_patch,
    load_record, merge_conditions, phase_name, rfc3339, step_name, timeline,
};
use crate::crd::{
    Condition, FailoverPolicy, FailoverPolicySpec, FailoverPolicyStatus, GoldenAnswer, GpuReserve,
    condition_type,
};
use crate::lease::{EpochLease, KubeLease, LeaseError, LeaseRecord};
use crate::metrics::Metrics;
use crate::policy::{self, pool_by_name, pool_name};
use crate::reserve::{
    POOL_LABEL, ReserveConfig, ReserveError, is_reserve_of, reserve_deployment, reserve_plan,
    reserve_selector, waiting_reserved, workload_shape,
};

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

/// Where the controller learns the golden answer a policy's probes judge by, to keep it in
/// `status.goldenAnswer`. The operator's is its [`crate::observe::ProbingObservations`].
pub trait GoldenAnswers: Send + Sync + fmt::Debug {
    /// The golden answer kept for `policy` now; `None` when there is none, yet or any more.
    fn golden_answer(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer>;
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub observations: Arc<dyn ObservationSource>,
    /// Without one, a golden answer in status is kept while it fits the probe.
    pub golden_answers: Option<Arc<dyn GoldenAnswers>>,
    pub steps: Arc<dyn StepExecutor>,
    pub clock: Arc<dyn Clock>,
    /// The longest a status patch or an Event may take.
    pub write_timeout: Duration,
    /// How GPU reserves' placeholder pods run.
    pub reserve: ReserveConfig,
    /// Consecutive failures per policy, for the error policy's backoff.
    failures: Mutex<HashMap<(String, String), u32>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("observations", &self.observations)
            .field("golden_answers", &self.golden_answers)
            .field("steps", &self.steps)
            .field("clock", &self.clock)
            .field("write_timeout", &self.write_timeout)
            .field("reserve", &self.reserve)
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
            golden_answers: None,
            steps: Arc::new(HandOffToComponents),
            clock: Arc::new(SystemClock),
            write_timeout: Duration::from_secs(10),
            reserve: ReserveConfig::default(),
            failures: Mutex::new(HashMap::new()),
        }
    }

    #[must_use]
    pub fn with_observations(mut self, observations: Arc<dyn ObservationSource>) -> Self {
        self.observations = observations;
        self
    }

    #[must_use]
    pub fn with_golden_answers(mut self, golden_answers: Arc<dyn GoldenAnswers>) -> Self {
        self.golden_answers = Some(golden_answers);
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

/// Something the reconcile tells the user about, as an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Notice {
    Machine(MachineEvent),
    LeaseCreated {
        holder: String,
        epoch: Epoch,
    },
    Handoff {
        step: Step,
        carried_by: &'static str,
        note: String,
    },
    UnknownCommand {
        value: String,
    },
    /// The record of handled commands could not be read, so the annotation was not run.
    CommandNotRun {
        value: String,
    },
    /// Placeholder pods hold, or now hold a different number of, the standby's GPUs.
    ReserveHeld(GpuReserve),
    /// A reserve no longer wanted (its pool is primary and ready, or the spec stopped asking) was
    /// deleted.
    ReserveReleased(GpuReserve),
}

/// The working state of one reconcile of a valid policy.
struct Run<'a> {
    spec: &'a FailoverPolicySpec,
    config: &'a FailoverConfig,
    now: Duration,
    machine: FailoverState,
    notices: Vec<Notice>,
    /// A promotion that finished during this reconcile.
    finished: Option<Promotion>,
    /// The latest promotion's steps that were left to other components, or carried out with a
    /// note.
    handed_off: Vec<HandedOffStep>,
    /// The GPU reserve held, as the status last recorded it and this reconcile left it.
    gpu_reserve: Option<GpuReserve>,
    /// The command annotation's value handled last, as this reconcile leaves it.
    handled_command: Option<HandledCommand>,
}

impl Run<'_> {
    fn feed(&mut self, input: Input) {
        let (next, actions) = self.machine.step(self.config, self.now, &input);
        for action in actions {
            // The pending step's action is carried out by the driver.
            if let MachineAction::Emit(event) = action {
                self.notices.push(Notice::Machine(event));
            }
        }
        self.machine = next;
    }

    /// Takes in one step the driver carried out: the machine after it, its events, the step's
    /// note for the timeline, and the promotion it finished.
    fn take(&mut self, driven: Driven<Waiting>) -> StepOutcome<Waiting> {
        self.machine = driven.state;
        self.notices
            .extend(driven.events.into_iter().map(Notice::Machine));
        if driven.finished.is_some() {
            self.finished = driven.finished;
        }
        if let StepOutcome::Done(done) = &driven.outcome {
            if let Some(note) = &done.note {
                self.note_step(driven.epoch, driven.step, note.clone(), done.handed_off);
            }
            if done.handed_off {
                self.notices.push(Notice::Handoff {
                    step: driven.step,
                    carried_by: done.carried_by,
                    note: done.note.clone().unwrap_or_default(),
                });
            }
        }
        driven.outcome
    }

    fn note_step(&mut self, epoch: Epoch, step: Step, note: String, handed_off: bool) {
        // Only the latest promotion's notes are shown; older ones are history.
        self.handed_off.retain(|h| h.epoch == epoch && h.step != step);
        self.handed_off.push(HandedOffStep {
            epoch,
            step,
            note,
            handed_off,
        });
    }

    fn pool_spec(&self, pool: Pool) -> &crate::crd::PoolSpec {
        // validate() guarantees two pools.
        &self.spec.pools[pool.index()]
    }

    fn record(&self) -> OperatorRecord {
        OperatorRecord {
            machine: self.machine.clone(),
            handled_command: self.handled_command.clone(),
            handed_off: self.handed_off.clone(),
        }
    }
}

/// Reads the epoch Lease; creates it when it does not exist, naming `recorded`: the primary and
/// epoch the policy's status last recorded, so that no epoch is ever reused.
async fn read_or_create_lease(
    lease: &impl EpochLease,
    spec: &FailoverPolicySpec,
    recorded: (Pool, Epoch),
) -> Result<(LeaseRecord, bool), LeaseError> {
    if let Some(record) = lease.read().await? {
        return Ok((record, false));
    }
    let (holder, epoch) = recorded;
    match lease.create(pool_name(spec, holder), epoch).await {
        Ok(record) => Ok((record, true)),
        // Created by somebody else between our read and our create: read theirs.
        Err(LeaseError::LostRace) => lease
            .read()
            .await?
            .map(|r| (r, false))
            .ok_or(LeaseError::LostRace),
        Err(error) => Err(error),
    }
}

/// The primary and epoch the status last recorded: the machine's when it reads, else the plain
/// `primaryPool` and `epoch` fields, else the home pool at epoch 0.
fn recorded_position(
    machine: Option<&FailoverState>,
    status: Option<&FailoverPolicyStatus>,
    spec: &FailoverPolicySpec,
) -> (Pool, Epoch) {
    if let Some(machine) = machine {
        return (machine.primary, machine.epoch);
    }
    let from_status = status.and_then(|s| {
        let pool = pool_by_name(spec, s.primary_pool.as_deref()?)?;
        Some((pool, Epoch(s.epoch?)))
    });
    from_status.unwrap_or((Pool::A, Epoch(0)))
}

/// What status recorded, as the reconcile starts from it.
struct Recorded {
    /// The state machine as status last recorded it; `None` for a new policy or an unreadable
    /// record, when the Lease, fed next, is the authority.
    machine: Option<FailoverState>,
    /// Whether the record of handled commands could be read: when it cannot, whether a command
    /// ran before is unknown and none is run.
    command_record_readable: bool,
}

/// The reconcile of a valid policy, as a pipeline: dereference what status recorded → validate
/// → observe the Lease and the pools → decide → execute the promotion's steps → keep the GPU
/// reserve → update status → publish what happened → keep the routers on the Lease's route.
async fn apply(policy: &FailoverPolicy, ctx: &Context, namespace: &str) -> Result<Action, Error> {
    // Before validation, so that a spec edited into nonsense stops being probed by its old self.
    ctx.observations.track(policy);
    let validated = match policy::validate(&policy.spec) {
        Ok(validated) => validated,
        Err(error) => {
            let previous_ready = policy
                .status
                .as_ref()
                .and_then(|s| s.conditions.get(condition_type::READY));
            return report_invalid(
                ctx,
                &policy.metadata,
                namespace,
                &error.to_string(),
                previous_ready,
            )
            .await;
        }
    };
    let (mut run, recorded) = dereference(policy, &validated.failover, ctx.clock.now(), namespace);
    // No owner reference: the epoch Lease outlives its policy (see the module doc).
    let lease = KubeLease::for_policy(Api::namespaced(ctx.client.clone(), namespace), &policy.name_any());
    let reference = policy.object_ref(&());
    let lease_now = observe(ctx, policy, namespace, &lease, &mut run, &recorded).await?;
    if lease_now.epoch < run.machine.epoch {
        // The machine ignores a lower epoch; without this, every promotion would lose its
        // compare-and-set and the policy would be stuck without a word.
        return report_lease_regressed(ctx, policy, namespace, &run, lease_now.epoch)
            .await
            .map(|()| Action::requeue(validated.probe.interval));
    }
    decide(&mut run, policy, recorded.command_record_readable);
    let executed = execute(ctx, policy, namespace, &lease, lease_now, &mut run, &recorded).await?;
    let lease_now = executed.lease_now;

    // The reserve follows the Lease as read or written in this reconcile, never a Lease that
    // could not be read or was lost.
    let reserve_error = match pool_by_name(&policy.spec, &lease_now.holder) {
        Some(primary) if run.machine.control_plane == ControlPlane::Reachable && run.machine.lease_known => {
            keep_reserve(ctx, &mut run, policy, namespace, primary)
                .await
                .err()
        }
        _ => None,
    };
    if let Some(error) = &reserve_error {
        // Told at once: nothing about a failed reserve is recorded, and it is tried again.
        warn(ctx, &reference, "GpuReserveFailed", error.to_string()).await;
    }

    let written = write_status(ctx, policy, namespace, &run, None).await;
    publish_recorded(
        ctx,
        policy,
        namespace,
        &run,
        written.is_ok(),
        executed.recorded_notices,
    )
    .await;
    let view_stale = keep_route(ctx, &run, &lease_now, policy, &reference).await;
    match (written, executed.error.or(reserve_error)) {
        // The step's failure is the cause (an unreachable Lease usually fails the status write
        // too); the status error is only logged, so the error counts under the step's category.
        (written, Some(error)) => {
            if let Err(status_error) = written {
                tracing::warn!(%namespace, policy = %policy.name_any(), error = %status_error, "status not written");
            }
            Err(error)
        }
        (Err(error), None) => Err(error),
        (Ok(()), None) => Ok(Action::requeue(match run.machine.phase {
            Phase::Promoting(_) => PROMOTING_REQUEUE.min(validated.probe.interval),
            // A router ahead of us means the Lease moved: read it again soon.
            _ if view_stale => PROMOTING_REQUEUE.min(validated.probe.interval),
            _ => validated.probe.interval,
        })),
    }
}

/// Reads what status recorded into the reconcile's working state: the machine (or a fresh one,
/// when it is missing or unreadable), the handled command, the timeline's notes, the reserve.
fn dereference<'a>(
    policy: &'a FailoverPolicy,
    config: &'a FailoverConfig,
    now: Duration,
    namespace: &str,
) -> (Run<'a>, Recorded) {
    let name = policy.name_any();
    let stored = load_record(policy.status.as_ref());
    let machine = stored.machine.unwrap_or_else(|error| {
        // Start afresh at the home pool and epoch 0: the Lease, fed below, is the authority, and a
        // newer epoch in it is adopted by re-running the steps after the lease write.
        tracing::warn!(%namespace, policy = %name, %error, "status.failover.machine unreadable; adopting the lease");
        None
    });
    let (handled_command, command_record_readable) = match stored.handled_command {
        Ok(handled) => (handled, true),
        Err(error) => {
            tracing::warn!(%namespace, policy = %name, %error, "status.failover.handledCommand unreadable");
            (None, false)
        }
    };
    let run = Run {
        spec: &policy.spec,
        config,
        now,
        machine: machine.clone().unwrap_or_default(),
        notices: Vec::new(),
        finished: None,
        handed_off: stored.handed_off,
        gpu_reserve: policy.status.as_ref().and_then(|s| s.gpu_reserve.clone()),
        handled_command,
    };
    let recorded = Recorded {
        machine,
        command_record_readable,
    };
    (run, recorded)
}

/// Reads the epoch Lease (creating it when missing) and feeds the machine what is known of the
/// control plane, the Lease and both pools. An unreachable Lease pauses control: the paused state
/// is reported, best effort, and the reconcile ends with that error.
async fn observe(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    lease: &KubeLease,
    run: &mut Run<'_>,
    recorded: &Recorded,
) -> Result<LeaseRecord, Error> {
    let spec = &policy.spec;
    let reference = policy.object_ref(&());
    let position = recorded_position(recorded.machine.as_ref(), policy.status.as_ref(), spec);
    let lease_now = match read_or_create_lease(lease, spec, position).await {
        Ok((record, created)) => {
            if created {
                run.notices.push(Notice::LeaseCreated {
                    holder: record.holder.clone(),
                    epoch: record.epoch,
                });
            }
            record
        }
        Err(error) if error.is_unreachable() => {
            // Without a record there is nothing true to report: the epoch is unknown.
            if recorded.machine.is_some() {
                run.feed(Input::ControlPlane(ControlPlane::Unreachable));
                run.feed(Input::Tick);
                // Best effort: the status write likely fails the same way, and the error that
                // matters to the caller is that control is paused.
                if let Err(error) = write_status(ctx, policy, namespace, run, None).await {
                    tracing::warn!(%namespace, policy = %policy.name_any(), %error, "could not report the paused control plane");
                }
                publish(ctx, &reference, spec, &run.notices).await;
            }
            return Err(Error::ControlPlaneUnreachable(error));
        }
        Err(error) => {
            if let LeaseError::Malformed(why) = &error {
                let note = format!("the epoch Lease is malformed and is left as it is: {why}");
                warn(ctx, &reference, "LeaseMalformed", note).await;
            }
            return Err(Error::Lease(error));
        }
    };
    let Some(holder) = pool_by_name(spec, &lease_now.holder) else {
        let note = format!(
            "the epoch Lease names {:?}, which is neither of this policy's pools",
            lease_now.holder
        );
        warn(ctx, &reference, "LeaseHolderUnknown", note).await;
        return Err(Error::LeaseHolderUnknown {
            holder: lease_now.holder,
        });
    };
    run.feed(Input::ControlPlane(ControlPlane::Reachable));
    run.feed(Input::LeaseObserved {
        holder,
        epoch: lease_now.epoch,
    });
    // Observations before any command: they happened before this reconcile, and a command is
    // judged on the freshest view of both pools' health.
    for observation in ctx.observations.drain(&ObjectRef::from_obj(policy)) {
        run.feed(observation.into());
    }
    Ok(lease_now)
}

/// Feeds the command the annotation gives, once per value, and the tick on which the machine
/// decides.
fn decide(run: &mut Run<'_>, policy: &FailoverPolicy, command_record_readable: bool) {
    let annotation = policy
        .annotations()
        .get(COMMAND_ANNOTATION)
        .map(|value| value.trim())
        .filter(|value| !value.is_empty());
    match annotation {
        // Removing the annotation forgets the command, so the same value given later is new.
        None => run.handled_command = None,
        Some(value) if !command_record_readable => {
            // Whether this value ran already is unknown: never risk running it twice.
            run.notices.push(Notice::CommandNotRun {
                value: value.to_owned(),
            });
            run.handled_command = Some(HandledCommand {
                value: value.to_owned(),
            });
        }
        Some(value) => match pending_command(Some(value), run.handled_command.as_ref()) {
            Some(CommandRequest::New { command, handled }) => {
                run.feed(Input::Command(command));
                run.handled_command = Some(handled);
            }
            Some(CommandRequest::Unknown { handled }) => {
                run.notices.push(Notice::UnknownCommand {
                    value: handled.value.clone(),
                });
                run.handled_command = Some(handled);
            }
            None => {}
        },
    }
    run.feed(Input::Tick);
}

/// What carrying out the promotion's steps left.
struct Executed {
    /// The Lease as read, or as the compare-and-set wrote it.
    lease_now: LeaseRecord,
    /// How many notices a status write has recorded: the write-ahead makes its notices true even
    /// when the final write fails.
    recorded_notices: usize,
    /// The failure of the step the promotion waits at, reported once the status is written.
    error: Option<Error>,
}

/// Carries out the promotion, step after step through core's driver and the Kubernetes
/// executor, until it finishes or has to wait. A lost compare-and-set, or a write-ahead that
/// failed, ends the reconcile at once: the loser writes nothing, not even its status.
async fn execute(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    lease: &KubeLease,
    lease_now: LeaseRecord,
    run: &mut Run<'_>,
    recorded: &Recorded,
) -> Result<Executed, Error> {
    let shapes = policy.spec.standby_shapes();
    let mut executor = KubeExecutor {
        ctx,
        policy,
        namespace,
        lease,
        lease_now,
        write_ahead: None,
        wrote_ahead: false,
    };
    let mut executed = Executed {
        lease_now: executor.lease_now.clone(),
        recorded_notices: 0,
        error: None,
    };
    for _ in 0..=Step::ALL.len() {
        if let Some(MachineAction::CompareAndSetLease { .. }) = run.machine.pending_action() {
            // Write ahead: the promotion is in status before the Lease moves, so an operator
            // restarted after the write resumes it instead of adopting the new epoch and skipping
            // the remaining steps.
            executor.write_ahead = (recorded.machine.as_ref() != Some(&run.machine))
                .then(|| status_of(ctx, policy, run, None))
                .transpose()?;
        }
        let Some(driven) = drive(&run.machine, run.config, run.now, &shapes, &mut executor).await else {
            break;
        };
        let (step, carries_on) = (driven.step, driven.carries_on());
        if executor.wrote_ahead {
            executor.wrote_ahead = false;
            executed.recorded_notices = run.notices.len();
        }
        match driven.outcome {
            // The loser acts on nothing: no status, no events, no other write.
            StepOutcome::LostRace => return Err(Error::LostRace),
            StepOutcome::NotYet(Waiting::Abort(error)) => return Err(error),
            _ => {}
        }
        match run.take(driven) {
            StepOutcome::Done(_) if carries_on => continue,
            StepOutcome::Done(_) | StepOutcome::LostRace | StepOutcome::NotYet(Waiting::Abort(_)) => {}
            StepOutcome::NotYet(Waiting::NotYet(reason)) => {
                tracing::debug!(%namespace, policy = %policy.name_any(), ?step, %reason, "step not done yet");
            }
            StepOutcome::NotYet(Waiting::Refused {
                carried_by,
                reason,
                note,
            }) => {
                // Told at once, not after the status write: nothing about it is recorded, and the
                // next reconcile reads the Lease again before it tries once more.
                tracing::warn!(%namespace, policy = %policy.name_any(), ?step, carried_by, %note, "step refused");
                warn(ctx, &policy.object_ref(&()), reason, note).await;
            }
            StepOutcome::NotYet(Waiting::Failed(error))
            | StepOutcome::Unreachable(Waiting::Failed(error)) => {
                executed.error = Some(error);
            }
            StepOutcome::Unreachable(other) => {
                tracing::debug!(%namespace, policy = %policy.name_any(), ?step, ?other, "control plane unreachable");
            }
        }
        break;
    }
    executed.lease_now = executor.lease_now;
    Ok(executed)
}

/// Publishes the notices a status write has recorded, and counts the epoch and a finished
/// promotion once status records them: after a failed write the next reconcile runs the same
/// steps again, and would tell and count them twice.
async fn publish_recorded(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    written: bool,
    recorded_by_write_ahead: usize,
) {
    let recorded = if written {
        run.notices.len()
    } else {
        recorded_by_write_ahead
    };
    publish(ctx, &policy.object_ref(&()), run.spec, &run.notices[..recorded]).await;
    if written {
        let name = policy.name_any();
        ctx.metrics.set_epoch(namespace, &name, run.machine.epoch.0);
        if let Some(done) = &run.finished {
            ctx.metrics
                .failover_finished(namespace, &name, TransitionKind::as_str(done.kind));
        }
    }
}

/// Keeps the GPU reserves where `primary`, the Lease's holder, wants them: placeholder pods for
/// the standby's reserved pilot-light replicas that are not running (an old primary after a
/// failover still runs them all, and needs none), applied with server-side apply on every
/// reconcile. Every reserve of this policy is found by its labels, not by the status alone (a
/// reserve applied by a reconcile whose status write failed is recorded nowhere), and each one
/// not wanted is deleted: its pool's pilot light is running, or the spec no longer asks for it.
/// The reserve of a pool that became primary is kept until that pool's ready replicas cover the
/// reserved ones: meanwhile its pods preempt the placeholders one by one, and the GPUs freed go
/// to them rather than to whatever else waits. A reserve is deleted rather than scaled to zero:
/// its existence is what holds GPUs, and the next one is built afresh from the workload's
/// template. Only a Deployment labelled as a reserve and owned by this policy is ever applied
/// over or deleted.
async fn keep_reserve(
    ctx: &Context,
    run: &mut Run<'_>,
    policy: &FailoverPolicy,
    namespace: &str,
    primary: Pool,
) -> Result<(), Error> {
    let policy_name = policy.name_any();
    let policy_uid = policy.uid().ok_or(Error::MissingObjectKey("uid"))?;
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), namespace);
    let listed = deployments
        .list(&ListParams::default().labels(&reserve_selector(&policy_name)))
        .await
        .map_err(|source| Error::Reserve {
            object: "listing Deployments".to_owned(),
            source,
        })?;
    let existing: Vec<Deployment> = listed
        .items
        .into_iter()
        .filter(|d| is_reserve_of(&d.metadata, &policy_uid))
        .collect();

    let mut wanted = None;
    if let Some(mut plan) = reserve_plan(&policy_name, run.spec, primary) {
        let pool = run.pool_spec(plan.pool);
        let workload = Workload::new(ctx.client.clone(), namespace, &pool.workload);
        let object = workload.get().await.map_err(|source| Error::Reserve {
            object: format!("reading {:?} {}", pool.workload.kind, pool.workload.name),
            source,
        })?;
        let running = object
            .data
            .pointer("/spec/replicas")
            .and_then(serde_json::Value::as_u64)
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
        plan.replicas = waiting_reserved(plan.replicas, pool.replicas, running);
        if plan.replicas > 0 {
            let shape = workload_shape(pool.workload.kind, &pool.workload.name, &object.data)
                .map_err(Error::ReserveShape)?;
            wanted = Some((plan, shape));
        }
    }

    // A reserve of the primary's pool is kept while the primary's reserved replicas are not all
    // ready: they are what preempts its placeholders.
    let spec = run.spec;
    // validate() guarantees two pools.
    let primary_spec = &spec.pools[primary.index()];
    let handing_over = if existing
        .iter()
        .any(|d| reserve_pool(d) == Some(primary_spec.name.as_str()))
    {
        let reserved = reserve_plan(&policy_name, run.spec, primary.other()).map_or(0, |plan| plan.replicas);
        let ready = if reserved == 0 {
            0
        } else {
            let workload = Workload::new(ctx.client.clone(), namespace, &primary_spec.workload);
            workload.ready_replicas().await.map_err(|source| Error::Reserve {
                object: format!(
                    "reading {:?} {}",
                    primary_spec.workload.kind, primary_spec.workload.name
                ),
                source,
            })?
        };
        waiting_reserved(reserved, primary_spec.replicas, ready) > 0
    } else {
        false
    };

    let wanted_name = wanted.as_ref().map(|(plan, _)| plan.deployment.clone());
    if run
        .gpu_reserve
        .as_ref()
        .is_some_and(|held| Some(&held.deployment) != wanted_name.as_ref())
    {
        run.gpu_reserve = None;
    }
    let recorded = policy.status.as_ref().and_then(|s| s.gpu_reserve.clone());
    for deployment in &existing {
        let name = deployment.name_any();
        let pool = reserve_pool(deployment).unwrap_or_default().to_owned();
        if Some(&name) == wanted_name.as_ref() || (handing_over && pool == primary_spec.name) {
            continue;
        }
        // The uid precondition: a Deployment created under this name since the list is not ours.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: deployment.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match deployments.delete(&name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.is_not_found() || status.code == 409 => continue,
            Err(source) => {
                return Err(Error::Reserve {
                    object: format!("deleting Deployment {name}"),
                    source,
                });
            }
        }
        let replicas = recorded
            .as_ref()
            .filter(|held| held.deployment == name)
            .map_or(0, |held| held.replicas);
        run.notices.push(Notice::ReserveReleased(GpuReserve {
            pool,
            deployment: name,
            replicas,
        }));
    }

    let Some((plan, shape)) = wanted else {
        return Ok(());
    };
    if !existing.iter().any(|d| d.name_any() == plan.deployment) {
        // Not found among this policy's reserves: the name must be free, or ours unlabelled.
        match deployments.get_opt(&plan.deployment).await {
            Ok(None) => {}
            Ok(Some(found)) if is_reserve_of(&found.metadata, &policy_uid) => {}
            Ok(Some(_)) => {
                return Err(Error::ReserveNameTaken {
                    deployment: plan.deployment,
                });
            }
            Err(source) => {
                return Err(Error::Reserve {
                    object: format!("reading Deployment {}", plan.deployment),
                    source,
                });
            }
        }
    }
    let deployment = reserve_deployment(policy, &plan, &shape, &ctx.reserve).map_err(Error::ReserveShape)?;
    let params = PatchParams::apply(FIELD_MANAGER).force();
    deployments
        .patch(&plan.deployment, &params, &Patch::Apply(&deployment))
        .await
        .map_err(|source| Error::Reserve {
            object: format!("applying Deployment {}", plan.deployment),
            source,
        })?;
    let held = GpuReserve {
        pool: plan.pool_name,
        deployment: plan.deployment,
        replicas: plan.replicas,
    };
    if run.gpu_reserve.as_ref() != Some(&held) {
        run.notices.push(Notice::ReserveHeld(held.clone()));
    }
    run.gpu_reserve = Some(held);
    Ok(())
}

/// The pool a reserve Deployment holds GPUs for, from its label.
fn reserve_pool(deployment: &Deployment) -> Option<&str> {
    deployment
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(POOL_LABEL))
        .map(String::as_str)
}

/// Between promotions, makes the routers hold the primary at the current epoch: the home pool's
/// epoch-0 route, and the route for a router that restarted without its state or was just added,
/// are pushed by no promotion. Only what the Lease read in this reconcile says is pushed; the
/// routers fence anything older themselves. Returns whether a router was seen ahead of us.
async fn keep_route(
    ctx: &Context,
    run: &Run<'_>,
    lease: &LeaseRecord,
    policy: &FailoverPolicy,
    reference: &ObjectReference,
) -> bool {
    let machine = &run.machine;
    if matches!(machine.phase, Phase::Promoting(_))
        || lease.epoch != machine.epoch
        || lease.holder != pool_name(run.spec, machine.primary)
    {
        return false;
    }
    let request = RouteSyncRequest {
        policy,
        pool: run.pool_spec(machine.primary),
        epoch: machine.epoch,
    };
    let report = ctx.steps.keep_route(request).await;
    // Told at once, as the route sync's back-off lets them be: nothing about the routers is
    // recorded in status.
    for (reason, note) in report.warnings {
        warn(ctx, reference, reason, note).await;
    }
    report.view_stale
}

/// Reports a Lease whose epoch went below the recorded one (deleted and recreated by hand,
/// restored from a backup): a Warning Event when the condition is new, and `Ready=False` with
/// reason `LeaseRegressed`. No command is taken, nothing is decided, nothing else is written.
async fn report_lease_regressed(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    lease_epoch: Epoch,
) -> Result<(), Error> {
    let already_reported = policy
        .status
        .as_ref()
        .and_then(|s| s.conditions.get(condition_type::READY))
        .is_some_and(|ready| ready.reason == LEASE_REGRESSED);
    write_status(ctx, policy, namespace, run, Some(lease_epoch)).await?;
    let reference = policy.object_ref(&());
    if !already_reported {
        let note = format!(
            "the epoch Lease is at epoch {lease_epoch}, below the recorded epoch {}; no control action \
             is taken until the Lease is back at epoch {} or higher",
            run.machine.epoch, run.machine.epoch
        );
        warn(ctx, &reference, LEASE_REGRESSED, note).await;
    }
    publish(ctx, &reference, run.spec, &run.notices).await;
    Ok(())
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

/// Applies the status the reconcile's working state makes, with server-side apply, under the
/// write timeout.
async fn write_status(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    lease_behind: Option<Epoch>,
) -> Result<(), Error> {
    let status = status_of(ctx, policy, run, lease_behind)?;
    apply_status(ctx, namespace, &policy.name_any(), &status).await
}

/// The status the reconcile's working state makes: pure, but for asking the golden answers'
/// source what it keeps.
fn status_of(
    ctx: &Context,
    policy: &FailoverPolicy,
    run: &Run<'_>,
    lease_behind: Option<Epoch>,
) -> Result<FailoverPolicyStatus, Error> {
    let golden_answer = match &ctx.golden_answers {
        Some(source) => source.golden_answer(&ObjectRef::from_obj(policy)),
        None => policy
            .status
            .as_ref()
            .and_then(|status| status.golden_answer.clone())
            .filter(|golden| golden.fits(&run.spec.probe)),
    };
    desired_status(&StatusFacts {
        spec: run.spec,
        config: run.config,
        generation: policy.metadata.generation,
        previous: policy.status.as_ref(),
        record: &run.record(),
        finished: run.finished.as_ref(),
        lease_behind,
        gpu_reserve: run.gpu_reserve.as_ref(),
        golden_answer: golden_answer.as_ref(),
        now: run.now,
    })
    .map_err(Error::Record)
}

async fn apply_status(
    ctx: &Context,
    namespace: &str,
    name: &str,
    status: &FailoverPolicyStatus,
) -> Result<(), Error> {
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.client.clone(), namespace);
    let patch = serde_json::json!({
        "apiVersion": FailoverPolicy::api_version(&()),
        "kind": FailoverPolicy::kind(&()),
        "status": status,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match tokio::time::timeout(
        ctx.write_timeout,
        api.patch_status(name, &params, &Patch::Apply(&patch)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(Error::StatusPatch(error)),
        Err(_) => Err(Error::StatusTimeout(ctx.write_timeout)),
    }
}

/// Reports a policy that cannot be run: a Warning Event and `Ready=False` with reason
/// `InvalidSpec`, by a JSON merge patch that needs nothing but the object's metadata. Nothing
/// else is touched, and the policy waits for its next change.
async fn report_invalid(
    ctx: &Context,
    meta: &ObjectMeta,
    namespace: &str,
    message: &str,
    previous_ready: Option<&Condition>,
) -> Result<Action, Error> {
    let name = meta.name.clone().ok_or(Error::MissingObjectKey("name"))?;
    tracing::warn!(%namespace, policy = %name, %message, "invalid FailoverPolicy");
    let patch = invalid_spec_patch(meta.generation, message, previous_ready, ctx.clock.now());
    let api = untyped_policies(ctx, namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let written = match tokio::time::timeout(
        ctx.write_timeout,
        api.patch_status(&name, &params, &Patch::Merge(&patch)),
    )
    .await
    {
        Ok(result) => result.map(drop).map_err(Error::StatusPatch),
        Err(_) => Err(Error::StatusTimeout(ctx.write_timeout)),
    };
    warn(
        ctx,
        &reference_from_meta(meta, namespace),
        "InvalidSpec",
        message.to_owned(),
    )
    .await;
    written.map(|()| Action::await_change())
}

/// FailoverPolicies, untyped: an answer may be an object that does not deserialize.
fn untyped_policies(ctx: &Context, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        ctx.client.clone(),
        namespace,
        &ApiResource::erase::<FailoverPolicy>(&()),
    )
}

/// The `Ready` condition stored on a policy that does not deserialize; `None` when it has none or
/// it cannot be read now, and the report then takes the current time.
async fn stored_ready(ctx: &Context, meta: &ObjectMeta, namespace: &str) -> Option<Condition> {
    let name = meta.name.as_deref()?;
    let api = untyped_policies(ctx, namespace);
    let object = match tokio::time::timeout(ctx.write_timeout, api.get(name)).await {
        Ok(Ok(object)) => object,
        Ok(Err(error)) => {
            tracing::debug!(%namespace, policy = %name, %error, "could not read the stored Ready condition");
            return None;
        }
        Err(_) => return None,
    };
    let ready = object
        .data
        .get("status")?
        .get("conditions")?
        .get(condition_type::READY)?;
    serde_json::from_value(ready.clone()).ok()
}

/// Removes the finalizer from a policy that is being deleted but no longer deserializes, so that
/// an unreadable object can still go away. The resourceVersion in the patch makes it a
/// compare-and-set: a concurrent change to the finalizers fails it, and it is retried.
async fn release_unreadable(ctx: &Context, meta: &ObjectMeta, namespace: &str) -> Result<Action, Error> {
    let name = meta.name.clone().ok_or(Error::MissingObjectKey("name"))?;
    let finalizers = meta.finalizers.clone().unwrap_or_default();
    if !finalizers.iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let remaining: Vec<&String> = finalizers.iter().filter(|f| *f != FINALIZER).collect();
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": meta.resource_version, "finalizers": remaining }
    });
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    api.patch_metadata(&name, &params, &Patch::Merge(&patch))
        .await
        .map_err(|e| Error::Finalizer(Box::new(finalizer::Error::RemoveFinalizer(e))))?;
    Ok(Action::await_change())
}

fn reference_from_meta(meta: &ObjectMeta, namespace: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some(FailoverPolicy::api_version(&()).into_owned()),
        kind: Some(FailoverPolicy::kind(&()).into_owned()),
        name: meta.name.clone(),
        namespace: Some(namespace.to_owned()),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        ..ObjectReference::default()
    }
}

/// Publishes one Warning Event, best effort.
async fn warn(ctx: &Context, reference: &ObjectReference, reason: &str, note: String) {
    let event = KubeEvent {
        type_: EventType::Warning,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    send(ctx, reference, &event).await;
}

/// Publishes the reconcile's notices as Events, best effort: an Event that cannot be written is
/// logged, never a reason to fail a reconcile whose state is already recorded.
async fn publish(ctx: &Context, reference: &ObjectReference, spec: &FailoverPolicySpec, notices: &[Notice]) {
    for notice in notices {
        send(ctx, reference, &describe(notice, spec)).await;
    }
}

async fn send(ctx: &Context, reference: &ObjectReference, event: &KubeEvent) {
    match tokio::time::timeout(ctx.write_timeout, ctx.recorder.publish(event, reference)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(reason = %event.reason, %error, "could not publish event"),
        Err(_) => tracing::warn!(reason = %event.reason, "publishing an event timed out"),
    }
}

/// The Event a notice becomes.
fn describe(notice: &Notice, spec: &FailoverPolicySpec) -> KubeEvent {
    let name = |pool: Pool| pool_name(spec, pool).to_owned();
    let (type_, reason, note, action) = match notice {
        Notice::LeaseCreated { holder, epoch } => (
            EventType::Normal,
            "LeaseCreated",
            format!("created the epoch Lease: {holder} is primary at epoch {epoch}"),
            "Lease",
        ),
        Notice::Handoff {
            step,
            carried_by,
            note,
        } => (
            EventType::Normal,
            "StepHandedOff",
            format!("{}: handed off to {carried_by}; {note}", step_name(*step)),
            "Promote",
        ),
        Notice::ReserveHeld(reserve) => (
            EventType::Normal,
            "GpuReserveHeld",
            format!(
                "placeholder pods (Deployment {}) hold the GPUs of {} pilot-light replicas of {}",
                reserve.deployment, reserve.replicas, reserve.pool
            ),
            "Reserve",
        ),
        Notice::ReserveReleased(reserve) => (
            EventType::Normal,
            "GpuReserveReleased",
            format!(
                "deleted Deployment {}: the GPUs held for {} are released",
                reserve.deployment, reserve.pool
            ),
            "Reserve",
        ),
        Notice::UnknownCommand { value } => (
            EventType::Warning,
            "UnknownCommand",
            format!("{COMMAND_ANNOTATION}={value:?} names no command; use {COMMAND_WORDS}"),
            "Command",
        ),
        Notice::CommandNotRun { value } => (
            EventType::Warning,
            "CommandNotRun",
            format!(
                "{COMMAND_ANNOTATION}={value:?} was not run: the record of handled commands was \
                 unreadable, so whether it ran before is unknown; give it again with a new @token"
            ),
            "Command",
        ),
        Notice::Machine(event) => match event {
            MachineEvent::PrimarySuspect { pool, failures } => (
                EventType::Warning,
                "PrimarySuspect",
                format!("{} failed {failures} checks in a row", name(*pool)),
                "Check",
            ),
            MachineEvent::PrimaryRecovered { pool } => (
                EventType::Normal,
                "PrimaryRecovered",
                format!("{} passes its checks again", name(*pool)),
                "Check",
            ),
            MachineEvent::PromotionStarted {
                kind,
                from,
                to,
                epoch,
            } => (
                EventType::Normal,
                "PromotionStarted",
                format!(
                    "{kind:?}: promoting {} over {} at epoch {epoch}",
                    name(*to),
                    name(*from)
                ),
                "Promote",
            ),
            MachineEvent::PromotionFinished { kind, to, epoch } => (
                EventType::Normal,
                "PromotionFinished",
                format!("{kind:?}: {} is primary at epoch {epoch}", name(*to)),
                "Promote",
            ),
            MachineEvent::PromotionBlocked { reason } => (
                EventType::Warning,
                "PromotionBlocked",
                format!("the primary is failing and nothing can be promoted: {reason:?}"),
                "Promote",
            ),
            MachineEvent::CommandRefused { command, reason } => (
                EventType::Warning,
                "CommandRefused",
                format!("{command:?} refused: {reason:?}"),
                "Command",
            ),
            MachineEvent::LostRace { epoch } => (
                EventType::Warning,
                "LostRace",
                format!("another writer moved the epoch Lease before epoch {epoch} could be claimed"),
                "Promote",
            ),
            MachineEvent::EpochAdopted { holder, epoch } => (
                EventType::Normal,
                "EpochAdopted",
                format!(
                    "the epoch Lease names {} at epoch {epoch}; adopted",
                    name(*holder)
                ),
                "Lease",
            ),
            MachineEvent::ControlPlaneUnreachable => (
                EventType::Warning,
                "ControlPlaneUnreachable",
                "the epoch Lease cannot be read; control actions are paused, the primary keeps serving"
                    .to_owned(),
                "Lease",
            ),
            MachineEvent::ControlPlaneRestored => (
                EventType::Normal,
                "ControlPlaneRestored",
                "the epoch Lease can be read again".to_owned(),
                "Lease",
            ),
            MachineEvent::StepRetried { step, epoch } => (
                EventType::Normal,
                "StepWaiting",
                format!("{} at epoch {epoch} is not done yet; retrying", step_name(*step)),
                "Promote",
            ),
        },
    };
    KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: action.to_owned(),
        secondary: None,
    }
}

#[cfg(test)]
mod tests {
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

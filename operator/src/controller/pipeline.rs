//! The reconcile of a valid policy, as a pipeline: dereference what status recorded → validate
//! → observe the Lease and the pools → decide → execute the promotion's steps through core's
//! driver → keep the GPU reserve → between promotions, keep the standby in its shape and prove
//! it when due → time the cold starts the last promotion caused → update status → publish what
//! happened → keep the routers on the Lease's route. Each stage is a function of its own below,
//! in that order.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use understudy_api::FIELD_MANAGER;
use understudy_core::drive::{Driven, StepOutcome, drive};
use understudy_core::failover::{
    Action as MachineAction, CheckResult, ControlPlane, FailoverConfig, FailoverState, Input, Phase,
    Promotion, Step, TransitionKind,
};
use understudy_core::{Epoch, Pool};
use understudy_prober::probe::Expectation;
use understudy_prober::sleep::WakeTimeouts;

use super::events::{Notice, publish, send, warn};
use super::execution::Workload;
use super::executor::{KubeExecutor, Waiting};
use super::gpu_reserve::keep_reserve;
use super::invalid::report_invalid;
use super::status::timeline_note;
use super::{
    COMMAND_ANNOTATION, CommandRequest, Context, Error, HandedOffStep, HandledCommand, LEASE_REGRESSED,
    OperatorRecord, PROMOTING_REQUEUE, RouteSyncRequest, StatusFacts, desired_status, load_record,
    pending_command, rfc3339, timeline,
};
use crate::coldstart;
use crate::crd::{
    ColdStartBreakdown, FailoverPolicy, FailoverPolicySpec, FailoverPolicyStatus, GpuReserve, ParityDrift,
    ParityStatus, StandbyProofRecord, condition_type,
};
use crate::lease::{EpochLease, KubeLease, LeaseError, LeaseRecord};
use crate::observe::probe_spec;
use crate::parity;
use crate::policy::ValidatedPolicy;
use crate::policy::{self, pool_by_name, pool_name};
use crate::standby::{self, Sleep};

/// The working state of one reconcile of a valid policy.
pub(super) struct Run<'a> {
    pub(super) spec: &'a FailoverPolicySpec,
    pub(super) config: &'a FailoverConfig,
    pub(super) now: Duration,
    pub(super) machine: FailoverState,
    pub(super) notices: Vec<Notice>,
    /// A promotion that finished during this reconcile.
    pub(super) finished: Option<Promotion>,
    /// The latest promotion's steps that were left to other components, or carried out with a
    /// note.
    pub(super) handed_off: Vec<HandedOffStep>,
    /// The GPU reserve held, as the status last recorded it and this reconcile left it.
    pub(super) gpu_reserve: Option<GpuReserve>,
    /// The command annotation's value handled last, as this reconcile leaves it.
    pub(super) handled_command: Option<HandledCommand>,
    /// `status.coldStart` with this reconcile's measurements in; `None` when none were taken.
    pub(super) cold_start: Option<Vec<ColdStartBreakdown>>,
    /// The standby proof this reconcile ran.
    pub(super) standby_proof: Option<StandbyProofRecord>,
    /// The last comparison of the pools, read once per reconcile so that status, the drift
    /// Events and the standby's keeper all see the same one: a promotion forced past its drift
    /// says so.
    pub(super) parity: Option<ParityStatus>,
}

impl Run<'_> {
    /// The keys the standby drifts in, as last compared.
    fn parity_drift(&self) -> &[ParityDrift] {
        self.parity.as_ref().map_or(&[], |p| p.drift.as_slice())
    }

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
            let forced =
                matches!(&self.machine.phase, Phase::Promoting(p) if p.kind == TransitionKind::Forced);
            if driven.step == Step::AcquireLease && forced && !self.parity_drift().is_empty() {
                let note = format!(
                    "promoted by force-failover past parity drift: {}",
                    parity::drift_line(self.parity_drift())
                );
                self.notices.push(Notice::ParityOverridden(note.clone()));
                self.note_step(driven.epoch, driven.step, note, false);
            }
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

    pub(super) fn pool_spec(&self, pool: Pool) -> &crate::crd::PoolSpec {
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
pub(super) async fn read_or_create_lease(
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
pub(super) fn recorded_position(
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
pub(super) struct Recorded {
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
pub(super) async fn apply(policy: &FailoverPolicy, ctx: &Context, namespace: &str) -> Result<Action, Error> {
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
    run.parity = ctx
        .findings
        .as_ref()
        .and_then(|source| source.parity(&ObjectRef::from_obj(policy)))
        .or_else(|| policy.status.as_ref().and_then(|s| s.parity.clone()));
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
    if !executed.woken.is_empty() {
        let known = policy
            .status
            .as_ref()
            .map_or(&[][..], |s| s.cold_start.as_slice());
        run.cold_start = Some(coldstart::merge(known, executed.woken.clone()));
    }

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

    if let Some(primary) = pool_by_name(&policy.spec, &lease_now.holder)
        && run.machine.phase == Phase::Serving
        && run.machine.control_plane == ControlPlane::Reachable
        && run.machine.lease_known
        && !run.config.paused
    {
        keep_standby(
            ctx,
            policy,
            namespace,
            &validated,
            primary.other(),
            run.parity_drift(),
        )
        .await;
        prove_standby(ctx, policy, namespace, &validated, &mut run, primary.other()).await;
    }
    let started = measure_cold_starts(ctx, policy, namespace, &mut run).await;

    let written = write_status(ctx, policy, namespace, &run, None).await;
    if written.is_ok() {
        report_drift(ctx, policy, &run).await;
        // Counted once: a start recorded complete is not read again, and a replica is woken once
        // per promotion.
        for breakdown in executed.woken.iter().chain(&started) {
            ctx.metrics.cold_start(breakdown);
        }
    }
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
pub(super) fn dereference<'a>(
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
        cold_start: None,
        standby_proof: None,
        parity: None,
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
pub(super) async fn observe(
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
pub(super) fn decide(run: &mut Run<'_>, policy: &FailoverPolicy, command_record_readable: bool) {
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
pub(super) struct Executed {
    /// The Lease as read, or as the compare-and-set wrote it.
    lease_now: LeaseRecord,
    /// How many notices a status write has recorded: the write-ahead makes its notices true even
    /// when the final write fails.
    recorded_notices: usize,
    /// The failure of the step the promotion waits at, reported once the status is written.
    error: Option<Error>,
    /// The replicas the Wake step woke, timed.
    woken: Vec<ColdStartBreakdown>,
}

/// Carries out the promotion, step after step through core's driver and the Kubernetes
/// executor, until it finishes or has to wait. A lost compare-and-set, or a write-ahead that
/// failed, ends the reconcile at once: the loser writes nothing, not even its status.
pub(super) async fn execute(
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
        woken: Vec::new(),
        first_tokens: Vec::new(),
    };
    let mut executed = Executed {
        lease_now: executor.lease_now.clone(),
        recorded_notices: 0,
        error: None,
        woken: Vec::new(),
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
        let Some(driven) = drive(&run.machine, run.config, || run.now, &shapes, &mut executor).await else {
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
    executed.woken = executor.woken_breakdowns();
    executed.lease_now = executor.lease_now;
    Ok(executed)
}

/// Keeps `standby` in its shape ([`standby`]) when the operator can reach replicas: a Normal
/// Event says what changed; what could not be done is logged and tried again next time.
async fn keep_standby(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    standby_pool: Pool,
    parity_drift: &[ParityDrift],
) {
    let Some(replicas) = &ctx.replicas else {
        return;
    };
    let Some(pool) = policy.spec.pools.get(standby_pool.index()) else {
        return;
    };
    let sleep = match ctx.expectation(policy) {
        _ if !parity_drift.is_empty() => Sleep::Not(format!(
            "it drifts from the primary: {}",
            parity::drift_line(parity_drift)
        )),
        Some(expect) => Sleep::AfterProbe(expect),
        None => Sleep::Not("no golden answer is recorded yet to probe it against".to_owned()),
    };
    let probe = probe_spec(&policy.spec.probe, &validated.probe, Expectation::NonEmpty);
    let workload = Workload::new(ctx.client.clone(), namespace, &pool.workload);
    let kept = standby::keep(
        &workload,
        pool,
        replicas.as_ref(),
        namespace,
        &probe,
        sleep,
        WakeTimeouts::default(),
    )
    .await;
    match kept {
        Ok(kept) if kept.changed() => {
            let event = KubeEvent {
                type_: EventType::Normal,
                reason: "StandbyShaped".to_owned(),
                note: Some(format!("standby {}: {kept}", pool.name)),
                action: "Standby".to_owned(),
                secondary: None,
            };
            send(ctx, &policy.object_ref(&()), &event).await;
        }
        Ok(kept) if !kept.left_awake.is_empty() => {
            tracing::info!(%namespace, policy = %policy.name_any(), standby = %pool.name, %kept, "standby not in shape yet");
        }
        Ok(_) => {}
        Err(error) => {
            tracing::warn!(%namespace, policy = %policy.name_any(), standby = %pool.name, %error, "could not keep the standby in shape");
        }
    }
}

/// When `spec.standbyProof` says one is due, and the time is outside its windows, wakes one of the
/// standby's sleeping replicas, probes it and puts it back to sleep ([`standby::prove`]). A
/// failed proof is fed to the machine as a failed check of the standby, so it is not promoted
/// until it passes its checks again; either way an Event says what happened.
async fn prove_standby(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    run: &mut Run<'_>,
    standby_pool: Pool,
) {
    let (Some(replicas), Some(proof)) = (&ctx.replicas, &validated.standby_proof) else {
        return;
    };
    let Some(pool) = policy.spec.pools.get(standby_pool.index()) else {
        return;
    };
    let last = policy.status.as_ref().and_then(|s| s.standby_proof.as_ref());
    let last_at = last
        .and_then(|p| p.at.parse::<Timestamp>().ok())
        .and_then(|at| Duration::try_from(Timestamp::UNIX_EPOCH.duration_until(at)).ok());
    let due = last_at.is_none_or(|at| run.now.saturating_sub(at) >= proof.every);
    let Some(expect) = ctx.expectation(policy) else {
        return;
    };
    if !due || !proof.allowed_at(run.now) || pool.standby_shape().warm == 0 {
        return;
    }
    let spec = probe_spec(&policy.spec.probe, &validated.probe, Expectation::NonEmpty);
    let after = last.filter(|p| p.pool == pool.name).map(|p| p.replica.as_str());
    let proved = standby::prove(
        pool,
        replicas.as_ref(),
        namespace,
        &spec,
        expect,
        WakeTimeouts::default(),
        after,
    )
    .await;
    let proof = match proved {
        Ok(Some(proof)) => proof,
        Ok(None) => return,
        Err(error) => {
            tracing::warn!(%namespace, policy = %policy.name_any(), standby = %pool.name, %error, "could not prove the standby");
            return;
        }
    };
    if !proof.passed {
        run.feed(Input::Check {
            pool: standby_pool,
            result: CheckResult::SoftFail,
        });
    }
    let (type_, reason) = if proof.passed {
        (EventType::Normal, "StandbyProven")
    } else {
        (EventType::Warning, "StandbyProofFailed")
    };
    let event = KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(format!("{} {}: {}", pool.name, proof.replica, proof.detail)),
        action: "Prove".to_owned(),
        secondary: None,
    };
    send(ctx, &policy.object_ref(&()), &event).await;
    run.standby_proof = Some(StandbyProofRecord {
        at: rfc3339(run.now),
        pool: pool.name.clone(),
        replica: proof.replica,
        passed: proof.passed,
        detail: proof.detail,
    });
}

/// For a while after a promotion to a pool with a pilot light, reads the cold starts of the pods
/// it created until each one's API answers ([`coldstart`]), into the run's `cold_start`. Returns
/// the starts that completed in this reconcile.
async fn measure_cold_starts(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &mut Run<'_>,
) -> Vec<ColdStartBreakdown> {
    let previous = policy.status.as_ref();
    let known = match &run.cold_start {
        Some(this_reconcile) => this_reconcile.clone(),
        None => previous.map_or_else(Vec::new, |s| s.cold_start.clone()),
    };
    let Some(last) = previous.and_then(|s| s.last_failover.as_ref()) else {
        return Vec::new();
    };
    let Some(pool) = pool_by_name(run.spec, &last.to_pool).filter(|p| *p == run.machine.primary) else {
        return Vec::new();
    };
    let spec = run.pool_spec(pool);
    let pilot_light = spec.standby_shape().pilot_light as usize;
    let complete = known
        .iter()
        .filter(|b| b.pool == spec.name && coldstart::complete(b))
        .count();
    let Ok(started) = last.started_at.parse::<Timestamp>() else {
        return Vec::new();
    };
    let since_start = Duration::try_from(Timestamp::UNIX_EPOCH.duration_until(started))
        .map_or(Duration::MAX, |at| run.now.saturating_sub(at));
    if pilot_light == 0 || complete >= pilot_light || since_start > coldstart::MEASURE_FOR {
        return Vec::new();
    }
    let first_answered = |endpoint: &str| ctx.observations.first_answered(endpoint);
    match coldstart::measure(&ctx.client, namespace, spec, started, &known, first_answered).await {
        Ok(measured) if measured.is_empty() => Vec::new(),
        Ok(measured) => {
            let newly_complete = measured
                .iter()
                .filter(|b| coldstart::complete(b))
                .cloned()
                .collect();
            run.cold_start = Some(coldstart::merge(&known, measured));
            newly_complete
        }
        Err(error) => {
            tracing::warn!(%namespace, policy = %policy.name_any(), %error, "could not read the promotion's cold starts");
            Vec::new()
        }
    }
}

/// Tells, once status records it, when the standby starts to drift from the primary, drifts in
/// other keys, or stops drifting: a Warning Event `ParityDrift` naming each key, or a Normal
/// `ParityRestored`.
async fn report_drift(ctx: &Context, policy: &FailoverPolicy, run: &Run<'_>) {
    if !run.spec.parity.enabled {
        return;
    }
    let keys = |parity: Option<&ParityStatus>| -> Vec<String> {
        parity
            .map(|p| p.drift.iter().map(|d| d.key.clone()).collect())
            .unwrap_or_default()
    };
    let before = keys(policy.status.as_ref().and_then(|s| s.parity.as_ref()));
    let (Some(now), after) = (run.parity.as_ref(), keys(run.parity.as_ref())) else {
        return;
    };
    if before == after {
        return;
    }
    let (primary, standby) = (
        run.pool_spec(run.machine.primary).name.as_str(),
        run.pool_spec(run.machine.standby()).name.as_str(),
    );
    let (type_, reason, note) = if after.is_empty() {
        (
            EventType::Normal,
            "ParityRestored",
            format!("{standby} no longer differs from {primary}"),
        )
    } else {
        (
            EventType::Warning,
            "ParityDrift",
            format!(
                "{standby} differs from {primary}: {}; it is not promoted automatically until they agree \
                 (force-failover still promotes it)",
                parity::drift_line(&now.drift)
            ),
        )
    };
    let event = KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Compare".to_owned(),
        secondary: None,
    };
    send(ctx, &policy.object_ref(&()), &event).await;
}

/// Publishes the notices a status write has recorded, and counts the epoch and a finished
/// promotion once status records them: after a failed write the next reconcile runs the same
/// steps again, and would tell and count them twice.
pub(super) async fn publish_recorded(
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
            let finished = timeline(run.spec, done, run.machine.last_transition_end, &run.handed_off);
            let event = KubeEvent {
                type_: EventType::Normal,
                reason: "FailoverTimeline".to_owned(),
                note: Some(timeline_note(&finished)),
                action: "Promote".to_owned(),
                secondary: None,
            };
            send(ctx, &policy.object_ref(&()), &event).await;
        }
    }
}

/// Between promotions, makes the routers hold the primary at the current epoch: the home pool's
/// epoch-0 route, and the route for a router that restarted without its state or was just added,
/// are pushed by no promotion. Only what the Lease read in this reconcile says is pushed; the
/// routers fence anything older themselves. Returns whether a router was seen ahead of us.
pub(super) async fn keep_route(
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
pub(super) async fn report_lease_regressed(
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

/// Applies the status the reconcile's working state makes, with server-side apply, under the
/// write timeout.
pub(super) async fn write_status(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    lease_behind: Option<Epoch>,
) -> Result<(), Error> {
    let status = status_of(ctx, policy, run, lease_behind)?;
    apply_status(ctx, namespace, &policy.name_any(), &status).await?;
    ctx.metrics
        .set_conditions(namespace, &policy.name_any(), &status.conditions);
    Ok(())
}

/// The status the reconcile's working state makes: pure, but for asking the golden answers'
/// source what it keeps.
pub(super) fn status_of(
    ctx: &Context,
    policy: &FailoverPolicy,
    run: &Run<'_>,
    lease_behind: Option<Epoch>,
) -> Result<FailoverPolicyStatus, Error> {
    let probe_accepted = ctx
        .findings
        .as_ref()
        .and_then(|source| source.probe_accepted(&ObjectRef::from_obj(policy)));
    let golden_answer = match &ctx.findings {
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
        probe_accepted: probe_accepted
            .as_ref()
            .map(|r| r.as_ref().map_err(String::as_str).copied()),
        cold_start: run.cold_start.as_deref(),
        standby_proof: run.standby_proof.as_ref(),
        parity: run.parity.as_ref(),
        now: run.now,
    })
    .map_err(Error::Record)
}

pub(super) async fn apply_status(
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

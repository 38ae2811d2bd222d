//! Stage 4: carry the promotion out, step after step, through core's driver and the Kubernetes
//! executor.

use std::time::Duration;

use kube::{Resource, ResourceExt};
use understudy_core::drive::{StepOutcome, drive};
use understudy_core::failover::{Action as MachineAction, Step};

use super::context::Context;
use super::error::Error;
use super::executor::{KubeExecutor, Waiting};
use super::run::{Recorded, Run};
use super::update_status::status_of;
use crate::crd::{ColdStartBreakdown, FailoverPolicy};
use crate::lease::{KubeLease, LeaseRecord};
use crate::policy::validate;
use crate::reconciler::warn;

/// What carrying out the promotion's steps left.
pub(super) struct Executed {
    /// The Lease as read, or as the compare-and-set wrote it.
    pub(super) lease_now: LeaseRecord,
    /// How many notices a status write has recorded: the write-ahead makes its notices true even
    /// when the final write fails.
    pub(super) recorded_notices: usize,
    /// The failure of the step the promotion waits at, reported once the status is written.
    pub(super) error: Option<Error>,
    /// The replicas the Wake step woke, timed.
    pub(super) woken: Vec<ColdStartBreakdown>,
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
    // A policy that does not validate is never executed; were one, its steps would wait as before.
    let deadline = validate(&policy.spec).map_or(Duration::MAX, |v| v.promotion_deadline());
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
        // Each step is timed when it returns, not at the reconcile's start: a promotion's steps
        // up to the route often all run in one reconcile.
        let clock = ctx.shell.clock.clone();
        let Some(driven) = drive(
            &run.machine,
            run.config,
            || clock.now(),
            &shapes,
            deadline,
            &mut executor,
        )
        .await
        else {
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
                warn(&ctx.shell, &policy.object_ref(&()), reason, note).await;
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

//! The GameDay controller: starts runs when the schedule or a `run` command says so, moves them
//! with the run machine ([`super`]) against the FailoverPolicy's status, gives the policy its
//! commands, and records runs, verdicts and the next run in status.
//!
//! Each reconcile is a list of stages over one working state (`pass.rs`): handle the GameDay's
//! command annotation → work out the next scheduled time and whether a run is due → read the
//! policy (and whether another game day holds it) → advance the run → apply the status
//! (write-ahead: a command is recorded before it is given) → give the command with a
//! compare-and-set on the policy's resourceVersion → publish Events.
//!
//! What this controller must never do:
//! - give the policy a command while the steady state does not hold (the machine decides);
//! - run two game days on one policy at once: the command is given together with the annotation
//!   `understudy.dev/game-day` naming the game day, in one patch conditional on the
//!   resourceVersion the steady state was judged on, and a policy held by another game day with a
//!   run under way is not steady;
//! - write to the policy anything but those two annotations: the promotion, the fencing and the
//!   primary stay the policy controller's.

mod context;
mod error;
mod faults;
mod notices;
mod pass;
mod policy;
mod schedule;
mod watch;

use std::sync::Arc;

use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use crate::crd::GameDay;
use crate::gameday::PolicyCommand;
use crate::reconciler::{self, object_reference, send, warn};
use crate::watchdog::Reconciler;

pub use self::context::Context;
pub use self::context::{ACTIVE_REQUEUE, STARTING_DEADLINE};
pub use self::error::Error;
use self::notices::describe;
use self::pass::{Pass, SpecRead};
pub use self::policy::GAME_DAY_ANNOTATION;
use self::policy::release;

/// Runs the GameDay controller over one namespace or all of them until the stream ends.
pub async fn run(ctx: Arc<Context>, namespace: Option<&str>) {
    // Policies are not watched: a run under way is looked at every few seconds, and its
    // measurements come from the timestamps in the policy's status, not from when we look.
    reconciler::run(
        ctx.shell.client.clone(),
        ctx,
        namespace,
        reconcile,
        error_policy,
        futures::stream::empty(),
    )
    .await;
}

/// Retries a failed reconcile soon: a run under way is timed by the policy's clock, not ours.
pub fn error_policy(object: Arc<DeserializeGuard<GameDay>>, error: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(gameday = %object.name_any(), category = error.category(), %error, "game day reconcile failed");
    Action::requeue(ACTIVE_REQUEUE)
}

/// Reconciles one GameDay, including one that does not deserialize.
pub async fn reconcile(object: Arc<DeserializeGuard<GameDay>>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _reconciling = ctx.shell.watchdog.reconciling(Reconciler::GameDay, object.meta());
    match &object.0 {
        Ok(gameday) => reconcile_game_day(gameday, &ctx).await,
        Err(invalid) => {
            let reference = object_reference::<GameDay>(&invalid.metadata);
            warn(&ctx.shell, &reference, "InvalidSpec", invalid.error.clone()).await;
            Ok(Action::await_change())
        }
    }
}

/// One reconcile of a GameDay, as a list of stages: read the spec → handle the `run` command →
/// work out the schedule → start a run that is due → advance the run against the policy → file a
/// finished run → take a fault back → write the status ahead → give the policy its command →
/// release the policy → publish → requeue.
pub(super) async fn reconcile_game_day(gameday: &GameDay, ctx: &Context) -> Result<Action, Error> {
    let mut pass = Pass::begin(gameday, ctx.shell.clock.now())?;
    let spec = SpecRead::of(gameday);
    pass.report_spec(&spec, gameday);
    let run_now = pass.handle_command(gameday, spec.error.is_some());
    let due = pass.schedule(gameday, &spec, run_now);
    pass.start_run(run_now, due);
    let (command, policy) = match &spec.config {
        Ok(config) => pass.advance_run(ctx, gameday, config).await?,
        Err(_) => (None, None),
    };
    let released = pass.file_finished_run(gameday, policy.as_ref());
    if let (Some(PolicyCommand::Restore(pool)), Some(policy)) = (&command, &policy) {
        pass.take_fault_back(ctx, gameday, policy, pool).await?;
    }
    // Write-ahead: the run records the command before the policy is given it, so that a command
    // given is never one the game day forgot.
    if pass.status != pass.previous {
        let read_at = gameday.metadata.resource_version.as_deref();
        // Conditional on the resourceVersion the reconcile read: a reconcile that ran on a stale
        // cached copy (one that had not yet seen a run start) gets a 409 and is retried, instead
        // of starting the same run again over the live one.
        reconciler::apply_status::<GameDay, _>(
            &ctx.shell,
            &pass.namespace,
            &pass.name,
            read_at,
            &pass.status,
        )
        .await?;
    }
    if let (Some(command), Some(policy)) = (&command, &policy) {
        pass.give(ctx, policy, command).await?;
    }
    if let Some(policy) = released {
        release(ctx, &pass.namespace, &policy, &pass.name).await;
    }
    let reference = gameday.object_ref(&());
    for notice in &pass.notices {
        send(&ctx.shell, &reference, &describe(notice)).await;
    }
    Ok(pass.requeue())
}

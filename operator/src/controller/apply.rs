//! The reconcile of a valid policy as a list of stages, each in a file of its own:
//! dereference → validate → observe the Lease → decide → execute → keep the GPU reserve → hold
//! the primary's rollout → keep the standby → time cold starts → update status → publish → keep
//! the route.

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use understudy_core::failover::Phase;

use super::cold_starts::{measure_cold_starts, record_woken};
use super::context::{Context, PROMOTING_REQUEUE};
use super::decide::decide;
use super::dereference::dereference;
use super::error::Error;
use super::execute::execute;
use super::gpu_reserve::keep_reserve_where_the_lease_says;
use super::invalid::report_invalid_spec;
use super::keep_rollout::keep_rollout;
use super::keep_route::keep_route;
use super::keep_standby::keep_standby_between_promotions;
use super::observe_lease::{observe, report_lease_regressed};
use super::prove_load::{settle_load_proof, stop_load_proof_unless_serving, take_load_proof};
use super::publish::publish_written;
use super::update_status::write_status;
use crate::crd::{FailoverPolicy, ParityStatus};
use crate::lease::KubeLease;
use crate::policy;

/// The reconcile of a policy, as a list of stages: validate → dereference what status recorded →
/// observe the Lease and the pools → decide → execute the promotion's steps → keep the GPU reserve
/// → hold the primary's rollout until the standby has passed on it → between promotions, keep the
/// standby in its shape and prove it (by probe and at load) → time cold starts → update
/// status → publish what it recorded → keep the routers on the Lease's route.
pub(super) async fn apply(policy: &FailoverPolicy, ctx: &Context, namespace: &str) -> Result<Action, Error> {
    // Before validation, so that a spec edited into nonsense stops being probed by its old self.
    ctx.observations.track(policy);
    if let Some(grants) = &ctx.grants {
        grants.track(policy);
    }
    let validated = match policy::validate(&policy.spec) {
        Ok(validated) => validated,
        Err(error) => return report_invalid_spec(ctx, policy, namespace, &error.to_string()).await,
    };
    let (mut run, recorded) = dereference(policy, &validated.failover, ctx.shell.clock.now(), namespace);
    run.parity = parity_now(ctx, policy);
    // No owner reference: the epoch Lease outlives its policy (see the module doc).
    let lease = KubeLease::for_policy(
        Api::namespaced(ctx.shell.client.clone(), namespace),
        &policy.name_any(),
    );
    let lease_now = observe(ctx, policy, namespace, &lease, &mut run, &recorded).await?;
    if lease_now.epoch < run.machine.epoch {
        // The machine ignores a lower epoch; without this, every promotion would lose its
        // compare-and-set and the policy would be stuck without a word.
        return report_lease_regressed(ctx, policy, namespace, &run, lease_now.epoch)
            .await
            .map(|()| Action::requeue(validated.probe.interval));
    }
    let load_proof = take_load_proof(ctx, policy, &validated, &mut run);
    decide(&mut run, policy, recorded.command_record_readable);
    stop_load_proof_unless_serving(ctx, policy, &run);
    let executed = execute(ctx, policy, namespace, &lease, lease_now, &mut run, &recorded).await?;
    record_woken(&mut run, policy, &executed.woken);
    let reserve_error =
        keep_reserve_where_the_lease_says(ctx, &mut run, policy, namespace, &executed.lease_now).await;
    keep_rollout(ctx, policy, namespace, &validated, &mut run, &executed.lease_now).await;
    keep_standby_between_promotions(ctx, policy, namespace, &validated, &mut run, &executed.lease_now).await;
    let started = measure_cold_starts(ctx, policy, namespace, &mut run).await;
    let written = write_status(ctx, policy, namespace, &run, None).await;
    if written.is_ok() {
        settle_load_proof(ctx, policy, namespace, load_proof).await;
    }
    publish_written(ctx, policy, namespace, &run, written.is_ok(), &executed, &started).await;
    let view_stale = keep_route(ctx, &run, &executed.lease_now, policy, &policy.object_ref(&())).await;
    let requeue = match run.machine.phase {
        Phase::Promoting(_) => PROMOTING_REQUEUE.min(validated.probe.interval),
        // A router ahead of us means the Lease moved: read it again soon.
        _ if view_stale => PROMOTING_REQUEUE.min(validated.probe.interval),
        _ => validated.probe.interval,
    };
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
        (Ok(()), None) => Ok(Action::requeue(requeue)),
    }
}

/// The last comparison of the pools: the probing rounds' when they keep one, else what status
/// recorded.
fn parity_now(ctx: &Context, policy: &FailoverPolicy) -> Option<ParityStatus> {
    ctx.findings
        .as_ref()
        .and_then(|source| source.parity(&ObjectRef::from_obj(policy)))
        .or_else(|| policy.status.as_ref().and_then(|s| s.parity.clone()))
}

//! Stage 9, between promotions: keep the routers on the Lease's route.

use k8s_openapi::api::core::v1::ObjectReference;
use understudy_core::failover::Phase;

use super::context::Context;
use super::run::Run;
use crate::crd::FailoverPolicy;
use crate::lease::LeaseRecord;
use crate::policy::pool_name;
use crate::ports::RouteSyncRequest;
use crate::reconciler::warn;

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
    let serving = ctx.passed(policy, machine.primary);
    let request = RouteSyncRequest {
        policy,
        pool: run.pool_spec(machine.primary),
        epoch: machine.epoch,
        serving: serving.as_ref(),
    };
    let report = ctx.steps.keep_route(request).await;
    // Told at once, as the route sync's back-off lets them be: nothing about the routers is
    // recorded in status.
    for (reason, note) in report.warnings {
        warn(&ctx.shell, reference, reason, note).await;
    }
    report.view_stale
}

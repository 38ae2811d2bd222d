//! Stage 6: time the cold starts the last promotion caused.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::context::Context;
use super::run::Run;
use crate::coldstart;
use crate::crd::{ColdStartBreakdown, FailoverPolicy};
use crate::policy::pool_by_name;

/// For a while after a promotion to a pool with a pilot light, reads the cold starts of the pods
/// it created until each one's API answers ([`coldstart`]), into the run's `cold_start`. Returns
/// the starts that completed in this reconcile.
pub(super) async fn measure_cold_starts(
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
    match coldstart::measure(&ctx.clusters, namespace, spec, started, &known, first_answered).await {
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

/// Takes the replicas the Wake step woke, timed, into the run's `cold_start`.
pub(super) fn record_woken(run: &mut Run<'_>, policy: &FailoverPolicy, woken: &[ColdStartBreakdown]) {
    if woken.is_empty() {
        return;
    }
    let known = policy
        .status
        .as_ref()
        .map_or(&[][..], |s| s.cold_start.as_slice());
    run.cold_start = Some(coldstart::merge(known, woken.to_vec()));
}

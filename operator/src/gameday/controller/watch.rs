//! A run's record of loss and its stop conditions' evidence: the routers' counters, sampled while
//! the run recovers.

use std::time::Duration;

use super::context::Context;
use kube::ResourceExt;

use crate::crd::{FailoverPolicy, GameDayRun, RequestCounts};
use crate::gameday::{StopLimits, load};
use crate::peers::PolicyClusters;

/// Samples the routers' counters for an injected run: the first sample is what the run counts
/// from, each one updates its record of loss, and the samples of the last window are judged
/// against its stop conditions (the first that fires is kept).
pub(super) async fn watch_load(
    ctx: &Context,
    key: &str,
    run: &mut GameDayRun,
    stop: Option<&StopLimits>,
    now: Duration,
    policy: Option<&FailoverPolicy>,
) {
    let Some((routers, token)) = &ctx.routers else {
        return;
    };
    let namespace = policy.and_then(ResourceExt::namespace).unwrap_or_default();
    let clusters = policy.map(|policy| PolicyClusters::of(&namespace, policy));
    let routers = match routers.resolve(clusters).await {
        Ok(routers) => routers,
        Err(why) => {
            tracing::warn!(run = %key, %why, "no router's counters to read");
            return;
        }
    };
    let (counters, unread) = load::sample(&routers, token).await;
    for why in &unread {
        tracing::warn!(run = %key, %why, "a router's counters could not be read");
    }
    if unread.len() == routers.len() {
        return;
    }
    let counts = |c: &load::Counters| RequestCounts {
        sent: c.sent,
        failed: c.failed,
        shed: c.shed,
    };
    let before = *run.requests_before.get_or_insert_with(|| counts(&counters));
    let since = counters.since(&load::Counters {
        sent: before.sent,
        failed: before.failed,
        shed: before.shed,
        ttft: std::collections::BTreeMap::new(),
    });
    run.requests = Some(counts(&since));
    let mut samples = ctx.samples();
    if run.phase.is_final() {
        samples.remove(key);
        return;
    }
    let window = samples.entry(key.to_owned()).or_default();
    window.push_back((now, counters.clone()));
    let Some(stop) = stop else {
        return;
    };
    // Keep the newest sample at or before the window's start, as its beginning.
    while window.len() > 1
        && window
            .get(1)
            .is_some_and(|(at, _)| now.saturating_sub(*at) >= stop.window)
    {
        window.pop_front();
    }
    let Some((_, first)) = window.front() else {
        return;
    };
    if run.stop_condition.is_none()
        && let Some(fired) = stop.fired(&counters.since(first))
    {
        tracing::warn!(run = %key, %fired, "stop condition");
        run.stop_condition = Some(fired);
    }
}

//! Stage 8: tell (as Events) and count what a status write recorded, and the pools' drift.

use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use understudy_core::failover::TransitionKind;

use super::context::Context;
use super::events::publish;
use super::execute::Executed;
use super::run::Run;
use super::status::timeline;
use super::status::timeline_note;
use crate::crd::ColdStartBreakdown;
use crate::crd::{FailoverPolicy, ParityStatus};
use crate::parity;
use crate::reconciler::send;

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
    send(&ctx.shell, &policy.object_ref(&()), &event).await;
}

/// Tells, once status records it, when the holder's fences stop being confirmed (some ran out or
/// cannot be reached: a Warning `GrantsUnconfirmed`), when every one of them serves again
/// (`GrantsRenewed`), and when a fence refuses a grant because it knows a higher epoch (a Warning
/// `GrantRefused`).
async fn report_grants(ctx: &Context, policy: &FailoverPolicy) {
    let Some(now) = ctx
        .grants
        .as_ref()
        .and_then(|grants| grants.last(&kube::runtime::reflector::ObjectRef::from_obj(policy)))
        .map(|granted| granted.status())
    else {
        return;
    };
    let before = policy.status.as_ref().and_then(|s| s.grants.as_ref());
    let events = crate::grants::events(before, &now);
    for (type_, reason, note) in events {
        let event = KubeEvent {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: "Grant".to_owned(),
            secondary: None,
        };
        send(&ctx.shell, &policy.object_ref(&()), &event).await;
    }
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
            let finished = timeline(run.spec, done, run.machine.last_transition_end, &run.handed_off);
            let event = KubeEvent {
                type_: EventType::Normal,
                reason: "FailoverTimeline".to_owned(),
                note: Some(timeline_note(&finished)),
                action: "Promote".to_owned(),
                secondary: None,
            };
            send(&ctx.shell, &policy.object_ref(&()), &event).await;
        }
    }
}

/// What a status write leaves to tell and count: the drift, the cold starts timed (counted once:
/// a start recorded complete is not read again, and a replica is woken once per promotion), and
/// the notices the write recorded.
pub(super) async fn publish_written(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    run: &Run<'_>,
    written: bool,
    executed: &Executed,
    started: &[ColdStartBreakdown],
) {
    if written {
        report_drift(ctx, policy, run).await;
        report_grants(ctx, policy).await;
        for breakdown in executed.woken.iter().chain(started) {
            ctx.metrics.cold_start(breakdown);
        }
    }
    publish_recorded(ctx, policy, namespace, run, written, executed.recorded_notices).await;
}

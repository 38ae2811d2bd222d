//! Stage 5, between promotions: keep the standby in its shape and prove it when due, by probe and
//! at the primary's load.

use std::time::Duration;

use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use understudy_core::Pool;
use understudy_core::failover::{CheckResult, Input};
use understudy_prober::probe::Expectation;
use understudy_prober::sleep::{ReplicaWake, WakeTimeouts, wake_replica_at_its_level};

use super::context::Context;
use super::events::Notice;
use super::prove_load::{prove_load_when_due, stop_load_proof, stop_load_proof_unless_serving};
use super::run::Run;
use crate::crd::{FailoverPolicy, ParityDrift, StandbyProofRecord};
use crate::judge::probe_spec;
use crate::lease::LeaseRecord;
use crate::parity;
use crate::policy::ValidatedPolicy;
use crate::policy::pool_by_name;
use crate::reconciler::{rfc3339, send, since_epoch};
use crate::standby::{self, Sleep};
use crate::workload::Workload;
use understudy_core::failover::{ControlPlane, Phase};

/// Between promotions, while the Lease can be read and nothing is paused: keeps the standby in its
/// shape, then proves it when due.
pub(super) async fn keep_standby_between_promotions(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    run: &mut Run<'_>,
    lease_now: &LeaseRecord,
) {
    // A promotion that finished in this reconcile made the proven pool the primary.
    stop_load_proof_unless_serving(ctx, policy, run);
    let Some(primary) = pool_by_name(&policy.spec, &lease_now.holder) else {
        return;
    };
    if run.machine.phase != Phase::Serving
        || run.machine.control_plane != ControlPlane::Reachable
        || !run.machine.lease_known
        || run.config.paused
    {
        stop_load_proof(ctx, policy);
        if run.prove_load_now {
            run.notices.push(Notice::ProveLoadNotRun(
                "the policy is not between promotions (suspect, promoting, paused, or without a readable Lease)".to_owned(),
            ));
        }
        return;
    }
    keep_primary_awake(ctx, policy, primary);
    // The clock now, not the reconcile's start: the promotion may have finished in this reconcile.
    let now = ctx.shell.clock.now();
    if let Some(drained_at) = drained_at(policy, run, validated)
        && now < drained_at
    {
        tracing::info!(
            %namespace, policy = %policy.name_any(), left = ?drained_at - now,
            "the old primary drains its streams before it is put into its standby shape"
        );
        if run.prove_load_now {
            run.notices.push(Notice::ProveLoadNotRun(
                "the old primary still drains its streams after a planned move".to_owned(),
            ));
        }
        return;
    }
    if prove_load_when_due(ctx, policy, namespace, validated, run, primary.other()) {
        // The proof woke what it replays against and puts it back to sleep itself.
        return;
    }
    keep_standby(
        ctx,
        policy,
        namespace,
        validated,
        primary.other(),
        run.parity_drift(),
    )
    .await;
    prove_standby(ctx, policy, namespace, validated, run, primary.other()).await;
}

/// When the old primary of the last planned move (one no failure started: a switchover, a
/// failback, a command) has had its drain (`spec.stream.drainFor`) and may be put into its
/// standby shape, which cuts what still runs on it; `None` when the last move was a failover (it
/// does not wait: the old primary failed) or there was none.
fn drained_at(policy: &FailoverPolicy, run: &Run<'_>, validated: &ValidatedPolicy) -> Option<Duration> {
    let planned = match &run.finished {
        Some(promotion) => promotion.fault_seen_at.is_none(),
        None => policy
            .status
            .as_ref()?
            .last_failover
            .as_ref()?
            .fault_seen_at
            .is_none(),
    };
    (planned && !validated.drain_for.is_zero())
        .then(|| run.machine.last_transition_end?.checked_add(validated.drain_for))
        .flatten()
}

/// Wakes the primary's replicas a promotion went on without: those its last probing round found
/// asleep (a primary serves awake, so nothing else puts one to sleep), each on a task of its own,
/// so that a slow wake (a level-2 reload) holds up no reconcile. A Normal Event names each one
/// once it is awake; one that does not wake is logged and found again by the next round. A wake
/// still under way is never started twice.
fn keep_primary_awake(ctx: &Context, policy: &FailoverPolicy, primary: Pool) {
    let Some(pool) = policy.spec.pools.get(primary.index()) else {
        return;
    };
    let level = pool.standby_shape().sleep_level;
    for endpoint in ctx.asleep(policy, primary) {
        let (shell, reference, pool_name) = (ctx.shell.clone(), policy.object_ref(&()), pool.name.clone());
        tokio::spawn(async move {
            let (woken, level) = wake_replica_at_its_level(&endpoint, level, WakeTimeouts::default()).await;
            if woken != ReplicaWake::Woken {
                tracing::info!(primary = %pool_name, replica = %endpoint, ?woken, "a primary replica still sleeps");
                return;
            }
            let event = KubeEvent {
                type_: EventType::Normal,
                reason: "PrimaryWoken".to_owned(),
                note: Some(format!(
                    "woke {endpoint} of primary {pool_name} from sleep level {level}: the promotion went \
                     on without it; it joins the route once it passes"
                )),
                action: "Wake".to_owned(),
                secondary: None,
            };
            send(&shell, &reference, &event).await;
        });
    }
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
        Some(expect) => Sleep::AfterProbe(expect, ctx.host_room(policy, standby_pool)),
        None => Sleep::Not("no golden answer is recorded yet to probe it against".to_owned()),
    };
    let probe = probe_spec(&policy.spec.probe, &validated.probe, Expectation::NonEmpty);
    let client = match ctx.clusters.client(namespace, pool).await {
        Ok(client) => client,
        Err(error) => {
            tracing::warn!(policy = %policy.name_any(), %error, "the standby's cluster cannot be reached; its shape is kept later");
            return;
        }
    };
    let workload = Workload::new(client, namespace, &pool.workload);
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
            send(&ctx.shell, &policy.object_ref(&()), &event).await;
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
    let last_at = last.and_then(|p| since_epoch(&p.at));
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
    send(&ctx.shell, &policy.object_ref(&()), &event).await;
    run.standby_proof = Some(StandbyProofRecord {
        at: rfc3339(run.now),
        pool: pool.name.clone(),
        replica: proof.replica,
        passed: proof.passed,
        detail: proof.detail,
    });
}

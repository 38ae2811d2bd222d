//! Stage, between promotions: with `spec.rollout: standbyFirst`, hold the primary's serving
//! template until the standby has run it and passed on it ([`crate::rollout`]); let the hold go
//! when the policy stops asking for it.

use kube::ResourceExt;
use understudy_core::Pool;
use understudy_core::failover::{ControlPlane, Phase};

use super::context::Context;
use super::events::Notice;
use super::run::Run;
use crate::crd::{FailoverPolicy, PoolSpec, RolloutMode};
use crate::lease::LeaseRecord;
use crate::load_proof::Outcome;
use crate::parity;
use crate::policy::{ValidatedPolicy, pool_by_name};
use crate::reconciler::since_epoch;
use crate::rollout::{self, LastProof, PoolView, Standing};

/// Keeps the primary's workload held, or lets it roll, as [`rollout::decide`] says; while a
/// promotion is under way, or the Lease or the API server cannot be read, leaves every hold as it
/// is.
pub(super) async fn keep_rollout(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    run: &mut Run<'_>,
    lease_now: &LeaseRecord,
) {
    if policy.spec.rollout != RolloutMode::StandbyFirst {
        release(ctx, policy, namespace, run).await;
        return;
    }
    let Some(primary) = pool_by_name(&policy.spec, &lease_now.holder) else {
        return;
    };
    if run.machine.phase != Phase::Serving
        || run.machine.control_plane != ControlPlane::Reachable
        || !run.machine.lease_known
    {
        return;
    }
    let standby = primary.other();
    let flags = parity::flag_policy(&policy.spec.parity);
    let (Some(primary_spec), Some(standby_spec)) = (
        policy.spec.pools.get(primary.index()),
        policy.spec.pools.get(standby.index()),
    ) else {
        return;
    };
    let read = |pool: &PoolSpec| {
        let flags = &flags;
        let pool = pool.clone();
        async move {
            let client = ctx
                .clusters
                .client(namespace, &pool)
                .await
                .map_err(|e| e.to_string())?;
            rollout::read_pool(client, namespace, &pool, flags)
                .await
                .map_err(|e| format!("pool {}: {e}", pool.name))
        }
    };
    let (primary_view, standby_view) = match futures::future::try_join(read(primary_spec), read(standby_spec))
        .await
    {
        Ok(views) => views,
        Err(error) => {
            tracing::warn!(%namespace, policy = %policy.name_any(), %error, "could not read the pools' workloads for the rollout; holds stay as they are");
            return;
        }
    };
    let passed = ctx.passed(policy, standby).unwrap_or_default();
    // Without the routers' samples no proof runs, and none is waited for.
    let load_proof = validated
        .load_proof
        .as_ref()
        .filter(|_| ctx.load_proofs.is_some())
        .map(|_| last_proof(policy, run, standby_spec));
    let standing = Standing {
        primary: &primary_view,
        standby: &standby_view,
        standby_health: run.machine.health[standby.index()],
        passed: &passed,
        ready_after: run.config.standby_ready_after,
        stop_after: run.config.promote_after,
        allowed: &policy.spec.parity.allow_drift,
        load_proof,
        now: run.now,
    };
    let decision = rollout::decide(&standing, run.rollout.as_ref());
    // The standby rolls first: it is never held, whoever held it (the primary it was before a
    // promotion, or someone by hand).
    set_hold(ctx, policy, namespace, standby_spec, &standby_view, false).await;
    set_hold(ctx, policy, namespace, primary_spec, &primary_view, decision.hold).await;
    run.proof_wanted_since = decision.proof_wanted_since;
    if decision.moved {
        run.notices.push(Notice::Rollout(decision.record.clone()));
    }
    run.rollout = Some(decision.record);
}

/// Holds `pool`'s workload, or lets it go, unless `view` says it is so already; a failure is
/// logged and tried again next reconcile.
async fn set_hold(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    pool: &PoolSpec,
    view: &PoolView,
    held: bool,
) {
    if view.held == held || view.template.is_none() && view.running.is_empty() {
        return;
    }
    match hold(ctx, namespace, pool, held).await {
        Ok(()) => {
            tracing::info!(%namespace, policy = %policy.name_any(), pool = %pool.name, held, "rollout hold set");
        }
        Err(error) => {
            tracing::warn!(%namespace, policy = %policy.name_any(), pool = %pool.name, held, %error, "could not set the rollout hold; tried again next reconcile");
        }
    }
}

/// Holds `pool`'s workload or lets it go ([`rollout::hold`]), in the pool's own cluster.
async fn hold(ctx: &Context, namespace: &str, pool: &PoolSpec, held: bool) -> Result<(), String> {
    let client = ctx
        .clusters
        .client(namespace, pool)
        .await
        .map_err(|e| e.to_string())?;
    rollout::hold(client, namespace, pool, held)
        .await
        .map_err(|e| e.to_string())
}

/// The standby's last load proof, from this reconcile or from status.
fn last_proof(policy: &FailoverPolicy, run: &Run<'_>, standby: &PoolSpec) -> Option<LastProof> {
    let record = run.last_load_proof(policy, &standby.name)?;
    Some(LastProof {
        at: since_epoch(&record.at)?,
        proven: record.result == Outcome::Proven.as_str(),
        failed: record.result == Outcome::Failed.as_str(),
    })
}

/// A policy that no longer asks for standby-first: the pool its record held rolls as deployed,
/// and the record goes. A pool that cannot be let go yet keeps the record, and is tried again.
async fn release(ctx: &Context, policy: &FailoverPolicy, namespace: &str, run: &mut Run<'_>) {
    let Some(record) = &run.rollout else {
        return;
    };
    let Some(pool) =
        pool_by_name(&policy.spec, &record.pool).and_then(|p: Pool| policy.spec.pools.get(p.index()))
    else {
        run.rollout = None;
        return;
    };
    match hold(ctx, namespace, pool, false).await {
        Ok(()) => {
            run.notices.push(Notice::RolloutReleased {
                pool: pool.name.clone(),
            });
            run.rollout = None;
        }
        Err(error) => {
            tracing::warn!(%namespace, policy = %policy.name_any(), pool = %pool.name, %error, "could not let the rollout hold go; tried again next reconcile");
        }
    }
}

//! The standby's load proofs ([`crate::load_proof`]) as the reconcile sees them: every reconcile
//! takes a finished proof into the machine, status, an Event and metrics before anything is
//! decided; between promotions one is started when due; anything else cancels one under way.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use understudy_core::Pool;
use understudy_core::failover::{Input, Phase};

use super::context::Context;
use super::events::Notice;
use super::run::Run;
use crate::crd::{FailoverPolicy, LoadProofRecord};
use crate::load_proof::{Finished, Job, Outcome};
use crate::policy::{StandbyProof, ValidatedPolicy};
use crate::reconciler::{send, since_epoch};

/// How soon a proof is tried again after one that did not run, or while a failed one blocks
/// promotion, when `every` is longer.
const RETRY_AFTER: Duration = Duration::from_secs(10 * 60);

/// A finished proof this reconcile took in, to be settled once status holds it.
pub(super) struct Taken {
    id: u64,
    finished: Finished,
}

/// Takes in a proof that finished since the last reconcile: the machine learns whether the pool
/// kept its thresholds (a failure counts only where `blocksPromotion` says so, and where proofs
/// can run at all), and status will record it. The proof stays until [`settle_load_proof`]: a
/// reconcile that fails before its status is written takes it in again. Then a block the policy
/// no longer asks for (its `loadProof` removed, or made not to block) is lifted.
pub(super) fn take_load_proof(
    ctx: &Context,
    policy: &FailoverPolicy,
    validated: &ValidatedPolicy,
    run: &mut Run<'_>,
) -> Option<Taken> {
    let blocks = blocks_promotion(validated) && ctx.load_proofs.is_some();
    let finished = ctx
        .load_proofs
        .as_ref()
        .and_then(|proofs| proofs.finished(&ObjectRef::from_obj(policy)));
    let standby = run.machine.standby();
    let taken = finished.map(|(id, finished)| {
        // A proof of a pool that is the primary now says nothing the machine may act on.
        if finished.pool == standby
            && let Some(proven) = machine_input(finished.outcome, blocks)
        {
            run.feed(Input::LoadProof {
                pool: finished.pool,
                proven,
            });
        }
        run.load_proof = Some(finished.record.clone());
        Taken { id, finished }
    });
    if !blocks {
        for pool in [Pool::A, Pool::B] {
            if run.machine.load_proof_failed[pool.index()] {
                run.feed(Input::LoadProof { pool, proven: true });
            }
        }
    }
    taken
}

/// Once status holds a proof taken in: it is settled, and an Event and the metrics say what it
/// showed, once.
pub(super) async fn settle_load_proof(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    taken: Option<Taken>,
) {
    let (Some(proofs), Some(Taken { id, finished })) = (&ctx.load_proofs, taken) else {
        return;
    };
    proofs.settle(&ObjectRef::from_obj(policy), id);
    let (type_, reason) = match finished.outcome {
        Outcome::Proven => (EventType::Normal, "StandbyLoadProven"),
        Outcome::Failed => (EventType::Warning, "StandbyLoadProofFailed"),
        Outcome::NotRun => (EventType::Warning, "StandbyLoadProofNotRun"),
    };
    let event = KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(finished.record.summary()),
        action: "ProveLoad".to_owned(),
        secondary: None,
    };
    send(&ctx.shell, &policy.object_ref(&()), &event).await;
    ctx.metrics
        .load_proof(namespace, &policy.name_any(), &finished.record);
}

/// Whether a failed proof blocks promotion: only where the policy asks for proofs and does not
/// say otherwise.
fn blocks_promotion(validated: &ValidatedPolicy) -> bool {
    validated.load_proof.as_ref().is_some_and(|p| p.blocks_promotion)
}

/// What the machine is told of a proof: whether the pool counts as proven, `None` when nothing
/// was replayed (no evidence either way).
fn machine_input(outcome: Outcome, blocks: bool) -> Option<bool> {
    match outcome {
        Outcome::Proven => Some(true),
        Outcome::Failed => Some(!blocks),
        Outcome::NotRun => None,
    }
}

/// Stops a proof under way unless the policy is between promotions, and drops a finished one
/// whose pool a promotion made the primary. What a stopped proof woke stays awake
/// ([`crate::load_proof::LoadProofs::cancel`]).
pub(super) fn stop_load_proof_unless_serving(ctx: &Context, policy: &FailoverPolicy, run: &Run<'_>) {
    if run.machine.phase != Phase::Serving || run.finished.is_some() {
        stop_load_proof(ctx, policy);
    }
    if run.finished.is_some()
        && let Some(proofs) = &ctx.load_proofs
    {
        proofs.drop_finished(&ObjectRef::from_obj(policy));
    }
}

/// Stops a proof under way.
pub(super) fn stop_load_proof(ctx: &Context, policy: &FailoverPolicy) {
    if let Some(pool) = ctx
        .load_proofs
        .as_ref()
        .and_then(|proofs| proofs.cancel(&ObjectRef::from_obj(policy)))
    {
        tracing::info!(policy = %policy.name_any(), ?pool, "load proof stopped: the policy is not between promotions");
    }
}

/// Whether a scheduled proof is due at `now` after `last`: `every` after it, or after ten minutes
/// (when sooner) if it did not run or the standby is `blocked` by a failed one; and outside the
/// schedule's windows.
fn due(last: Option<&LoadProofRecord>, blocked: bool, schedule: &StandbyProof, now: Duration) -> bool {
    let last_at = last.and_then(|p| since_epoch(&p.at));
    let every = if blocked || last.is_some_and(|p| p.result == Outcome::NotRun.as_str()) {
        schedule.every.min(RETRY_AFTER)
    } else {
        schedule.every
    };
    last_at.is_none_or(|at| now.saturating_sub(at) >= every) && schedule.allowed_at(now)
}

/// Between promotions: starts the standby's load proof when `spec.loadProof` says one is due
/// and the time is outside its windows. True while one runs, so that the standby's keeper leaves
/// the replicas it woke alone.
pub(super) fn prove_load_when_due(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    run: &mut Run<'_>,
    standby: Pool,
) -> bool {
    let (Some(proofs), Some(replicas), Some(proof)) =
        (&ctx.load_proofs, &ctx.replicas, &validated.load_proof)
    else {
        if run.prove_load_now {
            let why = if validated.load_proof.is_none() {
                "the policy sets no spec.loadProof"
            } else {
                "the operator reads no routers' traffic (it has no router admin token)"
            };
            run.notices.push(Notice::ProveLoadNotRun(why.to_owned()));
        }
        return false;
    };
    let key = ObjectRef::from_obj(policy);
    match proofs.running(&key) {
        Some(pool) if pool == standby => return true,
        // The pool it proves was promoted: what it woke serves now.
        Some(_) => stop_load_proof(ctx, policy),
        None => {}
    }
    let Some(pool_spec) = policy.spec.pools.get(standby.index()) else {
        return false;
    };
    // This standby's last proof: the other pool's, from before a promotion, times nothing here.
    let last = run.last_load_proof(policy, &pool_spec.name);
    let blocked = run.machine.load_proof_failed[standby.index()];
    // A standby-first rollout waits for a proof of the standby on its new template.
    let for_rollout = run.proof_wanted_since.is_some() && proof.schedule.allowed_at(run.now);
    if !run.prove_load_now && !for_rollout && !due(last, blocked, &proof.schedule, run.now) {
        return false;
    }
    let started = proofs.start(Job {
        policy: Arc::new(policy.clone()),
        namespace: namespace.to_owned(),
        pool: standby,
        pool_spec: pool_spec.clone(),
        proof: proof.clone(),
        replicas: Arc::clone(replicas),
        started_at: run.now,
    });
    if started {
        tracing::info!(
            %namespace, policy = %policy.name_any(), standby = %pool_spec.name, duration = ?proof.duration,
            share = proof.rate_share, "load proof started"
        );
    }
    if !started && run.prove_load_now {
        run.notices.push(Notice::ProveLoadNotRun(
            "the last proof's result is still being recorded; give the command again".to_owned(),
        ));
    }
    started
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::crd::FailoverPolicySpec;
    use crate::policy::validate;

    fn validated(load_proof: &str) -> ValidatedPolicy {
        let spec: FailoverPolicySpec = serde_yaml::from_str(&format!(
            "pools:\n  - {{name: east, workload: {{kind: Deployment, name: a}}, replicas: 1}}\n  \
             - {{name: west, workload: {{kind: Deployment, name: b}}, replicas: 1}}\n\
             recoveryObjective: 1m\n{load_proof}"
        ))
        .unwrap();
        validate(&spec).unwrap()
    }

    #[test]
    fn a_failed_proof_blocks_promotion_unless_the_policy_says_it_must_not() {
        let blocking = validated("loadProof: {every: 1h}\n");
        let not_blocking = validated("loadProof: {every: 1h, blocksPromotion: false}\n");
        let none = validated("");
        assert_eq!(
            machine_input(Outcome::Failed, blocks_promotion(&blocking)),
            Some(false)
        );
        assert_eq!(
            machine_input(Outcome::Failed, blocks_promotion(&not_blocking)),
            Some(true)
        );
        assert_eq!(
            machine_input(Outcome::Failed, blocks_promotion(&none)),
            Some(true)
        );
        assert_eq!(
            machine_input(Outcome::Proven, blocks_promotion(&blocking)),
            Some(true)
        );
        assert_eq!(machine_input(Outcome::NotRun, blocks_promotion(&blocking)), None);
    }

    #[test]
    fn a_proof_is_due_every_so_often_and_sooner_after_one_that_did_not_run_or_failed() {
        let schedule = validated("loadProof: {every: 6h, notBetween: ['08:00-09:00']}\n")
            .load_proof
            .unwrap()
            .schedule;
        let at = |h: u64, m: u64| Duration::from_secs(20_000 * 86_400 + h * 3600 + m * 60);
        let record = |result: &str| {
            LoadProofRecord::new(
                crate::reconciler::rfc3339(at(0, 0)),
                "west".to_owned(),
                result,
                String::new(),
            )
        };
        assert!(due(None, false, &schedule, at(0, 0)), "never run");
        let proven = record("Proven");
        assert!(!due(Some(&proven), false, &schedule, at(5, 59)));
        assert!(due(Some(&proven), false, &schedule, at(6, 0)));
        assert!(
            !due(Some(&proven), false, &schedule, at(8, 30)),
            "inside its window"
        );
        let not_run = record("NotRun");
        assert!(!due(Some(&not_run), false, &schedule, at(0, 9)));
        assert!(due(Some(&not_run), false, &schedule, at(0, 10)));
        let failed = record("Failed");
        assert!(
            due(Some(&failed), true, &schedule, at(0, 10)),
            "blocked: tried again sooner"
        );
        assert!(!due(Some(&failed), false, &schedule, at(0, 10)));
    }
}

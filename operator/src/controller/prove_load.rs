//! The standby's load proofs ([`crate::load_proof`]) as the reconcile sees them: every reconcile
//! takes a finished proof into the machine, status, an Event and metrics before anything is
//! decided; between promotions one is started when due; anything else cancels one under way.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use understudy_core::Pool;
use understudy_core::failover::Input;

use super::context::Context;
use super::run::Run;
use crate::crd::FailoverPolicy;
use crate::load_proof::{Job, Outcome};
use crate::policy::ValidatedPolicy;
use crate::reconciler::send;

/// Takes in a proof that finished since the last reconcile: the machine learns whether the pool
/// kept its thresholds (a failure counts only where `blocksPromotion` says so), status records it,
/// an Event and the metrics say what it showed. Then a block the policy no longer asks for (its
/// `loadProof` removed, or made not to block) is lifted.
pub(super) async fn take_load_proof(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    run: &mut Run<'_>,
) {
    let blocks = blocks_promotion(validated);
    let finished = ctx
        .load_proofs
        .as_ref()
        .and_then(|proofs| proofs.take_finished(&ObjectRef::from_obj(policy)));
    if let Some(done) = finished {
        if let Some(proven) = machine_input(done.outcome, blocks) {
            run.feed(Input::LoadProof {
                pool: done.pool,
                proven,
            });
        }
        let (type_, reason) = match done.outcome {
            Outcome::Proven => (EventType::Normal, "StandbyLoadProven"),
            Outcome::Failed => (EventType::Warning, "StandbyLoadProofFailed"),
            Outcome::NotRun => (EventType::Warning, "StandbyLoadProofNotRun"),
        };
        let event = KubeEvent {
            type_,
            reason: reason.to_owned(),
            note: Some(done.record.summary()),
            action: "ProveLoad".to_owned(),
            secondary: None,
        };
        send(&ctx.shell, &policy.object_ref(&()), &event).await;
        ctx.metrics
            .load_proof(namespace, &policy.name_any(), &done.record);
        run.load_proof = Some(done.record);
    }
    if !blocks {
        for pool in [Pool::A, Pool::B] {
            if run.machine.load_proof_failed[pool.index()] {
                run.feed(Input::LoadProof { pool, proven: true });
            }
        }
    }
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

/// Stops a proof under way: the policy is promoting, paused or without a readable Lease.
pub(super) fn cancel_load_proof(ctx: &Context, policy: &FailoverPolicy) {
    if let Some(pool) = ctx
        .load_proofs
        .as_ref()
        .and_then(|proofs| proofs.cancel(&ObjectRef::from_obj(policy)))
    {
        tracing::info!(policy = %policy.name_any(), ?pool, "load proof cancelled: the policy is no longer between promotions");
    }
}

/// Between promotions: starts the standby's load proof when `spec.loadProof` says one is due
/// and the time is outside its windows. True while one runs, so that the standby's keeper leaves
/// the replicas it woke alone.
pub(super) fn prove_load_when_due(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    validated: &ValidatedPolicy,
    run: &Run<'_>,
    standby: Pool,
) -> bool {
    let (Some(proofs), Some(replicas), Some(proof)) =
        (&ctx.load_proofs, &ctx.replicas, &validated.load_proof)
    else {
        return false;
    };
    let key = ObjectRef::from_obj(policy);
    if proofs.running(&key) {
        return true;
    }
    let Some(pool_spec) = policy.spec.pools.get(standby.index()) else {
        return false;
    };
    let last = run
        .load_proof
        .as_ref()
        .or_else(|| policy.status.as_ref().and_then(|s| s.load_proof.as_ref()));
    let last_at = last
        .and_then(|p| p.at.parse::<Timestamp>().ok())
        .and_then(|at| Duration::try_from(Timestamp::UNIX_EPOCH.duration_until(at)).ok());
    let due = last_at.is_none_or(|at| run.now.saturating_sub(at) >= proof.schedule.every);
    if !due || !proof.schedule.allowed_at(run.now) {
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
}

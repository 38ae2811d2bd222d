//! The FailoverPolicy controller: drives the failover state machine from Kubernetes.
//!
//! Each reconcile is a typed pipeline (`pipeline.rs`): validate the spec (pure, [`crate::policy`])
//! → dereference what status recorded → observe the epoch Lease (creating it when missing) and
//! the pools → decide on a command and a tick → execute the promotion's steps through core's
//! driver and the Kubernetes executor (`executor.rs`) → keep the GPU reserve where the Lease says
//! the standby is (`gpu_reserve.rs`) → apply the status → publish its events and count what
//! finished (`events.rs`) → between promotions, keep the Lease's route on the routers → requeue.
//!
//! The epoch Lease has no owner reference and outlives its policy: routers and fence sidecars
//! refuse anything below the highest epoch they have seen, so a policy deleted and created again
//! must carry on from the Lease's epoch, never start again at 0.
//!
//! What this controller must never do:
//! - let an epoch go back: a Lease found below the recorded epoch is reported (`Ready=False`,
//!   reason `LeaseRegressed`) and nothing is acted on until it is restored;
//! - write anything after losing a compare-and-set on the epoch Lease: the loser acts on nothing,
//!   not even its own status, until it has read the Lease again;
//! - tell or count what no status records: Events and the failover counter follow a successful
//!   status write, so a reconcile that fails and runs again does not report a step twice;
//! - fail over because the Lease cannot be read: an unreachable API server pauses control actions
//!   and commands wait, while the data path keeps its primary;
//! - crash-loop on a policy it cannot read: a malformed object or spec is reported as a Warning
//!   Event and `Ready=False` (reason `InvalidSpec`), and nothing else is touched;
//! - scale a pool down, or stop serving when a policy is deleted;
//! - apply a GPU reserve for the pool that holds the epoch Lease, or touch a reserve while the
//!   Lease cannot be read or was lost;
//! - apply over or delete a Deployment that is not labelled as a reserve and owned by the policy.

mod apply;
mod cold_starts;
mod context;
mod decide;
mod dereference;
mod error;
mod events;
mod execute;
mod executor;
mod gpu_reserve;
mod invalid;
mod keep_rollout;
mod keep_route;
mod keep_standby;
mod observe_lease;
mod prove_load;
mod publish;
mod run;
mod status;
mod update_status;

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use understudy_core::failover::{FailoverState, Phase};

use self::apply::apply;
use self::context::PROMOTING_REQUEUE;
pub use self::context::{Context, FINALIZER};
pub use self::error::Error;
use self::invalid::{release_unreadable, report_invalid, stored_ready};
pub use self::status::{
    HandedOffStep, OperatorRecord, StatusFacts, StoredRecord, desired_status, invalid_spec_patch,
    load_record, merge_conditions, phase_name, step_name, timeline,
};
use crate::crd::FailoverPolicy;
use crate::policy;
use crate::reconciler;
use crate::watchdog::Reconciler;

/// The longest wait between retries of a failing reconcile of a policy that cannot run (its spec
/// does not validate), so that nothing shorter bounds it.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

fn policy_key(meta: &ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Reconciles one FailoverPolicy, including ones that do not deserialize.
pub async fn reconcile(
    object: Arc<DeserializeGuard<FailoverPolicy>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started();
    let _reconciling = ctx
        .shell
        .watchdog
        .reconciling(Reconciler::FailoverPolicy, object.meta());
    let result = reconcile_guarded(&object, &ctx).await;
    if result.is_ok() {
        ctx.failures().remove(&policy_key(object.meta()));
    }
    result
}

async fn reconcile_guarded(
    object: &DeserializeGuard<FailoverPolicy>,
    ctx: &Context,
) -> Result<Action, Error> {
    let namespace = object
        .meta()
        .namespace
        .clone()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let policy = match &object.0 {
        Ok(policy) => policy,
        Err(invalid) => {
            if invalid.metadata.deletion_timestamp.is_some() {
                return release_unreadable(ctx, &invalid.metadata, &namespace).await;
            }
            // The guard keeps only the metadata; the stored Ready condition is read on its own so
            // that its transition time holds while the object stays unreadable.
            let previous_ready = stored_ready(ctx, &invalid.metadata, &namespace).await;
            return report_invalid(
                ctx,
                &invalid.metadata,
                &namespace,
                &invalid.error,
                previous_ready.as_ref(),
            )
            .await;
        }
    };
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.shell.client.clone(), &namespace);
    finalizer(&api, FINALIZER, Arc::new(policy.clone()), |event| async {
        match event {
            FinalizerEvent::Apply(policy) => apply(&policy, ctx, &namespace).await,
            FinalizerEvent::Cleanup(policy) => cleanup(&policy, ctx, &namespace),
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Requeues a failed reconcile with exponential backoff and counts the failure.
pub fn error_policy(
    object: Arc<DeserializeGuard<FailoverPolicy>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics.reconcile_failed(error.category());
    let key = policy_key(object.meta());
    let failures = {
        let mut map = ctx.failures();
        let count = map.entry(key.clone()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    };
    let delay = backoff(failures, retry_cap(&object));
    tracing::warn!(namespace = %key.0, policy = %key.1, category = error.category(), %error, ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// One second after the first failure, doubling up to `cap`.
#[must_use]
pub fn backoff(consecutive_failures: u32, cap: Duration) -> Duration {
    let exponent = consecutive_failures.saturating_sub(1).min(16);
    Duration::from_secs(1u64 << exponent).min(cap)
}

/// The longest a failed reconcile of `object` waits before it is tried again: no longer than a
/// successful one would, so that a promotion under way is not left for minutes at a step (the
/// promoting requeue while the recorded phase is Promoting, the probe interval otherwise).
#[must_use]
pub fn retry_cap(object: &DeserializeGuard<FailoverPolicy>) -> Duration {
    let Ok(policy) = &object.0 else {
        return MAX_BACKOFF;
    };
    let Ok(validated) = policy::validate(&policy.spec) else {
        return MAX_BACKOFF;
    };
    let interval = validated.probe.interval;
    match load_record(policy.status.as_ref()).machine {
        Ok(Some(FailoverState {
            phase: Phase::Promoting(_),
            ..
        })) => PROMOTING_REQUEUE.min(interval),
        _ => interval,
    }
}

/// Runs the controller over one namespace or all of them until the stream ends; each policy
/// `reconcile_now` names (a probe round that needs acting on,
/// [`crate::observe::ProbingObservations::urgent_rounds`]) is reconciled at once.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    reconcile_now: impl Stream<Item = ObjectRef<FailoverPolicy>> + Send + 'static,
) {
    // The epoch Leases are not watched: a label-less watch on Leases would stream every node's
    // heartbeat. The requeue at the probe interval reads each Lease instead.
    reconciler::run(
        ctx.shell.client.clone(),
        ctx,
        namespace,
        reconcile,
        error_policy,
        reconcile_now,
    )
    .await;
}

/// A deleted policy leaves its pools as they are, and its epoch Lease too: serving must not stop
/// because a policy was removed, and a policy created again under the same name must carry on
/// from the Lease's epoch rather than start again at 0. Its GPU reserve, which holds GPUs and
/// serves nothing, goes with it through its owner reference. Its fences are granted nothing more:
/// the serving pool's go on under their failsafe while the other pool's vouch for them.
fn cleanup(policy: &FailoverPolicy, ctx: &Context, namespace: &str) -> Result<Action, Error> {
    ctx.observations.forget(&ObjectRef::from_obj(policy));
    if let Some(grants) = &ctx.grants {
        grants.forget(&ObjectRef::from_obj(policy));
    }
    if let Some(proofs) = &ctx.load_proofs {
        proofs.forget(&ObjectRef::from_obj(policy));
    }
    ctx.metrics.forget_policy(namespace, &policy.name_any());
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use kube::runtime::finalizer;
    use understudy_core::failover::{Promotion, Step, TransitionKind};
    use understudy_core::{Epoch, Pool};

    use super::*;

    #[test]
    fn backoff_doubles_from_one_second_and_stops_at_its_cap() {
        assert_eq!(backoff(1, MAX_BACKOFF), Duration::from_secs(1));
        assert_eq!(backoff(2, MAX_BACKOFF), Duration::from_secs(2));
        assert_eq!(backoff(5, MAX_BACKOFF), Duration::from_secs(16));
        assert_eq!(backoff(9, MAX_BACKOFF), Duration::from_secs(256));
        assert_eq!(backoff(10, MAX_BACKOFF), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX, MAX_BACKOFF), MAX_BACKOFF);
        assert_eq!(backoff(9, Duration::from_secs(10)), Duration::from_secs(10));
    }

    fn guarded(status: serde_json::Value) -> DeserializeGuard<FailoverPolicy> {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "understudy.dev/v1alpha1",
            "kind": "FailoverPolicy",
            "metadata": {"name": "llama", "namespace": "serving"},
            "spec": {
                "recoveryObjective": "5m",
                "probe": {"interval": "15s"},
                "pools": [
                    {"name": "us-east", "workload": {"kind": "Deployment", "name": "vllm-east"}, "replicas": 4},
                    {"name": "us-west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4},
                ],
            },
            "status": status,
        }))
        .unwrap_or_else(|e| panic!("fixture: {e}"))
    }

    #[test]
    fn a_failing_reconcile_waits_no_longer_than_a_successful_one_would() {
        let serving = serde_json::to_value(OperatorRecord {
            machine: FailoverState::new(),
            handled_command: None,
            handed_off: Vec::new(),
        })
        .unwrap_or_default();
        let promoting = serde_json::to_value(OperatorRecord {
            machine: FailoverState {
                phase: Phase::Promoting(Promotion {
                    kind: TransitionKind::Manual,
                    from: Pool::A,
                    to: Pool::B,
                    epoch: Epoch(1),
                    step: Step::Scale,
                    started_at: Duration::ZERO,
                    done: Vec::new(),
                    fault_seen_at: None,
                }),
                ..FailoverState::new()
            },
            handled_command: None,
            handed_off: Vec::new(),
        })
        .unwrap_or_default();
        let cap = |status| retry_cap(&guarded(status));
        assert_eq!(cap(serde_json::json!({"failover": promoting})), PROMOTING_REQUEUE);
        assert_eq!(
            cap(serde_json::json!({"failover": serving})),
            Duration::from_secs(15)
        );
        assert_eq!(cap(serde_json::json!({})), Duration::from_secs(15));
        // A garbled record is not a promotion under way.
        assert_eq!(
            cap(serde_json::json!({"failover": {"machine": 7}})),
            Duration::from_secs(15)
        );
        let unreadable: DeserializeGuard<FailoverPolicy> = serde_json::from_value(serde_json::json!({
            "apiVersion": "understudy.dev/v1alpha1", "kind": "FailoverPolicy",
            "metadata": {"name": "llama", "namespace": "serving"}, "spec": {"pools": 7},
        }))
        .unwrap_or_else(|e| panic!("fixture: {e}"));
        assert_eq!(retry_cap(&unreadable), MAX_BACKOFF);
    }

    #[test]
    fn a_failed_apply_is_counted_under_its_own_phase_not_the_finalizer() {
        let wrapped = Error::Finalizer(Box::new(finalizer::Error::ApplyFailed(Error::LostRace)));
        assert_eq!(wrapped.category(), "lost_race");
        let unnamed = Error::Finalizer(Box::new(finalizer::Error::UnnamedObject));
        assert_eq!(unnamed.category(), "finalizer");
    }
}

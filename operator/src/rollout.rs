//! Standby-first rollouts (`spec.rollout: standbyFirst`): a change to the primary's serving
//! template (image, model, flags, `VLLM_*` environment) is held until the standby runs the same
//! template and has passed on it; then the primary rolls.
//!
//! The primary's workload is held all the while the policy asks for it, not only once a change is
//! seen: a Deployment's controller starts rolling within milliseconds of an edit, sooner than any
//! reconcile could pause it. So the primary's Deployment stays paused (a paused Deployment still
//! scales and still replaces a lost pod, at the template it ran), and a StatefulSet's partition
//! stays above its highest ordinal; the hold is let go only to roll a change the standby has
//! passed on, or one that leaves the serving template as it is (labels, resources). The standby is
//! never held: it rolls first.
//!
//! A change is pending when the workload's controller has not rolled it out (its generation not
//! seen, or fewer updated replicas than replicas), and it is a serving change when some pod runs
//! other serving keys than the template: keys, not whole templates, so that a webhook that adds a
//! sidecar changes nothing here. [`decide`] is pure and lives in the api crate, where the local
//! game day reads it too; [`read_pool`] and [`hold`] are the two calls to the API server.

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::Selector;
use understudy_api::FIELD_MANAGER;
pub use understudy_api::rollout::{Decision, LastProof, PoolView, Standing, decide, short};
use understudy_prober::parity::Fingerprint;
use understudy_prober::parity::flags::FlagPolicy;

use crate::crd::{PoolSpec, WorkloadKind};
use crate::parity::{serving_config, template_keys};
use crate::replicas::{replica_endpoint, rolled_out};

/// A StatefulSet's partition while it is held: above any ordinal it will reach, so that a pod a
/// promotion scales up starts at the template it ran too.
pub const HELD_PARTITION: i32 = i32::MAX;

/// Reads `pool`'s workload and its pods, with `client` in `namespace`: its template's serving
/// keys, the ones its pods run, whether it is rolled out, and its replicas. A workload that does
/// not exist reads as one with no template and no pods.
pub async fn read_pool(
    client: kube::Client,
    namespace: &str,
    pool: &PoolSpec,
    flags: &FlagPolicy,
) -> Result<PoolView, kube::Error> {
    let name = &pool.workload.name;
    let (template, selector, rolled_out, held) = match pool.workload.kind {
        WorkloadKind::Deployment => {
            let api: Api<Deployment> = Api::namespaced(client.clone(), namespace);
            let Some(deployment) = api.get_opt(name).await? else {
                return Ok(missing(pool));
            };
            let status = deployment.status.unwrap_or_default();
            let Some(spec) = deployment.spec else {
                return Ok(missing(pool));
            };
            let rolled_out = rolled_out(
                deployment.metadata.generation,
                status.observed_generation,
                spec.replicas.unwrap_or(1),
                status.replicas,
                status.updated_replicas,
            );
            let held = spec.paused.unwrap_or(false);
            (spec.template, spec.selector, rolled_out, held)
        }
        WorkloadKind::StatefulSet => {
            let api: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
            let Some(set) = api.get_opt(name).await? else {
                return Ok(missing(pool));
            };
            let status = set.status.unwrap_or_default();
            let Some(spec) = set.spec else {
                return Ok(missing(pool));
            };
            let rolled_out = rolled_out(
                set.metadata.generation,
                status.observed_generation,
                spec.replicas.unwrap_or(1),
                Some(status.replicas),
                status.updated_replicas,
            );
            // One that updates `OnDelete` rolls no pod on its own: it is held as it is.
            let held = spec.update_strategy.as_ref().is_some_and(|s| {
                s.type_.as_deref() == Some("OnDelete")
                    || s.rolling_update
                        .as_ref()
                        .and_then(|r| r.partition)
                        .is_some_and(|partition| partition > 0)
            });
            (spec.template, spec.selector, rolled_out, held)
        }
        // Refused by validation: a LeaderWorkerSet is not held.
        WorkloadKind::LeaderWorkerSet => return Ok(missing(pool)),
    };
    let pods = pods_of(client, namespace, selector).await?;
    let keys =
        |template: &PodTemplateSpec| serving_config(template).map(|config| template_keys(&config, flags));
    let mut running: Vec<Fingerprint> = Vec::new();
    for pod in pods
        .iter()
        // A pod that is leaving, or that ended (evicted, failed), runs nothing.
        .filter(|pod| {
            pod.metadata.deletion_timestamp.is_none()
                && !matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Failed" | "Succeeded")
                )
        })
    {
        let as_template = PodTemplateSpec {
            metadata: None,
            spec: pod.spec.clone(),
        };
        if let Some(keys) = keys(&as_template)
            && !running.contains(&keys)
        {
            running.push(keys);
        }
    }
    Ok(PoolView {
        name: pool.name.clone(),
        template: keys(&template),
        running,
        rolled_out,
        replicas: pods
            .iter()
            .filter_map(|pod| replica_endpoint(pod, pool.port))
            .map(|endpoint| endpoint.authority())
            .collect(),
        held,
    })
}

fn gone_is_done<T>(patched: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match patched {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error),
    }
}

fn missing(pool: &PoolSpec) -> PoolView {
    PoolView {
        name: pool.name.clone(),
        ..PoolView::default()
    }
}

async fn pods_of(
    client: kube::Client,
    namespace: &str,
    selector: LabelSelector,
) -> Result<Vec<Pod>, kube::Error> {
    // A selector that cannot be read, or selects every pod, reads as no pods of this workload.
    let Ok(selector) = Selector::try_from(selector) else {
        return Ok(Vec::new());
    };
    if selector.selects_all() {
        return Ok(Vec::new());
    }
    let api: Api<Pod> = Api::namespaced(client, namespace);
    Ok(api
        .list(&ListParams::default().labels_from(&selector))
        .await?
        .items)
}

/// Holds `pool`'s workload (`held`: a Deployment paused, a StatefulSet's partition at
/// [`HELD_PARTITION`]) or lets it roll (not paused, partition 0), with a merge patch, as
/// `kubectl rollout pause` sends: applying would take the field from whoever deploys the
/// workload. A StatefulSet that updates `OnDelete` refuses a partition, and says so. A workload
/// that no longer exists holds nothing.
pub async fn hold(
    client: kube::Client,
    namespace: &str,
    pool: &PoolSpec,
    held: bool,
) -> Result<(), kube::Error> {
    let name = &pool.workload.name;
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    match pool.workload.kind {
        WorkloadKind::Deployment => {
            let api: Api<Deployment> = Api::namespaced(client, namespace);
            let patch = serde_json::json!({ "spec": { "paused": held } });
            gone_is_done(api.patch(name, &params, &Patch::Merge(&patch)).await)?;
        }
        WorkloadKind::StatefulSet => {
            let api: Api<StatefulSet> = Api::namespaced(client, namespace);
            let partition = if held { HELD_PARTITION } else { 0 };
            let patch = serde_json::json!({
                "spec": { "updateStrategy": { "rollingUpdate": { "partition": partition } } }
            });
            gone_is_done(api.patch(name, &params, &Patch::Merge(&patch)).await)?;
        }
        WorkloadKind::LeaderWorkerSet => {}
    }
    Ok(())
}

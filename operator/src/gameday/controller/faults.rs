//! The faults a run plays on the policy's pools: a crash (pods deleted), drift (a `VLLM_`
//! variable rolled out), and the fences' hang and wrong answers.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use understudy_api::FIELD_MANAGER;
use understudy_api::fence_fault::{FAULT_PATH, FenceFault, MAX_FAULT_SECONDS};
use understudy_prober::http1;
use understudy_prober::probe::Bearer;

use super::context::Context;
use super::error::Error;
use crate::crd::{FailoverPolicy, PoolSpec, WorkloadKind};
use crate::gameday::DRIFT_VARIABLE;
use crate::replicas::{KubeReplicas, replica_endpoint};

/// Crashes the pool named `pool` of `policy`: deletes its serving pods with no grace period, as
/// a node or a process dying would. Their names.
pub(super) async fn crash(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    pool: &str,
) -> Result<Vec<String>, Error> {
    let Some((_, pods)) = pool_pods(ctx, namespace, policy, pool).await? else {
        return Ok(Vec::new());
    };
    let Some(spec) = policy.spec.pools.iter().find(|p| p.name == pool) else {
        return Ok(Vec::new());
    };
    let client = ctx
        .clusters
        .client(namespace, spec)
        .await
        .map_err(|e| Error::Inject(e.to_string()))?;
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let mut deleted = Vec::new();
    for pod in pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()) {
        let name = pod.name_any();
        match api.delete(&name, &now).await {
            Ok(_) => deleted.push(name),
            Err(kube::Error::Api(status)) if status.is_not_found() => {}
            Err(error) => return Err(Error::Inject(format!("deleting pod {name}: {error}"))),
        }
    }
    Ok(deleted)
}

/// Sets [`DRIFT_VARIABLE`] to `run` in the serving container of the pool named `pool` (a
/// Deployment), or takes it away with `None`; the workload rolls out either way.
pub(super) async fn set_drift(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    pool: &str,
    run: Option<&str>,
) -> Result<(), Error> {
    let Some(spec) = policy.spec.pools.iter().find(|p| p.name == pool) else {
        return Ok(());
    };
    if spec.workload.kind != WorkloadKind::Deployment {
        // Nothing was injected, so there is nothing to take back.
        return match run {
            Some(_) => Err(Error::Inject(format!(
                "a drift is injected into a Deployment, and {pool} runs a {:?}",
                spec.workload.kind
            ))),
            None => Ok(()),
        };
    }
    let client = ctx
        .clusters
        .client(namespace, spec)
        .await
        .map_err(|e| Error::Inject(e.to_string()))?;
    let api: Api<Deployment> = Api::namespaced(client, namespace);
    let name = &spec.workload.name;
    let deployment = api
        .get(name)
        .await
        .map_err(|error| Error::Inject(format!("reading Deployment {name}: {error}")))?;
    let container = deployment
        .spec
        .as_ref()
        .and_then(|s| crate::parity::serving_container(&s.template))
        .map(|c| c.name.clone())
        .ok_or_else(|| {
            Error::Inject(format!(
                "Deployment {name} runs no vLLM container that names a model"
            ))
        })?;
    let variable = match run {
        Some(run) => serde_json::json!({"name": DRIFT_VARIABLE, "value": run}),
        None => serde_json::json!({"name": DRIFT_VARIABLE, "$patch": "delete"}),
    };
    let patch = serde_json::json!({
        "spec": {"template": {"spec": {"containers": [{"name": container, "env": [variable]}]}}}
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    api.patch(name, &params, &Patch::Strategic(&patch))
        .await
        .map(|_| ())
        .map_err(|error| Error::Inject(format!("patching Deployment {name}: {error}")))
}

/// The pool named `pool` and its serving pods, whatever their phase; `None` for a pool the
/// policy does not name.
pub(super) async fn pool_pods<'a>(
    ctx: &Context,
    namespace: &str,
    policy: &'a FailoverPolicy,
    pool: &str,
) -> Result<Option<(&'a PoolSpec, Vec<Pod>)>, Error> {
    let Some(spec) = policy.spec.pools.iter().find(|p| p.name == pool) else {
        return Ok(None);
    };
    let pods = KubeReplicas::in_clusters(ctx.clusters.clone())
        .pods(namespace, spec)
        .await
        .map_err(|error| Error::Inject(error.to_string()))?;
    Ok(Some((spec, pods)))
}

/// Has the fences of `pool`'s running replicas play `fault` (for at most the duration given), or
/// take their fault away (`None`); the pods whose fences did. Every fence must take a fault; a
/// fence that has no fault endpoint (404: the pool's port is vLLM's own, with no fence in front)
/// has no fault to take away.
pub(super) async fn set_fence_fault(
    ctx: &Context,
    namespace: &str,
    policy: &FailoverPolicy,
    pool: &str,
    fault: Option<(FenceFault, Duration)>,
) -> Result<Vec<String>, Error> {
    let Some((spec, pods)) = pool_pods(ctx, namespace, policy, pool).await? else {
        return Ok(Vec::new());
    };
    let body = serde_json::json!({
        "fault": fault.map(|(fault, _)| fault),
        "seconds": fault.map_or(1, |(_, lasting)| lasting.as_secs().clamp(1, MAX_FAULT_SECONDS)),
    });
    let body = bytes::Bytes::from(body.to_string());
    let mut told = Vec::new();
    for pod in &pods {
        let Some(endpoint) = replica_endpoint(pod, spec.port) else {
            continue;
        };
        let name = pod.name_any();
        let call = http1::exchange(http1::Call {
            host: &endpoint.host,
            port: endpoint.port,
            method: http::Method::PUT,
            target: FAULT_PATH,
            bearer: ctx.replica_token.as_ref().map(Bearer::secret),
            json: Some(body.clone()),
        });
        let answer = tokio::time::timeout(ctx.shell.write_timeout, call).await;
        let why = match answer {
            Ok(Ok((status, _))) if status.is_success() => {
                told.push(name);
                continue;
            }
            Ok(Ok((status, _))) if status == http::StatusCode::NOT_FOUND && fault.is_none() => continue,
            Ok(Ok((status, answer))) => {
                let hint = match status.as_u16() {
                    404 => "; a hang or half-failed game day needs a fence sidecar on the pool's port",
                    401 | 403 => "; the operator's --replica-token-file must hold the fences' control token",
                    _ => "",
                };
                format!(
                    "answered {status}: {}{hint}",
                    String::from_utf8_lossy(&answer).trim()
                )
            }
            Ok(Err(why)) => why,
            Err(_) => format!("no answer within {:?}", ctx.shell.write_timeout),
        };
        return Err(Error::Inject(format!(
            "the fence of pod {name} at {endpoint}: {why}"
        )));
    }
    Ok(told)
}

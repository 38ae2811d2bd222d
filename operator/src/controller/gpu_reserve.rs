//! The GPU reserve kept where the Lease says the standby is: placeholder pods for the standby's
//! pilot-light replicas with `reserveGpus`, none for the primary beyond the hand-over.
//!
//! It must never apply a reserve for the pool that holds the epoch Lease, nor apply over or delete
//! a Deployment that is not labelled as a reserve and owned by the policy.

use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use understudy_api::FIELD_MANAGER;
use understudy_core::Pool;

use super::context::Context;
use super::error::Error;
use super::events::Notice;
use super::run::Run;
use crate::crd::{FailoverPolicy, GpuReserve};
use crate::lease::LeaseRecord;
use crate::policy::pool_by_name;
use crate::reconciler::warn;
use crate::reserve::{
    POOL_LABEL, ReservePlan, WorkloadShape, is_reserve_of, reserve_deployment, reserve_plan,
    reserve_selector, waiting_reserved, workload_shape,
};
use crate::workload::Workload;
use kube::Resource;
use understudy_core::failover::ControlPlane;

/// Keeps the reserve where the Lease as read or written in this reconcile says the standby is,
/// never where a Lease that could not be read or was lost says. A failure is told at once as a
/// Warning (nothing about it is recorded, and it is tried again) and returned.
pub(super) async fn keep_reserve_where_the_lease_says(
    ctx: &Context,
    run: &mut Run<'_>,
    policy: &FailoverPolicy,
    namespace: &str,
    lease_now: &LeaseRecord,
) -> Option<Error> {
    let primary = pool_by_name(&policy.spec, &lease_now.holder)?;
    if run.machine.control_plane != ControlPlane::Reachable || !run.machine.lease_known {
        return None;
    }
    let error = keep_reserve(ctx, run, policy, namespace, primary).await.err()?;
    warn(
        &ctx.shell,
        &policy.object_ref(&()),
        "GpuReserveFailed",
        error.to_string(),
    )
    .await;
    Some(error)
}

/// Keeps the GPU reserves where `primary`, the Lease's holder, wants them: placeholder pods for
/// the standby's reserved pilot-light replicas that are not running (an old primary after a
/// failover still runs them all, and needs none), applied with server-side apply on every
/// reconcile. Every reserve of this policy is found by its labels, not by the status alone (a
/// reserve applied by a reconcile whose status write failed is recorded nowhere), and each one
/// not wanted is deleted: its pool's pilot light is running, or the spec no longer asks for it.
/// The reserve of a pool that became primary is kept until that pool's ready replicas cover the
/// reserved ones: meanwhile its pods preempt the placeholders one by one, and the GPUs freed go
/// to them rather than to whatever else waits. A reserve is deleted rather than scaled to zero:
/// its existence is what holds GPUs, and the next one is built afresh from the workload's
/// template. Only a Deployment labelled as a reserve and owned by this policy is ever applied
/// over or deleted.
pub(super) async fn keep_reserve(
    ctx: &Context,
    run: &mut Run<'_>,
    policy: &FailoverPolicy,
    namespace: &str,
    primary: Pool,
) -> Result<(), Error> {
    let policy_name = policy.name_any();
    let policy_uid = policy.uid().ok_or(Error::MissingObjectKey("uid"))?;
    let deployments: Api<Deployment> = Api::namespaced(ctx.shell.client.clone(), namespace);
    let listed = deployments
        .list(&ListParams::default().labels(&reserve_selector(&policy_name)))
        .await
        .map_err(|source| Error::Reserve {
            object: "listing Deployments".to_owned(),
            source,
        })?;
    let existing: Vec<Deployment> = listed
        .items
        .into_iter()
        .filter(|d| is_reserve_of(&d.metadata, &policy_uid))
        .collect();

    let wanted = wanted_reserve(ctx, run, namespace, &policy_name, primary).await?;

    // validate() guarantees two pools.
    let primary_spec = &run.spec.pools[primary.index()];
    let handing_over = handing_over(ctx, run, namespace, &policy_name, primary, &existing).await?;

    let wanted_name = wanted.as_ref().map(|(plan, _)| plan.deployment.clone());
    if run
        .gpu_reserve
        .as_ref()
        .is_some_and(|held| Some(&held.deployment) != wanted_name.as_ref())
    {
        run.gpu_reserve = None;
    }
    let recorded = policy.status.as_ref().and_then(|s| s.gpu_reserve.clone());
    for deployment in &existing {
        let name = deployment.name_any();
        let pool = reserve_pool(deployment).unwrap_or_default().to_owned();
        if Some(&name) == wanted_name.as_ref() || (handing_over && pool == primary_spec.name) {
            continue;
        }
        // The uid precondition: a Deployment created under this name since the list is not ours.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: deployment.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match deployments.delete(&name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.is_not_found() || status.code == 409 => continue,
            Err(source) => {
                return Err(Error::Reserve {
                    object: format!("deleting Deployment {name}"),
                    source,
                });
            }
        }
        let replicas = recorded
            .as_ref()
            .filter(|held| held.deployment == name)
            .map_or(0, |held| held.replicas);
        run.notices.push(Notice::ReserveReleased(GpuReserve {
            pool,
            deployment: name,
            replicas,
        }));
    }

    match wanted {
        Some((plan, shape)) => hold(ctx, run, policy, &deployments, &existing, plan, &shape).await,
        None => Ok(()),
    }
}

/// The reserve `primary` wants for the standby: its reserved pilot-light replicas that its
/// workload does not run, shaped like one of its replicas; `None` when none waits.
async fn wanted_reserve(
    ctx: &Context,
    run: &Run<'_>,
    namespace: &str,
    policy_name: &str,
    primary: Pool,
) -> Result<Option<(ReservePlan, WorkloadShape)>, Error> {
    if let Some(mut plan) = reserve_plan(policy_name, run.spec, primary) {
        let pool = run.pool_spec(plan.pool);
        let workload = Workload::new(
            ctx.clusters.client(namespace, pool).await?,
            namespace,
            &pool.workload,
        );
        let object = workload.get().await.map_err(|source| Error::Reserve {
            object: format!("reading {:?} {}", pool.workload.kind, pool.workload.name),
            source,
        })?;
        let running = object
            .data
            .pointer("/spec/replicas")
            .and_then(serde_json::Value::as_u64)
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
        plan.replicas = waiting_reserved(plan.replicas, pool.replicas, running);
        if plan.replicas > 0 {
            let shape = workload_shape(pool.workload.kind, &pool.workload.name, &object.data)
                .map_err(Error::ReserveShape)?;
            return Ok(Some((plan, shape)));
        }
    }

    Ok(None)
}

/// Whether a reserve of the primary's own pool is kept: while the primary's reserved replicas are
/// not all ready, since they are what preempts its placeholders.
async fn handing_over(
    ctx: &Context,
    run: &Run<'_>,
    namespace: &str,
    policy_name: &str,
    primary: Pool,
    existing: &[Deployment],
) -> Result<bool, Error> {
    // validate() guarantees two pools.
    let primary_spec = &run.spec.pools[primary.index()];
    if !existing
        .iter()
        .any(|d| reserve_pool(d) == Some(primary_spec.name.as_str()))
    {
        return Ok(false);
    }
    let reserved = reserve_plan(policy_name, run.spec, primary.other()).map_or(0, |plan| plan.replicas);
    if reserved == 0 {
        return Ok(false);
    }
    let client = ctx.clusters.client(namespace, primary_spec).await?;
    let workload = Workload::new(client, namespace, &primary_spec.workload);
    let ready = workload.ready_replicas().await.map_err(|source| Error::Reserve {
        object: format!(
            "reading {:?} {}",
            primary_spec.workload.kind, primary_spec.workload.name
        ),
        source,
    })?;
    Ok(waiting_reserved(reserved, primary_spec.replicas, ready) > 0)
}

/// Applies the wanted reserve, after making sure its name is free or already ours.
async fn hold(
    ctx: &Context,
    run: &mut Run<'_>,
    policy: &FailoverPolicy,
    deployments: &Api<Deployment>,
    existing: &[Deployment],
    plan: ReservePlan,
    shape: &WorkloadShape,
) -> Result<(), Error> {
    let policy_uid = policy.uid().ok_or(Error::MissingObjectKey("uid"))?;
    if !existing.iter().any(|d| d.name_any() == plan.deployment) {
        // Not found among this policy's reserves: the name must be free, or ours unlabelled.
        match deployments.get_opt(&plan.deployment).await {
            Ok(None) => {}
            Ok(Some(found)) if is_reserve_of(&found.metadata, &policy_uid) => {}
            Ok(Some(_)) => {
                return Err(Error::ReserveNameTaken {
                    deployment: plan.deployment,
                });
            }
            Err(source) => {
                return Err(Error::Reserve {
                    object: format!("reading Deployment {}", plan.deployment),
                    source,
                });
            }
        }
    }
    let deployment = reserve_deployment(policy, &plan, shape, &ctx.reserve).map_err(Error::ReserveShape)?;
    let params = PatchParams::apply(FIELD_MANAGER).force();
    deployments
        .patch(&plan.deployment, &params, &Patch::Apply(&deployment))
        .await
        .map_err(|source| Error::Reserve {
            object: format!("applying Deployment {}", plan.deployment),
            source,
        })?;
    let held = GpuReserve {
        pool: plan.pool_name,
        deployment: plan.deployment,
        replicas: plan.replicas,
    };
    if run.gpu_reserve.as_ref() != Some(&held) {
        run.notices.push(Notice::ReserveHeld(held.clone()));
    }
    run.gpu_reserve = Some(held);
    Ok(())
}

/// The pool a reserve Deployment holds GPUs for, from its label.
pub(super) fn reserve_pool(deployment: &Deployment) -> Option<&str> {
    deployment
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(POOL_LABEL))
        .map(String::as_str)
}

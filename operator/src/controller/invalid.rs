//! Policies that cannot be run: a spec that does not validate or an object that does not
//! deserialize is reported (`Ready=False`, reason `InvalidSpec`, and a Warning Event) and nothing
//! else is touched; one being deleted is let go.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer;
use understudy_api::FIELD_MANAGER;

use super::context::{Context, FINALIZER};
use super::error::Error;
use super::status::invalid_spec_patch;
use crate::crd::{Condition, FailoverPolicy, condition_type};
use crate::reconciler::{object_reference, warn};

/// Reports a policy that cannot be run: a Warning Event and `Ready=False` with reason
/// `InvalidSpec`, by a JSON merge patch that needs nothing but the object's metadata. Nothing
/// else is touched, and the policy waits for its next change.
pub(super) async fn report_invalid(
    ctx: &Context,
    meta: &ObjectMeta,
    namespace: &str,
    message: &str,
    previous_ready: Option<&Condition>,
) -> Result<Action, Error> {
    let name = meta.name.clone().ok_or(Error::MissingObjectKey("name"))?;
    tracing::warn!(%namespace, policy = %name, %message, "invalid FailoverPolicy");
    let patch = invalid_spec_patch(meta.generation, message, previous_ready, ctx.shell.clock.now());
    let api = untyped_policies(ctx, namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let written = match tokio::time::timeout(
        ctx.shell.write_timeout,
        api.patch_status(&name, &params, &Patch::Merge(&patch)),
    )
    .await
    {
        Ok(result) => result.map(drop).map_err(Error::StatusPatch),
        Err(_) => Err(Error::StatusTimeout(ctx.shell.write_timeout)),
    };
    warn(
        &ctx.shell,
        &object_reference::<FailoverPolicy>(meta),
        "InvalidSpec",
        message.to_owned(),
    )
    .await;
    written.map(|()| Action::await_change())
}

/// Reports a policy whose spec does not validate, keeping the transition time of a `Ready`
/// condition that already said so.
pub(super) async fn report_invalid_spec(
    ctx: &Context,
    policy: &FailoverPolicy,
    namespace: &str,
    message: &str,
) -> Result<Action, Error> {
    let previous_ready = policy
        .status
        .as_ref()
        .and_then(|s| s.conditions.get(condition_type::READY));
    report_invalid(ctx, &policy.metadata, namespace, message, previous_ready).await
}

/// FailoverPolicies, untyped: an answer may be an object that does not deserialize.
pub(super) fn untyped_policies(ctx: &Context, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        ctx.shell.client.clone(),
        namespace,
        &ApiResource::erase::<FailoverPolicy>(&()),
    )
}

/// The `Ready` condition stored on a policy that does not deserialize; `None` when it has none or
/// it cannot be read now, and the report then takes the current time.
pub(super) async fn stored_ready(ctx: &Context, meta: &ObjectMeta, namespace: &str) -> Option<Condition> {
    let name = meta.name.as_deref()?;
    let api = untyped_policies(ctx, namespace);
    let object = match tokio::time::timeout(ctx.shell.write_timeout, api.get(name)).await {
        Ok(Ok(object)) => object,
        Ok(Err(error)) => {
            tracing::debug!(%namespace, policy = %name, %error, "could not read the stored Ready condition");
            return None;
        }
        Err(_) => return None,
    };
    let ready = object
        .data
        .get("status")?
        .get("conditions")?
        .get(condition_type::READY)?;
    serde_json::from_value(ready.clone()).ok()
}

/// Removes the finalizer from a policy that is being deleted but no longer deserializes, so that
/// an unreadable object can still go away. The resourceVersion in the patch makes it a
/// compare-and-set: a concurrent change to the finalizers fails it, and it is retried.
pub(super) async fn release_unreadable(
    ctx: &Context,
    meta: &ObjectMeta,
    namespace: &str,
) -> Result<Action, Error> {
    let name = meta.name.clone().ok_or(Error::MissingObjectKey("name"))?;
    let finalizers = meta.finalizers.clone().unwrap_or_default();
    if !finalizers.iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let remaining: Vec<&String> = finalizers.iter().filter(|f| *f != FINALIZER).collect();
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": meta.resource_version, "finalizers": remaining }
    });
    let api: Api<FailoverPolicy> = Api::namespaced(ctx.shell.client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    api.patch_metadata(&name, &params, &Patch::Merge(&patch))
        .await
        .map_err(|e| Error::Finalizer(Box::new(finalizer::Error::RemoveFinalizer(e))))?;
    Ok(Action::await_change())
}

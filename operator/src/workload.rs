//! A pool's workload (Deployment, StatefulSet or LeaderWorkerSet) as the operator scales and reads
//! it: through its scale subresource and its status, never by applying over what its owner
//! deploys.

use std::fmt;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use understudy_api::FIELD_MANAGER;

use crate::crd::{WorkloadKind, WorkloadRef};

/// A pool's workload, through its scale subresource and status.
#[derive(Clone)]
pub struct Workload {
    api: Api<DynamicObject>,
    name: String,
}

impl fmt::Debug for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Workload")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Workload {
    /// The workload `workload` names in `namespace`.
    #[must_use]
    pub fn new(client: kube::Client, namespace: &str, workload: &WorkloadRef) -> Self {
        let (group, version, plural) = match workload.kind {
            WorkloadKind::Deployment => ("apps", "v1", "deployments"),
            WorkloadKind::StatefulSet => ("apps", "v1", "statefulsets"),
            WorkloadKind::LeaderWorkerSet => ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
        };
        let kind = format!("{:?}", workload.kind);
        let resource =
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, &kind), plural);
        Workload {
            api: Api::namespaced_with(client, namespace, &resource),
            name: workload.name.clone(),
        }
    }

    /// Raise the desired replicas to `replicas`; never lowers them. Returns whether it wrote.
    ///
    /// A JSON merge patch on the scale subresource, as `kubectl scale` sends, rather than
    /// server-side apply: applying would take ownership of `spec.replicas` away from whoever
    /// deploys the workload, and their next apply would either conflict or scale the new primary
    /// back down.
    pub async fn scale_up_to(&self, replicas: u32) -> Result<bool, kube::Error> {
        if self.desired_replicas().await? >= i64::from(replicas) {
            return Ok(false);
        }
        self.set_replicas(replicas).await?;
        Ok(true)
    }

    /// A standby's replicas brought to `replicas`: lowered to them, or raised to them from none (a
    /// standby with nothing running cannot be proven), never raised otherwise. Returns the
    /// replicas it changed from, or `None` when it changed nothing. The same patch as
    /// [`Workload::scale_up_to`].
    pub async fn scale_standby_to(&self, replicas: u32) -> Result<Option<u32>, kube::Error> {
        let desired = self.desired_replicas().await?;
        match u32::try_from(desired) {
            Ok(from) if from > replicas || (from == 0 && replicas > 0) => {
                self.set_replicas(replicas).await?;
                Ok(Some(from))
            }
            _ => Ok(None),
        }
    }

    /// `spec.replicas` of the scale subresource.
    async fn desired_replicas(&self) -> Result<i64, kube::Error> {
        let scale = self.api.get_scale(&self.name).await?;
        Ok(i64::from(scale.spec.and_then(|s| s.replicas).unwrap_or(0)))
    }

    async fn set_replicas(&self, replicas: u32) -> Result<(), kube::Error> {
        let patch = serde_json::json!({ "spec": { "replicas": replicas } });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        self.api
            .patch_scale(&self.name, &params, &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// The workload as it is stored, pod template included.
    pub async fn get(&self) -> Result<DynamicObject, kube::Error> {
        self.api.get(&self.name).await
    }

    /// How many replicas are ready, from the workload's `status.readyReplicas`.
    pub async fn ready_replicas(&self) -> Result<u32, kube::Error> {
        let object = self.api.get(&self.name).await?;
        Ok(object
            .data
            .get("status")
            .and_then(|s| s.get("readyReplicas"))
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0))
    }
}

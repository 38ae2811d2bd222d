//! Where a pool's replicas are: the Running pods its workload selects ([`KubeReplicas`]), or a
//! fixed list per pool ([`FixedReplicas`]) where there is no cluster; both are a
//! [`ReplicaEndpoints`]. Also how vLLM is started in a workload's pod template, once it has rolled
//! out.
//!
//! What this module must never do: turn "the API server could not be asked" into "the pool has no
//! replicas" (that is a [`ResolveError`]), or list pods with a selector that selects nothing in
//! particular.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ListParams};
use kube::core::{Expression, Selector};
use kube::{Client, ResourceExt};
use understudy_prober::probe::{Bearer, Endpoint};

use crate::clusters::Clusters;
use crate::crd::{PoolSpec, WorkloadKind};
use crate::parity::{ServingConfig, model_host_path, serving_config};
use crate::ports::{ModelPlace, ReplicaEndpoints, ResolveError};

/// The label a LeaderWorkerSet puts on every pod of its groups, with the set's name.
const LWS_NAME_LABEL: &str = "leaderworkerset.sigs.k8s.io/name";
/// The worker index label; the leader, which serves the API, is worker 0.
const LWS_WORKER_INDEX_LABEL: &str = "leaderworkerset.sigs.k8s.io/worker-index";

/// A pool's replicas are the Running pods its workload selects in the pool's cluster, at
/// `http://<podIP>:<port>`, called with the fences' control token when there is one.
///
/// A pool in another cluster whose API server cannot be reached (no connection, no answer, a 5xx)
/// is probed at the replicas it was last listed with, for at most [`LAST_LISTED_FOR`]: a region
/// lost whole is then seen as its pool failing, not as nothing to see, and a region cut off from
/// the operator as one it cannot reach. A refusal (401, 403, 404) or a kubeconfig that cannot be
/// used is not an outage, and leaves the pool unknown, as in the operator's own cluster. (The
/// operator's own cluster unreachable leaves it without its Lease, so nothing is promoted then
/// anyway.) The grants never use the list: [`ReplicaEndpoints::fences`] lists afresh or fails.
#[derive(Clone)]
pub struct KubeReplicas {
    clusters: Arc<Clusters>,
    bearer: Option<Bearer>,
    /// Each pool in another cluster as last listed, and when.
    last_listed: Arc<Mutex<HashMap<ListedPool, Listed>>>,
}

/// When a pool was listed, and its endpoints then.
type Listed = (Instant, Vec<Endpoint>);

/// How long a pool in another cluster is probed as last listed while its API server cannot be
/// reached: long past any promotion's detection, short enough that its pods' addresses are not
/// given to other pods meanwhile.
pub const LAST_LISTED_FOR: Duration = Duration::from_secs(600);

/// A pool in another cluster: its policy's namespace, its cluster and its workload.
type ListedPool = (String, String, String);

impl fmt::Debug for KubeReplicas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeReplicas").finish_non_exhaustive()
    }
}

impl KubeReplicas {
    /// Every pool in `client`'s cluster, or in the cluster it names.
    #[must_use]
    pub fn new(client: Client) -> Self {
        Self::in_clusters(Arc::new(Clusters::new(client)))
    }

    /// Every pool in the cluster it names, through `clusters`.
    #[must_use]
    pub fn in_clusters(clusters: Arc<Clusters>) -> Self {
        KubeReplicas {
            clusters,
            bearer: None,
            last_listed: Arc::default(),
        }
    }

    /// The clusters the pools are found in.
    #[must_use]
    pub fn clusters(&self) -> &Arc<Clusters> {
        &self.clusters
    }

    /// Calls every replica with `bearer`: the control token of the fence sidecars in front of
    /// them, so that the operator's probes pass a fenced standby's fence and its sleep and wake
    /// calls are let through.
    #[must_use]
    pub fn with_bearer(mut self, bearer: Option<Bearer>) -> Self {
        self.bearer = bearer;
        self
    }

    /// The selector of the workload's serving pods; `None` when the workload does not exist,
    /// which leaves the pool without replicas.
    ///
    /// A Deployment or StatefulSet selects with `spec.selector`. A LeaderWorkerSet labels its
    /// pods with its name, and only each group's leader (worker 0) serves the API.
    pub async fn selector(&self, namespace: &str, pool: &PoolSpec) -> Result<Option<Selector>, ResolveError> {
        let workload = &pool.workload;
        let client = self.clusters.client(namespace, pool).await?;
        let read_error = |source| ResolveError::Workload {
            kind: workload.kind,
            name: workload.name.clone(),
            source,
        };
        let label_selector: Option<LabelSelector> = match workload.kind {
            WorkloadKind::Deployment => {
                let api: Api<Deployment> = Api::namespaced(client, namespace);
                match api.get_opt(&workload.name).await.map_err(read_error)? {
                    Some(deployment) => deployment.spec.map(|s| s.selector),
                    None => return Ok(None),
                }
            }
            WorkloadKind::StatefulSet => {
                let api: Api<StatefulSet> = Api::namespaced(client, namespace);
                match api.get_opt(&workload.name).await.map_err(read_error)? {
                    Some(set) => set.spec.map(|s| s.selector),
                    None => return Ok(None),
                }
            }
            WorkloadKind::LeaderWorkerSet => {
                let selector: Selector = [
                    Expression::Equal(LWS_NAME_LABEL.to_owned(), workload.name.clone()),
                    Expression::Equal(LWS_WORKER_INDEX_LABEL.to_owned(), "0".to_owned()),
                ]
                .into_iter()
                .collect();
                return Ok(Some(selector));
            }
        };
        let unusable = |reason: String| ResolveError::Selector {
            kind: workload.kind,
            name: workload.name.clone(),
            reason,
        };
        let selector = Selector::try_from(label_selector.unwrap_or_default()).map_err(|e| unusable(e.0))?;
        if selector.selects_all() {
            return Err(unusable("it selects every pod".to_owned()));
        }
        Ok(Some(selector))
    }

    /// The serving pods of `pool`'s workload, whatever their phase; none when the workload does
    /// not exist.
    pub async fn pods(&self, namespace: &str, pool: &PoolSpec) -> Result<Vec<Pod>, ResolveError> {
        let Some(selector) = self.selector(namespace, pool).await? else {
            return Ok(Vec::new());
        };
        self.selected(namespace, pool, &selector).await
    }

    /// The pods `selector` selects, `pool`'s workload's.
    async fn selected(
        &self,
        namespace: &str,
        pool: &PoolSpec,
        selector: &Selector,
    ) -> Result<Vec<Pod>, ResolveError> {
        let pods: Api<Pod> = Api::namespaced(self.clusters.client(namespace, pool).await?, namespace);
        let listed = pods
            .list(&ListParams::default().labels_from(selector))
            .await
            .map_err(|source| ResolveError::Pods {
                kind: pool.workload.kind,
                name: pool.workload.name.clone(),
                source,
            })?;
        Ok(listed.items)
    }

    /// The probe endpoints of `pool`'s replicas; for a pool in another cluster that cannot be
    /// asked, the ones it was last listed with.
    pub async fn endpoints(&self, namespace: &str, pool: &PoolSpec) -> Result<Vec<Endpoint>, ResolveError> {
        let listed = self.pods(namespace, pool).await.map(|pods| {
            pods.iter()
                .filter_map(|pod| replica_endpoint(pod, pool.port))
                .map(|endpoint| endpoint.with_bearer(self.bearer.clone()))
                .collect::<Vec<_>>()
        });
        let Some(cluster) = pool.cluster_name() else {
            return listed;
        };
        let key = (
            namespace.to_owned(),
            cluster.to_owned(),
            pool.workload.name.clone(),
        );
        let mut last = self.last_listed.lock().unwrap_or_else(PoisonError::into_inner);
        match listed {
            Ok(endpoints) => {
                last.insert(key, (Instant::now(), endpoints.clone()));
                Ok(endpoints)
            }
            Err(error) if is_outage(&error) => match last.get(&key) {
                Some((at, endpoints)) if !endpoints.is_empty() && at.elapsed() <= LAST_LISTED_FOR => {
                    tracing::warn!(%cluster, pool = %pool.name, %error, listed_ago = ?at.elapsed(), "the pool's cluster cannot be reached; probing its replicas as last listed");
                    Ok(endpoints.clone())
                }
                _ => Err(error),
            },
            Err(error) => Err(error),
        }
    }
}

impl ReplicaEndpoints for KubeReplicas {
    fn resolve<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<Endpoint>, ResolveError>> {
        Box::pin(self.endpoints(namespace, pool))
    }

    fn fences<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<(Vec<Endpoint>, bool), ResolveError>> {
        Box::pin(async move {
            // A workload that does not exist lists no pods, but its pods may still be going
            // (deleted in the background, or orphaned): nothing says the list is whole.
            let Some(selector) = self.selector(namespace, pool).await? else {
                return Ok((Vec::new(), false));
            };
            let pods = self.selected(namespace, pool, &selector).await?;
            let fences = pods
                .iter()
                .filter_map(|pod| fence_endpoint(pod, pool.port))
                .map(|endpoint| endpoint.with_bearer(self.bearer.clone()))
                .collect();
            // Every pod the workload selects was listed: the ones left out run no fence.
            Ok((fences, true))
        })
    }

    fn serving_config<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Option<ServingConfig>, ResolveError>> {
        Box::pin(async move {
            let template = self.rolled_out_template(namespace, pool).await?;
            Ok(template.as_ref().and_then(serving_config))
        })
    }

    fn replica_names<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<String>, ResolveError>> {
        Box::pin(async move {
            let pods = self.pods(namespace, pool).await?;
            Ok(pods
                .iter()
                .filter(|pod| replica_endpoint(pod, pool.port).is_some())
                .map(ResourceExt::name_any)
                .collect())
        })
    }

    fn model_places<'a>(
        &'a self,
        namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<ModelPlace>, ResolveError>> {
        Box::pin(async move {
            let pods = self.pods(namespace, pool).await?;
            Ok(pods
                .iter()
                .filter(|pod| replica_endpoint(pod, pool.port).is_some())
                .filter_map(|pod| {
                    let spec = pod.spec.as_ref()?;
                    Some(ModelPlace {
                        pod: pod.name_any(),
                        endpoint: replica_endpoint(pod, pool.port)?.authority(),
                        node: spec.node_name.clone()?,
                        path: model_host_path(spec),
                    })
                })
                .collect())
        })
    }
}

impl KubeReplicas {
    /// The workload's pod template, once every replica runs it. While a rollout is under way old
    /// and new pods both answer, so what they serve cannot be told yet: `None`, as for a
    /// LeaderWorkerSet, which is not read.
    pub async fn rolled_out_template(
        &self,
        namespace: &str,
        pool: &PoolSpec,
    ) -> Result<Option<PodTemplateSpec>, ResolveError> {
        let workload = &pool.workload;
        let client = self.clusters.client(namespace, pool).await?;
        let read_error = |source| ResolveError::Workload {
            kind: workload.kind,
            name: workload.name.clone(),
            source,
        };
        let template = match workload.kind {
            WorkloadKind::Deployment => {
                let api: Api<Deployment> = Api::namespaced(client, namespace);
                let deployment = api.get_opt(&workload.name).await.map_err(read_error)?;
                deployment.and_then(|d| {
                    let status = d.status.unwrap_or_default();
                    let spec = d.spec?;
                    rolled_out(
                        d.metadata.generation,
                        status.observed_generation,
                        spec.replicas.unwrap_or(1),
                        status.replicas,
                        status.updated_replicas,
                    )
                    .then_some(spec.template)
                })
            }
            WorkloadKind::StatefulSet => {
                let api: Api<StatefulSet> = Api::namespaced(client, namespace);
                let set = api.get_opt(&workload.name).await.map_err(read_error)?;
                set.and_then(|s| {
                    let status = s.status.unwrap_or_default();
                    let spec = s.spec?;
                    rolled_out(
                        s.metadata.generation,
                        status.observed_generation,
                        spec.replicas.unwrap_or(1),
                        Some(status.replicas),
                        status.updated_replicas,
                    )
                    .then_some(spec.template)
                })
            }
            WorkloadKind::LeaderWorkerSet => None,
        };
        Ok(template)
    }
}

/// Whether `error` says the API server could not be reached (no connection, no answer in time, a
/// 5xx), rather than that it refused or that its kubeconfig cannot be used.
fn is_outage(error: &ResolveError) -> bool {
    let (ResolveError::Workload { source, .. } | ResolveError::Pods { source, .. }) = error else {
        return false;
    };
    match source {
        kube::Error::Api(status) => status.code >= 500,
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

/// Whether a workload's controller has seen its latest spec and every one of its replicas runs
/// the latest template, with no old one left.
pub(crate) fn rolled_out(
    generation: Option<i64>,
    observed_generation: Option<i64>,
    replicas: i32,
    current: Option<i32>,
    updated: Option<i32>,
) -> bool {
    observed_generation >= generation && current.unwrap_or(0) == replicas && updated.unwrap_or(0) == replicas
}

/// The model `template`'s vLLM container serves: `vllm serve MODEL` or `--model MODEL`, in its
/// command and arguments together ([`serving_config`]).
#[must_use]
pub fn template_model(template: &PodTemplateSpec) -> Option<String> {
    serving_config(template)?.model()
}

/// Where `pod` serves, if it can be probed: Running, not being deleted, with an IP. A pod still
/// pending has nothing to probe yet, and one that is terminating is leaving the pool.
#[must_use]
pub fn replica_endpoint(pod: &Pod, port: u16) -> Option<Endpoint> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    Some(Endpoint::new(ip, port))
}

/// Where `pod`'s fence may serve: any pod with an address that has not ended, terminating and
/// unready ones too, since a fence may hold a grant until its process is gone.
#[must_use]
pub fn fence_endpoint(pod: &Pod, port: u16) -> Option<Endpoint> {
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    Some(Endpoint::new(ip, port))
}

/// Fixed endpoints per pool name, for tests and for running without a cluster.
#[derive(Clone, Debug, Default)]
pub struct FixedReplicas {
    pools: HashMap<String, Vec<Endpoint>>,
    configs: Arc<Mutex<HashMap<String, ServingConfig>>>,
    names: HashMap<String, Vec<String>>,
    places: HashMap<String, Vec<ModelPlace>>,
}

impl FixedReplicas {
    /// The pool named `pool` is served at `endpoints`; a pool never named has no replicas.
    #[must_use]
    pub fn with_pool(mut self, pool: &str, endpoints: Vec<Endpoint>) -> Self {
        self.pools.insert(pool.to_owned(), endpoints);
        self
    }

    /// From now on the pool named `pool` serves `model`, in this value and its clones; a pool
    /// never given one serves a model that cannot be told.
    pub fn set_model(&self, pool: &str, model: &str) {
        let argv = ["vllm", "serve", model].map(str::to_owned).into();
        self.set_config(
            pool,
            ServingConfig {
                argv,
                ..ServingConfig::default()
            },
        );
    }

    /// The replicas of the pool named `pool` are the pods `names`, in the order of its endpoints.
    #[must_use]
    pub fn with_names(mut self, pool: &str, names: Vec<String>) -> Self {
        self.names.insert(pool.to_owned(), names);
        self
    }

    /// The replicas of the pool named `pool` have their model files at `places`.
    #[must_use]
    pub fn with_model_places(mut self, pool: &str, places: Vec<ModelPlace>) -> Self {
        self.places.insert(pool.to_owned(), places);
        self
    }

    /// From now on the pool named `pool` starts vLLM as `config` says, in this value and its
    /// clones; a pool never given one has a template that cannot be told.
    pub fn set_config(&self, pool: &str, config: ServingConfig) {
        let mut configs = self.configs.lock().unwrap_or_else(PoisonError::into_inner);
        configs.insert(pool.to_owned(), config);
    }
}

impl ReplicaEndpoints for FixedReplicas {
    fn resolve<'a>(
        &'a self,
        _namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<Endpoint>, ResolveError>> {
        let endpoints = self.pools.get(&pool.name).cloned().unwrap_or_default();
        Box::pin(async move { Ok(endpoints) })
    }

    fn fences<'a>(
        &'a self,
        _namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<(Vec<Endpoint>, bool), ResolveError>> {
        // The list is the pool, whole.
        let endpoints = self.pools.get(&pool.name).cloned().unwrap_or_default();
        Box::pin(async move { Ok((endpoints, true)) })
    }

    fn serving_config<'a>(
        &'a self,
        _namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Option<ServingConfig>, ResolveError>> {
        let configs = self.configs.lock().unwrap_or_else(PoisonError::into_inner);
        let config = configs.get(&pool.name).cloned();
        Box::pin(async move { Ok(config) })
    }

    fn replica_names<'a>(
        &'a self,
        _namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<String>, ResolveError>> {
        let names = self.names.get(&pool.name).cloned().unwrap_or_default();
        Box::pin(async move { Ok(names) })
    }

    fn model_places<'a>(
        &'a self,
        _namespace: &'a str,
        pool: &'a PoolSpec,
    ) -> BoxFuture<'a, Result<Vec<ModelPlace>, ResolveError>> {
        let places = self.places.get(&pool.name).cloned().unwrap_or_default();
        Box::pin(async move { Ok(places) })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_model_is_read_from_the_serve_arguments_of_the_pod_template() {
        let template = |command: &[&str], args: &[&str]| -> PodTemplateSpec {
            serde_json::from_value(serde_json::json!({"spec": {"containers": [
                {"name": "sidecar", "image": "fence"},
                {"name": "vllm", "image": "vllm/vllm-openai", "command": command, "args": args},
            ]}}))
            .unwrap()
        };
        assert_eq!(
            template_model(&template(
                &["vllm", "serve"],
                &["meta-llama/Llama-3.1-8B", "--port", "8000"]
            ))
            .as_deref(),
            Some("meta-llama/Llama-3.1-8B")
        );
        assert_eq!(
            template_model(&template(
                &["python3", "-m", "vllm.entrypoints.openai.api_server"],
                &["--model=/models/qwen"]
            ))
            .as_deref(),
            Some("/models/qwen")
        );
        assert_eq!(template_model(&template(&[], &["--port", "8000"])), None);
    }
}

//! Where the components the operator calls are: at the addresses its command line gives, or the
//! Running pods a label selector picks in a namespace, as the chart installs them. Pods are
//! listed again at each use, so that a router or agent rescheduled elsewhere is found where it is.
//!
//! Found by label, they are looked for in the operator's own cluster and in every cluster a
//! policy's pools live in, in the same namespace (the chart installed in each region): a region's
//! routers and GPU agents are that region's. A region whose pods cannot be listed is left out with
//! a warning, so that a lost region never holds up a route to the one that serves; its routers
//! keep the old route, which its fences refuse once their grant runs out.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};

use crate::clusters::Clusters;
use crate::crd::{FailoverPolicy, PoolSpec};
use crate::router_admin::RouterAdminUrl;

/// A policy's namespace and pools: where, besides the operator's own cluster, components found by
/// label are looked for.
#[derive(Clone, Copy, Debug)]
pub struct PolicyClusters<'a> {
    pub namespace: &'a str,
    pub pools: &'a [PoolSpec],
}

impl<'a> PolicyClusters<'a> {
    #[must_use]
    pub fn of(namespace: &'a str, policy: &'a FailoverPolicy) -> Self {
        PolicyClusters {
            namespace,
            pools: &policy.spec.pools,
        }
    }
}

/// The Running pods `selector` selects in `namespace`, each at its IP and `port`.
#[derive(Clone)]
pub struct LabelledPods {
    /// The operator's own cluster, and the others pools live in.
    pub clusters: Arc<Clusters>,
    pub namespace: String,
    pub selector: String,
    pub port: u16,
}

impl std::fmt::Debug for LabelledPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabelledPods")
            .field("namespace", &self.namespace)
            .field("selector", &self.selector)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl LabelledPods {
    /// Each Running pod's `(ip, port)`, in the operator's own cluster and in every cluster of
    /// `policy`'s pools; `what` names them in an error. Only the operator's own cluster failing to
    /// list is an error: another cluster that cannot be listed is left out with a warning.
    pub async fn addresses(
        &self,
        what: &str,
        policy: Option<PolicyClusters<'_>>,
    ) -> Result<Vec<(String, u16)>, String> {
        let mut found = self.listed(self.clusters.home().clone(), what).await?;
        let mut seen = BTreeSet::new();
        for pool in policy.iter().flat_map(|p| p.pools) {
            let (Some(policy), Some(cluster)) = (policy, pool.cluster_name()) else {
                continue;
            };
            if !seen.insert(cluster) {
                continue;
            }
            let listed = match self.clusters.client(policy.namespace, pool).await {
                Ok(client) => self.listed(client, what).await,
                Err(error) => Err(error.to_string()),
            };
            match listed {
                Ok(pods) => found.extend(pods),
                Err(why) => tracing::warn!(%cluster, %why, "a cluster's {what} cannot be found; left out"),
            }
        }
        found.sort();
        found.dedup();
        Ok(found)
    }

    async fn listed(&self, client: Client, what: &str) -> Result<Vec<(String, u16)>, String> {
        let (namespace, selector) = (&self.namespace, &self.selector);
        let pods: Api<Pod> = Api::namespaced(client, namespace);
        let listed = pods
            .list(&ListParams::default().labels(selector))
            .await
            .map_err(|error| format!("listing the {what} ({selector} in {namespace}): {error}"))?;
        Ok(listed
            .items
            .iter()
            .filter_map(|pod| {
                let status = pod.status.as_ref()?;
                (status.phase.as_deref() == Some("Running")).then_some(())?;
                (pod.metadata.deletion_timestamp.is_none()).then_some(())?;
                Some((status.pod_ip.clone()?, self.port))
            })
            .collect())
    }
}

/// Where the routers' admin APIs are.
#[derive(Clone, Debug)]
pub enum Routers {
    /// At these URLs (`--router-admin`).
    At(Vec<RouterAdminUrl>),
    /// The router pods a label selects (`--router-selector`), at their admin port.
    Labelled(LabelledPods),
}

impl Routers {
    /// The routers' admin URLs now, with those of every cluster `policy`'s pools live in. Never
    /// empty: no router to call is an error, so that a route is never taken as pushed to "all" of
    /// none.
    pub async fn resolve(&self, policy: Option<PolicyClusters<'_>>) -> Result<Vec<RouterAdminUrl>, String> {
        let found = match self {
            Routers::At(at) => at.clone(),
            Routers::Labelled(pods) => pods
                .addresses("routers", policy)
                .await?
                .into_iter()
                .filter_map(|(ip, port)| {
                    let host = if ip.contains(':') { format!("[{ip}]") } else { ip };
                    format!("http://{host}:{port}").parse().ok()
                })
                .collect(),
        };
        if found.is_empty() {
            return Err(match self {
                Routers::At(_) => "no router is configured".to_owned(),
                Routers::Labelled(pods) => format!(
                    "no running router pod matches {} in {}",
                    pods.selector, pods.namespace
                ),
            });
        }
        Ok(found)
    }
}

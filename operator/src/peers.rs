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
        let found = self.addresses_by_cluster(what, policy).await?;
        let mut found: Vec<(String, u16)> = found.into_iter().map(|(_, ip, port)| (ip, port)).collect();
        found.sort();
        found.dedup();
        Ok(found)
    }

    /// [`Self::addresses`], each with the cluster it was found in (`None`: the operator's own).
    pub async fn addresses_by_cluster(
        &self,
        what: &str,
        policy: Option<PolicyClusters<'_>>,
    ) -> Result<Vec<(Option<String>, String, u16)>, String> {
        Ok(self.find(what, policy).await?.pods)
    }

    /// The pods found in each cluster, and the clusters left out with why.
    pub async fn find(&self, what: &str, policy: Option<PolicyClusters<'_>>) -> Result<Found, String> {
        let home = self.listed(self.clusters.home().clone(), what).await?;
        let mut found: Vec<(Option<String>, String, u16)> =
            home.into_iter().map(|(ip, port)| (None, ip, port)).collect();
        let mut seen = BTreeSet::new();
        let mut left_out = Vec::new();
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
                Ok(pods) => found.extend(
                    pods.into_iter()
                        .map(|(ip, port)| (Some(cluster.to_owned()), ip, port)),
                ),
                Err(why) => {
                    tracing::warn!(%cluster, %why, "a cluster's {what} cannot be found; left out");
                    left_out.push(format!("cluster {cluster}: {why}"));
                }
            }
        }
        Ok(Found {
            pods: found,
            left_out,
        })
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

/// What [`LabelledPods::find`] found: each pod's cluster (`None`: the operator's own), IP and port,
/// and the clusters whose pods could not be listed, each with why.
#[derive(Clone, Debug, Default)]
pub struct Found {
    pub pods: Vec<(Option<String>, String, u16)>,
    pub left_out: Vec<String>,
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
        Ok(self.resolve_all(policy).await?.0)
    }

    /// [`Self::resolve`], with the clusters whose routers could not be listed, each with why.
    pub async fn resolve_all(
        &self,
        policy: Option<PolicyClusters<'_>>,
    ) -> Result<(Vec<RouterAdminUrl>, Vec<String>), String> {
        let (found, left_out) = match self {
            Routers::At(at) => (at.clone(), Vec::new()),
            Routers::Labelled(pods) => {
                let Found {
                    pods: found,
                    left_out,
                } = pods.find("routers", policy).await?;
                let mut urls: Vec<RouterAdminUrl> = found
                    .into_iter()
                    .filter_map(|(_, ip, port)| {
                        let host = if ip.contains(':') { format!("[{ip}]") } else { ip };
                        format!("http://{host}:{port}").parse().ok()
                    })
                    .collect();
                urls.sort_by_key(ToString::to_string);
                urls.dedup_by_key(|url| url.to_string());
                (urls, left_out)
            }
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
        Ok((found, left_out))
    }
}

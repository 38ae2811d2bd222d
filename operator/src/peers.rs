//! Where the components the operator calls are: at the addresses its command line gives, or the
//! Running pods a label selector picks in a namespace, as the chart installs them. Pods are
//! listed again at each use, so that a router or agent rescheduled elsewhere is found where it is.

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};

use crate::router_admin::RouterAdminUrl;

/// The Running pods `selector` selects in `namespace`, each at its IP and `port`.
#[derive(Clone)]
pub struct LabelledPods {
    pub client: Client,
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
    /// Each Running pod's `(ip, port)`; `what` names them in an error.
    pub async fn addresses(&self, what: &str) -> Result<Vec<(String, u16)>, String> {
        let (namespace, selector) = (&self.namespace, &self.selector);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
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
    /// The routers' admin URLs now. Never empty: no router to call is an error, so that a
    /// route is never taken as pushed to "all" of none.
    pub async fn resolve(&self) -> Result<Vec<RouterAdminUrl>, String> {
        let found = match self {
            Routers::At(at) => at.clone(),
            Routers::Labelled(pods) => pods
                .addresses("routers")
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

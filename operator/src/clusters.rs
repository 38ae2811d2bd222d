//! The clusters a policy's pools live in: the operator's own, or another one a pool names
//! (`spec.pools[].cluster`), reached with the kubeconfig a Secret in the policy's namespace holds.
//! Everything the operator does to a pool (listing its pods, scaling its workload, reading its
//! cold starts, reserving its GPUs, injecting a game day's faults) goes through the client
//! [`Clusters::client`] gives for it; the epoch Lease, the policy and its Events stay in the
//! operator's own cluster.
//!
//! A Secret is read again at most every [`REREAD_AFTER`], so that rotated credentials are picked
//! up, and its client is kept while the Secret's `resourceVersion` stays the same. A Secret that
//! cannot be read again (within [`READ_TIMEOUT`]) keeps the client it gave last: the operator's own
//! API server being slow must not cut it off from a region. A Secret deleted, or changed to a
//! kubeconfig that cannot be used, drops its client: its credentials may have been revoked on
//! purpose.
//!
//! A kubeconfig is the policy author's, and the operator holds its own credentials: one that would
//! run a program (`exec`, `auth-provider`) or read a file of the operator's (`tokenFile`,
//! `client-certificate`, `client-key`, `certificate-authority`) is refused before it is used, so
//! that a Secret can neither run code in the operator nor send its token elsewhere.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::crd::{ClusterRef, PoolSpec};

/// How long a Secret's kubeconfig is used before the Secret is read again.
pub const REREAD_AFTER: Duration = Duration::from_secs(30);
/// How long a connection to another cluster's API server may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a call to another cluster's API server may wait for its answer. The operator only
/// gets and lists there, never watches, so a lost region is told apart from a slow one quickly.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a pool's cluster cannot be reached.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster {cluster}: reading the Secret {secret:?}: {source}")]
    Secret {
        cluster: String,
        secret: String,
        #[source]
        source: kube::Error,
    },
    #[error("cluster {cluster}: the Secret {secret:?} does not exist")]
    NoSecret { cluster: String, secret: String },
    #[error("cluster {cluster}: the Secret {secret:?} has no key {key:?}")]
    NoKey {
        cluster: String,
        secret: String,
        key: String,
    },
    #[error("cluster {cluster}: the kubeconfig in the Secret {secret:?} cannot be used: {reason}")]
    Kubeconfig {
        cluster: String,
        secret: String,
        reason: String,
    },
}

/// Where a Secret's kubeconfig came from: the policy's namespace, the Secret and its key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SecretKey {
    namespace: String,
    secret: String,
    key: String,
}

struct Cached {
    client: Client,
    resource_version: Option<String>,
    read_at: Instant,
}

/// The operator's own cluster and the others its policies' pools name.
pub struct Clusters {
    home: Client,
    others: Mutex<HashMap<SecretKey, Cached>>,
    reread_after: Duration,
}

impl fmt::Debug for Clusters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Clusters").finish_non_exhaustive()
    }
}

impl Clusters {
    /// The operator's own cluster is `home`; it holds the Secrets the others are reached with.
    #[must_use]
    pub fn new(home: Client) -> Self {
        Clusters {
            home,
            others: Mutex::new(HashMap::new()),
            reread_after: REREAD_AFTER,
        }
    }

    /// Reads a Secret again once its kubeconfig has been used for `after`, not [`REREAD_AFTER`].
    #[must_use]
    pub fn reread_after(mut self, after: Duration) -> Self {
        self.reread_after = after;
        self
    }

    /// The operator's own cluster.
    #[must_use]
    pub fn home(&self) -> &Client {
        &self.home
    }

    /// The client for `pool`, of a policy in `namespace`.
    pub async fn client(&self, namespace: &str, pool: &PoolSpec) -> Result<Client, ClusterError> {
        match &pool.cluster {
            None => Ok(self.home.clone()),
            Some(cluster) => self.other(namespace, cluster).await,
        }
    }

    async fn other(&self, namespace: &str, cluster: &ClusterRef) -> Result<Client, ClusterError> {
        let at = SecretKey {
            namespace: namespace.to_owned(),
            secret: cluster.kubeconfig_secret.name.clone(),
            key: cluster.kubeconfig_secret.key.clone(),
        };
        // One reader at a time: a probing round asks for every pool at once, and one read of the
        // Secret serves them all.
        let mut others = self.others.lock().await;
        if let Some(cached) = others.get(&at)
            && cached.read_at.elapsed() < self.reread_after
        {
            return Ok(cached.client.clone());
        }
        let secrets: Api<Secret> = Api::namespaced(self.home.clone(), namespace);
        let read = tokio::time::timeout(READ_TIMEOUT, secrets.get_opt(&at.secret))
            .await
            .unwrap_or_else(|_| {
                Err(kube::Error::Service(
                    format!("no answer within {READ_TIMEOUT:?}").into(),
                ))
            });
        let read = match read {
            Ok(Some(secret)) => secret,
            Ok(None) => {
                others.remove(&at);
                return Err(ClusterError::NoSecret {
                    cluster: cluster.name.clone(),
                    secret: at.secret,
                });
            }
            Err(source) => {
                if let Some(cached) = others.get_mut(&at) {
                    tracing::warn!(cluster = %cluster.name, secret = %at.secret, %source, "the kubeconfig's Secret could not be read again; the client it gave last is kept");
                    cached.read_at = Instant::now();
                    return Ok(cached.client.clone());
                }
                return Err(ClusterError::Secret {
                    cluster: cluster.name.clone(),
                    secret: at.secret,
                    source,
                });
            }
        };
        let resource_version = read.metadata.resource_version.clone();
        if let Some(cached) = others.get_mut(&at)
            && cached.resource_version == resource_version
        {
            cached.read_at = Instant::now();
            return Ok(cached.client.clone());
        }
        let client = match client_from(cluster, &at, &read).await {
            Ok(client) => client,
            Err(error) => {
                others.remove(&at);
                return Err(error);
            }
        };
        tracing::info!(cluster = %cluster.name, secret = %at.secret, %namespace, "reaching the cluster with the kubeconfig in its Secret");
        others.insert(
            at,
            Cached {
                client: client.clone(),
                resource_version,
                read_at: Instant::now(),
            },
        );
        Ok(client)
    }
}

/// A client from the kubeconfig under `at.key` of `secret`, with timeouts for a cluster that may
/// be a region away.
async fn client_from(cluster: &ClusterRef, at: &SecretKey, secret: &Secret) -> Result<Client, ClusterError> {
    let unusable = |reason: String| ClusterError::Kubeconfig {
        cluster: cluster.name.clone(),
        secret: at.secret.clone(),
        reason,
    };
    let bytes = secret
        .data
        .as_ref()
        .and_then(|data| data.get(&at.key))
        .map(|value| value.0.clone())
        .or_else(|| {
            let text = secret.string_data.as_ref()?.get(&at.key)?;
            Some(text.clone().into_bytes())
        })
        .ok_or_else(|| ClusterError::NoKey {
            cluster: cluster.name.clone(),
            secret: at.secret.clone(),
            key: at.key.clone(),
        })?;
    let text = String::from_utf8(bytes).map_err(|_| unusable("it is not UTF-8".to_owned()))?;
    let kubeconfig = Kubeconfig::from_yaml(&text).map_err(|e| unusable(e.to_string()))?;
    outside_the_secret(&kubeconfig).map_err(unusable)?;
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| unusable(e.to_string()))?;
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(READ_TIMEOUT);
    config.write_timeout = Some(READ_TIMEOUT);
    Client::try_from(config).map_err(|e| unusable(e.to_string()))
}

/// Why `kubeconfig` reaches outside its Secret: a program it would run, or a file of the
/// operator's it would read.
fn outside_the_secret(kubeconfig: &Kubeconfig) -> Result<(), String> {
    for named in &kubeconfig.auth_infos {
        let Some(user) = &named.auth_info else {
            continue;
        };
        let refused = [
            (user.exec.is_some(), "exec"),
            (user.auth_provider.is_some(), "auth-provider"),
            (user.token_file.is_some(), "tokenFile"),
            (user.client_certificate.is_some(), "client-certificate"),
            (user.client_key.is_some(), "client-key"),
        ];
        if let Some((_, field)) = refused.iter().find(|(set, _)| *set) {
            return Err(format!(
                "user {:?} sets {field}, which would run a program or read a file of the operator's; \
                 give the credentials inline (token, client-certificate-data, client-key-data)",
                named.name
            ));
        }
    }
    for named in &kubeconfig.clusters {
        if named
            .cluster
            .as_ref()
            .is_some_and(|c| c.certificate_authority.is_some())
        {
            return Err(format!(
                "cluster {:?} sets certificate-authority, a file of the operator's; give certificate-authority-data",
                named.name
            ));
        }
    }
    Ok(())
}

//! The shell both controllers run in, the FailoverPolicy's and the GameDay's: the controller loop
//! over one namespace or all, Events published under a timeout against a reference to their
//! object, and status written by server-side apply under the crate's field manager and a timeout.
//! Each controller brings its context, holding a [`Shell`], its reconcile and its error policy.
//!
//! What this module must never do: decide anything about an object, fail a reconcile because an
//! Event could not be written, or wait on the API server without a timeout.

use std::fmt::{self, Debug};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use understudy_api::FIELD_MANAGER;
pub use understudy_api::time::{rfc3339, since_epoch};

use crate::ports::{Clock, SystemClock};
use crate::watchdog::Watchdog;

/// The name Events are reported under.
pub const CONTROLLER_NAME: &str = "understudy-operator";

/// What both controllers' contexts hold for the shell: the client, the Event recorder, the clock,
/// the longest a status patch or an Event may take, and the watchdog each reconcile reports to.
#[derive(Clone)]
pub struct Shell {
    pub client: Client,
    pub recorder: Recorder,
    pub clock: Arc<dyn Clock>,
    /// The longest a status patch or an Event may take.
    pub write_timeout: Duration,
    /// Where each reconcile records that it runs, so that a stuck one is noticed.
    pub watchdog: Watchdog,
    /// What the controller's Warning Events say it was doing.
    action: &'static str,
}

impl fmt::Debug for Shell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shell")
            .field("clock", &self.clock)
            .field("write_timeout", &self.write_timeout)
            .field("watchdog", &self.watchdog)
            .field("action", &self.action)
            .finish_non_exhaustive()
    }
}

impl Shell {
    /// Events reported as `instance` of [`CONTROLLER_NAME`], Warnings saying the controller was
    /// doing `action`; the wall clock, ten seconds for a write, a watchdog of its own.
    #[must_use]
    pub fn new(client: Client, instance: Option<String>, action: &'static str) -> Shell {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.to_owned(),
            instance,
        };
        Shell {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            clock: Arc::new(SystemClock::new()),
            write_timeout: Duration::from_secs(10),
            watchdog: Watchdog::default(),
            action,
        }
    }
}

/// A context that holds a [`Shell`], and the builder calls each such context takes.
pub trait WithShell: Sized {
    fn shell_mut(&mut self) -> &mut Shell;

    /// Reads time from `clock` (tests stop it or move it by hand).
    #[must_use]
    fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.shell_mut().clock = clock;
        self
    }

    /// Records each reconcile with `watchdog`, so that a stuck one is noticed.
    #[must_use]
    fn with_watchdog(mut self, watchdog: Watchdog) -> Self {
        self.shell_mut().watchdog = watchdog;
        self
    }
}

/// Runs a controller of `K` over `namespace` (all namespaces when `None`) until the stream ends:
/// objects that do not deserialize reach `reconcile` too, as a [`DeserializeGuard`], so that one
/// malformed object is reported instead of breaking the watch. Each object `reconcile_now` names
/// is reconciled as soon as it can be, besides the watch's changes and the requeues.
pub async fn run<K, C, R, Fut, E>(
    client: Client,
    ctx: Arc<C>,
    namespace: Option<&str>,
    reconcile: R,
    error_policy: fn(Arc<DeserializeGuard<K>>, &E, Arc<C>) -> Action,
    reconcile_now: impl Stream<Item = ObjectRef<K>> + Send + 'static,
) where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
    C: Send + Sync + 'static,
    R: FnMut(Arc<DeserializeGuard<K>>, Arc<C>) -> Fut,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
{
    let objects: Api<DeserializeGuard<K>> = match namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let reconcile_now = reconcile_now.map(|object| {
        let guarded = ObjectRef::<DeserializeGuard<K>>::new(&object.name);
        match &object.namespace {
            Some(namespace) => guarded.within(namespace),
            None => guarded,
        }
    });
    Controller::new(objects, watcher::Config::default().any_semantic())
        .reconcile_on(reconcile_now)
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|outcome| async move {
            match outcome {
                Ok((object, _)) => tracing::debug!(%object, "reconciled"),
                Err(error) => tracing::debug!(kind = K::kind(&()).as_ref(), %error, "reconcile attempt"),
            }
        })
        .await;
}

/// The reference an Event about the `K` with `meta` names.
#[must_use]
pub fn object_reference<K: Resource<DynamicType = ()>>(meta: &ObjectMeta) -> ObjectReference {
    ObjectReference {
        api_version: Some(K::api_version(&()).into_owned()),
        kind: Some(K::kind(&()).into_owned()),
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        ..ObjectReference::default()
    }
}

/// Publishes one Warning Event, best effort.
pub async fn warn(shell: &Shell, reference: &ObjectReference, reason: &str, note: String) {
    let event = KubeEvent {
        type_: EventType::Warning,
        reason: reason.to_owned(),
        note: Some(note),
        action: shell.action.to_owned(),
        secondary: None,
    };
    send(shell, reference, &event).await;
}

/// Publishes one Event, best effort: one that cannot be written in time is logged and dropped.
pub async fn send(shell: &Shell, reference: &ObjectReference, event: &KubeEvent) {
    match tokio::time::timeout(shell.write_timeout, shell.recorder.publish(event, reference)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(reason = %event.reason, %error, "could not publish event"),
        Err(_) => tracing::warn!(reason = %event.reason, "publishing an event timed out"),
    }
}

/// Why a status could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StatusWrite {
    /// The API server refused the patch (a 409 when `read_at` no longer holds).
    #[error("status patch: {0}")]
    Patch(#[source] kube::Error),
    /// The patch got no answer in time.
    #[error("status patch got no answer within {0:?}")]
    Timeout(Duration),
}

/// Applies `status` to the `K` named `name`, by server-side apply under [`FIELD_MANAGER`] and the
/// write timeout; with `read_at`, only over the `resourceVersion` the reconcile read.
pub async fn apply_status<K, S>(
    shell: &Shell,
    namespace: &str,
    name: &str,
    read_at: Option<&str>,
    status: &S,
) -> Result<(), StatusWrite>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Debug,
    S: Serialize,
{
    let api: Api<K> = Api::namespaced(shell.client.clone(), namespace);
    let mut patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    if let Some(version) = read_at {
        patch["metadata"] = serde_json::json!({ "resourceVersion": version });
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let timeout = shell.write_timeout;
    match tokio::time::timeout(timeout, api.patch_status(name, &params, &Patch::Apply(&patch))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(StatusWrite::Patch(error)),
        Err(_) => Err(StatusWrite::Timeout(timeout)),
    }
}

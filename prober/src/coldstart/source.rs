//! Where a cold start's record comes from: files `kubectl` wrote, or the Kubernetes API.
//!
//! Both paths end in the same [`Recorded`] (the pod and its events as JSON, the container's log
//! with timestamps), and everything after that — parsing, stage boundaries, the table — is shared,
//! so the two can never disagree about the same pod. This module only fetches; it must never
//! decide a stage (that is [`super::build`]'s job).

use std::path::{Path, PathBuf};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::{ListParams, LogParams};

use super::{ColdStartInputs, Timeline};

/// Why a cold start's record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    File { path: PathBuf, source: std::io::Error },
    #[error("the Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("re-encoding what the API returned: {0}")]
    Encode(serde_json::Error),
    #[error(transparent)]
    Parse(#[from] super::Error),
}

/// One replica's cold start as recorded, before anything is read out of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// `kubectl get pod NAME -o json`.
    pub pod: String,
    /// `kubectl get events --field-selector involvedObject.name=NAME -o json`; `None` when
    /// there is no record of events.
    pub events: Option<String>,
    /// `kubectl logs NAME -c CONTAINER --timestamps`; empty when there is no log.
    pub log: String,
    /// The serving container; the pod's first container when `None`.
    pub container: Option<String>,
}

impl Recorded {
    /// The record `kubectl` wrote to files.
    pub fn from_files(
        pod: &Path,
        events: Option<&Path>,
        logs: Option<&Path>,
        container: Option<String>,
    ) -> Result<Recorded, Error> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| Error::File {
                path: path.to_owned(),
                source,
            })
        };
        Ok(Recorded {
            pod: read(pod)?,
            events: events.map(read).transpose()?,
            log: logs.map(read).transpose()?.unwrap_or_default(),
            container,
        })
    }

    /// The record as the API server holds it: the pod, its events (field selector
    /// `involvedObject.name`) and the serving container's log with timestamps. The container is
    /// named in the log request even when the caller named none, so that the log is the first
    /// container's, as the timeline's is.
    pub async fn from_api(
        client: kube::Client,
        namespace: &str,
        name: &str,
        container: Option<String>,
    ) -> Result<Recorded, Error> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let pod = pods.get(name).await?;
        let pod_json = serde_json::to_string(&pod).map_err(Error::Encode)?;
        let container = container.or_else(|| {
            super::parse_pod(&pod_json)
                .ok()
                .and_then(|p| p.container(None).map(|c| c.name.clone()))
        });
        let events: Api<Event> = Api::namespaced(client, namespace);
        let selector = format!("involvedObject.name={name}");
        let events = events.list(&ListParams::default().fields(&selector)).await?;
        let log = pods
            .logs(
                name,
                &LogParams {
                    container: container.clone(),
                    timestamps: true,
                    ..LogParams::default()
                },
            )
            .await?;
        Ok(Recorded {
            pod: pod_json,
            events: Some(serde_json::to_string(&events).map_err(Error::Encode)?),
            log,
            container,
        })
    }

    /// The timeline this record gives, the first token's time added when a probe saw one.
    pub fn timeline(&self, first_token: Option<Timestamp>) -> Result<Timeline, Error> {
        let pod = super::parse_pod(&self.pod)?;
        let events = match &self.events {
            Some(json) => super::parse_events(json)?,
            None => Vec::new(),
        };
        Ok(super::build(&ColdStartInputs {
            pod: &pod,
            events: &events,
            log: &self.log,
            container: self.container.as_deref(),
            first_token,
        }))
    }
}

//! The few fields of a Pod and its Events that time a cold start, read from the JSON that
//! `kubectl get pod -o json` and `kubectl get events -o json` print (or the API returns).
//!
//! Only what the timeline needs is typed, so a newer API server's extra fields never break the
//! parse. This module reads; it must never decide stage boundaries (that is [`super`]'s job).

use jiff::Timestamp;
use serde::Deserialize;

/// A Pod, as much of it as a cold start needs.
#[derive(Debug, Clone, Deserialize)]
pub struct Pod {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub uid: Option<String>,
    #[serde(default)]
    pub creation_timestamp: Option<Timestamp>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default)]
    pub conditions: Vec<PodCondition>,
    #[serde(default)]
    pub container_statuses: Vec<ContainerStatus>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodCondition {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: String,
    #[serde(default)]
    pub last_transition_time: Option<Timestamp>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStatus {
    pub name: String,
    #[serde(default)]
    pub state: Option<ContainerState>,
    #[serde(default)]
    pub restart_count: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContainerState {
    #[serde(default)]
    pub running: Option<RunningState>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunningState {
    #[serde(default)]
    pub started_at: Option<Timestamp>,
}

impl Pod {
    /// When the condition of this type last turned `True`; `None` while it is not true.
    pub fn condition_true_at(&self, kind: &str) -> Option<Timestamp> {
        self.status
            .conditions
            .iter()
            .find(|c| c.kind == kind && c.status == "True")
            .and_then(|c| c.last_transition_time)
    }

    /// The status of the named container, or of the first container when no name is given.
    pub fn container(&self, name: Option<&str>) -> Option<&ContainerStatus> {
        match name {
            Some(name) => self.status.container_statuses.iter().find(|c| c.name == name),
            None => self.status.container_statuses.first(),
        }
    }
}

/// A core/v1 Event (the `events.k8s.io/v1` spellings `regarding` and `note` are accepted too).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    #[serde(alias = "regarding")]
    pub involved_object: ObjectReference,
    #[serde(default)]
    pub reason: String,
    #[serde(default, alias = "note")]
    pub message: String,
    #[serde(default)]
    pub event_time: Option<Timestamp>,
    #[serde(default, alias = "deprecatedFirstTimestamp")]
    pub first_timestamp: Option<Timestamp>,
    #[serde(default, alias = "deprecatedLastTimestamp")]
    pub last_timestamp: Option<Timestamp>,
    /// How many times the kubelet saw this event (repeats are folded into one, `lastTimestamp`
    /// moving on).
    #[serde(default, alias = "deprecatedCount")]
    pub count: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectReference {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub uid: Option<String>,
    #[serde(default)]
    pub field_path: Option<String>,
}

impl Event {
    /// When the event first happened: `eventTime` (microseconds) when set, else the
    /// one-second `firstTimestamp`, else `lastTimestamp`.
    pub fn time(&self) -> Option<Timestamp> {
        self.event_time.or(self.first_timestamp).or(self.last_timestamp)
    }

    /// When the event last happened: `lastTimestamp`, else `eventTime`, else `firstTimestamp`.
    pub fn last_time(&self) -> Option<Timestamp> {
        self.last_timestamp.or(self.event_time).or(self.first_timestamp)
    }

    /// Whether the event is about this pod (by uid when both sides have one, else by name).
    pub fn is_about(&self, pod: &Pod) -> bool {
        match (&self.involved_object.uid, &pod.metadata.uid) {
            (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => a == b,
            _ => self.involved_object.name == pod.metadata.name,
        }
    }

    /// The container a kubelet event is about, from `fieldPath` (`spec.containers{vllm}`).
    pub fn container(&self) -> Option<&str> {
        let path = self.involved_object.field_path.as_deref()?;
        path.strip_prefix("spec.containers{")?.strip_suffix('}')
    }
}

/// `kubectl get events -o json` prints a List; a bare array is accepted too.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum EventDocument {
    List { items: Vec<Event> },
    Array(Vec<Event>),
}

impl EventDocument {
    pub(crate) fn into_events(self) -> Vec<Event> {
        match self {
            EventDocument::List { items } | EventDocument::Array(items) => items,
        }
    }
}

//! Cold-start timelines: where a replica's start went, stage by stage.
//!
//! One [`Timeline`] per replica, built from the pod's conditions and events ([`kube`]), the
//! container's `kubectl logs --timestamps` output ([`vllm_log`]) and the first successful
//! generating probe. The stages are [`ColdStartStage`]s in start order: node, image, container
//! start, engine start, weight load, warmup, ready, first token. A stage whose signal is missing is
//! [`StageDuration::Unknown`] with the missing signal named: this module must never guess a
//! time, and it does no I/O ([`source`] reads the files or the API).

pub mod kube;
pub mod source;
pub mod vllm_log;

use std::fmt;
use std::time::Duration;

use jiff::Timestamp;
use serde::Serialize;

use self::kube::{ContainerStatus, Event, EventDocument, Pod};
use self::vllm_log::{StartupLog, duration_of};

/// Why the inputs could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the pod JSON: {0}")]
    Pod(serde_json::Error),
    #[error("the events JSON: {0}")]
    Events(serde_json::Error),
}

/// One stage of a cold start, in the order they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ColdStartStage {
    /// Pod created → scheduled on a node (includes autoscaler or Karpenter provisioning).
    Node,
    /// `Pulling` → `Pulled`, timed by the kubelet's own in-message pull duration.
    Image,
    /// Image ready → the container process running (create and start).
    ContainerStart,
    /// The container running → `Starting to load model`: Python's imports, the API server
    /// resolving the model's config, the engine core and worker processes starting.
    EngineStart,
    /// `Starting to load model` → `Model loading took` (or, where that is not printed, as on CPU,
    /// `Loading weights took`).
    WeightLoad,
    /// Weights loaded → engine initialised (profiling, KV cache, torch.compile, CUDA graphs).
    Warmup,
    /// Engine initialised → the API answers (uvicorn `Application startup complete.`, else the
    /// pod's `Ready` condition).
    Ready,
    /// API ready → the first successful generating probe.
    FirstToken,
}

impl ColdStartStage {
    pub const ALL: [ColdStartStage; 8] = [
        ColdStartStage::Node,
        ColdStartStage::Image,
        ColdStartStage::ContainerStart,
        ColdStartStage::EngineStart,
        ColdStartStage::WeightLoad,
        ColdStartStage::Warmup,
        ColdStartStage::Ready,
        ColdStartStage::FirstToken,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ColdStartStage::Node => "node",
            ColdStartStage::Image => "image",
            ColdStartStage::ContainerStart => "container-start",
            ColdStartStage::EngineStart => "engine-start",
            ColdStartStage::WeightLoad => "weight-load",
            ColdStartStage::Warmup => "warmup",
            ColdStartStage::Ready => "ready",
            ColdStartStage::FirstToken => "first-token",
        }
    }
}

impl fmt::Display for ColdStartStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How long a stage took, or which signal was missing to tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageDuration {
    Known(Duration),
    Unknown { missing: &'static str },
}

impl StageDuration {
    pub fn known(&self) -> Option<Duration> {
        match self {
            StageDuration::Known(d) => Some(*d),
            StageDuration::Unknown { .. } => None,
        }
    }
}

impl Serialize for StageDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(1))?;
        match self {
            StageDuration::Known(d) => map.serialize_entry("seconds", &d.as_secs_f64())?,
            StageDuration::Unknown { missing } => map.serialize_entry("unknown", missing)?,
        }
        map.end()
    }
}

/// One stage of one replica's start.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageReport {
    pub stage: ColdStartStage,
    pub duration: StageDuration,
    /// When the stage began, where a signal says so.
    pub started: Option<Timestamp>,
    /// When the stage ended, where a signal says so.
    pub finished: Option<Timestamp>,
    /// What else the signals said (node name, provisioner, cache hits, sub-stage seconds).
    pub detail: Vec<String>,
}

/// One replica's cold start.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub pod: String,
    pub namespace: Option<String>,
    pub container: Option<String>,
    pub created: Option<Timestamp>,
    pub stages: Vec<StageReport>,
    /// Pod created → first token: the number a recovery objective is compared with.
    pub to_first_token: StageDuration,
}

impl Timeline {
    pub fn stage(&self, stage: ColdStartStage) -> &StageReport {
        // `build` always lists every stage, in order.
        &self.stages[stage as usize]
    }

    pub fn duration(&self, stage: ColdStartStage) -> Option<Duration> {
        self.stage(stage).duration.known()
    }
}

/// What the inputs of one replica's cold start are.
#[derive(Debug, Clone)]
pub struct ColdStartInputs<'a> {
    pub pod: &'a Pod,
    pub events: &'a [Event],
    /// The container's log with `kubectl logs --timestamps` prefixes; empty when unavailable.
    pub log: &'a str,
    /// The serving container; the pod's first container when `None`.
    pub container: Option<&'a str>,
    /// When the first successful generating probe got its first token.
    pub first_token: Option<Timestamp>,
}

/// Reads `kubectl get pod -o json` output.
pub fn parse_pod(json: &str) -> Result<Pod, Error> {
    serde_json::from_str(json).map_err(Error::Pod)
}

/// Reads `kubectl get events -o json` output (a List, or a bare array of events).
pub fn parse_events(json: &str) -> Result<Vec<Event>, Error> {
    serde_json::from_str::<EventDocument>(json)
        .map(EventDocument::into_events)
        .map_err(Error::Events)
}

/// The span between two instants, when both are known and in order.
fn between(start: Option<Timestamp>, end: Option<Timestamp>) -> Option<Duration> {
    let span = end?.duration_since(start?);
    Duration::try_from(span).ok()
}

fn known_or(duration: Option<Duration>, missing: &'static str) -> StageDuration {
    match duration {
        Some(d) => StageDuration::Known(d),
        None => StageDuration::Unknown { missing },
    }
}

/// How the image became available.
enum ImagePull {
    /// `Successfully pulled image … in D`: D is the kubelet's pull time.
    Pulled(Option<Duration>),
    /// `Container image … already present on machine`.
    Cached,
}

fn image_pull(message: &str) -> Option<ImagePull> {
    if message.contains("already present on machine") {
        return Some(ImagePull::Cached);
    }
    let rest = message.split_once("Successfully pulled image ")?.1;
    // The image reference is quoted; the duration follows ` in ` after the closing quote.
    let after_ref = rest
        .strip_prefix('"')
        .and_then(|r| r.split_once('"'))
        .map(|(_, a)| a)?;
    let duration = after_ref
        .trim_start()
        .strip_prefix("in ")
        .and_then(|d| d.split([' ', '(']).next())
        .and_then(|d| understudy_core::duration::parse(d.trim_end_matches('.')).ok());
    Some(ImagePull::Pulled(duration))
}

/// Builds one replica's timeline. Every stage is present; unknown ones name their missing signal.
pub fn build(inputs: &ColdStartInputs<'_>) -> Timeline {
    let pod = inputs.pod;
    let status = pod.container(inputs.container);
    let container = inputs
        .container
        .map(str::to_owned)
        .or_else(|| status.map(|s| s.name.clone()));
    let events = PodEvents::about(pod, inputs.events, container.as_deref());
    let log = StartupLog::parse(inputs.log);
    let created = pod.metadata.creation_timestamp;

    let node = node_stage(pod, &events, created);
    let image = image_stage(&events);
    let container_start = container_start_stage(status, &events, image.finished);
    let engine_start = engine_start_stage(&log, container_start.finished);
    let weight_load = weight_load_stage(&log);
    let warmup = warmup_stage(&log, weight_load.finished);
    let ready = ready_stage(pod, &log, created, warmup.finished);
    let first_token = first_token_stage(ready.finished, inputs.first_token);
    let stages = vec![
        node,
        image,
        container_start,
        engine_start,
        weight_load,
        warmup,
        ready,
        first_token,
    ];

    Timeline {
        pod: pod.metadata.name.clone(),
        namespace: pod.metadata.namespace.clone(),
        container,
        created,
        stages,
        to_first_token: known_or(
            between(created, inputs.first_token),
            "the pod's creationTimestamp and a successful generating probe",
        ),
    }
}

/// The events about one pod, oldest first, and the container whose events count.
struct PodEvents<'a> {
    events: Vec<&'a Event>,
    container: Option<&'a str>,
}

impl<'a> PodEvents<'a> {
    fn about(pod: &Pod, events: &'a [Event], container: Option<&'a str>) -> Self {
        let mut events: Vec<&Event> = events.iter().filter(|e| e.is_about(pod)).collect();
        events.sort_by_key(|e| e.time());
        PodEvents { events, container }
    }

    /// The first event with this reason, whatever it is about in the pod.
    fn pod_event(&self, reason: &str) -> Option<&'a Event> {
        self.events.iter().copied().find(|e| e.reason == reason)
    }

    /// How many events have this reason, whatever they are about in the pod.
    fn count(&self, reason: &str) -> usize {
        self.events.iter().filter(|e| e.reason == reason).count()
    }

    /// The events with this reason about the serving container, or about no container in particular.
    fn container_events(&self, reason: &str) -> Vec<&'a Event> {
        self.events
            .iter()
            .copied()
            .filter(|e| {
                e.reason == reason
                    && (self.container.is_none()
                        || e.container().is_none()
                        || e.container() == self.container)
            })
            .collect()
    }

    /// The oldest of those events.
    fn container_event(&self, reason: &str) -> Option<&'a Event> {
        self.container_events(reason).first().copied()
    }
}

/// Node: created → scheduled. The Scheduled event carries microseconds; the condition whole seconds.
fn node_stage(pod: &Pod, events: &PodEvents<'_>, created: Option<Timestamp>) -> StageReport {
    let scheduled_event = events.pod_event("Scheduled");
    let scheduled = scheduled_event
        .and_then(Event::time)
        .or_else(|| pod.condition_true_at("PodScheduled"));
    let mut detail = Vec::new();
    if let Some(e) = events.pod_event("TriggeredScaleUp") {
        detail.push(format!("cluster-autoscaler: {}", e.message));
    }
    if let Some(e) = events.pod_event("Nominated") {
        detail.push(format!("karpenter: {}", e.message));
    }
    let failed = events.count("FailedScheduling");
    if failed > 0 {
        detail.push(format!("{failed} FailedScheduling event(s)"));
    }
    if let Some(node) = scheduled_event
        .and_then(|e| e.message.rsplit_once(" to "))
        .map(|(_, n)| n)
    {
        detail.push(format!("assigned to {node}"));
    }
    StageReport {
        stage: ColdStartStage::Node,
        duration: match (created, scheduled) {
            (None, _) => StageDuration::Unknown {
                missing: "the pod's creationTimestamp",
            },
            (_, None) => StageDuration::Unknown {
                missing: "a Scheduled event or PodScheduled=True condition",
            },
            _ => known_or(
                between(created, scheduled),
                "scheduling before creation (clock skew)",
            ),
        },
        started: created,
        finished: scheduled,
        detail,
    }
}

/// Image: the kubelet's in-message pull time, or zero when the image was already there.
fn image_stage(events: &PodEvents<'_>) -> StageReport {
    let pulling = events.container_event("Pulling");
    let pulled = events.container_event("Pulled");
    let pull = pulled.and_then(|e| image_pull(&e.message));
    let (image_duration, image_detail) = match &pull {
        Some(ImagePull::Cached) => (
            StageDuration::Known(Duration::ZERO),
            vec!["already present on machine".into()],
        ),
        Some(ImagePull::Pulled(Some(d))) => (StageDuration::Known(*d), vec!["pulled".into()]),
        Some(ImagePull::Pulled(None)) => (
            known_or(
                between(pulling.and_then(Event::time), pulled.and_then(Event::time)),
                "a pull duration in the Pulled message or a Pulling event",
            ),
            vec!["pulled".into()],
        ),
        None => (
            StageDuration::Unknown {
                missing: "a Pulled event",
            },
            vec![],
        ),
    };
    let image_ready = pulled.and_then(Event::time);
    StageReport {
        stage: ColdStartStage::Image,
        duration: image_duration,
        started: pulling.and_then(Event::time).or(image_ready),
        finished: image_ready,
        detail: image_detail,
    }
}

/// Container start: image ready → the process running.
fn container_start_stage(
    status: Option<&ContainerStatus>,
    events: &PodEvents<'_>,
    image_ready: Option<Timestamp>,
) -> StageReport {
    let running = status
        .and_then(|s| s.state.as_ref())
        .and_then(|s| s.running.as_ref())
        .and_then(|r| r.started_at)
        .or_else(|| events.container_event("Started").and_then(Event::time));
    let mut detail = Vec::new();
    let restarts = status.map_or(0, |s| s.restart_count);
    // After a restart the current run began at its own pull (the kubelet folds repeats into one
    // event and moves `lastTimestamp` on), not at the first run's. Every run has a pull, so
    // fewer pulls than runs means the current run's has expired or was never recorded.
    let run_pull = if restarts == 0 {
        image_ready
    } else {
        detail.push(format!("{restarts} restart(s): times are the current run's"));
        let pulls = events.container_events("Pulled");
        let seen: u32 = pulls.iter().map(|e| e.count.unwrap_or(1).max(1)).sum();
        if seen > restarts {
            pulls
                .iter()
                .filter_map(|e| e.last_time())
                .filter(|t| running.is_none_or(|r| *t <= r))
                .max()
        } else {
            None
        }
    };
    StageReport {
        stage: ColdStartStage::ContainerStart,
        duration: match (run_pull, running) {
            (None, _) if image_ready.is_some() => StageDuration::Unknown {
                missing: "a Pulled event for the current run (the container restarted; fewer pulls recorded than runs)",
            },
            (None, _) => StageDuration::Unknown {
                missing: "a Pulled event",
            },
            (_, None) => StageDuration::Unknown {
                missing: "the container's running.startedAt or a Started event",
            },
            _ => known_or(between(run_pull, running), "start before image (clock skew)"),
        },
        started: run_pull,
        finished: running,
        detail,
    }
}

/// Engine start: the container running → `Starting to load model`, with the milestones the log
/// shows inside it, each after the container started. Where the engine core loads the model
/// itself (vLLM 0.11 on one GPU), no worker line is printed and none is named.
fn engine_start_stage(log: &StartupLog, running: Option<Timestamp>) -> StageReport {
    let load_start = log.load_started.and_then(|m| m.at);
    let milestones = [
        ("API server", log.api_server_started),
        ("config resolved", log.config_resolved),
        ("engine core", log.engine_core_started),
        ("worker", log.worker_started),
    ];
    let detail = milestones
        .into_iter()
        .filter_map(|(name, mark)| {
            let at = mark?.at?;
            if load_start.is_some_and(|end| at > end) {
                return None;
            }
            let after = between(running, Some(at))?;
            Some(format!("{name} at +{:.1} s", after.as_secs_f64()))
        })
        .collect();
    StageReport {
        stage: ColdStartStage::EngineStart,
        duration: match (running, load_start) {
            (None, _) => StageDuration::Unknown {
                missing: "the container's running.startedAt or a Started event",
            },
            (_, None) => StageDuration::Unknown {
                missing: "a timestamped `Starting to load model` line",
            },
            _ => known_or(
                between(running, load_start),
                "loading before the container ran (clock skew)",
            ),
        },
        started: running,
        finished: load_start,
        detail,
    }
}

/// Weight load: the log's own span, else vLLM's printed seconds.
fn weight_load_stage(log: &StartupLog) -> StageReport {
    let load_start = log.load_started.and_then(|m| m.at);
    let load_end = log.load_finished.and_then(|m| m.at);
    let mut detail = Vec::new();
    if let Some(s) = log.load_seconds {
        detail.push(format!("vLLM: {s} s"));
    }
    StageReport {
        stage: ColdStartStage::WeightLoad,
        duration: known_or(
            between(load_start, load_end).or_else(|| log.load_seconds.and_then(duration_of)),
            "`Starting to load model` and `Model loading took` (or `Loading weights took`) lines",
        ),
        started: load_start,
        finished: load_end,
        detail,
    }
}

/// Warmup: weights loaded → engine initialised.
fn warmup_stage(log: &StartupLog, load_end: Option<Timestamp>) -> StageReport {
    let engine_ready = log.engine_ready.and_then(|m| m.at);
    let mut detail = Vec::new();
    if let Some(s) = log.compile_seconds {
        let cache = match log.compile_cache_hit {
            Some(true) => " (compile cache hit)",
            Some(false) => " (cold compile)",
            None => "",
        };
        detail.push(format!("torch.compile {s} s{cache}"));
    }
    if let Some(s) = log.cudagraph_seconds {
        detail.push(format!("CUDA graphs {s} s"));
    }
    if let Some(s) = log.engine_init_seconds {
        detail.push(format!("engine init {s} s"));
    }
    StageReport {
        stage: ColdStartStage::Warmup,
        duration: known_or(
            between(load_end, engine_ready).or_else(|| log.engine_init_seconds.and_then(duration_of)),
            "`Model loading took` (or `Loading weights took`) and `init engine … took` lines",
        ),
        started: load_end,
        finished: engine_ready,
        detail,
    }
}

/// Ready: engine initialised → the API answers.
fn ready_stage(
    pod: &Pod,
    log: &StartupLog,
    created: Option<Timestamp>,
    engine_ready: Option<Timestamp>,
) -> StageReport {
    let ready_condition = pod.condition_true_at("Ready");
    let api_ready = log.api_ready.and_then(|m| m.at).or(ready_condition);
    let mut detail = Vec::new();
    if log.api_ready.and_then(|m| m.at).is_some() {
        detail.push("uvicorn: Application startup complete".to_string());
    } else if ready_condition.is_some() {
        detail.push("pod Ready condition".to_string());
    }
    if let Some(d) = between(created, ready_condition) {
        // To the millisecond, as the table prints times; an API server writes whole seconds.
        let d = Duration::from_millis(d.as_millis() as u64);
        detail.push(format!("pod Ready at +{}", understudy_core::duration::format(d)));
    }
    StageReport {
        stage: ColdStartStage::Ready,
        duration: match (engine_ready, api_ready) {
            (None, _) => StageDuration::Unknown {
                missing: "a timestamped `init engine … took` line",
            },
            (_, None) => StageDuration::Unknown {
                missing: "`Application startup complete.` or a Ready=True condition",
            },
            _ => known_or(
                between(engine_ready, api_ready),
                "ready before engine init (clock skew)",
            ),
        },
        started: engine_ready,
        finished: api_ready,
        detail,
    }
}

/// First token: API ready → the first successful generating probe.
fn first_token_stage(api_ready: Option<Timestamp>, first_token: Option<Timestamp>) -> StageReport {
    StageReport {
        stage: ColdStartStage::FirstToken,
        duration: match (api_ready, first_token) {
            (_, None) => StageDuration::Unknown {
                missing: "a successful generating probe",
            },
            (None, _) => StageDuration::Unknown {
                missing: "the API-ready time",
            },
            _ => known_or(
                between(api_ready, first_token),
                "first token before ready (clock skew)",
            ),
        },
        started: api_ready,
        finished: first_token,
        detail: vec![],
    }
}

/// The stage table a user reads: stage, start offset from pod creation, duration, detail.
pub fn render_table(timeline: &Timeline) -> String {
    use std::fmt::Write;
    // Milliseconds are as fine as a reader needs; the JSON keeps nanoseconds.
    let fmt = |d: Duration| understudy_core::duration::format(Duration::from_millis(d.as_millis() as u64));
    let mut out = String::new();
    let ns = timeline
        .namespace
        .as_deref()
        .map(|n| format!("{n}/"))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "cold start of {ns}{} (container {})",
        timeline.pod,
        timeline.container.as_deref().unwrap_or("?")
    );
    let _ = writeln!(out, "{:<16} {:>14} {:>14}  detail", "stage", "starts at", "took");
    for s in &timeline.stages {
        let at = match between(timeline.created, s.started) {
            Some(d) => format!("+{}", fmt(d)),
            None => "?".to_string(),
        };
        let (took, missing) = match &s.duration {
            StageDuration::Known(d) => (fmt(*d), None),
            StageDuration::Unknown { missing } => ("unknown".to_string(), Some(*missing)),
        };
        let mut detail = s.detail.join("; ");
        if let Some(missing) = missing {
            detail = format!("missing {missing}");
        }
        let _ = writeln!(out, "{:<16} {at:>14} {took:>14}  {detail}", s.stage.as_str());
    }
    let total = match &timeline.to_first_token {
        StageDuration::Known(d) => fmt(*d),
        StageDuration::Unknown { .. } => "unknown".to_string(),
    };
    let _ = writeln!(out, "{:<16} {:>14} {total:>14}", "to first token", "");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelet_pull_message_gives_its_own_duration_in_both_forms() {
        let newer = "Successfully pulled image \"vllm/vllm-openai:v0.11.0\" in 1m26.512s (1m30s including waiting). \
                     Image size: 10468593510 bytes.";
        assert!(
            matches!(image_pull(newer), Some(ImagePull::Pulled(Some(d))) if d == Duration::from_millis(86_512))
        );
        let older = "Successfully pulled image \"busybox\" in 46.9444707s";
        assert!(
            matches!(image_pull(older), Some(ImagePull::Pulled(Some(d))) if d == Duration::from_nanos(46_944_470_700))
        );
        let cached = "Container image \"x\" already present on machine and can be accessed by the pod";
        assert!(matches!(image_pull(cached), Some(ImagePull::Cached)));
        assert!(image_pull("Pulling image \"x\"").is_none());
    }
}

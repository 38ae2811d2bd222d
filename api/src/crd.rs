//! The FailoverPolicy and GameDay custom resources: what a user writes (spec) and what the
//! operator reports (status).
//!
//! The schema carries every rule an apiserver can enforce on its own (types, enums, bounds and
//! CEL `x-kubernetes-validations`), so a nonsense policy is refused at `kubectl apply` with a
//! message naming the field. [`crate::policy`] repeats the same checks in Rust for objects that
//! were stored before a rule existed. This module holds types only: no I/O, no decisions.

use std::{borrow::Cow, collections::BTreeMap};

use kube::{CustomResource, KubeSchema, core::Rule};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use understudy_core::quorum::StandbyShape;
use understudy_core::recovery::{Mix, Stage, Standby};

use crate::route::StreamContract;

/// The API group of every understudy resource.
pub const GROUP: &str = "understudy.dev";

/// Regular expression of a Go duration as CEL's `duration()` accepts it. The sign is allowed
/// here so that `-10s` is reported as "must be greater than zero" rather than as malformed.
const DURATION_PATTERN: &str = "^-?(0|(([0-9]+([.][0-9]*)?|[.][0-9]+)(ns|us|ms|s|m|h))+)$";

/// An RFC 1123 label: lower-case alphanumerics and '-', starting and ending alphanumeric.
const DNS_LABEL_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

/// An RFC 1123 subdomain, the form of most Kubernetes object names.
const DNS_SUBDOMAIN_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

fn positive_duration() -> Rule {
    Rule::new("duration(self) > duration('0s')").message("must be greater than zero")
}

fn non_negative_duration() -> Rule {
    Rule::new("duration(self) >= duration('0s')").message("must not be negative")
}

fn dns_label() -> Rule {
    Rule::new(format!("self.matches('{DNS_LABEL_PATTERN}')")).message(
        "must be a DNS label: lower-case letters, digits and '-', starting and ending with a letter or digit",
    )
}

/// A duration written the way Go and Kubernetes write one: `10s`, `1m30s`, `850ms`, `1.5h`.
///
/// Kept as the user's text so that `kubectl get -o yaml` shows what they wrote and CEL rules can
/// compare values with `duration()`; [`understudy_core::duration::parse`] reads it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GoDuration(pub String);

impl GoDuration {
    /// Parses the text with core's Go-duration parser.
    pub fn parse(&self) -> Result<std::time::Duration, understudy_core::duration::ParseDurationError> {
        understudy_core::duration::parse(&self.0)
    }
}

impl From<&str> for GoDuration {
    fn from(text: &str) -> Self {
        GoDuration(text.to_owned())
    }
}

impl std::fmt::Display for GoDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl JsonSchema for GoDuration {
    fn schema_name() -> Cow<'static, str> {
        "GoDuration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "maxLength": 32,
            "x-kubernetes-validations": [{
                "rule": format!("self.matches('{DURATION_PATTERN}')"),
                "message": "must be a duration such as 10s, 1m30s or 1.5h",
            }],
        })
    }
}

/// How an LLM service fails over from an active GPU pool to a standby pool, and back.
#[allow(
    clippy::duplicated_attributes,
    reason = "two printer columns are both `type_ = \"string\"`, which clippy reads as a duplicate"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "understudy.dev",
    version = "v1alpha1",
    kind = "FailoverPolicy",
    plural = "failoverpolicies",
    shortname = "fpol",
    namespaced,
    status = "FailoverPolicyStatus",
    derive = "PartialEq",
    doc = "Fails LLM serving over from an active GPU pool to a standby pool, with a fencing epoch.",
    printcolumn(name = "Primary", type_ = "string", json_path = ".status.primaryPool"),
    printcolumn(name = "Epoch", type_ = "integer", json_path = ".status.epoch"),
    printcolumn(name = "State", type_ = "string", json_path = ".status.state"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct FailoverPolicySpec {
    /// The two pools. The first is the home primary (pool A), the second the home standby (pool B).
    #[schemars(length(min = 2, max = 2))]
    #[x_kube(
        validation = Rule::new("size(self) != 2 || self[0].name != self[1].name")
            .message("the two pools must have different names"),
        validation = Rule::new(
            "size(self) != 2 || self[0].workload.kind != self[1].workload.kind \
             || self[0].workload.name != self[1].workload.name \
             || (has(self[0].cluster) ? self[0].cluster.name : '') \
                != (has(self[1].cluster) ? self[1].cluster.name : '')"
        )
        .message("two pools name the same workload in the same cluster: each pool must run its own replicas"),
    )]
    pub pools: Vec<PoolSpec>,

    /// How long serving may be lost before the failover is a failure, e.g. `5m`. The operator
    /// reports in status whether the standby tiers can meet it.
    #[x_kube(validation = positive_duration())]
    pub recovery_objective: GoDuration,

    /// The share of the promoted pool's replicas that must pass generating probes before the
    /// pool is routed, the share the primary must keep passing with afterwards (up to a
    /// majority: more would fail a primary over for one replica restarting), and the share
    /// `recoveryObjective` is judged at, e.g. `0.5`: with four warm and four pilot-light
    /// replicas, the route moves when the four warm answer, admission control shields them, and
    /// the pilot light joins the route as each replica passes. Defaults to a majority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.01, max = 1.0))]
    pub min_serving_fraction: Option<f64>,

    /// How long each cold-start stage takes on this stack, as far as you know before the
    /// operator has measured one: `ObjectiveMet` is computed from these until measurements
    /// replace them, stage by stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start_estimates: Option<ColdStartEstimates>,

    /// The generating probe sent to every awake replica of both pools.
    #[serde(default)]
    pub probe: ProbeSpec,

    /// When failed probes make the primary suspect, and when they promote the standby.
    #[serde(default)]
    pub trigger: TriggerSpec,

    /// Whether and when the home pool takes the primary role back.
    #[serde(default)]
    pub failback: FailbackSpec,

    /// Drift checks between the pools: model artifact, runtime and serving flags.
    #[serde(default)]
    pub parity: ParitySpec,

    /// Proving a sleeping standby between incidents: every so often one of its warm replicas is
    /// woken, probed against the golden answer and put back to sleep. Absent: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_proof: Option<StandbyProofSpec>,

    /// Load proof: every so often the primary's recorded traffic (the shapes the routers keep,
    /// never the content) is replayed against the standby through its fences, at a share of the
    /// primary's rate, and judged by its thresholds. A sleeping standby is woken for it and put
    /// back to sleep after. Absent: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_proof: Option<LoadProofSpec>,

    /// Admission control on the new primary while every conversation rebuilds its KV cache.
    #[serde(default)]
    pub admission: AdmissionSpec,

    /// What clients see when a stream is cut by a failover.
    #[serde(default)]
    pub stream: StreamSpec,

    /// The serving grants the operator gives the fences that run with `--grants`: the right to
    /// serve an epoch until a deadline, renewed well before it. A fence whose grant ran out
    /// refuses work, so a pool cut off from the operator stops on its own.
    #[serde(default)]
    pub grants: GrantsSpec,

    /// How a change to the primary's serving template (image, model, flags, `VLLM_*`
    /// environment) rolls out. `asDeployed`: at once, as its owner deploys it. `standbyFirst`:
    /// the primary's workload is held (a Deployment paused, a StatefulSet's partition raised)
    /// until the standby runs the same serving template and has passed its probes and, with
    /// `loadProof`, a load proof on it; then the primary rolls, and a standby that fails on the
    /// new version stops the rollout with the primary untouched. With `standbyFirst` the operator
    /// owns `spec.paused` of both pools' Deployments and the partition of their StatefulSets.
    #[serde(default)]
    pub rollout: RolloutMode,

    /// Where a promotion moves the route. Absent: understudy's routers (`--router-admin`), which
    /// alone have the waiting room, admission control for the prefill storm and the stream
    /// contract. `httpRoute`: a Gateway API HTTPRoute the gateway you run already serves, whose
    /// backendRefs' weights move between the pools. `service`: a Service whose selector moves
    /// to the new primary's pods, for any ingress. Either way the pools' fences refuse the old
    /// epoch, whatever the gateway still sends them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteTargetSpec>,

    /// Stops automatic promotion and failback; explicit commands still work.
    #[serde(default)]
    pub paused: bool,
}

// Where a promotion moves the route, when not to understudy's routers. (No doc comment: the
// schema would take it over the field's own description.)
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.httpRoute) != has(self.service)")
        .message("route names one target: httpRoute or service"),
)]
pub struct RouteTargetSpec {
    /// A Gateway API HTTPRoute in the policy's namespace whose rules send to the pools'
    /// backends. A promotion gives the other pool's backendRefs weight 0 and the new primary's
    /// the weight the pools had in every rule, and records the epoch in the
    /// `understudy.dev/epoch` annotation; the step is done once every gateway in its
    /// `parentRefs` has accepted the route at its new generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_route: Option<HttpRouteTarget>,
    /// A Service in the policy's namespace whose selector a promotion sets to the new primary's
    /// pod labels (its workload's `matchLabels`), recording the epoch in the
    /// `understudy.dev/epoch` annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceTarget>,
}

/// An HTTPRoute whose backendRefs' weights move between the pools.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteTarget {
    #[schemars(length(max = 253))]
    pub name: String,
    /// Each pool's backend, as the HTTPRoute's backendRefs name it: one for each pool.
    #[schemars(length(min = 2, max = 2))]
    pub backends: Vec<PoolBackend>,
}

/// The backend that sends to one pool.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolBackend {
    /// The pool's name, as `spec.pools` names it.
    pub pool: String,
    /// `Service`, or an `InferencePool` (`inference.networking.k8s.io`), whose `failureMode`
    /// should be `FailClose`: an endpoint picker that fails open sends to any pod it selects.
    #[serde(default)]
    pub kind: BackendKind,
    #[schemars(length(max = 253))]
    pub name: String,
}

// What kind of backend a pool is sent to through. (No doc comment: the schema would take it
// over the field's own description.)
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    #[default]
    Service,
    InferencePool,
}

impl BackendKind {
    /// The API group a backendRef of this kind names (`""`: the core group).
    #[must_use]
    pub fn group(self) -> &'static str {
        match self {
            BackendKind::Service => "",
            BackendKind::InferencePool => "inference.networking.k8s.io",
        }
    }

    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Service => "Service",
            BackendKind::InferencePool => "InferencePool",
        }
    }
}

/// A Service whose selector moves between the pools.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceTarget {
    #[schemars(length(max = 63))]
    pub name: String,
}

/// The annotation a route target carries the epoch it was last moved at in.
pub const EPOCH_ANNOTATION: &str = "understudy.dev/epoch";

// How the primary's serving template rolls out. (No doc comment: the schema would take it over
// the field's own description.)
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum RolloutMode {
    #[default]
    AsDeployed,
    StandbyFirst,
}

impl FailoverPolicySpec {
    /// Both pools' standby shapes, by [`understudy_core::Pool::index`]. A spec that validates has
    /// two pools; a missing one is an empty shape, which a promotion cannot serve with.
    #[must_use]
    pub fn standby_shapes(&self) -> [StandbyShape; 2] {
        [0, 1].map(|i| {
            self.pools
                .get(i)
                .map_or(StandbyShape::hot(0), PoolSpec::standby_shape)
                .serving_at(self.min_serving_fraction)
        })
    }
}

/// When a sleeping standby is proven.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StandbyProofSpec {
    /// How often, e.g. `6h`; at least a minute.
    pub every: GoDuration,
    /// UTC windows in which no proof starts, as `HH:MM-HH:MM` (one may wrap past midnight), e.g.
    /// the busy hours when a woken replica's memory is better left to the primary's node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub not_between: Vec<String>,
}

/// When and how the standby is proven at the primary's load.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoadProofSpec {
    /// How often, e.g. `6h`; at least a minute.
    pub every: GoDuration,
    /// UTC windows in which no proof starts, as `HH:MM-HH:MM` (one may wrap past midnight).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub not_between: Vec<String>,
    /// How long the replay runs, e.g. `60s`; at most 10 minutes.
    #[serde(default = "default_load_proof_duration")]
    pub duration: GoDuration,
    /// The share of the primary's recorded rate replayed: `1` is the primary's load, `0.5` half
    /// of it; above 0, at most 4.
    #[serde(default = "one")]
    pub rate_share: f64,
    /// The largest share of replayed requests that may fail, 0 to 1.
    #[serde(default = "default_max_error_rate")]
    pub max_error_rate: f64,
    /// The longest 99th-percentile time to first token, e.g. `2s`.
    #[serde(default = "default_ttft_p99")]
    pub ttft_p99: GoDuration,
    /// The longest 99th-percentile gap between tokens, e.g. `200ms`.
    #[serde(default = "default_itl_p99")]
    pub itl_p99: GoDuration,
    /// Whether a failed proof blocks automatic promotion and `failover` commands (as a failed
    /// probe does) until a later proof passes; `force-failover` still promotes.
    #[serde(default = "default_true")]
    pub blocks_promotion: bool,
}

fn default_load_proof_duration() -> GoDuration {
    GoDuration("60s".to_owned())
}

fn one() -> f64 {
    1.0
}

fn default_max_error_rate() -> f64 {
    0.01
}

fn default_ttft_p99() -> GoDuration {
    GoDuration("2s".to_owned())
}

fn default_itl_p99() -> GoDuration {
    GoDuration("200ms".to_owned())
}

/// The last load proof of the standby.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoadProofRecord {
    /// When it started, RFC 3339.
    pub at: String,
    /// The pool it replayed against.
    pub pool: String,
    /// `Proven`, `Failed`, or `NotRun` (no traffic recorded, no replica reached).
    pub result: String,
    /// The replicas it replayed against, and how many of them it woke.
    pub replicas: u32,
    #[serde(default)]
    pub woken: u32,
    /// The rate the routers recorded, and the rate replayed, in requests a second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_rate: Option<f64>,
    /// Requests replayed, and how many of them failed.
    #[serde(default)]
    pub requests: u32,
    #[serde(default)]
    pub errors: u32,
    /// The 99th-percentile time to first token and gap between tokens, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p99_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_p99_ms: Option<u64>,
    /// The thresholds broken, or why it did not run, in words.
    pub detail: String,
}

impl LoadProofRecord {
    /// A proof of `pool` started `at` that came to `result`, with no figures yet.
    #[must_use]
    pub fn new(at: String, pool: String, result: &str, detail: String) -> LoadProofRecord {
        LoadProofRecord {
            at,
            pool,
            result: result.to_owned(),
            replicas: 0,
            woken: 0,
            recorded_rate: None,
            replayed_rate: None,
            requests: 0,
            errors: 0,
            ttft_p99_ms: None,
            itl_p99_ms: None,
            detail,
        }
    }

    /// What the proof showed, in one line: `Proven at … against west: 720 requests at 12/s (the
    /// primary's 10/s recorded) on 2 replicas, 0 failed, TTFT p99 180 ms, inter-token p99 21 ms`.
    #[must_use]
    pub fn summary(&self) -> String {
        let mut line = format!("{} at {} against {}", self.result, self.at, self.pool);
        if self.requests > 0 {
            let rate = |r: Option<f64>| r.map_or_else(|| "?".to_owned(), |r| format!("{r}/s"));
            let millis = |ms: Option<u64>| ms.map_or_else(|| "-".to_owned(), |ms| format!("{ms} ms"));
            line.push_str(&format!(
                ": {} requests at {} (the primary's {} recorded) on {} replica{} ({} woken), {} failed, \
                 TTFT p99 {}, inter-token p99 {}",
                self.requests,
                rate(self.replayed_rate),
                rate(self.recorded_rate),
                self.replicas,
                if self.replicas == 1 { "" } else { "s" },
                self.woken,
                self.errors,
                millis(self.ttft_p99_ms),
                millis(self.itl_p99_ms),
            ));
        }
        line.push_str(&format!(": {}", self.detail));
        line
    }
}

/// Where a standby-first rollout stands.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutRecord {
    pub phase: RolloutPhase,
    /// The pool whose workload is held: the primary's.
    pub pool: String,
    /// The digest of the serving template the primary is set to run, and the change from what it
    /// runs, key by key (`runtime.image: a -> b`); empty when nothing is pending.
    pub target: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub change: String,
    /// When the rollout came to this phase, RFC 3339.
    pub since: String,
    /// When the standby was first seen running the target, RFC 3339: its probes and load proof
    /// count from then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_on_it_since: Option<String>,
    /// The standby's passing checks in a row when it was first seen running the target; it must
    /// pass `spec.trigger.standbyReadyAfter` more.
    #[serde(default)]
    pub standby_passes_before: u32,
    /// Its failed checks in a row then: a run of failures from before it ran the target (while it
    /// rolled) does not stop the rollout.
    #[serde(default)]
    pub standby_failures_before: u32,
    /// What it waits for, or why it stopped, in words.
    pub message: String,
}

/// The phases of a standby-first rollout.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutPhase {
    /// The primary runs its serving template; the next change to it is held.
    UpToDate,
    /// A change to the primary is held until the standby runs the same serving template.
    Holding,
    /// The standby runs it; its probes and load proof on it are awaited.
    Proving,
    /// The standby passed on it: the primary rolls.
    Rolling,
    /// The standby failed on it: the primary is held, untouched, until its template changes.
    Stopped,
}

impl RolloutPhase {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            RolloutPhase::UpToDate => "UpToDate",
            RolloutPhase::Holding => "Holding",
            RolloutPhase::Proving => "Proving",
            RolloutPhase::Rolling => "Rolling",
            RolloutPhase::Stopped => "Stopped",
        }
    }
}

/// The last proof of a sleeping standby.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StandbyProofRecord {
    /// When it ran, RFC 3339.
    pub at: String,
    /// The pool and the replica woken.
    pub pool: String,
    pub replica: String,
    /// Woken, answered right, and asleep again.
    pub passed: bool,
    /// What happened, step by step.
    pub detail: String,
}

/// Estimated cold-start stage times, each a duration such as `70s`; a stage left out is unknown.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ColdStartEstimates {
    /// A node with free GPUs: provisioning by the autoscaler, then scheduling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<GoDuration>,
    /// Pulling the serving image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull: Option<GoDuration>,
    /// Creating and starting the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_start: Option<GoDuration>,
    /// The container running → vLLM starting to load the weights: Python's imports, the engine
    /// core and worker processes starting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_start: Option<GoDuration>,
    /// Loading the weights (size ÷ effective read rate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_load: Option<GoDuration>,
    /// Profiling, KV-cache allocation, compilation and CUDA graph capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<GoDuration>,
    /// Engine initialised → the API answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_ready: Option<GoDuration>,
    /// API ready → the first generated token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token: Option<GoDuration>,
    /// Waking a level-1 sleeper: weights back from host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_level1: Option<GoDuration>,
    /// Waking a level-2 sleeper: weights reloaded from storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_level2: Option<GoDuration>,
}

impl ColdStartEstimates {
    /// Each estimate with its stage, in stage order.
    #[must_use]
    pub fn entries(&self) -> [(Stage, Option<&GoDuration>); 10] {
        [
            (Stage::Node, self.node.as_ref()),
            (Stage::ImagePull, self.image_pull.as_ref()),
            (Stage::ContainerStart, self.container_start.as_ref()),
            (Stage::EngineStart, self.engine_start.as_ref()),
            (Stage::WeightLoad, self.weight_load.as_ref()),
            (Stage::Warmup, self.warmup.as_ref()),
            (Stage::ApiReady, self.api_ready.as_ref()),
            (Stage::FirstToken, self.first_token.as_ref()),
            (Stage::WakeLevel1, self.wake_level1.as_ref()),
            (Stage::WakeLevel2, self.wake_level2.as_ref()),
        ]
    }
}

/// One of the two pools of a policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "!has(self.standby) || size(self.standby) == 0 \
         || self.standby.map(g, g.replicas).sum() == self.replicas"
    )
        .message("standby tier replicas must add up to the pool's replicas"),
    validation = Rule::new(
        "!has(self.cluster) || !has(self.standby) \
         || self.standby.all(g, !has(g.reserveGpus) || !g.reserveGpus)"
    )
        .message("reserveGpus: GPUs are reserved only in the operator's own cluster, and this pool lives in another"),
)]
pub struct PoolSpec {
    /// The pool's name, used in status and by the router, e.g. `us-east`.
    #[schemars(length(max = 63))]
    #[x_kube(validation = dns_label())]
    pub name: String,

    /// The workload whose pods are this pool's replicas, in the policy's namespace (of the pool's
    /// cluster).
    pub workload: WorkloadRef,

    /// The cluster the pool lives in, when it is not the operator's own: a region of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterRef>,

    /// Replicas this pool serves with while it is the primary.
    #[schemars(range(min = 1, max = 1024))]
    pub replicas: u32,

    /// How this pool's replicas wait while it is the standby. Empty means all of them hot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub standby: Vec<TierGroup>,

    /// The port the replicas serve the OpenAI-compatible API on.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
}

impl PoolSpec {
    /// The name of the cluster the pool lives in; `None` for the operator's own.
    #[must_use]
    pub fn cluster_name(&self) -> Option<&str> {
        self.cluster.as_ref().map(|c| c.name.as_str())
    }

    /// The standby tiers as the operator runs them: an empty list means every replica hot, and a
    /// pool whose every replica is pilot light keeps one of them running, hot ([`keep_one_lit`]).
    #[must_use]
    pub fn standby_groups(&self) -> Vec<TierGroup> {
        if self.standby.is_empty() {
            vec![TierGroup {
                tier: Tier::Hot,
                replicas: self.replicas,
                sleep_level: None,
                reserve_gpus: None,
            }]
        } else {
            keep_one_lit(self.standby.clone())
        }
    }

    /// What a promotion of this pool has to bring up, from its standby tiers: its warm replicas
    /// and the deepest level they sleep at (a level-2 wake also serves level 1), and its
    /// pilot-light replicas. The one place the tiers become what the step driver asks.
    #[must_use]
    pub fn standby_shape(&self) -> StandbyShape {
        let groups = self.standby_groups();
        let of = |tier: Tier| groups.iter().filter(move |group| group.tier == tier);
        StandbyShape {
            replicas: self.replicas,
            warm: of(Tier::Warm).map(|group| group.replicas).sum(),
            sleep_level: of(Tier::Warm).map(TierGroup::sleep_level).max().unwrap_or(1),
            pilot_light: of(Tier::PilotLight).map(|group| group.replicas).sum(),
            min_serving: None,
        }
    }

    /// The standby tiers as the recovery planner counts them.
    #[must_use]
    pub fn standby_mix(&self) -> Mix {
        let standby = |group: &TierGroup| match group.tier {
            Tier::Hot => Standby::Hot,
            Tier::Warm => Standby::Warm(group.sleep_level()),
            Tier::PilotLight => Standby::PilotLight {
                reserved: group.reserve_gpus(),
            },
        };
        Mix(self
            .standby_groups()
            .iter()
            .map(|group| (standby(group), group.replicas))
            .collect())
    }
}

/// Another cluster, reached with a kubeconfig the operator reads from a Secret in the policy's
/// namespace. The operator lists the pool's pods there and calls them at their pod IPs, so the
/// operator's pods must reach the other cluster's pod network (a flat network across clusters, or
/// a mesh that gives one).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterRef {
    /// The cluster's name, shown in status and by the CLI, e.g. `us-east-1`.
    #[schemars(length(max = 63))]
    #[x_kube(validation = dns_label())]
    pub name: String,

    /// The Secret, in the policy's namespace, that holds the kubeconfig. Its current context is
    /// used; certificates and tokens must be inline (`certificate-authority-data`, `token`), since
    /// the operator has no files of the user's, and no exec plugin runs.
    pub kubeconfig_secret: SecretKeyRef,
}

/// A key of a Secret in the policy's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(max = 253))]
    #[x_kube(
        validation = Rule::new(format!("self.matches('{DNS_SUBDOMAIN_PATTERN}')"))
            .message("must be a Kubernetes object name (RFC 1123 subdomain)"),
    )]
    pub name: String,

    /// The key whose value is the kubeconfig.
    #[serde(default = "default_kubeconfig_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_kubeconfig_key() -> String {
    "kubeconfig".to_owned()
}

/// The workload that runs a pool's replicas.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    /// The kind of the workload.
    pub kind: WorkloadKind,

    /// The workload's name.
    #[schemars(length(max = 253))]
    #[x_kube(
        validation = Rule::new(format!("self.matches('{DNS_SUBDOMAIN_PATTERN}')"))
            .message("must be a Kubernetes object name (RFC 1123 subdomain)"),
    )]
    pub name: String,
}

/// Kinds of workload a pool can be.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    /// A LeaderWorkerSet (`leaderworkerset.x-k8s.io`), for models sharded across nodes.
    LeaderWorkerSet,
}

/// `groups` with one replica of a pilot-light group made hot when every replica is pilot light.
///
/// A standby with nothing running cannot be proven: a round that probes no replica fails hard,
/// so such a pool would never be eligible for promotion, and would be promoted blind if it were.
/// The pilot flame is the one replica kept running; it comes from a group whose GPUs are reserved
/// when there is one (it holds its own GPU, so one placeholder fewer is needed), and the rest
/// grow on promotion as before.
fn keep_one_lit(mut groups: Vec<TierGroup>) -> Vec<TierGroup> {
    if groups.iter().any(|group| group.tier != Tier::PilotLight) {
        return groups;
    }
    let Some(from) = groups
        .iter()
        .position(TierGroup::reserve_gpus)
        .or_else(|| groups.iter().position(|group| group.replicas > 0))
    else {
        return groups;
    };
    groups[from].replicas -= 1;
    if groups[from].replicas == 0 {
        groups.remove(from);
    }
    groups.insert(
        0,
        TierGroup {
            tier: Tier::Hot,
            replicas: 1,
            sleep_level: None,
            reserve_gpus: None,
        },
    );
    groups
}

/// A number of standby replicas that wait in the same way.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.sleepLevel) || self.tier == 'warm'")
        .message("sleepLevel applies only to the warm tier"),
    validation = Rule::new("!has(self.reserveGpus) || self.tier == 'pilotLight'")
        .message("reserveGpus applies only to the pilotLight tier"),
)]
pub struct TierGroup {
    /// How these replicas wait.
    pub tier: Tier,

    /// How many replicas wait this way.
    #[schemars(range(min = 1, max = 1024))]
    pub replicas: u32,

    /// vLLM sleep level for the warm tier: 1 keeps weights in host RAM, 2 discards them.
    /// Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2))]
    pub sleep_level: Option<u8>,

    /// For the pilotLight tier: hold these replicas' GPUs with placeholder pods so that
    /// promotion does not wait for capacity. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve_gpus: Option<bool>,
}

impl TierGroup {
    /// The sleep level a warm replica is put to.
    #[must_use]
    pub fn sleep_level(&self) -> u8 {
        self.sleep_level.unwrap_or(1)
    }

    /// Whether this group's GPUs are held while it waits.
    #[must_use]
    pub fn reserve_gpus(&self) -> bool {
        self.reserve_gpus.unwrap_or(false)
    }
}

/// How a standby replica waits.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub enum Tier {
    /// Awake and probed, no user traffic: takes over with a route switch.
    Hot,
    /// Asleep through vLLM sleep mode: woken, probed, then routed.
    Warm,
    /// Not running: scaled up, cold-started, probed, then routed. A pool whose every replica is
    /// pilot light keeps one running, hot, so that it can be proven before it is promoted.
    PilotLight,
}

/// The generating probe.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("duration(self.timeout) < duration(self.interval)")
        .message("timeout must be shorter than interval"),
    validation = Rule::new("duration(self.budgets.total) <= duration(self.timeout)")
        .message("budgets.total must not be longer than timeout"),
    validation = Rule::new("duration(self.budgets.firstToken) <= duration(self.budgets.total)")
        .message("budgets.firstToken must not be longer than budgets.total"),
)]
pub struct ProbeSpec {
    /// Time between probes of one replica.
    #[serde(default = "default_probe_interval")]
    #[x_kube(validation = positive_duration())]
    pub interval: GoDuration,

    /// A probe that has not finished after this long has failed.
    #[serde(default = "default_probe_timeout")]
    #[x_kube(validation = positive_duration())]
    pub timeout: GoDuration,

    /// The prompt, sent with deterministic sampling.
    #[serde(default = "default_probe_prompt")]
    #[schemars(length(min = 1, max = 4096))]
    pub prompt: String,

    /// Tokens to generate.
    #[serde(default = "default_probe_max_tokens")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_tokens: u32,

    /// What counts as a right answer.
    #[serde(default)]
    pub expect: ProbeExpect,

    /// Latency a passing probe stays within.
    #[serde(default)]
    pub budgets: ProbeBudgets,
}

impl Default for ProbeSpec {
    fn default() -> Self {
        ProbeSpec {
            interval: default_probe_interval(),
            timeout: default_probe_timeout(),
            prompt: default_probe_prompt(),
            max_tokens: default_probe_max_tokens(),
            expect: ProbeExpect::default(),
            budgets: ProbeBudgets::default(),
        }
    }
}

/// What a probe's output is compared with.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.mode != 'regex' || has(self.value)")
        .message("value is required when mode is regex"),
    validation = Rule::new("self.mode != 'nonEmpty' || !has(self.value)")
        .message("value is not used when mode is nonEmpty"),
)]
pub struct ProbeExpect {
    /// How the output is compared.
    #[serde(default)]
    pub mode: ExpectMode,

    /// The expected prefix or regular expression. Without it, in prefix mode, the golden answer
    /// is recorded from the home primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub value: Option<String>,
}

/// How a probe's output is compared.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum ExpectMode {
    /// The output starts with the expected text.
    #[default]
    Prefix,
    /// The output matches the regular expression.
    Regex,
    /// Any non-empty output passes.
    NonEmpty,
}

/// Latency limits of a passing probe.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ProbeBudgets {
    /// Time to the first token.
    #[serde(default = "default_first_token_budget")]
    #[x_kube(validation = positive_duration())]
    pub first_token: GoDuration,

    /// Time to the whole answer.
    #[serde(default = "default_total_budget")]
    #[x_kube(validation = positive_duration())]
    pub total: GoDuration,
}

impl Default for ProbeBudgets {
    fn default() -> Self {
        ProbeBudgets {
            first_token: default_first_token_budget(),
            total: default_total_budget(),
        }
    }
}

/// The hysteresis that turns failed probes into a promotion.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.promoteAfter >= self.suspectAfter")
        .message("promoteAfter must not be below suspectAfter"),
    validation = Rule::new("self.hardFailure.promoteAfter <= self.promoteAfter")
        .message("hardFailure.promoteAfter must not be above promoteAfter"),
)]
pub struct TriggerSpec {
    /// Consecutive failed checks of the primary before it is suspect.
    #[serde(default = "default_suspect_after")]
    #[schemars(range(min = 1, max = 1000))]
    pub suspect_after: u32,

    /// Consecutive failed checks of the primary before the standby is promoted.
    #[serde(default = "default_promote_after")]
    #[schemars(range(min = 1, max = 1000))]
    pub promote_after: u32,

    /// Hard failures (connection refused, reset, 5xx) are stronger evidence than slow answers.
    #[serde(default)]
    pub hard_failure: HardFailureSpec,

    /// No promotion starts within this long after the previous one finished.
    #[serde(default = "default_min_dwell")]
    #[x_kube(validation = non_negative_duration())]
    pub min_dwell: GoDuration,

    /// Consecutive passing checks before a standby may be promoted.
    #[serde(default = "default_standby_ready_after")]
    #[schemars(range(min = 1, max = 1000))]
    pub standby_ready_after: u32,
}

impl Default for TriggerSpec {
    fn default() -> Self {
        TriggerSpec {
            suspect_after: default_suspect_after(),
            promote_after: default_promote_after(),
            hard_failure: HardFailureSpec::default(),
            min_dwell: default_min_dwell(),
            standby_ready_after: default_standby_ready_after(),
        }
    }
}

/// Promotion on hard failures alone.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HardFailureSpec {
    /// Consecutive hard failures that promote the standby; at most `promoteAfter`.
    #[serde(default = "default_hard_promote_after")]
    #[schemars(range(min = 1, max = 1000))]
    pub promote_after: u32,
}

impl Default for HardFailureSpec {
    fn default() -> Self {
        HardFailureSpec {
            promote_after: default_hard_promote_after(),
        }
    }
}

/// Whether and when the home pool takes the primary role back.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.mode != 'automatic' || has(self.healthyFor)")
        .message("healthyFor is required when mode is automatic"),
)]
pub struct FailbackSpec {
    /// `manual` waits for a failback command; `automatic` fails back after sustained health.
    #[serde(default)]
    pub mode: FailbackMode,

    /// How long the home pool must pass every probe before an automatic failback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = positive_duration())]
    pub healthy_for: Option<GoDuration>,
}

/// Failback modes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum FailbackMode {
    #[default]
    Manual,
    Automatic,
}

/// Drift checks between the two pools.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ParitySpec {
    /// A standby that drifts from the primary is not eligible for promotion.
    #[serde(default = "default_true")]
    pub enabled: bool,

    /// Serving flags that may differ between pools.
    #[serde(default = "default_ignore_flags")]
    #[schemars(length(max = 64), inner(length(min = 2, max = 128)))]
    #[x_kube(
        validation = Rule::new("self.all(f, f.startsWith('-'))")
            .message("ignoreFlags lists command-line flags, such as --port"),
    )]
    pub ignore_flags: Vec<String>,

    /// Compare the pools' model files too, read at this depth where they lie: `cache` (the
    /// snapshot commit, the blob digests the Hugging Face cache names files by, and their sizes;
    /// nothing read), `headers` (also the safetensors headers and tokenizer files) or `full` (also
    /// the SHA-256 of every file, taken once per file and kept). Each replica's model directory
    /// must be on a hostPath volume, read by the GPU agent of its node (the chart's
    /// `agent.modelCacheHostPath`). A key that differs (`artifact.model.file.NAME.sha256`, …)
    /// blocks promotion as any other; `ArtifactDigestCompared` says whether they were read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_digest: Option<ArtifactDigest>,

    /// Fingerprint keys allowed to differ between the pools by design, e.g.
    /// `env.VLLM_LOGGING_LEVEL`; a key ending in `*` allows every key it begins, e.g. `env.*`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 256)))]
    pub allow_drift: Vec<String>,
}

impl Default for ParitySpec {
    fn default() -> Self {
        ParitySpec {
            enabled: true,
            ignore_flags: default_ignore_flags(),
            artifact_digest: None,
            allow_drift: Vec::new(),
        }
    }
}

// How the model artifact is fingerprinted for parity. (No doc comment: the schema would take it
// over the field's own description, which says what each depth reads.)
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum ArtifactDigest {
    /// The digests recorded in the model cache (cheap).
    #[default]
    Cache,
    /// File headers and sizes.
    Headers,
    /// A hash of every weight file (slow, exact).
    Full,
}

impl ArtifactDigest {
    /// As the policy spells it, which is how the node agent is asked for it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactDigest::Cache => "cache",
            ArtifactDigest::Headers => "headers",
            ArtifactDigest::Full => "full",
        }
    }
}

/// Admission control on a newly promoted primary.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.maxConcurrency) || self.maxConcurrency >= self.initialConcurrency")
        .message("maxConcurrency must not be below initialConcurrency"),
)]
pub struct AdmissionSpec {
    /// How long after promotion admission is limited; `0s` turns it off.
    #[serde(default = "default_admission_window")]
    #[x_kube(validation = non_negative_duration())]
    pub window: GoDuration,

    /// Concurrent requests per replica admitted at the start of the window.
    #[serde(default = "default_initial_concurrency")]
    #[schemars(range(min = 1, max = 100000))]
    pub initial_concurrency: u32,

    /// Concurrent requests per replica at the end of the window; unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_concurrency: Option<u32>,

    /// Prompt tokens per replica admitted for prefill at the start of the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub initial_prefill_tokens: Option<u32>,

    /// The request header that carries a request's priority: `interactive` and `batch` name
    /// their classes (batch is shed first, interactive last), any other value the default class.
    #[serde(default = "default_priority_header")]
    #[schemars(length(min = 1, max = 128))]
    #[x_kube(
        validation = Rule::new("self.matches('^[A-Za-z0-9][-A-Za-z0-9]*$')")
            .message("must be an HTTP header name: letters, digits and '-'"),
    )]
    pub priority_header: String,

    /// Priority values (as the header carries them, e.g. `low`) refused outright, 429 with
    /// Retry-After, while the window is open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16), inner(length(min = 1, max = 63)))]
    pub shed_priorities: Option<Vec<String>>,
}

impl Default for AdmissionSpec {
    fn default() -> Self {
        AdmissionSpec {
            window: default_admission_window(),
            initial_concurrency: default_initial_concurrency(),
            max_concurrency: None,
            initial_prefill_tokens: None,
            priority_header: default_priority_header(),
            shed_priorities: None,
        }
    }
}

/// How serving grants are timed; the arithmetic is in `understudy_api::grant`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GrantsSpec {
    /// How long a grant lets a fence serve without another, e.g. `10s`. A pool cut off from the
    /// operator and from the other pool's fences stops serving at most this long after its last
    /// grant; a promotion whose old primary could not be told waits this long plus `clockSkew`
    /// before the new primary serves. At least three renewals. Defaults to 10s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = positive_duration())]
    pub ttl: Option<GoDuration>,

    /// How often the operator renews every fence's grant, e.g. `2s`. Defaults to 2s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = positive_duration())]
    pub renew_every: Option<GoDuration>,

    /// How far the operator's and the fences' clocks may disagree, e.g. `1s`: a grant delayed in
    /// the network never serves past the operator's deadline by more. Below half of `ttl`.
    /// Defaults to 1s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = non_negative_duration())]
    pub clock_skew: Option<GoDuration>,
}

/// The contract for streams cut by a failover.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StreamSpec {
    /// What a client whose stream was cut sees.
    #[serde(default)]
    pub contract: StreamContract,

    /// How long a planned move (a switchover or a failback) lets the streams still running on the
    /// old primary finish before it is put into its standby shape (its warm replicas put to sleep,
    /// its pilot light scaled down), which cuts what still runs, e.g. `2m`. Its fences take no new
    /// work meanwhile. A failover does not wait: the old primary failed. Defaults to 60s; `0s`
    /// cuts at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_for: Option<GoDuration>,
}

fn default_port() -> u16 {
    8000
}
fn default_probe_interval() -> GoDuration {
    "10s".into()
}
fn default_probe_timeout() -> GoDuration {
    "5s".into()
}
fn default_probe_prompt() -> String {
    "The capital of France is".to_owned()
}
fn default_probe_max_tokens() -> u32 {
    8
}
fn default_first_token_budget() -> GoDuration {
    "2s".into()
}
fn default_total_budget() -> GoDuration {
    "4s".into()
}
fn default_suspect_after() -> u32 {
    2
}
fn default_promote_after() -> u32 {
    4
}
fn default_hard_promote_after() -> u32 {
    2
}
fn default_min_dwell() -> GoDuration {
    "5m".into()
}
fn default_standby_ready_after() -> u32 {
    2
}
fn default_true() -> bool {
    true
}
fn default_ignore_flags() -> Vec<String> {
    vec!["--port".to_owned(), "--host".to_owned()]
}
fn default_admission_window() -> GoDuration {
    "5m".into()
}
fn default_initial_concurrency() -> u32 {
    4
}
fn default_priority_header() -> String {
    crate::route::DEFAULT_PRIORITY_HEADER.to_owned()
}

/// The condition types a FailoverPolicy reports, the keys of [`FailoverPolicyStatus::conditions`].
pub mod condition_type {
    /// The primary serves and the policy is being enforced.
    pub const READY: &str = "Ready";
    /// The standby passes its own probes and could be promoted.
    pub const STANDBY_PROVEN: &str = "StandbyProven";
    /// Model artifact, runtime and serving flags match between the pools.
    pub const PARITY_HOLDS: &str = "ParityHolds";
    /// The standby tiers, at their measured cold-start times, can meet the recovery objective.
    pub const OBJECTIVE_MET: &str = "ObjectiveMet";
    /// The replicas accept the policy's probe; `False` when they refuse the probe itself (an
    /// unknown model, a bad request, a missing key), which leaves both pools unjudged.
    pub const PROBE_ACCEPTED: &str = "ProbeAccepted";
    /// Whether the last comparison of the pools read both pools' model files as
    /// `spec.parity.artifactDigest` asks, and why not; present only when the policy sets it.
    pub const ARTIFACT_DIGEST_COMPARED: &str = "ArtifactDigestCompared";
    /// Whether the standby kept its thresholds when the primary's recorded traffic was last
    /// replayed against it; present only when the policy sets `spec.loadProof`.
    pub const STANDBY_LOAD_PROVEN: &str = "StandbyLoadProven";
    /// Every type a policy always reports.
    pub const ALL: [&str; 5] = [READY, STANDBY_PROVEN, PARITY_HOLDS, OBJECTIVE_MET, PROBE_ACCEPTED];
    /// The types a policy reports only when its spec asks for what they describe.
    pub const WHEN_ASKED: [&str; 2] = [ARTIFACT_DIGEST_COMPARED, STANDBY_LOAD_PROVEN];
}

/// What the operator observed and did.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FailoverPolicyStatus {
    /// The name of the pool that holds the primary role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary_pool: Option<String>,

    /// The fencing epoch of the current primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,

    /// The failover state machine's state, e.g. Serving, Suspect, Promoting, Degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,

    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Conditions keyed by type (Ready, StandbyProven, ParityHolds, ObjectiveMet), so that
    /// server-side apply merges them one by one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub conditions: BTreeMap<String, Condition>,

    /// The timeline of the most recent failover or failback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failover: Option<FailoverTimeline>,

    /// Where each replica a promotion started went, stage by stage, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cold_start: Vec<ColdStartBreakdown>,

    /// `coldStart` summarized per tier.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cold_start_summary: Vec<ColdStartSummary>,

    /// The placeholder pods that hold GPUs for the standby's pilot-light replicas; absent when
    /// none are held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_reserve: Option<GpuReserve>,

    /// The primary's answer that both pools are judged by, when `spec.probe.expect` is prefix
    /// mode without a value: recorded once, so that a restarted or newly elected operator judges
    /// by it instead of by whatever the primary answers then. Dropped, and recorded again, when
    /// the probe's prompt or `maxTokens` change or the primary serves another model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub golden_answer: Option<GoldenAnswer>,

    /// The last comparison of the pools: every key that differs, and what could not be compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parity: Option<ParityStatus>,

    /// The last time a sleeping standby replica was woken and proven (`spec.standbyProof`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_proof: Option<StandbyProofRecord>,

    /// The standby's last load proof (`spec.loadProof`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_proof: Option<LoadProofRecord>,

    /// Where a standby-first rollout of the primary's serving template stands
    /// (`spec.rollout: standbyFirst`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutRecord>,

    /// The operator's own record of the state machine, so that a restarted operator resumes
    /// where the last one stopped. Its shape belongs to the state machine, not to this schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserve_unknown_object")]
    pub failover: Option<serde_json::Value>,

    /// The serving grants as the fences answered the operator's last round; absent when the
    /// operator has no fence token, and so grants nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grants: Option<GrantsStatus>,
}

/// The serving grants the fences hold, as they answered one round.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GrantsStatus {
    /// The epoch granted, and the pool that holds it.
    pub epoch: u64,
    pub holder: String,
    /// When the round was pushed (RFC 3339).
    pub granted_at: String,
    /// Every fence of the other pool took the epoch, so the holder's serve without waiting out
    /// the old holder's grants.
    pub prior_revoked: bool,
    /// How long the holder's serving fences may serve on without another grant, at the least,
    /// in seconds, as they answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_seconds: Option<f64>,
    /// Each pool's fences by standing: `serving`, `failsafe`, `waiting`, `fenced`, `expired`,
    /// `none` (no grant yet), `takesNoGrants` (a fence that reads the Lease, or no fence),
    /// `refused` (it knows a higher epoch than the operator read), `unreachable`.
    pub pools: Vec<PoolGrants>,
}

/// One pool's fences by the standing of their grants.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolGrants {
    pub pool: String,
    pub fences: BTreeMap<String, u32>,
}

fn preserve_unknown_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// One comparison of the two pools' fingerprints: the serving flags and vLLM environment of their
/// pod templates, and what a running replica of each says of itself (vLLM's version, each served
/// model's root and context length, the digests of how it tokenizes a fixed text and a fixed chat).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ParityStatus {
    /// When the pools were compared, RFC 3339.
    pub checked_at: String,
    /// How many keys were compared.
    pub compared: u32,
    /// How many of them are the model files' (`artifact.*`), with `spec.parity.artifactDigest`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub artifact_keys: u32,
    /// The keys that differ, which block an automatic promotion.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drift: Vec<ParityDrift>,
    /// The keys that differ and `spec.parity.allowDrift` allows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed: Vec<ParityDrift>,
    /// What was not compared this time, and why (a pool with no replica running, a workload
    /// rolling out).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_compared: Vec<String>,
    /// Each pool's model files as last read, with `spec.parity.artifactDigest`: kept so that an
    /// operator that restarts still compares a pool whose files cannot be read now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_files: Vec<ModelFilesRecord>,
}

/// A pool's model files as last read: one digest over its `artifact.*` keys that
/// `spec.parity.allowDrift` does not let differ.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ModelFilesRecord {
    pub pool: String,
    /// The model its template named then.
    pub model: String,
    pub digest: String,
    /// The depth they were read at (`spec.parity.artifactDigest`).
    pub depth: String,
    /// When they were read, RFC 3339.
    pub read_at: String,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One fingerprint key whose values differ; an absent value is a key one side does not have.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ParityDrift {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
}

/// Each difference as status names it: the primary's value against the standby's.
#[must_use]
pub fn drift_of(differences: Vec<understudy_core::fingerprint::Difference>) -> Vec<ParityDrift> {
    differences
        .into_iter()
        .map(|d| ParityDrift {
            key: d.key,
            primary: d.left,
            standby: d.right,
        })
        .collect()
}

/// The drifted keys in one line: `flag.max-model-len (8192 ≠ 4096), …`.
#[must_use]
pub fn drift_line(drift: &[ParityDrift]) -> String {
    let side = |v: &Option<String>| v.clone().unwrap_or_else(|| "absent".to_owned());
    drift
        .iter()
        .map(|d| format!("{} ({} ≠ {})", d.key, side(&d.primary), side(&d.standby)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The GPU reserve of a policy: a Deployment of placeholder pods at a low priority, which the
/// scheduler preempts when the pool's pilot-light replicas scale up.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GpuReserve {
    /// The pool whose GPUs are held: the standby.
    pub pool: String,
    /// The Deployment of placeholder pods, in the policy's namespace.
    pub deployment: String,
    /// The pilot-light replicas whose GPUs are held (a LeaderWorkerSet replica is several pods).
    pub replicas: u32,
}

/// The primary's first passing answer to the probe, as the prefix every later answer of either
/// pool must start with.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GoldenAnswer {
    /// The answer's first characters.
    pub prefix: String,
    /// The prompt it answered (`spec.probe.prompt` when it was recorded).
    pub prompt: String,
    /// The `spec.probe.maxTokens` it was generated with.
    pub max_tokens: u32,
    /// The pool that was primary and gave it.
    pub pool: String,
    /// The model that pool's workload served, as its `vllm serve` arguments name it; absent
    /// when they do not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// When it was recorded, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_at: Option<String>,
}

impl GoldenAnswer {
    /// Whether this answer still judges answers to `probe`: the probe records one (prefix mode
    /// without a value) and asks what it answered, with the same prompt and `maxTokens`.
    #[must_use]
    pub fn fits(&self, probe: &ProbeSpec) -> bool {
        probe.expect.mode == ExpectMode::Prefix
            && probe.expect.value.is_none()
            && self.prompt == probe.prompt
            && self.max_tokens == probe.max_tokens
    }
}

/// One condition; its type is its key in the status's conditions map.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Whether the condition holds.
    pub status: ConditionStatus,

    /// A CamelCase word saying why.
    #[serde(default)]
    pub reason: String,

    /// A sentence for people.
    #[serde(default)]
    pub message: String,

    /// When `status` last changed, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

/// The three values of a Kubernetes condition's status.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// The steps of one failover or failback, as they happened.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FailoverTimeline {
    /// Failover (away from the primary) or failback (home again).
    pub kind: TransitionKind,
    /// The name of the pool that lost the primary role.
    pub from_pool: String,
    /// The name of the pool that took it.
    pub to_pool: String,
    /// The epoch the transition claimed.
    pub epoch: u64,
    /// When the primary's run of failed checks that led to the decision began, RFC 3339; absent
    /// when no failure started it (a command).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_seen_at: Option<String>,
    /// When the decision was taken, RFC 3339.
    pub started_at: String,
    /// The steps completed so far, in order.
    #[serde(default)]
    pub steps: Vec<TimelineStep>,
    /// RFC 3339; absent while the transition runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// Failover or failback.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum TransitionKind {
    Failover,
    Failback,
}

/// One step of a transition: when it began and when it completed.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TimelineStep {
    /// The step, e.g. LeaseClaimed, Woken, ScaledUp, Serving, Routed, AdmissionOpened.
    pub step: String,
    /// When it began, RFC 3339: steps run one after another, so when the one before it completed
    /// (the first, when the decision was taken).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// When it completed, RFC 3339.
    pub at: String,
    /// How long it took, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub milliseconds: Option<u64>,
    /// True when the operator made no call for this step and left it to another component (the
    /// fence sidecar, the prober, the router): the promotion moved on, but the step is not
    /// known to be done. `note` says who carries it and what happened.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub handed_off: bool,
    /// What happened, where the step's name alone would claim more than is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Where one replica's start went.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ColdStartBreakdown {
    /// The pool's name.
    pub pool: String,
    /// The replica: its pod's name, or for a replica woken from sleep, its address.
    pub replica: String,
    /// The tier it waited in before it started (`pilotLight`, `warm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// Seconds per stage (node, imagePull, containerStart, engineStart, weightLoad, warmup,
    /// apiReady, firstToken for a replica started cold; wakeLevel1 or wakeLevel2, and firstToken,
    /// for one woken); a stage not measured has no value.
    #[serde(default)]
    pub stages: BTreeMap<String, Option<f64>>,
}

/// One tier's measured starts: per stage, the median and the worst over its replicas.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ColdStartSummary {
    pub tier: String,
    /// Replicas measured.
    pub replicas: u32,
    /// Per stage measured at least once.
    #[serde(default)]
    pub stages: BTreeMap<String, StageSummary>,
}

/// A stage's median and worst, in seconds.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct StageSummary {
    pub median: f64,
    pub worst: f64,
}

/// Fails a FailoverPolicy over for real, on a schedule or on demand, and records the timeline and
/// a verdict.
///
/// The fault goes through the policy's own command annotation, so the promotion is the real one,
/// fenced by the epoch Lease; the game day only asks, watches the policy's status, and judges.
#[allow(
    clippy::duplicated_attributes,
    reason = "several printer columns are `type_ = \"string\"`, which clippy reads as a duplicate"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "understudy.dev",
    version = "v1alpha1",
    kind = "GameDay",
    plural = "gamedays",
    shortname = "gd",
    namespaced,
    status = "GameDayStatus",
    derive = "PartialEq",
    doc = "Fails a FailoverPolicy over for real, on a schedule or on demand, and records a verdict.",
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.policyRef.name"),
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Last Verdict", type_ = "string", json_path = ".status.lastVerdict"),
    printcolumn(name = "Next Run", type_ = "date", json_path = ".status.nextRunAt")
)]
#[serde(rename_all = "camelCase")]
pub struct GameDaySpec {
    /// The FailoverPolicy, in this namespace, that the game day fails over. It cannot change: a
    /// run under way and the runs recorded belong to one policy.
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("policyRef cannot change; create another GameDay"),
    )]
    pub policy_ref: PolicyRef,

    /// When to run, as a five-field cron expression (`minute hour day-of-month month
    /// day-of-week`) in UTC, e.g. `0 10 * * TUE`. Without it, the game day runs only when given
    /// the annotation `understudy.dev/command: run`. A run due while another is still going is
    /// skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    #[x_kube(
        validation = Rule::new(format!("self.matches('{CRON_PATTERN}')")).message(
            "must be a five-field cron expression (minute hour day-of-month month day-of-week), \
             e.g. '0 10 * * TUE', or @hourly, @daily, @weekly, @monthly, @yearly"
        ),
    )]
    pub schedule: Option<String>,

    /// The IANA time zone the schedule is read in, e.g. `Europe/Berlin`; UTC when unset. A time
    /// a daylight-saving change skips fires right after the gap; a time it repeats fires once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: Option<String>,

    /// What a scheduled run that comes due while another run of this game day is under way does,
    /// as a CronJob's: `Forbid` skips it, `Allow` starts it as soon as the run under way ends
    /// (one waits at most), `Replace` stops the run under way if it has not injected its fault
    /// yet (a fault injected is never cut short: then the new run is skipped, and said so).
    #[serde(default)]
    pub concurrency_policy: ConcurrencyPolicy,

    /// What is injected.
    #[serde(default)]
    pub fault: Fault,

    /// What must hold before anything is injected. A run that finds it broken injects nothing
    /// and is recorded Aborted.
    #[serde(default)]
    pub steady_state: SteadyStateSpec,

    /// Stop condition: the run fails when the new primary is not serving this long after the
    /// fault was injected (and likewise for the failback), e.g. `5m`.
    #[x_kube(validation = positive_duration())]
    pub max_recovery: GoDuration,

    /// Whether the game day gives the primary role back to the home pool itself.
    #[serde(default)]
    pub failback: GameDayFailback,

    /// Stop conditions on what the clients see, read from the routers (the operator's
    /// `--router-admin`) over a sliding window once the fault is injected: when one fires, the
    /// run fails, and with `failback.mode: after` gives the primary role back at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_conditions: Option<StopConditions>,

    /// Finished runs kept in `status.lastRuns`, newest first.
    #[serde(default = "default_history_limit")]
    #[schemars(range(min = 1, max = 50))]
    pub history_limit: u32,
}

/// Five whitespace-separated fields of digits, names, `*`, `,`, `-` and `/`, or a macro. The
/// operator's cron parser checks the ranges and says which field is wrong.
const CRON_PATTERN: &str = "^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|\
                            [*,/0-9A-Za-z-]+( +[*,/0-9A-Za-z-]+){4})$";

/// A FailoverPolicy in the game day's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyRef {
    /// The FailoverPolicy's name.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(
        validation = Rule::new(format!("self.matches('{DNS_SUBDOMAIN_PATTERN}')"))
            .message("must be a Kubernetes object name (RFC 1123 subdomain)"),
    )]
    pub name: String,
}

/// What a scheduled run due while another runs does.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ConcurrencyPolicy {
    /// Start it as soon as the run under way ends.
    Allow,
    /// Skip it.
    #[default]
    Forbid,
    /// Stop the run under way if it has not injected yet, and start this one.
    Replace,
}

/// The fault a game day injects.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum Fault {
    /// Ask the policy to fail over (its `failover` command): the real promotion, fenced by the
    /// epoch Lease, from a primary that is still healthy.
    #[default]
    Failover,
    /// Crash the primary: delete its serving pods at once, as a node or a process dying would.
    /// Nothing tells the policy: it must see the failure with its own probes and promote the
    /// standby by itself. The workload recreates the pods.
    Crash,
    /// Restart the standby with another serving configuration: its workload's serving container
    /// gets the variable `VLLM_UNDERSTUDY_GAMEDAY_DRIFT`, and rolls out. The policy must report
    /// the drift (`ParityHolds` False naming it) and promote nothing; the run then takes the
    /// variable away and waits for parity to hold again. A Deployment's only.
    Drift,
    /// Hang the primary: its replicas' fence sidecars hold every request but the operator's
    /// control calls, unanswered (`/health` too), as a wedged engine would. Nothing tells the
    /// policy: its probes must time out and it must promote the standby by itself. The fault is
    /// taken away once the run is judged, and ends by itself after `maxRecovery` and a minute in
    /// any case. Needs fences in front of the replicas and the operator's `--replica-token-file`.
    Hang,
    /// Half-fail the primary: its fences answer every completion at once, well formed and wrong,
    /// while `/health` stays green, as a replica on a corrupting GPU would. Only the policy's
    /// golden-answer probe can see it; it must promote the standby by itself. Taken away as
    /// `hang` is, and with the same needs.
    HalfFailed,
    /// Prove the standby at the primary's load now (the policy's `prove-load` command): the run
    /// passes when a load proof of the standby that started after the command is `Proven`, and
    /// fails when it fails, does not run, or none ends within `maxRecovery`. Nothing is promoted.
    /// Needs `spec.loadProof` on the policy.
    LoadProof,
}

/// The steady state a run checks before it injects. Always checked, from the policy's status:
/// `Ready` is True and the state is Serving (no promotion under way, primary not suspect); the
/// standby is proven (`StandbyProven` True) and parity is not broken; the home pool is primary;
/// the policy is not paused; the policy's minimum dwell since its last transition has passed; no
/// other game day is running on the policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SteadyStateSpec {
    /// Also require the policy's `Ready` condition to have been True at least this long, e.g.
    /// `30m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = non_negative_duration())]
    pub ready_for: Option<GoDuration>,
}

/// Whether and when a game day fails back.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.mode != 'after' || has(self.after)")
        .message("after is required when mode is after"),
    validation = Rule::new("self.mode != 'manual' || !has(self.after)")
        .message("after is not used when mode is manual"),
)]
pub struct GameDayFailback {
    /// `manual`: the run ends once the standby serves, and stays there until someone gives the
    /// policy a failback command. `after`: the game day holds on the standby for `after`, then
    /// gives the failback command itself.
    #[serde(default)]
    pub mode: GameDayFailbackMode,

    /// How long to hold on the standby before failing back. The policy refuses a promotion
    /// within its `trigger.minDwell`, so the failback waits for that too when it is longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = positive_duration())]
    pub after: Option<GoDuration>,
}

/// Limits on what the clients see during a run, over a sliding window.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StopConditions {
    /// The most of the window's requests that may fail (an upstream's 5xx, no endpoint in time,
    /// every try failed), as a fraction, e.g. `0.05`. Shed requests do not count as failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_error_rate: Option<f64>,

    /// The longest the window's 99th percentile time to first token may be, e.g. `10s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = positive_duration())]
    pub max_ttft_p99: Option<GoDuration>,

    /// The sliding window, e.g. `1m`.
    #[serde(default = "default_stop_window")]
    #[x_kube(validation = positive_duration())]
    pub window: GoDuration,

    /// Fewer requests in the window than this judge nothing: a handful of requests is no rate.
    #[serde(default = "default_stop_min_requests")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub min_requests: u32,
}

fn default_stop_window() -> GoDuration {
    "1m".into()
}

fn default_stop_min_requests() -> u32 {
    20
}

/// Requests the routers counted.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RequestCounts {
    pub sent: u64,
    /// Failed for the client: an upstream's 5xx, no endpoint in time, every try failed.
    pub failed: u64,
    /// Shed by admission control.
    pub shed: u64,
}

/// Game-day failback modes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum GameDayFailbackMode {
    #[default]
    Manual,
    After,
}

fn default_history_limit() -> u32 {
    10
}

/// What the operator observed of a game day's runs.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GameDayStatus {
    /// The current run's phase, or Idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,

    /// The run under way, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_run: Option<GameDayRun>,

    /// Finished runs, newest first, at most `spec.historyLimit`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_runs: Vec<GameDayRun>,

    /// The verdict of the newest finished run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_verdict: Option<Verdict>,

    /// A scheduled run that came due while another was under way and waits for it to end
    /// (`concurrencyPolicy: Allow`): when it was due, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_run_at: Option<String>,

    /// When the schedule next fires, RFC 3339; absent without a schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_run_at: Option<String>,

    /// Why nothing is scheduled, when the schedule cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,

    /// The last `understudy.dev/command` value handled, so that it is not run twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handled_command: Option<String>,

    /// The spec generation `nextRunAt` was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// One run of a game day.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GameDayRun {
    /// The run's id, from the time it was due, e.g. `20240604-100000`.
    pub id: String,
    /// What started it.
    pub trigger: RunTrigger,
    /// Where the run is.
    pub phase: RunPhase,
    /// Every phase the run entered, in order, with when.
    #[serde(default)]
    pub transitions: Vec<RunTransition>,
    /// The pool that was primary when the fault was injected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_pool: Option<String>,
    /// The standby the fault was to promote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_pool: Option<String>,
    /// The policy's epoch before the fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_epoch: Option<u64>,
    /// The command annotation value given to the policy to inject the fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// What the run did to inject a fault that is not a command, e.g. the pods it deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub injected: Option<String>,
    /// The command value the policy had handled when a fault that is not a command was injected:
    /// a promotion under another value was somebody's command, not the policy's own answer to
    /// the fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handled_before: Option<String>,
    /// The recovery, as the policy's own status recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryTimeline>,
    /// The failback, as the policy's own status recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failback: Option<RecoveryTimeline>,
    /// A stop condition that fired (the clients' error rate or time to first token over the
    /// window, or the standby losing its steady state while holding): the run fails, and fails
    /// back early when it fails back at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_condition: Option<String>,
    /// What the routers counted from the injection on: the run's record of loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<RequestCounts>,
    /// The routers' totals when the fault was injected, which `requests` counts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_before: Option<RequestCounts>,
    /// Set when the run is over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
    /// Why the verdict is what it is, or what the run waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What started a run.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum RunTrigger {
    Schedule,
    Command,
}

/// The phases of a run.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunPhase {
    Scheduled,
    CheckingSteadyState,
    Injected,
    Recovered,
    HoldingOnStandby,
    FailingBack,
    /// A drift was taken back; waiting for parity to hold again.
    Restoring,
    Done,
    Aborted,
    Failed,
}

impl RunPhase {
    /// How many phases there are: a bound on the steps one call of the run machine can take.
    pub const COUNT: usize = 10;

    /// Whether the run is over.
    #[must_use]
    pub fn is_final(self) -> bool {
        matches!(self, RunPhase::Done | RunPhase::Aborted | RunPhase::Failed)
    }
}

/// A phase a run entered and when, RFC 3339.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RunTransition {
    pub phase: RunPhase,
    pub at: String,
}

/// A run's verdict.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The standby served within `maxRecovery` (and, with `failback.mode: after`, the home pool
    /// took the role back within it).
    Passed,
    /// A stop condition fired: serving did not come back within `maxRecovery`, the standby
    /// lost its steady state while holding, or the policy left the standby during the hold by a
    /// move the run did not command.
    Failed,
    /// Nothing was judged: the steady state did not hold, so nothing was injected, or the policy
    /// refused or went its own way.
    Aborted,
}

/// One promotion a run caused, from the command to serving, with the policy's own timeline.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RecoveryTimeline {
    /// When the game day gave the command, RFC 3339.
    pub commanded_at: String,
    /// The epoch the promotion claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// When the policy started the promotion (its `lastFailover.startedAt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// When the policy finished it (its `lastFailover.finishedAt`): the new primary serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_at: Option<String>,
    /// Seconds from the command to serving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<u64>,
    /// The promotion's steps, as the policy recorded them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<TimelineStep>,
}

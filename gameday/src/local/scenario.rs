//! A local game day's scenario: the pools, the policy, the load and the faults, as YAML a user
//! copies and edits.
//!
//! Unknown and misplaced fields are refused with their name, and every rule is checked before a
//! process starts: a scenario that cannot run says why and starts nothing.

use std::time::Duration;

use serde::Deserialize;
use understudy_api::crd::{AdmissionSpec, RolloutPhase};
use understudy_api::grant::GrantTiming;
use understudy_core::drive::promotion_deadline;
use understudy_core::duration;
use understudy_core::load_proof::{self, Thresholds};

/// The scenario `understudy-gameday run` runs when given none: a hot standby, a crashed primary.
pub const DEFAULT: &str = include_str!("../../../examples/gamedays/local/default.yaml");

/// A scenario, as written.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    /// How long load runs, from the moment both pools serve.
    pub duration: String,
    /// The model both pools serve.
    #[serde(default = "default_model")]
    pub model: String,
    pub pools: Pools,
    /// Whether pool b stands by or serves beside pool a.
    #[serde(default)]
    pub topology: Topology,
    #[serde(default)]
    pub policy: LocalPolicy,
    #[serde(default)]
    pub router: RouterShape,
    pub load: Load,
    #[serde(default)]
    pub faults: Vec<FaultAt>,
    /// Commands an operator gives during the run, as `kubectl annotate` would.
    #[serde(default)]
    pub commands: Vec<CommandAt>,
    /// A load proof of the standby during the run: the routers' recorded traffic replayed
    /// against it through its fences, as the operator's `spec.loadProof` does.
    #[serde(default, rename = "loadProof")]
    pub load_proof: Option<LocalLoadProof>,
    /// A new version set on both pools during the run, under the FailoverPolicy's
    /// `rollout: standbyFirst`.
    #[serde(default)]
    pub rollout: Option<LocalRollout>,
    /// What the run must show to pass.
    #[serde(default)]
    pub expect: Expect,
    /// Runs to compare side by side in one report, each the scenario with some of its sections
    /// replaced; absent, the scenario is one run.
    #[serde(default)]
    pub runs: Vec<Variant>,
}

/// A load proof during a local run, in the FailoverPolicy's `spec.loadProof` terms, with `at`
/// (from the start of load) for `every`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LocalLoadProof {
    pub at: String,
    pub duration: String,
    #[serde(default = "one")]
    pub rate_share: f64,
    #[serde(default = "one_percent")]
    pub max_error_rate: f64,
    pub ttft_p99: String,
    pub itl_p99: String,
}

fn one() -> f64 {
    1.0
}

fn one_percent() -> f64 {
    0.01
}

/// A new version of the serving template, set on both pools at `at` (from the start of load), as
/// a user sets a new image on both workloads: each pool's `vllm serve` flags with `args` added.
/// The standby rolls to it at once; the primary is held until the standby has passed on it, as
/// the operator holds it with `spec.rollout: standbyFirst`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalRollout {
    pub at: String,
    pub args: Vec<String>,
}

/// A rollout, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedRollout {
    pub at: Duration,
    pub args: Vec<String>,
}

/// A load proof, checked: when it starts, and what the operator's would run with.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckedLoadProof {
    pub at: Duration,
    pub duration: Duration,
    pub rate_share: f64,
    pub thresholds: Thresholds,
}

/// One run of a comparison: the sections it gives replace the scenario's, whole.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub name: String,
    #[serde(default)]
    pub pools: Option<Pools>,
    #[serde(default)]
    pub topology: Option<Topology>,
    #[serde(default)]
    pub policy: Option<LocalPolicy>,
    #[serde(default)]
    pub router: Option<RouterShape>,
    #[serde(default)]
    pub rollout: Option<LocalRollout>,
    #[serde(default)]
    pub expect: Option<Expect>,
}

/// How the two pools serve.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// Pool a serves and pool b stands by; the failover logic promotes b when a fails.
    #[default]
    ActivePassive,
    /// Every replica of both pools serves in one route, and no failover logic runs: the routers'
    /// ejection of a failing endpoint is all the failover there is.
    ActiveActive,
}

/// What the routers do with a failed try, and how they admit work after a promotion.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouterShape {
    /// Whether a try refused or reset before any byte is made again on another endpoint.
    #[serde(default = "yes")]
    pub retries: bool,
    /// Whether a request with no endpoint to take it waits for one (until a new route or an
    /// endpoint's return) rather than failing at once.
    #[serde(default = "yes")]
    pub waiting_room: bool,
    /// How long an endpoint that failed is left out; absent, the router's own back-off (one
    /// second, growing with each ejection in a row).
    #[serde(default)]
    pub eject_for: Option<String>,
    /// Admission control on the promoted pool, per replica as in a FailoverPolicy's
    /// `admission`; absent, off.
    #[serde(default)]
    pub admission: Option<LocalAdmission>,
}

impl Default for RouterShape {
    fn default() -> Self {
        RouterShape {
            retries: true,
            waiting_room: true,
            eject_for: None,
            admission: None,
        }
    }
}

fn yes() -> bool {
    true
}

fn level_one() -> u8 {
    1
}

/// A FailoverPolicy's `admission`, with its field names.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LocalAdmission {
    /// How long after the route admission is limited.
    pub window: String,
    /// Concurrent requests per replica admitted at the start of the window.
    pub initial_concurrency: u32,
    /// Concurrent requests per replica at the end of the window.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// Prompt tokens per replica admitted at the start of the window.
    #[serde(default)]
    pub initial_prefill_tokens: Option<u32>,
}

impl LocalAdmission {
    /// The same settings as a FailoverPolicy's spec.
    #[must_use]
    pub fn spec(&self) -> AdmissionSpec {
        AdmissionSpec {
            window: self.window.as_str().into(),
            initial_concurrency: self.initial_concurrency,
            max_concurrency: self.max_concurrency,
            initial_prefill_tokens: self.initial_prefill_tokens,
            ..AdmissionSpec::default()
        }
    }
}

fn default_model() -> String {
    "Qwen/Qwen3-0.6B".to_owned()
}

/// The two pools: `a` is the home primary, `b` its standby.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pools {
    pub a: PoolShape,
    pub b: PoolShape,
}

/// One pool's replicas: hot (awake) unless some are warm.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PoolShape {
    pub replicas: u32,
    /// How many of the standby's replicas are put to sleep (vLLM sleep mode) before the run and
    /// woken on promotion; the rest wait awake.
    #[serde(default)]
    pub warm: u32,
    /// The level the warm replicas sleep at: 1 keeps the weights in host memory, 2 discards
    /// them (the wake reloads them).
    #[serde(default = "level_one")]
    pub sleep_level: u8,
    /// How many of the standby's replicas do not run until a promotion starts them, each with
    /// the emulator's modelled startup stages.
    #[serde(default)]
    pub pilot_light: u32,
    /// vLLM flags (and the emulator's `--emu-*` settings) every replica of the pool starts
    /// with, after the runner's own: `["--max-num-seqs", "2"]` for two workers.
    #[serde(default)]
    pub args: Vec<String>,
    /// What serves: the emulator (the default), or real vLLM from the tier
    /// `tests/vllm/install.sh` installs.
    #[serde(default)]
    pub engine: Engine,
}

/// What a pool's replicas run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// `vllm-emulator`: sleep mode, GPU-sized timings, every fault, many replicas.
    #[default]
    Emulated,
    /// Real vLLM (its CPU build) serving the tier's tiny model: about a minute and 4 GB of
    /// memory per replica, no sleep mode, and only the faults signals make (crash, hang,
    /// hang-engine).
    Vllm,
}

/// How the failover logic judges a replica each round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProbeKind {
    /// A generating probe whose answer is checked against the golden answer (understudy's).
    #[default]
    Generate,
    /// `GET /health` answering 200 within the timeout, as a Kubernetes readiness probe or a
    /// load balancer's health check judges it: a baseline, blind to an engine that hangs while
    /// its API server answers.
    Health,
}

/// The failover policy, in the FailoverPolicy's own terms.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LocalPolicy {
    /// How often both pools are probed.
    pub interval: String,
    /// How long one probe may take.
    pub timeout: String,
    pub suspect_after: u32,
    pub promote_after: u32,
    /// Consecutive refusals or 5xx that promote on their own.
    pub hard_promote_after: u32,
    pub standby_ready_after: u32,
    /// `manual` (the default): only a `failback` command gives the primary role back to pool
    /// a; `automatic`: after pool a passes `healthyChecks` rounds in a row as the standby.
    #[serde(default)]
    pub failback: Failback,
    /// The least time between two promotions.
    #[serde(default = "no_dwell")]
    pub min_dwell: String,
    /// The FailoverPolicy's `minServingFraction`: the share of the promoted pool that must pass
    /// before it is routed, and that it must keep passing with as the primary (up to a majority).
    /// A majority when absent.
    #[serde(default)]
    pub min_serving_fraction: Option<f64>,
    /// The FailoverPolicy's `recoveryObjective`: what is left of it after a hang's detection is
    /// how long a promotion may wait for all it wants before it routes what serves.
    #[serde(default = "five_minutes")]
    pub recovery_objective: String,
    /// The FailoverPolicy's `stream.drainFor`: how long a planned move lets the streams still
    /// running on the old primary finish before its warm replicas are put to sleep (which aborts
    /// what still runs there).
    #[serde(default = "one_minute")]
    pub drain_for: String,
    /// How each replica is judged: `generate` (the default) or `health`, a baseline.
    #[serde(default)]
    pub probe: ProbeKind,
    /// The serving grants the fences take: how long each lasts, how often it is renewed, and
    /// the clock-skew margin (`understudy_api::grant`).
    #[serde(default)]
    pub grant: LocalGrant,
}

/// The serving grants' timing, in the FailoverPolicy's own terms.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LocalGrant {
    pub ttl: String,
    pub renew_every: String,
    pub skew: String,
}

impl Default for LocalGrant {
    fn default() -> Self {
        LocalGrant {
            ttl: "10s".to_owned(),
            renew_every: "2s".to_owned(),
            skew: "1s".to_owned(),
        }
    }
}

impl LocalGrant {
    fn timing(&self) -> Result<GrantTiming, ScenarioError> {
        let renew_every = parse_duration("policy.grant.renewEvery", &self.renew_every)?;
        let timing = GrantTiming {
            ttl: parse_duration("policy.grant.ttl", &self.ttl)?,
            renew_every,
            skew: parse_duration("policy.grant.skew", &self.skew)?,
            // A push answers within a renewal period, and within a second on loopback.
            push_timeout: renew_every.min(Duration::from_secs(1)),
        };
        timing
            .check()
            .map_err(|e| invalid("policy.grant", e.to_string()))?;
        Ok(timing)
    }
}

fn one_minute() -> String {
    "60s".to_owned()
}

fn five_minutes() -> String {
    "5m".to_owned()
}

fn no_dwell() -> String {
    "0s".to_owned()
}

/// When the primary role goes back to the home pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", tag = "mode")]
pub enum Failback {
    #[default]
    Manual,
    Automatic {
        #[serde(rename = "healthyChecks")]
        healthy_checks: u32,
    },
}

impl Default for LocalPolicy {
    fn default() -> Self {
        LocalPolicy {
            interval: "1s".to_owned(),
            timeout: "800ms".to_owned(),
            suspect_after: 1,
            promote_after: 3,
            hard_promote_after: 2,
            standby_ready_after: 2,
            failback: Failback::Manual,
            min_dwell: no_dwell(),
            min_serving_fraction: None,
            recovery_objective: five_minutes(),
            drain_for: one_minute(),
            probe: ProbeKind::Generate,
            grant: LocalGrant::default(),
        }
    }
}

/// Open-loop load against the routers.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Load {
    /// Requests a second, arriving as a Poisson process.
    pub rate: f64,
    /// The share of requests that stream.
    #[serde(default = "half")]
    pub stream_share: f64,
    /// Output tokens asked of each request, drawn uniformly from `[min, max]`.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: [u32; 2],
    /// Prompt words, drawn uniformly from `[min, max]`.
    #[serde(default = "default_prompt_words")]
    pub prompt_words: [u32; 2],
    /// The share of requests that begin with one shared system prefix.
    #[serde(default)]
    pub shared_prefix_share: f64,
    /// Which priority class requests declare; the rest declare none.
    #[serde(default)]
    pub priorities: PriorityMix,
}

/// The shares of requests sent as `interactive` and as `batch` (`x-understudy-priority`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityMix {
    #[serde(default)]
    pub interactive: f64,
    #[serde(default)]
    pub batch: f64,
}

fn half() -> f64 {
    0.5
}
fn default_max_tokens() -> [u32; 2] {
    [8, 24]
}
fn default_prompt_words() -> [u32; 2] {
    [4, 48]
}

/// A fault, at a time counted from the start of load.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultAt {
    pub at: String,
    pub fault: FaultKind,
    /// The pool whose every replica gets the fault: the primary at the time when absent.
    #[serde(default)]
    pub pool: Option<PoolName>,
    /// How long it lasts; absent, to the end. A hung replica is continued (SIGCONT), an
    /// emulator fault cleared, the lease store given back. A crashed replica never returns.
    #[serde(default, rename = "for")]
    pub lasts: Option<String>,
}

/// A command, at a time counted from the start of load.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandAt {
    pub at: String,
    pub command: LocalCommand,
}

/// The FailoverPolicy's commands (its `understudy.dev/command` annotation's values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LocalCommand {
    Failover,
    Failback,
    ForceFailover,
}

/// What happens to the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL: the process is gone, its port refuses.
    Crash,
    /// SIGSTOP: connections stay open and nothing answers.
    Hang,
    /// The engine stops while the API server answers: real vLLM's worker process stopped
    /// (SIGSTOP), the emulator's `engine-hung`. `/health` stays 200; no generation progresses.
    HangEngine,
    /// Health answers, generation fails with a 500 (the emulator's `half-failed:error`).
    HalfFailed,
    /// Fluent answers that are not the model's (the emulator's `wrong-output`): only a
    /// generating probe against the golden answer sees it.
    WrongOutput,
    /// Prefill and decode ten times slower (the emulator's `slow:10`).
    Slow,
    /// The failover logic cut off from the lease's store, as when the operator's cluster is lost:
    /// no grant is renewed, and the fences serve on only while the other pool vouches for them.
    LostLease,
    /// The pool cut off from the failover logic and from the other pool's fences: its replicas
    /// and fences run on, and the routers still reach them (its region's clients do), but no
    /// probe, grant or peer question crosses. Its fences stop when their grants run out.
    Partition,
}

impl FaultKind {
    /// The emulator's fault text, for the faults its control port injects.
    #[must_use]
    pub fn emulator_fault(self) -> Option<&'static str> {
        match self {
            FaultKind::Crash | FaultKind::Hang | FaultKind::LostLease | FaultKind::Partition => None,
            FaultKind::HangEngine => Some("engine-hung"),
            FaultKind::HalfFailed => Some("half-failed:error"),
            FaultKind::WrongOutput => Some("wrong-output"),
            FaultKind::Slow => Some("slow:10"),
        }
    }

    /// Whether the probes see it as strong evidence (refused, 5xx) rather than weak (timeouts,
    /// wrong or slow answers).
    #[must_use]
    pub fn is_hard(self) -> bool {
        matches!(self, FaultKind::Crash | FaultKind::HalfFailed)
    }

    /// The name reports use.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Crash => "crash",
            FaultKind::Hang => "hang",
            FaultKind::HangEngine => "hang-engine",
            FaultKind::HalfFailed => "half-failed",
            FaultKind::WrongOutput => "wrong-output",
            FaultKind::Slow => "slow",
            FaultKind::LostLease => "lost-lease",
            FaultKind::Partition => "partition",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolName {
    A,
    B,
}

/// What the run must show to pass.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Expect {
    /// Promotions that must finish.
    #[serde(default)]
    pub failovers: Option<u32>,
    /// The most requests that may fail.
    #[serde(default)]
    pub max_failed: Option<u64>,
    /// The most requests sent after the first fault that may fail: the ones a dying replica
    /// already held are not counted here, since nothing can save a request a replica took and lost.
    #[serde(default)]
    pub max_failed_sent_after_fault: Option<u64>,
    /// The fewest requests that must fail: a baseline that loses nothing is not the baseline
    /// its name says, and the comparison would be wrong.
    #[serde(default)]
    pub min_failed: Option<u64>,
    /// The most requests sent after the first fault that may succeed: a baseline that keeps
    /// serving through the fault was not blind to it, and the comparison would be wrong.
    #[serde(default)]
    pub max_ok_sent_after_fault: Option<u64>,
    /// The most the interactive p99 time to first token in the storm after the route may be,
    /// as a multiple of its steady p99 before the fault.
    #[serde(default)]
    pub interactive_storm_ttft_within: Option<f64>,
    /// Whether the scenario's load proof must prove the standby (`true`) or fail it (`false`).
    #[serde(default)]
    pub load_proven: Option<bool>,
    /// The phase the scenario's rollout must end in: `UpToDate` (the primary rolled after the
    /// standby passed) or `Stopped` (the standby failed on it and the primary was never touched).
    #[serde(default)]
    pub rollout: Option<RolloutPhase>,
}

/// A scenario that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("not a scenario: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("{field}: {message}")]
    Invalid { field: &'static str, message: String },
}

/// A scenario's runs, checked, under the scenario's name.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub name: String,
    pub runs: Vec<Checked>,
}

/// A scenario checked and with its durations parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    pub scenario: Scenario,
    pub duration: Duration,
    pub interval: Duration,
    pub timeout: Duration,
    /// Each fault's time, in the order given.
    pub fault_times: Vec<Duration>,
    /// When each fault ends, when it does.
    pub fault_ends: Vec<Option<Duration>>,
    /// Each command's time, in the order given.
    pub command_times: Vec<Duration>,
    pub min_dwell: Duration,
    /// How long a promotion may take before its steps stop waiting for all they want.
    pub promotion_deadline: Duration,
    /// How long a planned move lets the old primary's streams finish.
    pub drain_for: Duration,
    /// How long the routers leave a failed endpoint out, when the scenario says.
    pub eject_for: Option<Duration>,
    /// The serving grants' timing.
    pub grant: GrantTiming,
    /// The load proof, when the scenario runs one.
    pub load_proof: Option<CheckedLoadProof>,
    /// The rollout, when the scenario sets a new version.
    pub rollout: Option<CheckedRollout>,
}

fn invalid(field: &'static str, message: impl Into<String>) -> ScenarioError {
    ScenarioError::Invalid {
        field,
        message: message.into(),
    }
}

/// A load proof that starts and ends within the run, with thresholds a replay can keep.
fn check_load_proof(proof: &LocalLoadProof, run: Duration) -> Result<CheckedLoadProof, ScenarioError> {
    let at = within("loadProof.at", &proof.at, run)?;
    let duration = parse_duration("loadProof.duration", &proof.duration)?;
    if duration.is_zero() || at + duration > run {
        return Err(invalid(
            "loadProof.duration",
            "must be more than 0s and end within the run",
        ));
    }
    if !load_proof::valid_share(proof.rate_share) {
        return Err(invalid("loadProof.rateShare", "must be above 0 and at most 4"));
    }
    if !load_proof::valid_error_rate(proof.max_error_rate) {
        return Err(invalid("loadProof.maxErrorRate", "must be between 0 and 1"));
    }
    Ok(CheckedLoadProof {
        at,
        duration,
        rate_share: proof.rate_share,
        thresholds: Thresholds {
            max_error_rate: proof.max_error_rate,
            ttft_p99: parse_duration("loadProof.ttftP99", &proof.ttft_p99)?,
            itl_p99: parse_duration("loadProof.itlP99", &proof.itl_p99)?,
        },
    })
}

fn parse_duration(field: &'static str, text: &str) -> Result<Duration, ScenarioError> {
    duration::parse(text).map_err(|e| invalid(field, format!("{text:?}: {e}")))
}

/// The most replicas a pool may run here: each is a process on this machine.
const MAX_REPLICAS: u32 = 16;
/// The longest run: a local game day is a rehearsal, not a soak.
const MAX_DURATION: Duration = Duration::from_secs(600);

impl Scenario {
    /// Reads and checks a scenario of one run.
    pub fn parse(text: &str) -> Result<Checked, ScenarioError> {
        let mut plan = Scenario::plan(text)?;
        if plan.runs.len() != 1 {
            return Err(invalid(
                "runs",
                format!("{} runs where one was expected", plan.runs.len()),
            ));
        }
        Ok(plan.runs.remove(0))
    }

    /// Reads a scenario and checks each of its runs: one, or one per entry of `runs`, each
    /// named after its entry.
    pub fn plan(text: &str) -> Result<Plan, ScenarioError> {
        let mut scenario: Scenario = serde_yaml::from_str(text)?;
        let name = scenario.name.clone();
        let variants = std::mem::take(&mut scenario.runs);
        if variants.is_empty() {
            return Ok(Plan {
                name,
                runs: vec![scenario.check()?],
            });
        }
        let runs = variants
            .into_iter()
            .map(|variant| {
                let mut run = scenario.clone();
                run.name = variant.name;
                run.pools = variant.pools.unwrap_or(run.pools);
                run.topology = variant.topology.unwrap_or(run.topology);
                run.policy = variant.policy.unwrap_or(run.policy);
                run.router = variant.router.unwrap_or(run.router);
                run.rollout = variant.rollout.or(run.rollout);
                run.expect = variant.expect.unwrap_or(run.expect);
                run.check()
            })
            .collect::<Result<_, _>>()?;
        Ok(Plan { name, runs })
    }

    fn check(mut self) -> Result<Checked, ScenarioError> {
        let duration = parse_duration("duration", &self.duration)?;
        if duration.is_zero() || duration > MAX_DURATION {
            return Err(invalid("duration", "must be more than 0s and at most 10m"));
        }
        self.check_pools()?;
        // A standby that is all pilot light keeps one replica running, hot, so that it can be
        // proven before a promotion: the operator's rule (`PoolSpec::standby_groups`).
        if self.pools.b.pilot_light == self.pools.b.replicas {
            self.pools.b.pilot_light -= 1;
        }
        let interval = parse_duration("policy.interval", &self.policy.interval)?;
        let timeout = parse_duration("policy.timeout", &self.policy.timeout)?;
        if interval < Duration::from_millis(100) || timeout.is_zero() || timeout >= interval {
            return Err(invalid(
                "policy",
                "interval must be at least 100ms and timeout shorter than it",
            ));
        }
        check_load_mix(&self.load)?;
        let eject_for = check_router(&self.router)?;
        check_load_lengths(&self.load)?;
        let (fault_times, fault_ends) = self.fault_times(duration)?;
        let command_times = self
            .commands
            .iter()
            .map(|c| within("commands[].at", &c.at, duration))
            .collect::<Result<Vec<_>, _>>()?;
        let min_dwell = parse_duration("policy.minDwell", &self.policy.min_dwell)?;
        let objective = parse_duration("policy.recoveryObjective", &self.policy.recovery_objective)?;
        if objective.is_zero() {
            return Err(invalid("policy.recoveryObjective", "must be more than 0s"));
        }
        // A hang's detection, as the operator counts it (`ValidatedPolicy::detection`).
        let detection = interval * self.policy.promote_after + timeout;
        let promotion_deadline = promotion_deadline(objective, detection, interval);
        let drain_for = parse_duration("policy.drainFor", &self.policy.drain_for)?;
        if drain_for > MAX_DURATION {
            return Err(invalid("policy.drainFor", "must be at most 10m"));
        }
        if let Some(fraction) = self.policy.min_serving_fraction
            && !(fraction > 0.0 && fraction <= 1.0)
        {
            return Err(invalid(
                "policy.minServingFraction",
                "must be more than 0 and at most 1",
            ));
        }
        if let Failback::Automatic { healthy_checks: 0 } = self.policy.failback {
            return Err(invalid("policy.failback.healthyChecks", "must be at least 1"));
        }
        let grant = self.policy.grant.timing()?;
        let load_proof = self
            .load_proof
            .as_ref()
            .map(|p| check_load_proof(p, duration))
            .transpose()?;
        if self.expect.load_proven.is_some() && load_proof.is_none() {
            return Err(invalid("expect.loadProven", "the scenario runs no load proof"));
        }
        let rollout = self
            .rollout
            .as_ref()
            .map(|r| self.check_rollout(r, duration))
            .transpose()?;
        if self.expect.rollout.is_some() && rollout.is_none() {
            return Err(invalid("expect.rollout", "the scenario sets no new version"));
        }
        if self
            .expect
            .rollout
            .is_some_and(|phase| !matches!(phase, RolloutPhase::UpToDate | RolloutPhase::Stopped))
        {
            return Err(invalid(
                "expect.rollout",
                "a rollout ends UpToDate (the primary rolled) or Stopped (it never will)",
            ));
        }
        Ok(Checked {
            scenario: self,
            duration,
            interval,
            timeout,
            fault_times,
            fault_ends,
            command_times,
            min_dwell,
            promotion_deadline,
            drain_for,
            eject_for,
            grant,
            load_proof,
            rollout,
        })
    }

    /// A rollout replaces emulated replicas in place, a standby's hot ones only: putting a warm
    /// replica back to sleep and growing a pilot light at a new version are not built here.
    fn check_rollout(
        &self,
        rollout: &LocalRollout,
        duration: Duration,
    ) -> Result<CheckedRollout, ScenarioError> {
        let at = within("rollout.at", &rollout.at, duration)?;
        if rollout.args.is_empty() {
            return Err(invalid("rollout.args", "name the new version's serving flags"));
        }
        if self.topology != Topology::ActivePassive {
            return Err(invalid(
                "rollout",
                "a standby-first rollout needs a standby: active-passive",
            ));
        }
        let b = &self.pools.b;
        if b.warm > 0 || b.pilot_light > 0 {
            return Err(invalid(
                "rollout",
                "the local game day rolls hot replicas only: pool b has no warm or pilot-light tier here",
            ));
        }
        if self.pools.a.engine == Engine::Vllm || b.engine == Engine::Vllm {
            return Err(invalid(
                "rollout",
                "the local game day rolls emulated replicas only",
            ));
        }
        // A replica being replaced is out of the run's list of replicas, where faults and
        // commands find theirs.
        if !self.faults.is_empty() || !self.commands.is_empty() {
            return Err(invalid(
                "rollout",
                "a rollout runs without faults or commands here",
            ));
        }
        Ok(CheckedRollout {
            at,
            args: rollout.args.clone(),
        })
    }

    /// Each pool's size, and the standby's tiers: only the standby sleeps or waits unstarted,
    /// and only when its pool is a standby at all (active-passive).
    fn check_pools(&self) -> Result<(), ScenarioError> {
        for (field, pool) in [
            ("pools.a.replicas", &self.pools.a),
            ("pools.b.replicas", &self.pools.b),
        ] {
            if pool.replicas == 0 || pool.replicas > MAX_REPLICAS {
                return Err(invalid(field, format!("must be 1 to {MAX_REPLICAS}")));
            }
        }
        if self.pools.a.warm > 0 || self.pools.a.pilot_light > 0 {
            return Err(invalid(
                "pools.a",
                "the home primary serves awake and whole: warm and pilot-light tiers belong to the standby, pool b",
            ));
        }
        let b = &self.pools.b;
        if (b.warm > 0 || b.pilot_light > 0) && self.topology == Topology::ActiveActive {
            return Err(invalid(
                "pools.b",
                "active-active serves every replica: none may sleep or wait unstarted",
            ));
        }
        if b.warm + b.pilot_light > b.replicas || !(1..=2).contains(&b.sleep_level) {
            return Err(invalid(
                "pools.b",
                "warm and pilotLight together must be at most replicas, and sleepLevel 1 or 2",
            ));
        }
        if b.engine == Engine::Vllm && b.pilot_light > 0 {
            return Err(invalid(
                "pools.b",
                "a pilot light of real vLLM servers is not built yet",
            ));
        }
        let real = [("pools.a", &self.pools.a), ("pools.b", b)]
            .into_iter()
            .find(|(_, pool)| pool.engine == Engine::Vllm);
        if let Some((field, _)) = real
            && b.warm > 0
        {
            // A warm tier starts both pools with sleep mode (either may sleep after a failback).
            return Err(invalid(
                field,
                "vLLM's CPU build has no sleep mode, which a warm tier needs: with `engine: vllm`, \
                 pool b has no warm replicas",
            ));
        }
        for fault in &self.faults {
            let real = |pool: &PoolShape| pool.engine == Engine::Vllm;
            let struck_real = match fault.pool {
                Some(PoolName::A) => real(&self.pools.a),
                Some(PoolName::B) => real(&self.pools.b),
                None => real(&self.pools.a) || real(&self.pools.b),
            };
            let by_signal = matches!(
                fault.fault,
                FaultKind::Crash
                    | FaultKind::Hang
                    | FaultKind::HangEngine
                    | FaultKind::LostLease
                    | FaultKind::Partition
            );
            if struck_real && !by_signal {
                return Err(invalid(
                    "faults[].fault",
                    format!(
                        "{} needs the emulator's fault port; a real vLLM pool takes crash, hang, hang-engine and partition",
                        fault.fault.as_str()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// When each fault strikes, and when it ends where it does.
    fn fault_times(
        &self,
        duration: Duration,
    ) -> Result<(Vec<Duration>, Vec<Option<Duration>>), ScenarioError> {
        let mut fault_times = Vec::with_capacity(self.faults.len());
        let mut fault_ends = Vec::with_capacity(self.faults.len());
        for fault in &self.faults {
            let at = within("faults[].at", &fault.at, duration)?;
            fault_times.push(at);
            let end = match &fault.lasts {
                None => None,
                Some(_) if fault.fault == FaultKind::Crash => {
                    return Err(invalid(
                        "faults[].for",
                        "a crashed replica does not come back: a crash lasts to the end",
                    ));
                }
                Some(text) => Some(at + parse_duration("faults[].for", text)?),
            };
            fault_ends.push(end);
        }
        Ok((fault_times, fault_ends))
    }
}

/// The load's rate and shares: each share a fraction, the priorities' together too.
fn check_load_mix(load: &Load) -> Result<(), ScenarioError> {
    if !(load.rate > 0.0 && load.rate <= 2_000.0) {
        return Err(invalid("load.rate", "must be more than 0 and at most 2000"));
    }
    for (field, share) in [
        ("load.streamShare", load.stream_share),
        ("load.sharedPrefixShare", load.shared_prefix_share),
        ("load.priorities.interactive", load.priorities.interactive),
        ("load.priorities.batch", load.priorities.batch),
    ] {
        if !(0.0..=1.0).contains(&share) {
            return Err(invalid(field, "must be between 0 and 1"));
        }
    }
    if load.priorities.interactive + load.priorities.batch > 1.0 {
        return Err(invalid(
            "load.priorities",
            "interactive and batch together must be at most 1",
        ));
    }
    Ok(())
}

/// The routers' settings; how long they leave a failed endpoint out, when the scenario says.
fn check_router(router: &RouterShape) -> Result<Option<Duration>, ScenarioError> {
    let eject_for = match &router.eject_for {
        Some(text) => Some(parse_duration("router.ejectFor", text)?),
        None => None,
    };
    if let Some(admission) = &router.admission {
        parse_duration("router.admission.window", &admission.window)?;
        if admission.initial_concurrency == 0
            || admission
                .max_concurrency
                .is_some_and(|m| m < admission.initial_concurrency)
        {
            return Err(invalid(
                "router.admission",
                "initialConcurrency must be at least 1 and maxConcurrency not below it",
            ));
        }
    }
    Ok(eject_for)
}

/// The ranges the load draws its requests' lengths from.
fn check_load_lengths(load: &Load) -> Result<(), ScenarioError> {
    for (field, [low, high]) in [
        ("load.maxTokens", load.max_tokens),
        ("load.promptWords", load.prompt_words),
    ] {
        if low == 0 || low > high || high > 4_096 {
            return Err(invalid(field, "must be [min, max] with 1 <= min <= max <= 4096"));
        }
    }
    Ok(())
}

/// A time into the run, which must fall within its duration.
fn within(field: &'static str, text: &str, duration: Duration) -> Result<Duration, ScenarioError> {
    let at = parse_duration(field, text)?;
    if at >= duration {
        return Err(invalid(field, format!("{text} is not within the run's duration")));
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_default_scenario_is_valid_and_crashes_its_primary() {
        let checked = Scenario::parse(DEFAULT).unwrap();
        assert_eq!(checked.scenario.faults[0].fault, FaultKind::Crash);
        assert!(checked.fault_times[0] < checked.duration);
    }

    #[test]
    fn a_misspelled_field_is_refused_by_its_name() {
        let text = DEFAULT.replace("rate:", "rat:");
        let error = Scenario::parse(&text).unwrap_err().to_string();
        assert!(error.contains("rat"), "{error}");
    }

    #[test]
    fn a_fault_after_the_end_and_an_absurd_duration_are_refused() {
        let late = DEFAULT.replace("at: 10s", "at: 10m");
        assert!(matches!(
            Scenario::parse(&late),
            Err(ScenarioError::Invalid {
                field: "faults[].at",
                ..
            })
        ));
        let long = DEFAULT.replace("duration: 30s", "duration: 2562047788015215h");
        assert!(Scenario::parse(&long).is_err());
    }

    #[test]
    fn each_run_replaces_whole_sections_and_keeps_the_rest() {
        let text = format!(
            "{DEFAULT}runs:\n  - name: baseline\n    router: {{retries: false}}\n    topology: active-active\n  - name: ours\n"
        );
        let plan = Scenario::plan(&text).unwrap();
        assert_eq!(plan.name, "crashed-primary-hot-standby");
        let [baseline, ours] = &plan.runs[..] else {
            panic!("two runs expected")
        };
        assert_eq!(baseline.scenario.name, "baseline");
        assert!(!baseline.scenario.router.retries);
        // A section given replaces the scenario's whole, with its own defaults.
        assert!(baseline.scenario.router.waiting_room);
        assert_eq!(baseline.scenario.topology, Topology::ActiveActive);
        assert_eq!(ours.scenario.topology, Topology::ActivePassive);
        assert!(ours.scenario.router.retries);
        assert_eq!(ours.scenario.load, baseline.scenario.load);
        // A scenario of several runs is not one run.
        assert!(Scenario::parse(&text).is_err());
    }

    #[test]
    fn a_misplaced_field_in_a_run_and_shares_over_one_are_refused() {
        let misplaced = format!("{DEFAULT}runs:\n  - name: x\n    rate: 5\n");
        let error = Scenario::plan(&misplaced).unwrap_err().to_string();
        assert!(error.contains("rate"), "{error}");
        let shares = DEFAULT.replace(
            "sharedPrefixShare: 0.3",
            "sharedPrefixShare: 0.3\n  priorities: {interactive: 0.7, batch: 0.5}",
        );
        assert!(matches!(
            Scenario::parse(&shares),
            Err(ScenarioError::Invalid {
                field: "load.priorities",
                ..
            })
        ));
        let window = DEFAULT.replace(
            "policy:",
            "router: {admission: {window: soon, initialConcurrency: 2}}\npolicy:",
        );
        assert!(matches!(
            Scenario::parse(&window),
            Err(ScenarioError::Invalid {
                field: "router.admission.window",
                ..
            })
        ));
    }

    #[test]
    fn a_load_proof_must_end_within_the_run_and_its_expectation_needs_one() {
        let with = |proof: &str| DEFAULT.replace("faults:", &format!("loadProof: {proof}\nfaults:"));
        let checked = Scenario::parse(&with(
            "{at: 5s, duration: 4s, rateShare: 0.5, ttftP99: 1s, itlP99: 200ms}",
        ))
        .unwrap();
        let proof = checked.load_proof.unwrap();
        assert_eq!(
            (proof.at, proof.duration, proof.rate_share),
            (Duration::from_secs(5), Duration::from_secs(4), 0.5)
        );
        assert_eq!(proof.thresholds.max_error_rate, 0.01);
        for (proof, field) in [
            (
                "{at: 28s, duration: 4s, ttftP99: 1s, itlP99: 200ms}",
                "loadProof.duration",
            ),
            (
                "{at: 40s, duration: 1s, ttftP99: 1s, itlP99: 200ms}",
                "loadProof.at",
            ),
            (
                "{at: 5s, duration: 4s, rateShare: 0, ttftP99: 1s, itlP99: 200ms}",
                "loadProof.rateShare",
            ),
            (
                "{at: 5s, duration: 4s, ttftP99: soon, itlP99: 200ms}",
                "loadProof.ttftP99",
            ),
        ] {
            assert_eq!(refusal(&with(proof)).0, field, "{proof}");
        }
        let expected = DEFAULT.replace("failovers: 1", "failovers: 1\n  loadProven: true");
        assert_eq!(refusal(&expected).0, "expect.loadProven");
    }

    #[test]
    fn tiers_belong_to_the_standby_and_a_standby_keeps_one_replica_running() {
        let text = DEFAULT.replace(
            "a: {replicas: 2}\n  b: {replicas: 2}",
            "a: {replicas: 2}\n  b: {replicas: 2, pilotLight: 2}",
        );
        let all_pilot = Scenario::parse(&text).unwrap();
        assert_eq!(all_pilot.scenario.pools.b.pilot_light, 1, "one kept running, hot");
        for (shapes, field) in [
            ("a: {replicas: 2, warm: 1}\n  b: {replicas: 2}", "pools.a"),
            (
                "a: {replicas: 2}\n  b: {replicas: 3, warm: 2, pilotLight: 2}",
                "pools.b",
            ),
            (
                "a: {replicas: 2}\n  b: {replicas: 2, warm: 1, sleepLevel: 3}",
                "pools.b",
            ),
        ] {
            let text = DEFAULT.replace("a: {replicas: 2}\n  b: {replicas: 2}", shapes);
            assert_eq!(refusal(&text).0, field, "{shapes}");
        }
    }

    #[test]
    fn a_crash_cannot_last_a_while_and_failback_reads_in_the_policys_terms() {
        let crash = DEFAULT.replace("fault: crash, pool: a}", "fault: crash, pool: a, for: 2s}");
        assert!(matches!(
            Scenario::parse(&crash),
            Err(ScenarioError::Invalid {
                field: "faults[].for",
                ..
            })
        ));
        let automatic = DEFAULT.replace(
            "standbyReadyAfter: 2",
            "standbyReadyAfter: 2\n  failback: {mode: automatic, healthyChecks: 3}\n  minDwell: 5s",
        );
        let checked = Scenario::parse(&automatic).unwrap();
        assert_eq!(
            checked.scenario.policy.failback,
            Failback::Automatic { healthy_checks: 3 }
        );
        assert_eq!(checked.min_dwell, Duration::from_secs(5));
        let misspelled = automatic.replace("healthyChecks", "healthy");
        assert!(Scenario::parse(&misspelled).is_err());
    }

    #[test]
    fn the_serving_share_and_the_objective_read_in_the_policys_terms_and_give_the_deadline() {
        let with = |extra: &str| {
            DEFAULT.replace(
                "standbyReadyAfter: 2",
                &format!("standbyReadyAfter: 2\n  {extra}"),
            )
        };
        let checked = Scenario::parse(&with("minServingFraction: 0.5\n  recoveryObjective: 10s")).unwrap();
        assert_eq!(checked.scenario.policy.min_serving_fraction, Some(0.5));
        // 10 s less a hang's detection: promoteAfter rounds and one timeout.
        let detection = checked.interval * checked.scenario.policy.promote_after + checked.timeout;
        assert_eq!(checked.promotion_deadline, Duration::from_secs(10) - detection);
        for (extra, field) in [
            ("minServingFraction: 0", "policy.minServingFraction"),
            ("minServingFraction: 1.5", "policy.minServingFraction"),
            ("recoveryObjective: 0s", "policy.recoveryObjective"),
            ("recoveryObjective: soon", "policy.recoveryObjective"),
        ] {
            match Scenario::parse(&with(extra)) {
                Err(ScenarioError::Invalid { field: got, .. }) => assert_eq!(got, field, "{extra}"),
                other => panic!("{extra}: {other:?}"),
            }
        }
    }

    #[test]
    fn every_example_scenario_is_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gamedays/local");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            if let Err(e) = Scenario::plan(&text) {
                panic!("{}: {e}", path.display());
            }
            seen += 1;
        }
        assert!(seen >= 7, "{seen} scenarios");
    }

    /// The field and message a scenario is refused with.
    fn refusal(text: &str) -> (&'static str, String) {
        match Scenario::parse(text) {
            Err(ScenarioError::Invalid { field, message }) => (field, message),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn a_rollout_needs_new_flags_a_hot_emulated_standby_and_a_time_within_the_run() {
        let crash = "faults:\n  - {at: 10s, fault: crash, pool: a}\n";
        let with = |rollout: &str| DEFAULT.replace(crash, &format!("rollout: {rollout}\n"));
        let checked = Scenario::parse(&with("{at: 5s, args: [--max-num-seqs, \"64\"]}")).unwrap();
        let rollout = checked.rollout.unwrap();
        assert_eq!((rollout.at, rollout.args.len()), (Duration::from_secs(5), 2));
        assert_eq!(refusal(&with("{at: 5s, args: []}")).0, "rollout.args");
        assert_eq!(refusal(&with("{at: 40s, args: [--x]}")).0, "rollout.at");
        let warm = with("{at: 5s, args: [--x]}").replace("b: {replicas: 2}", "b: {replicas: 2, warm: 1}");
        let (field, message) = refusal(&warm);
        assert_eq!(field, "rollout");
        assert!(message.contains("hot replicas only"), "{message}");
        let active = format!("{}topology: active-active\n", with("{at: 5s, args: [--x]}"));
        assert_eq!(refusal(&active).0, "rollout");
        let (field, _) = refusal(&DEFAULT.replace("maxFailedSentAfterFault: 0", "rollout: Stopped"));
        assert_eq!(field, "expect.rollout");
        let holding = with("{at: 5s, args: [--x]}").replace("maxFailedSentAfterFault: 0", "rollout: Holding");
        assert_eq!(refusal(&holding).0, "expect.rollout");
        let faulted = DEFAULT.replace(crash, &format!("rollout: {{at: 5s, args: [--x]}}\n{crash}"));
        let (field, message) = refusal(&faulted);
        assert_eq!(field, "rollout");
        assert!(message.contains("without faults"), "{message}");
    }

    #[test]
    fn a_real_vllm_pool_serves_hot_and_takes_only_the_faults_signals_make() {
        for (pools, field) in [
            (
                "  a: {replicas: 2}\n  b: {replicas: 2, engine: vllm, warm: 1}",
                "pools.b",
            ),
            (
                "  a: {replicas: 2, engine: vllm}\n  b: {replicas: 2, warm: 1}",
                "pools.a",
            ),
        ] {
            let real = DEFAULT.replace("  a: {replicas: 2}\n  b: {replicas: 2}", pools);
            let (got, message) = refusal(&real);
            assert_eq!(got, field);
            assert!(message.contains("no sleep mode"), "{message}");
        }
        let half_failed = DEFAULT
            .replace("  a: {replicas: 2}", "  a: {replicas: 2, engine: vllm}")
            .replace("fault: crash", "fault: half-failed");
        let (field, message) = refusal(&half_failed);
        assert_eq!(field, "faults[].fault");
        assert!(message.contains("half-failed"), "{message}");
        let hung = DEFAULT
            .replace("  a: {replicas: 2}", "  a: {replicas: 2, engine: vllm}")
            .replace("fault: crash", "fault: hang-engine");
        let checked = Scenario::parse(&hung).unwrap();
        assert_eq!(checked.scenario.pools.a.engine, Engine::Vllm);
        assert_eq!(checked.scenario.faults[0].fault, FaultKind::HangEngine);
    }
}

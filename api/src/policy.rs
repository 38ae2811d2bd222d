//! A FailoverPolicy's spec, checked and converted into what the failover state machine runs on.
//!
//! The CRD schema refuses nonsense at `kubectl apply`, but the operator also reads objects stored
//! before a rule existed, so [`validate`] repeats every schema rule here, in Rust, with a message
//! naming the field as the user wrote it. Everything here is pure: no Kubernetes client, no clock.
//! It must never guess: a spec it cannot read exactly is an error, not a default.

use std::time::Duration;

use understudy_core::{
    Pool,
    duration::ParseDurationError,
    failover::{ConfigError, FailbackPolicy, FailoverConfig},
    load_proof::{self, Thresholds},
    recovery::StageTimes,
};

use crate::crd::{
    ExpectMode, FailbackMode, FailoverPolicySpec, GoDuration, LoadProofSpec, RolloutMode, RouteTargetSpec,
    Tier, WorkloadKind,
};
use crate::grant::{GrantTiming, InvalidTiming};

/// Why a spec cannot be run. Each message starts with the field's path in the object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("spec.pools must list exactly 2 pools, found {found}")]
    PoolCount { found: usize },
    #[error(
        "{field} {value:?} must be a DNS label: lower-case letters, digits and '-', starting and ending \
         with a letter or digit, at most 63 characters"
    )]
    NotDnsLabel { field: String, value: String },
    #[error("{field} {value:?} must be a Kubernetes object name (RFC 1123 subdomain)")]
    NotObjectName { field: String, value: String },
    #[error("spec.pools: the two pools must have different names, both are {name:?}")]
    SamePoolName { name: String },
    #[error(
        "spec.pools: two pools name the same workload ({kind:?} {name:?}) in the same cluster: each pool must run its own replicas"
    )]
    SameWorkload { kind: WorkloadKind, name: String },
    #[error("{field} must be between {min} and {max}, is {value}")]
    OutOfRange {
        field: String,
        value: u64,
        min: u64,
        max: u64,
    },
    #[error("{field} must have at most {max} entries, has {len}")]
    TooMany { field: String, len: usize, max: usize },
    #[error("{field} must be between {min} and {max} characters long, is {len}")]
    Length {
        field: String,
        len: usize,
        min: usize,
        max: usize,
    },
    #[error(
        "spec.pools[{pool}].standby: tier replicas add up to {sum}, but the pool has {replicas} replicas"
    )]
    TierReplicasDoNotSum { pool: usize, sum: u64, replicas: u32 },
    #[error("spec.pools[{pool}].standby[{group}].sleepLevel applies only to the warm tier")]
    SleepLevelNotWarm { pool: usize, group: usize },
    #[error("spec.pools[{pool}].standby[{group}].reserveGpus applies only to the pilotLight tier")]
    ReserveGpusNotPilotLight { pool: usize, group: usize },
    #[error(
        "spec.pools[{pool}].standby[{group}].reserveGpus: GPUs are reserved only in the operator's own cluster, \
         and this pool lives in cluster {cluster:?}"
    )]
    ReserveGpusElsewhere {
        pool: usize,
        group: usize,
        cluster: String,
    },
    // The parse error is in the message, which status shows whole; it is not also a `source`,
    // or an error chain would print it twice.
    #[error("{field}: {error}")]
    Duration {
        field: &'static str,
        error: ParseDurationError,
    },
    #[error("{field} must be greater than zero")]
    ZeroDuration { field: &'static str },
    #[error("spec.grants: {0}")]
    Grants(#[from] InvalidTiming),
    #[error("spec.probe.timeout ({timeout}) must be shorter than spec.probe.interval ({interval})")]
    TimeoutNotShorterThanInterval {
        timeout: GoDuration,
        interval: GoDuration,
    },
    #[error("spec.probe.budgets.total ({total}) must not be longer than spec.probe.timeout ({timeout})")]
    TotalBudgetOverTimeout { total: GoDuration, timeout: GoDuration },
    #[error(
        "spec.probe.budgets.firstToken ({first_token}) must not be longer than spec.probe.budgets.total ({total})"
    )]
    FirstTokenBudgetOverTotal {
        first_token: GoDuration,
        total: GoDuration,
    },
    #[error(
        "spec.rollout: standbyFirst holds a Deployment or a StatefulSet, and spec.pools[{pool}] runs a LeaderWorkerSet"
    )]
    RolloutCannotHold { pool: usize },
    #[error("spec.route: {0}")]
    RouteTarget(String),
    #[error("spec.probe.expect.value is required when mode is regex")]
    RegexWithoutValue,
    #[error("spec.probe.expect.value is not a valid regex: {0}")]
    InvalidRegex(String),
    #[error("spec.probe.expect.value is not used when mode is nonEmpty")]
    ValueWithNonEmpty,
    #[error(
        "spec.trigger.promoteAfter ({promote_after}) must not be below spec.trigger.suspectAfter ({suspect_after})"
    )]
    PromoteAfterBelowSuspectAfter { suspect_after: u32, promote_after: u32 },
    #[error(
        "spec.trigger.hardFailure.promoteAfter ({hard}) must not be above spec.trigger.promoteAfter ({promote_after})"
    )]
    HardPromoteAfterAboveSoft { hard: u32, promote_after: u32 },
    #[error("spec.failback.healthyFor is required when mode is automatic")]
    HealthyForMissing,
    #[error("spec.failback.healthyFor ({healthy_for}) is more probe intervals than can be counted")]
    HealthyForTooLong { healthy_for: GoDuration },
    #[error("spec.parity.ignoreFlags[{index}] {flag:?} must be a command-line flag, such as --port")]
    NotAFlag { index: usize, flag: String },
    #[error(
        "spec.admission.maxConcurrency ({max}) must not be below spec.admission.initialConcurrency ({initial})"
    )]
    MaxConcurrencyBelowInitial { initial: u32, max: u32 },
    #[error("spec.admission.priorityHeader {0:?} must be an HTTP header name: letters, digits and '-'")]
    NotAHeaderName(String),
    #[error("{field}.every ({every}) must be at least a minute: a proof wakes a replica")]
    ProofTooOften { field: &'static str, every: GoDuration },
    #[error("{field}.notBetween[{index}] {text:?} must be a UTC window such as 08:00-20:00")]
    NotAWindow {
        field: &'static str,
        index: usize,
        text: String,
    },
    #[error("{field} {value} must be {range}")]
    NotInRange {
        field: &'static str,
        value: String,
        range: &'static str,
    },
    #[error("spec.minServingFraction {0} must be above 0 and at most 1")]
    ServingFraction(String),
    #[error("spec.coldStartEstimates.{stage}: {error}")]
    Estimate {
        stage: &'static str,
        error: ParseDurationError,
    },
    /// A rule of the state machine's own that the checks above did not catch.
    #[error("the state machine refuses this policy: {0}")]
    Config(#[from] ConfigError),
}

/// Probe timing, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeTiming {
    pub interval: Duration,
    pub timeout: Duration,
    pub first_token_budget: Duration,
    pub total_budget: Duration,
}

/// A spec that passed every check, with its durations parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedPolicy {
    /// What the failover state machine runs on.
    pub failover: FailoverConfig,
    pub probe: ProbeTiming,
    pub recovery_objective: Duration,
    /// Zero when admission control after promotion is off.
    pub admission_window: Duration,
    /// `spec.minServingFraction`, when given.
    pub min_serving_fraction: Option<f64>,
    /// `spec.coldStartEstimates`, parsed; empty when none are given.
    pub estimates: StageTimes,
    /// `spec.standbyProof`, parsed.
    pub standby_proof: Option<StandbyProof>,
    /// `spec.loadProof`, parsed.
    pub load_proof: Option<LoadProof>,
    /// `spec.stream.drainFor`: how long a planned move lets the old primary's streams finish.
    pub drain_for: Duration,
    /// How the fences' serving grants are timed.
    pub grants: GrantTiming,
}

/// How long a planned move lets the old primary's streams finish when the policy does not say:
/// most answers end within it, and the old primary's GPUs are held only that much longer.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(60);

impl ValidatedPolicy {
    /// The longest a failed primary goes unnoticed, whatever the failure: a hung one (every probe
    /// times out, a soft failure) is replaced after `promoteAfter` failed rounds, each a probe
    /// interval, and one probe timeout for the round in flight when it hung. A crash is seen
    /// sooner ([`Self::crash_detection`]); the objective is judged by the slower.
    #[must_use]
    pub fn detection(&self) -> Duration {
        self.probe.interval * self.failover.promote_after + self.probe.timeout
    }

    /// How long a promotion may take from its start before its steps stop waiting for all they
    /// want ([`understudy_core::drive::promotion_deadline`]): the recovery objective less a hang's
    /// detection, at least one probe interval.
    #[must_use]
    pub fn promotion_deadline(&self) -> Duration {
        understudy_core::drive::promotion_deadline(
            self.recovery_objective,
            self.detection(),
            self.probe.interval,
        )
    }

    /// The longest a crashed primary (refused connections, 5xx, a dead engine) goes unnoticed:
    /// its failed rounds count as hard failures and as failures, so it is replaced at whichever
    /// count comes first, `hardFailure.promoteAfter` or `promoteAfter`, plus one probe timeout.
    #[must_use]
    pub fn crash_detection(&self) -> Duration {
        let rounds = self.failover.hard_promote_after.min(self.failover.promote_after);
        self.probe.interval * rounds + self.probe.timeout
    }
}

/// Checks every rule of the schema and of the state machine, and converts the spec.
pub fn validate(spec: &FailoverPolicySpec) -> Result<ValidatedPolicy, PolicyError> {
    check_pools(spec)?;
    let recovery_objective = positive("spec.recoveryObjective", &spec.recovery_objective)?;
    let probe = check_probe(spec)?;
    let trigger = &spec.trigger;
    for (field, value) in [
        ("spec.trigger.suspectAfter", trigger.suspect_after),
        ("spec.trigger.promoteAfter", trigger.promote_after),
        (
            "spec.trigger.hardFailure.promoteAfter",
            trigger.hard_failure.promote_after,
        ),
        ("spec.trigger.standbyReadyAfter", trigger.standby_ready_after),
    ] {
        in_range(field, value, 1, 1000)?;
    }
    if trigger.promote_after < trigger.suspect_after {
        return Err(PolicyError::PromoteAfterBelowSuspectAfter {
            suspect_after: trigger.suspect_after,
            promote_after: trigger.promote_after,
        });
    }
    if trigger.hard_failure.promote_after > trigger.promote_after {
        return Err(PolicyError::HardPromoteAfterAboveSoft {
            hard: trigger.hard_failure.promote_after,
            promote_after: trigger.promote_after,
        });
    }
    let min_dwell = parse("spec.trigger.minDwell", &trigger.min_dwell)?;
    let failback = check_failback(spec, probe.interval)?;
    check_parity(spec)?;
    let admission_window = check_admission(spec)?;
    let drain_for = match &spec.stream.drain_for {
        Some(text) => parse("spec.stream.drainFor", text)?,
        None => DEFAULT_DRAIN,
    };
    // Longer than an hour holds an old primary's GPUs for no stream a client still waits on.
    in_range("spec.stream.drainFor (seconds)", drain_for.as_secs(), 0, 3600)?;
    if let Some(fraction) = spec.min_serving_fraction
        && !(fraction > 0.0 && fraction <= 1.0)
    {
        return Err(PolicyError::ServingFraction(fraction.to_string()));
    }
    let grants = check_grants(spec)?;
    let estimates = estimates(spec)?;
    let standby_proof = match &spec.standby_proof {
        Some(proof) => Some(check_schedule(
            ("spec.standbyProof", "spec.standbyProof.every"),
            &proof.every,
            &proof.not_between,
        )?),
        None => None,
    };
    let load_proof = match &spec.load_proof {
        Some(proof) => Some(check_load_proof(proof)?),
        None => None,
    };
    if spec.rollout == RolloutMode::StandbyFirst
        && let Some(pool) = spec
            .pools
            .iter()
            .position(|pool| pool.workload.kind == WorkloadKind::LeaderWorkerSet)
    {
        return Err(PolicyError::RolloutCannotHold { pool });
    }
    if let Some(route) = &spec.route {
        check_route_target(spec, route).map_err(PolicyError::RouteTarget)?;
    }

    let failover = FailoverConfig {
        suspect_after: trigger.suspect_after,
        promote_after: trigger.promote_after,
        hard_promote_after: trigger.hard_failure.promote_after,
        standby_ready_after: trigger.standby_ready_after,
        min_dwell,
        failback,
        paused: spec.paused,
    };
    failover.check()?;
    Ok(ValidatedPolicy {
        failover,
        probe,
        recovery_objective,
        admission_window,
        drain_for,
        min_serving_fraction: spec.min_serving_fraction,
        estimates,
        standby_proof,
        load_proof,
        grants,
    })
}

/// The grants' timing from `spec.grants`, defaults filled in, checked against the bounds its
/// arithmetic rests on.
fn check_grants(spec: &FailoverPolicySpec) -> Result<GrantTiming, PolicyError> {
    let defaults = GrantTiming::default();
    let grants = &spec.grants;
    let read = |field, value: &Option<GoDuration>, default| match value {
        Some(text) => parse(field, text),
        None => Ok(default),
    };
    let renew_every = read(
        "spec.grants.renewEvery",
        &grants.renew_every,
        defaults.renew_every,
    )?;
    let timing = GrantTiming {
        ttl: read("spec.grants.ttl", &grants.ttl, defaults.ttl)?,
        renew_every,
        skew: read("spec.grants.clockSkew", &grants.clock_skew, defaults.skew)?,
        // A push to a fence answers within a renewal period, and within a second.
        push_timeout: renew_every.min(defaults.push_timeout),
    };
    timing.check().map_err(PolicyError::Grants)?;
    Ok(timing)
}

/// A proof's `every` and `notBetween` under `field`, parsed.
fn check_schedule(
    (field, every_field): (&'static str, &'static str),
    every_text: &GoDuration,
    not_between: &[String],
) -> Result<StandbyProof, PolicyError> {
    let every = parse(every_field, every_text)?;
    if every < Duration::from_secs(60) {
        return Err(PolicyError::ProofTooOften {
            field,
            every: every_text.clone(),
        });
    }
    let not_between = not_between
        .iter()
        .enumerate()
        .map(|(index, text)| {
            UtcWindow::parse(text).ok_or_else(|| PolicyError::NotAWindow {
                field,
                index,
                text: text.clone(),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(StandbyProof { every, not_between })
}

/// `spec.loadProof`, parsed.
fn check_load_proof(proof: &LoadProofSpec) -> Result<LoadProof, PolicyError> {
    let schedule = check_schedule(
        ("spec.loadProof", "spec.loadProof.every"),
        &proof.every,
        &proof.not_between,
    )?;
    let duration = positive("spec.loadProof.duration", &proof.duration)?;
    in_range("spec.loadProof.duration (seconds)", duration.as_secs(), 1, 600)?;
    if !load_proof::valid_share(proof.rate_share) {
        return Err(PolicyError::NotInRange {
            field: "spec.loadProof.rateShare",
            value: proof.rate_share.to_string(),
            range: "above 0 and at most 4",
        });
    }
    if !load_proof::valid_error_rate(proof.max_error_rate) {
        return Err(PolicyError::NotInRange {
            field: "spec.loadProof.maxErrorRate",
            value: proof.max_error_rate.to_string(),
            range: "between 0 and 1",
        });
    }
    Ok(LoadProof {
        schedule,
        duration,
        rate_share: proof.rate_share,
        thresholds: Thresholds {
            max_error_rate: proof.max_error_rate,
            ttft_p99: positive("spec.loadProof.ttftP99", &proof.ttft_p99)?,
            itl_p99: positive("spec.loadProof.itlP99", &proof.itl_p99)?,
        },
        blocks_promotion: proof.blocks_promotion,
    })
}

/// `spec.loadProof`, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadProof {
    /// How often, and when not.
    pub schedule: StandbyProof,
    /// How long each replay runs.
    pub duration: Duration,
    /// The share of the primary's recorded rate replayed.
    pub rate_share: f64,
    pub thresholds: Thresholds,
    pub blocks_promotion: bool,
}

/// `spec.standbyProof`: how often, and when not (a load proof's schedule too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StandbyProof {
    pub every: Duration,
    pub not_between: Vec<UtcWindow>,
}

impl StandbyProof {
    /// Whether a proof may start at `since_epoch` (time since the Unix epoch, UTC).
    #[must_use]
    pub fn allowed_at(&self, since_epoch: Duration) -> bool {
        let minute = u32::try_from(since_epoch.as_secs() / 60 % (24 * 60)).unwrap_or(0);
        !self.not_between.iter().any(|window| window.contains(minute))
    }
}

/// A window of the UTC day, in minutes since midnight; it wraps past midnight when it ends
/// before it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UtcWindow {
    pub from: u32,
    pub to: u32,
}

impl UtcWindow {
    /// `HH:MM-HH:MM`.
    #[must_use]
    pub fn parse(text: &str) -> Option<UtcWindow> {
        let minute = |hm: &str| {
            let (h, m) = hm.trim().split_once(':')?;
            let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
            (h < 24 && m < 60).then_some(h * 60 + m)
        };
        let (from, to) = text.split_once('-')?;
        Some(UtcWindow {
            from: minute(from)?,
            to: minute(to)?,
        })
    }

    /// Whether `minute` of the day falls inside.
    #[must_use]
    pub fn contains(&self, minute: u32) -> bool {
        if self.from <= self.to {
            (self.from..self.to).contains(&minute)
        } else {
            minute >= self.from || minute < self.to
        }
    }
}

/// `spec.coldStartEstimates`, parsed.
fn estimates(spec: &FailoverPolicySpec) -> Result<StageTimes, PolicyError> {
    let mut times = StageTimes::new();
    let Some(estimates) = &spec.cold_start_estimates else {
        return Ok(times);
    };
    for (stage, text) in estimates.entries() {
        if let Some(text) = text {
            let duration = text.parse().map_err(|error| PolicyError::Estimate {
                stage: stage.as_str(),
                error,
            })?;
            times.set(stage, duration);
        }
    }
    Ok(times)
}

/// The state machine's configuration for this spec: [`validate`], keeping only that part.
pub fn failover_config(spec: &FailoverPolicySpec) -> Result<FailoverConfig, PolicyError> {
    validate(spec).map(|policy| policy.failover)
}

/// The name the user gave `pool`: the first listed pool is [`Pool::A`], the second [`Pool::B`].
///
/// Empty for a spec with fewer than two pools, which [`validate`] refuses.
#[must_use]
pub fn pool_name(spec: &FailoverPolicySpec, pool: Pool) -> &str {
    spec.pools.get(pool.index()).map_or("", |p| p.name.as_str())
}

/// Which pool carries `name`, if either does.
#[must_use]
pub fn pool_by_name(spec: &FailoverPolicySpec, name: &str) -> Option<Pool> {
    [Pool::A, Pool::B]
        .into_iter()
        .find(|&pool| spec.pools.get(pool.index()).is_some_and(|p| p.name == name))
}

fn check_pools(spec: &FailoverPolicySpec) -> Result<(), PolicyError> {
    let [a, b] = spec.pools.as_slice() else {
        return Err(PolicyError::PoolCount {
            found: spec.pools.len(),
        });
    };
    for (index, pool) in spec.pools.iter().enumerate() {
        if !is_dns_label(&pool.name) {
            return Err(PolicyError::NotDnsLabel {
                field: format!("spec.pools[{index}].name"),
                value: pool.name.clone(),
            });
        }
        if !is_object_name(&pool.workload.name) {
            return Err(PolicyError::NotObjectName {
                field: format!("spec.pools[{index}].workload.name"),
                value: pool.workload.name.clone(),
            });
        }
        if let Some(cluster) = &pool.cluster {
            if !is_dns_label(&cluster.name) {
                return Err(PolicyError::NotDnsLabel {
                    field: format!("spec.pools[{index}].cluster.name"),
                    value: cluster.name.clone(),
                });
            }
            if !is_object_name(&cluster.kubeconfig_secret.name) {
                return Err(PolicyError::NotObjectName {
                    field: format!("spec.pools[{index}].cluster.kubeconfigSecret.name"),
                    value: cluster.kubeconfig_secret.name.clone(),
                });
            }
        }
        in_range(&format!("spec.pools[{index}].replicas"), pool.replicas, 1, 1024)?;
        in_range(&format!("spec.pools[{index}].port"), pool.port, 1, 65535)?;
        at_most(&format!("spec.pools[{index}].standby"), pool.standby.len(), 8)?;
        for (group_index, group) in pool.standby.iter().enumerate() {
            let field = format!("spec.pools[{index}].standby[{group_index}]");
            in_range(&format!("{field}.replicas"), group.replicas, 1, 1024)?;
            if let Some(level) = group.sleep_level {
                if group.tier != Tier::Warm {
                    return Err(PolicyError::SleepLevelNotWarm {
                        pool: index,
                        group: group_index,
                    });
                }
                in_range(&format!("{field}.sleepLevel"), level, 1, 2)?;
            }
            if group.reserve_gpus.is_some() && group.tier != Tier::PilotLight {
                return Err(PolicyError::ReserveGpusNotPilotLight {
                    pool: index,
                    group: group_index,
                });
            }
            if let (Some(true), Some(cluster)) = (group.reserve_gpus, pool.cluster_name()) {
                return Err(PolicyError::ReserveGpusElsewhere {
                    pool: index,
                    group: group_index,
                    cluster: cluster.to_owned(),
                });
            }
        }
        if !pool.standby.is_empty() {
            let sum: u64 = pool.standby.iter().map(|g| u64::from(g.replicas)).sum();
            if sum != u64::from(pool.replicas) {
                return Err(PolicyError::TierReplicasDoNotSum {
                    pool: index,
                    sum,
                    replicas: pool.replicas,
                });
            }
        }
    }
    if a.name == b.name {
        return Err(PolicyError::SamePoolName { name: a.name.clone() });
    }
    if a.workload == b.workload && a.cluster_name() == b.cluster_name() {
        return Err(PolicyError::SameWorkload {
            kind: a.workload.kind,
            name: a.workload.name.clone(),
        });
    }
    Ok(())
}

fn check_probe(spec: &FailoverPolicySpec) -> Result<ProbeTiming, PolicyError> {
    let probe = &spec.probe;
    let timing = ProbeTiming {
        interval: positive("spec.probe.interval", &probe.interval)?,
        timeout: positive("spec.probe.timeout", &probe.timeout)?,
        first_token_budget: positive("spec.probe.budgets.firstToken", &probe.budgets.first_token)?,
        total_budget: positive("spec.probe.budgets.total", &probe.budgets.total)?,
    };
    if timing.timeout >= timing.interval {
        return Err(PolicyError::TimeoutNotShorterThanInterval {
            timeout: probe.timeout.clone(),
            interval: probe.interval.clone(),
        });
    }
    if timing.total_budget > timing.timeout {
        return Err(PolicyError::TotalBudgetOverTimeout {
            total: probe.budgets.total.clone(),
            timeout: probe.timeout.clone(),
        });
    }
    if timing.first_token_budget > timing.total_budget {
        return Err(PolicyError::FirstTokenBudgetOverTotal {
            first_token: probe.budgets.first_token.clone(),
            total: probe.budgets.total.clone(),
        });
    }
    length("spec.probe.prompt", &probe.prompt, 1, 4096)?;
    in_range("spec.probe.maxTokens", probe.max_tokens, 1, 4096)?;
    if let Some(value) = &probe.expect.value {
        length("spec.probe.expect.value", value, 1, 4096)?;
    }
    match (probe.expect.mode, &probe.expect.value) {
        (ExpectMode::Regex, None) => Err(PolicyError::RegexWithoutValue),
        // The schema cannot check a pattern's syntax; refuse it here rather than at every probe.
        (ExpectMode::Regex, Some(pattern)) => match regex::Regex::new(pattern) {
            Ok(_) => Ok(timing),
            Err(error) => Err(PolicyError::InvalidRegex(error.to_string())),
        },
        (ExpectMode::NonEmpty, Some(_)) => Err(PolicyError::ValueWithNonEmpty),
        _ => Ok(timing),
    }
}

fn check_failback(spec: &FailoverPolicySpec, interval: Duration) -> Result<FailbackPolicy, PolicyError> {
    let healthy_for = match &spec.failback.healthy_for {
        Some(text) => Some((text, positive("spec.failback.healthyFor", text)?)),
        None => None,
    };
    match (spec.failback.mode, healthy_for) {
        (FailbackMode::Manual, _) => Ok(FailbackPolicy::Manual),
        (FailbackMode::Automatic, None) => Err(PolicyError::HealthyForMissing),
        (FailbackMode::Automatic, Some((text, healthy_for))) => {
            // A partial interval still needs a whole passing check, hence the ceiling.
            let checks = healthy_for.as_nanos().div_ceil(interval.as_nanos());
            let healthy_checks = u32::try_from(checks).map_err(|_| PolicyError::HealthyForTooLong {
                healthy_for: text.clone(),
            })?;
            Ok(FailbackPolicy::Automatic { healthy_checks })
        }
    }
}

fn check_parity(spec: &FailoverPolicySpec) -> Result<(), PolicyError> {
    let flags = &spec.parity.ignore_flags;
    at_most("spec.parity.ignoreFlags", flags.len(), 64)?;
    for (index, flag) in flags.iter().enumerate() {
        length(&format!("spec.parity.ignoreFlags[{index}]"), flag, 2, 128)?;
        if !flag.starts_with('-') {
            return Err(PolicyError::NotAFlag {
                index,
                flag: flag.clone(),
            });
        }
    }
    Ok(())
}

fn check_admission(spec: &FailoverPolicySpec) -> Result<Duration, PolicyError> {
    let admission = &spec.admission;
    let window = parse("spec.admission.window", &admission.window)?;
    in_range(
        "spec.admission.initialConcurrency",
        admission.initial_concurrency,
        1,
        100_000,
    )?;
    if let Some(max) = admission.max_concurrency {
        in_range("spec.admission.maxConcurrency", max, 1, 100_000)?;
        if max < admission.initial_concurrency {
            return Err(PolicyError::MaxConcurrencyBelowInitial {
                initial: admission.initial_concurrency,
                max,
            });
        }
    }
    if let Some(tokens) = admission.initial_prefill_tokens {
        in_range(
            "spec.admission.initialPrefillTokens",
            tokens,
            1,
            u64::from(u32::MAX),
        )?;
    }
    let header = &admission.priority_header;
    length("spec.admission.priorityHeader", header, 1, 128)?;
    let mut chars = header.chars();
    let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-');
    if !well_formed {
        return Err(PolicyError::NotAHeaderName(header.clone()));
    }
    if let Some(priorities) = &admission.shed_priorities {
        at_most("spec.admission.shedPriorities", priorities.len(), 16)?;
        for (index, priority) in priorities.iter().enumerate() {
            length(
                &format!("spec.admission.shedPriorities[{index}]"),
                priority,
                1,
                63,
            )?;
        }
    }
    Ok(window)
}

fn parse(field: &'static str, text: &GoDuration) -> Result<Duration, PolicyError> {
    text.parse()
        .map_err(|error| PolicyError::Duration { field, error })
}

fn positive(field: &'static str, text: &GoDuration) -> Result<Duration, PolicyError> {
    let duration = parse(field, text)?;
    if duration.is_zero() {
        return Err(PolicyError::ZeroDuration { field });
    }
    Ok(duration)
}

fn in_range(field: &str, value: impl Into<u64>, min: u64, max: u64) -> Result<(), PolicyError> {
    let value = value.into();
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(PolicyError::OutOfRange {
            field: field.to_owned(),
            value,
            min,
            max,
        })
    }
}

fn at_most(field: &str, len: usize, max: usize) -> Result<(), PolicyError> {
    if len > max {
        return Err(PolicyError::TooMany {
            field: field.to_owned(),
            len,
            max,
        });
    }
    Ok(())
}

fn length(field: &str, text: &str, min: usize, max: usize) -> Result<(), PolicyError> {
    // The apiserver counts characters, not bytes, for minLength and maxLength.
    let len = text.chars().count();
    if (min..=max).contains(&len) {
        Ok(())
    } else {
        Err(PolicyError::Length {
            field: field.to_owned(),
            len,
            min,
            max,
        })
    }
}

fn is_dns_label(text: &str) -> bool {
    let bytes = text.as_bytes();
    let edge_ok = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    (1..=63).contains(&bytes.len())
        && bytes.first().is_some_and(edge_ok)
        && bytes.last().is_some_and(edge_ok)
        && bytes.iter().all(|b| edge_ok(b) || *b == b'-')
}

fn is_object_name(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(is_dns_label)
}

/// A route target names one target, and an HTTPRoute target one backend for each pool, each its
/// own. Both pools live in the operator's cluster, where the target is.
fn check_route_target(spec: &FailoverPolicySpec, route: &RouteTargetSpec) -> Result<(), String> {
    if let Some(pool) = spec.pools.iter().find(|p| p.cluster.is_some()) {
        return Err(format!(
            "pool {} lives in another cluster; a route target moves traffic between pools in the operator's own",
            pool.name
        ));
    }
    match (&route.http_route, &route.service) {
        (Some(http_route), None)
            if http_route.backends.len() == 2
                && http_route.backends[0].kind == http_route.backends[1].kind
                && http_route.backends[0].name == http_route.backends[1].name =>
        {
            Err(format!(
                "httpRoute.backends names {} for both pools; each pool needs its own backend",
                http_route.backends[0].name
            ))
        }
        (Some(http_route), None) => {
            for pool in &spec.pools {
                let named = http_route.backends.iter().filter(|b| b.pool == pool.name).count();
                if named != 1 {
                    return Err(format!(
                        "httpRoute.backends names pool {} {named} times; each pool needs one backend",
                        pool.name
                    ));
                }
            }
            match http_route
                .backends
                .iter()
                .find(|b| !spec.pools.iter().any(|p| p.name == b.pool))
            {
                Some(stray) => Err(format!(
                    "httpRoute.backends names {}, which is no pool",
                    stray.pool
                )),
                None => Ok(()),
            }
        }
        (None, Some(_)) => Ok(()),
        _ => Err("name one target: httpRoute or service".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::FailoverPolicySpec;
    use understudy_core::recovery::{Mix, Stage, Standby};

    /// Two hot pools and nothing else: every other field takes its default.
    const MINIMAL: &str = "
pools:
  - name: east
    workload: {kind: Deployment, name: llm-east}
    replicas: 2
  - name: west
    workload: {kind: Deployment, name: llm-west}
    replicas: 2
recoveryObjective: 5m
";

    fn spec(yaml: &str) -> FailoverPolicySpec {
        serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("fixture does not parse: {e}\n{yaml}"))
    }

    /// The minimal fixture with `extra` top-level YAML appended.
    fn minimal_with(extra: &str) -> FailoverPolicySpec {
        spec(&format!("{MINIMAL}{extra}"))
    }

    fn refusal(spec: &FailoverPolicySpec) -> String {
        match validate(spec) {
            Ok(policy) => panic!("expected the spec to be refused, got {policy:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_route_target_names_one_target_and_one_backend_for_each_pool() {
        let both = "route:\n  httpRoute: {name: chat, backends: [{pool: east, name: e}, {pool: west, kind: InferencePool, name: w}]}\n";
        assert!(validate(&minimal_with(both)).is_ok());
        assert!(validate(&minimal_with("route:\n  service: {name: chat}\n")).is_ok());
        let twice =
            "route:\n  httpRoute: {name: chat, backends: [{pool: east, name: e}, {pool: east, name: w}]}\n";
        assert_eq!(
            refusal(&minimal_with(twice)),
            "spec.route: httpRoute.backends names pool east 2 times; each pool needs one backend"
        );
        let stray = "route:\n  httpRoute: {name: chat, backends: [{pool: east, name: e}, {pool: west, name: w}, {pool: south, name: s}]}\n";
        assert!(refusal(&minimal_with(stray)).contains("south, which is no pool"));
        let shared =
            "route:\n  httpRoute: {name: chat, backends: [{pool: east, name: e}, {pool: west, name: e}]}\n";
        assert!(refusal(&minimal_with(shared)).contains("each pool needs its own backend"));
        let far = MINIMAL.replace(
            "  - name: west\n",
            "  - name: west\n    cluster: {name: far, kubeconfigSecret: {name: far}}\n",
        );
        let far = spec(&format!("{far}route:\n  service: {{name: chat}}\n"));
        assert!(refusal(&far).contains("pool west lives in another cluster"));
        assert_eq!(
            refusal(&minimal_with("route: {}\n")),
            "spec.route: name one target: httpRoute or service"
        );
    }

    #[test]
    fn a_minimal_spec_runs_on_the_documented_defaults() {
        let policy = validate(&spec(MINIMAL)).expect("minimal spec is valid");
        assert_eq!(
            policy.failover,
            FailoverConfig {
                suspect_after: 2,
                promote_after: 4,
                hard_promote_after: 2,
                standby_ready_after: 2,
                min_dwell: Duration::from_secs(300),
                failback: FailbackPolicy::Manual,
                paused: false,
            }
        );
        assert_eq!(
            policy.probe,
            ProbeTiming {
                interval: Duration::from_secs(10),
                timeout: Duration::from_secs(5),
                first_token_budget: Duration::from_secs(2),
                total_budget: Duration::from_secs(4),
            }
        );
        assert_eq!(policy.recovery_objective, Duration::from_secs(300));
        assert_eq!(policy.admission_window, Duration::from_secs(300));
        assert_eq!(failover_config(&spec(MINIMAL)), Ok(policy.failover));
    }

    #[test]
    fn trigger_counts_and_pause_reach_the_state_machine() {
        let config = failover_config(&minimal_with(
            "trigger: {suspectAfter: 3, promoteAfter: 6, hardFailure: {promoteAfter: 1}, minDwell: 90s, \
             standbyReadyAfter: 5}\npaused: true\n",
        ))
        .expect("valid");
        assert_eq!(
            (
                config.suspect_after,
                config.promote_after,
                config.hard_promote_after,
                config.standby_ready_after
            ),
            (3, 6, 1, 5)
        );
        assert_eq!(config.min_dwell, Duration::from_secs(90));
        assert!(config.paused);
    }

    #[test]
    fn automatic_failback_counts_healthy_for_in_whole_probe_intervals_rounded_up() {
        let exact = failover_config(&minimal_with("failback: {mode: automatic, healthyFor: 1m}\n"));
        assert_eq!(
            exact.map(|c| c.failback),
            Ok(FailbackPolicy::Automatic { healthy_checks: 6 })
        );
        let partial = failover_config(&minimal_with(
            "failback: {mode: automatic, healthyFor: 65s}\nprobe: {interval: 10s}\n",
        ));
        assert_eq!(
            partial.map(|c| c.failback),
            Ok(FailbackPolicy::Automatic { healthy_checks: 7 })
        );
        let short = failover_config(&minimal_with("failback: {mode: automatic, healthyFor: 1s}\n"));
        assert_eq!(
            short.map(|c| c.failback),
            Ok(FailbackPolicy::Automatic { healthy_checks: 1 })
        );
    }

    #[test]
    fn manual_failback_ignores_healthy_for_but_still_reads_it() {
        let config = failover_config(&minimal_with("failback: {mode: manual, healthyFor: 10m}\n"));
        assert_eq!(config.map(|c| c.failback), Ok(FailbackPolicy::Manual));
        let garbled = refusal(&minimal_with("failback: {mode: manual, healthyFor: soon}\n"));
        assert!(
            garbled.starts_with("spec.failback.healthyFor: invalid duration"),
            "{garbled}"
        );
    }

    #[test]
    fn automatic_failback_without_healthy_for_is_refused() {
        let message = refusal(&minimal_with("failback: {mode: automatic}\n"));
        assert_eq!(
            message,
            "spec.failback.healthyFor is required when mode is automatic"
        );
    }

    #[test]
    fn probe_timing_rules_name_the_fields() {
        let cases = [
            (
                "probe: {interval: 10s, timeout: 10s}\n",
                "spec.probe.timeout (10s) must be shorter than spec.probe.interval (10s)",
            ),
            (
                "probe: {interval: 0s}\n",
                "spec.probe.interval must be greater than zero",
            ),
            (
                "probe: {interval: '-10s'}\n",
                "spec.probe.interval: negative duration \"-10s\"",
            ),
            (
                "probe: {timeout: 0s}\n",
                "spec.probe.timeout must be greater than zero",
            ),
            (
                "probe: {interval: ten}\n",
                "spec.probe.interval: invalid duration \"ten\"",
            ),
            (
                "probe: {timeout: 3s}\n",
                "spec.probe.budgets.total (4s) must not be longer than spec.probe.timeout (3s)",
            ),
            (
                "probe: {budgets: {firstToken: 3s, total: 2s}}\n",
                "spec.probe.budgets.firstToken (3s) must not be longer than spec.probe.budgets.total (2s)",
            ),
            (
                "probe: {expect: {mode: regex}}\n",
                "spec.probe.expect.value is required when mode is regex",
            ),
            (
                "probe: {expect: {mode: nonEmpty, value: Paris}}\n",
                "spec.probe.expect.value is not used when mode is nonEmpty",
            ),
            (
                "probe: {expect: {mode: regex, value: 'Par(is'}}\n",
                "spec.probe.expect.value is not a valid regex: ",
            ),
            (
                "probe: {maxTokens: 0}\n",
                "spec.probe.maxTokens must be between 1 and 4096, is 0",
            ),
            (
                "probe: {prompt: ''}\n",
                "spec.probe.prompt must be between 1 and 4096 characters long, is 0",
            ),
        ];
        for (extra, expected) in cases {
            let message = refusal(&minimal_with(extra));
            assert!(
                message.starts_with(expected),
                "for {extra:?}: got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn trigger_rules_name_the_fields() {
        let cases = [
            (
                "trigger: {suspectAfter: 3, promoteAfter: 2}\n",
                "spec.trigger.promoteAfter (2) must not be below spec.trigger.suspectAfter (3)",
            ),
            (
                "trigger: {promoteAfter: 4, hardFailure: {promoteAfter: 5}}\n",
                "spec.trigger.hardFailure.promoteAfter (5) must not be above spec.trigger.promoteAfter (4)",
            ),
            (
                "trigger: {suspectAfter: 0}\n",
                "spec.trigger.suspectAfter must be between 1 and 1000, is 0",
            ),
            (
                "trigger: {standbyReadyAfter: 0}\n",
                "spec.trigger.standbyReadyAfter must be between 1 and 1000, is 0",
            ),
            (
                "trigger: {minDwell: '-1m'}\n",
                "spec.trigger.minDwell: negative duration",
            ),
        ];
        for (extra, expected) in cases {
            let message = refusal(&minimal_with(extra));
            assert!(
                message.starts_with(expected),
                "for {extra:?}: got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn zero_min_dwell_and_zero_admission_window_mean_none() {
        let policy = validate(&minimal_with(
            "trigger: {minDwell: 0s}\nadmission: {window: '0'}\n",
        ))
        .expect("valid");
        assert_eq!(policy.failover.min_dwell, Duration::ZERO);
        assert_eq!(policy.admission_window, Duration::ZERO);
    }

    #[test]
    fn grants_default_to_ten_seconds_renewed_every_two_and_bad_timings_are_refused() {
        let grants = |extra: &str| validate(&minimal_with(extra)).map(|p| p.grants);
        assert_eq!(grants(""), Ok(GrantTiming::default()));
        let short = grants("grants: {ttl: 3s, renewEvery: 500ms, clockSkew: 250ms}\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (short.ttl, short.renew_every, short.skew, short.push_timeout),
            (
                Duration::from_secs(3),
                Duration::from_millis(500),
                Duration::from_millis(250),
                Duration::from_millis(500)
            )
        );
        let few = grants("grants: {ttl: 4s, renewEvery: 2s}\n").map(|_| ()).err();
        assert!(
            few.as_ref()
                .is_some_and(|e| e.to_string().starts_with("spec.grants: ")),
            "{few:?}"
        );
        assert!(grants("grants: {clockSkew: 5s}\n").is_err());
        assert!(grants("grants: {ttl: soon}\n").is_err());
    }

    #[test]
    fn a_planned_move_drains_a_minute_unless_the_policy_says_and_never_more_than_an_hour() {
        let drain = |extra: &str| validate(&minimal_with(extra)).map(|p| p.drain_for);
        assert_eq!(drain(""), Ok(DEFAULT_DRAIN));
        assert_eq!(drain("stream: {drainFor: 2m}\n"), Ok(Duration::from_secs(120)));
        assert_eq!(drain("stream: {drainFor: 0s}\n"), Ok(Duration::ZERO));
        assert!(drain("stream: {drainFor: 2h}\n").is_err());
        assert!(drain("stream: {drainFor: soon}\n").is_err());
    }

    const POOL_B: &str =
        "  - name: west\n    workload: {kind: Deployment, name: llm-west}\n    replicas: 2\n";

    #[test]
    fn a_standby_first_rollout_holds_deployments_and_statefulsets_only() {
        let east = "  - name: east\n    workload: {kind: StatefulSet, name: llm-east}\n    replicas: 2\n";
        let pools = format!("pools:\n{east}{POOL_B}recoveryObjective: 5m\n");
        assert!(validate(&spec(&format!("{pools}rollout: standbyFirst\n"))).is_ok());
        let lws = "  - name: east\n    workload: {kind: LeaderWorkerSet, name: llm-east}\n    replicas: 2\n";
        let pools = format!("pools:\n{POOL_B}{lws}recoveryObjective: 5m\n");
        assert!(validate(&spec(&pools)).is_ok(), "held only when asked");
        assert_eq!(
            refusal(&spec(&format!("{pools}rollout: standbyFirst\n"))),
            "spec.rollout: standbyFirst holds a Deployment or a StatefulSet, and spec.pools[1] runs a LeaderWorkerSet"
        );
    }

    fn with_pools(pools: &str) -> FailoverPolicySpec {
        spec(&format!("pools:\n{pools}recoveryObjective: 5m\n"))
    }

    #[test]
    fn pool_rules_name_the_pool() {
        let cases = [
            (
                with_pools(POOL_B),
                "spec.pools must list exactly 2 pools, found 1",
            ),
            (
                with_pools(&format!("{POOL_B}{POOL_B}")),
                "spec.pools: the two pools must have different names, both are \"west\"",
            ),
            (
                with_pools(&format!(
                    "  - name: east\n    workload: {{kind: Deployment, name: llm-west}}\n    replicas: 2\n{POOL_B}"
                )),
                "spec.pools: two pools name the same workload (Deployment \"llm-west\") in the same cluster",
            ),
            (
                with_pools(&format!(
                    "  - name: east\n    workload: {{kind: Deployment, name: llm}}\n    replicas: 2\n    cluster: {{name: Us-East, kubeconfigSecret: {{name: east}}}}\n{POOL_B}"
                )),
                "spec.pools[0].cluster.name \"Us-East\" must be a DNS label",
            ),
            (
                with_pools(&format!(
                    "{POOL_B}  - name: east\n    workload: {{kind: Deployment, name: llm}}\n    replicas: 2\n    \
                     cluster: {{name: us-east, kubeconfigSecret: {{name: east}}}}\n    \
                     standby:\n      - {{tier: pilotLight, replicas: 2, reserveGpus: true}}\n"
                )),
                "spec.pools[1].standby[0].reserveGpus: GPUs are reserved only in the operator's own cluster",
            ),
            (
                with_pools(&format!(
                    "  - name: East_1\n    workload: {{kind: Deployment, name: llm}}\n    replicas: 2\n{POOL_B}"
                )),
                "spec.pools[0].name \"East_1\" must be a DNS label",
            ),
            (
                with_pools(&format!(
                    "  - name: east\n    workload: {{kind: Deployment, name: LLM}}\n    replicas: 2\n{POOL_B}"
                )),
                "spec.pools[0].workload.name \"LLM\" must be a Kubernetes object name",
            ),
            (
                with_pools(&format!(
                    "  - name: east\n    workload: {{kind: Deployment, name: llm}}\n    replicas: 0\n{POOL_B}"
                )),
                "spec.pools[0].replicas must be between 1 and 1024, is 0",
            ),
            (
                with_pools(&format!(
                    "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 8\n    \
                     standby:\n      - {{tier: warm, replicas: 4}}\n      - {{tier: pilotLight, replicas: 3}}\n"
                )),
                "spec.pools[1].standby: tier replicas add up to 7, but the pool has 8 replicas",
            ),
            (
                with_pools(&format!(
                    "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 2\n    \
                     standby:\n      - {{tier: hot, replicas: 2, sleepLevel: 1}}\n"
                )),
                "spec.pools[1].standby[0].sleepLevel applies only to the warm tier",
            ),
            (
                with_pools(&format!(
                    "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 2\n    \
                     standby:\n      - {{tier: warm, replicas: 2, sleepLevel: 3}}\n"
                )),
                "spec.pools[1].standby[0].sleepLevel must be between 1 and 2, is 3",
            ),
            (
                with_pools(&format!(
                    "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 2\n    \
                     standby:\n      - {{tier: warm, replicas: 2, reserveGpus: true}}\n"
                )),
                "spec.pools[1].standby[0].reserveGpus applies only to the pilotLight tier",
            ),
        ];
        for (spec, expected) in cases {
            let message = refusal(&spec);
            assert!(
                message.starts_with(expected),
                "got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn serving_fraction_and_estimates_are_checked_and_parsed() {
        let policy = validate(&minimal_with(
            "minServingFraction: 0.5\ncoldStartEstimates: {node: 6m, weightLoad: 70s, wakeLevel1: 25s}\n",
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(policy.min_serving_fraction, Some(0.5));
        assert_eq!(policy.estimates.get(Stage::Node), Some(Duration::from_secs(360)));
        assert_eq!(
            policy.estimates.get(Stage::WakeLevel1),
            Some(Duration::from_secs(25))
        );
        assert_eq!(
            policy.estimates.get(Stage::Warmup),
            None,
            "left out is unknown, not zero"
        );
        for (extra, expected) in [
            (
                "minServingFraction: 0\n",
                "spec.minServingFraction 0 must be above 0 and at most 1",
            ),
            (
                "minServingFraction: 1.5\n",
                "spec.minServingFraction 1.5 must be above 0",
            ),
            (
                "coldStartEstimates: {warmup: soon}\n",
                "spec.coldStartEstimates.warmup: invalid duration \"soon\"",
            ),
        ] {
            let message = refusal(&minimal_with(extra));
            assert!(
                message.starts_with(expected),
                "got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn pools_in_two_clusters_may_name_the_same_workload() {
        let spec = with_pools(
            "  - name: east\n    workload: {kind: Deployment, name: llm}\n    replicas: 2\n    \
             cluster: {name: us-east, kubeconfigSecret: {name: east-kubeconfig}}\n  \
             - name: west\n    workload: {kind: Deployment, name: llm}\n    replicas: 2\n    \
             cluster: {name: us-west, kubeconfigSecret: {name: west-kubeconfig, key: config}}\n",
        );
        assert!(validate(&spec).is_ok(), "{:?}", validate(&spec).err());
        assert_eq!(spec.pools[0].cluster_name(), Some("us-east"));
        let secret = spec.pools[0].cluster.as_ref().map(|c| &c.kubeconfig_secret);
        assert_eq!(
            secret.map(|s| (s.name.as_str(), s.key.as_str())),
            Some(("east-kubeconfig", "kubeconfig"))
        );
        let mut home = spec.clone();
        home.pools[0].cluster = None;
        home.pools[1].cluster = None;
        assert!(validate(&home).is_err(), "the same workload in one cluster");
    }

    #[test]
    fn the_serving_share_sets_the_quorum_and_the_tiers_the_planners_mix() {
        let pools = format!(
            "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 8\n    \
             standby:\n      - {{tier: warm, replicas: 4}}\n      - {{tier: pilotLight, replicas: 4, reserveGpus: true}}\n"
        );
        let majority = with_pools(&pools);
        assert_eq!(majority.standby_shapes()[1].serving_quorum(), 5);
        let mut half = majority.clone();
        half.min_serving_fraction = Some(0.5);
        assert_eq!(half.standby_shapes()[1].serving_quorum(), 4);
        assert_eq!(half.standby_shapes()[0].serving_quorum(), 1, "half of two");
        assert_eq!(
            half.pools[1].standby_mix(),
            Mix(vec![
                (Standby::Warm(1), 4),
                (Standby::PilotLight { reserved: true }, 4)
            ])
        );
        assert_eq!(half.pools[0].standby_mix(), Mix(vec![(Standby::Hot, 2)]));
    }

    #[test]
    fn a_standby_proof_runs_every_so_often_outside_its_windows() {
        let policy = validate(&minimal_with(
            "standbyProof: {every: 6h, notBetween: ['08:00-20:00', '23:30-00:30']}\n",
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let proof = policy.standby_proof.unwrap_or_else(|| panic!("parsed"));
        assert_eq!(proof.every, Duration::from_secs(6 * 3600));
        let at = |h: u64, m: u64| Duration::from_secs(19_000 * 86_400 + h * 3600 + m * 60);
        assert!(proof.allowed_at(at(7, 59)));
        assert!(!proof.allowed_at(at(8, 0)));
        assert!(!proof.allowed_at(at(19, 59)));
        assert!(proof.allowed_at(at(20, 0)));
        assert!(!proof.allowed_at(at(23, 45)), "a window wraps past midnight");
        assert!(!proof.allowed_at(at(0, 15)));
        assert!(proof.allowed_at(at(0, 30)));
        for (extra, expected) in [
            (
                "standbyProof: {every: 30s}\n",
                "spec.standbyProof.every (30s) must be at least a minute",
            ),
            (
                "standbyProof: {every: 1h, notBetween: ['8-20']}\n",
                "spec.standbyProof.notBetween[0] \"8-20\" must be a UTC window",
            ),
            (
                "standbyProof: {every: 1h, notBetween: ['24:00-01:00']}\n",
                "spec.standbyProof.notBetween[0]",
            ),
        ] {
            let message = refusal(&minimal_with(extra));
            assert!(
                message.starts_with(expected),
                "got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn a_load_proof_takes_its_defaults_and_refuses_what_cannot_be_replayed() {
        let policy = validate(&minimal_with(
            "loadProof: {every: 6h, notBetween: ['08:00-20:00']}\n",
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let proof = policy.load_proof.unwrap_or_else(|| panic!("parsed"));
        assert_eq!(proof.schedule.every, Duration::from_secs(6 * 3600));
        assert_eq!(proof.duration, Duration::from_secs(60));
        assert_eq!(proof.rate_share, 1.0);
        assert_eq!(
            proof.thresholds,
            Thresholds {
                max_error_rate: 0.01,
                ttft_p99: Duration::from_secs(2),
                itl_p99: Duration::from_millis(200),
            }
        );
        assert!(proof.blocks_promotion);
        let at = |h: u64| Duration::from_secs(19_000 * 86_400 + h * 3600);
        assert!(proof.schedule.allowed_at(at(7)));
        assert!(!proof.schedule.allowed_at(at(8)), "inside its window");
        let set = validate(&minimal_with(
            "loadProof: {every: 1h, duration: 90s, rateShare: 0.5, maxErrorRate: 0.05, ttftP99: 800ms, \
             itlP99: 50ms, blocksPromotion: false}\n",
        ))
        .unwrap_or_else(|e| panic!("{e}"))
        .load_proof
        .unwrap_or_else(|| panic!("parsed"));
        assert_eq!(
            (set.duration, set.rate_share, set.blocks_promotion),
            (Duration::from_secs(90), 0.5, false)
        );
        assert_eq!(
            set.thresholds,
            Thresholds {
                max_error_rate: 0.05,
                ttft_p99: Duration::from_millis(800),
                itl_p99: Duration::from_millis(50),
            }
        );
        for (extra, expected) in [
            (
                "loadProof: {every: 10s}\n",
                "spec.loadProof.every (10s) must be at least a minute",
            ),
            (
                "loadProof: {every: 1h, notBetween: ['x']}\n",
                "spec.loadProof.notBetween[0]",
            ),
            (
                "loadProof: {every: 1h, duration: 20m}\n",
                "spec.loadProof.duration (seconds) must be between 1 and 600",
            ),
            (
                "loadProof: {every: 1h, rateShare: 0}\n",
                "spec.loadProof.rateShare 0 must be above 0",
            ),
            (
                "loadProof: {every: 1h, maxErrorRate: 1.5}\n",
                "spec.loadProof.maxErrorRate 1.5 must be between 0 and 1",
            ),
            ("loadProof: {every: 1h, ttftP99: 0s}\n", "spec.loadProof.ttftP99"),
        ] {
            let message = refusal(&minimal_with(extra));
            assert!(
                message.starts_with(expected),
                "got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn detection_is_a_hangs_failed_rounds_and_one_timeout_and_a_crash_is_seen_sooner() {
        let policy = validate(&minimal_with(
            "probe: {interval: 10s, timeout: 5s}\ntrigger: {promoteAfter: 4, hardFailure: {promoteAfter: 2}}\n",
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(policy.detection(), Duration::from_secs(45));
        assert_eq!(policy.crash_detection(), Duration::from_secs(25));
        // The minimal policy's objective is 5m: what is left after 45 s of detection.
        assert_eq!(policy.promotion_deadline(), Duration::from_secs(255));
    }

    #[test]
    fn the_same_workload_name_in_two_kinds_is_two_workloads() {
        let spec = with_pools(&format!(
            "  - name: east\n    workload: {{kind: StatefulSet, name: llm-west}}\n    replicas: 2\n{POOL_B}"
        ));
        assert!(validate(&spec).is_ok());
    }

    #[test]
    fn admission_and_parity_rules_name_the_fields() {
        let cases = [
            (
                "admission: {initialConcurrency: 8, maxConcurrency: 4}\n",
                "spec.admission.maxConcurrency (4) must not be below spec.admission.initialConcurrency (8)",
            ),
            (
                "admission: {priorityHeader: 'x priority'}\n",
                "spec.admission.priorityHeader \"x priority\" must be an HTTP header name",
            ),
            (
                "admission: {window: '-5m'}\n",
                "spec.admission.window: negative duration",
            ),
            (
                "parity: {ignoreFlags: [port]}\n",
                "spec.parity.ignoreFlags[0] \"port\" must be a command-line flag",
            ),
            (
                "recoveryObjective: 0s\n",
                "spec.recoveryObjective must be greater than zero",
            ),
        ];
        for (extra, expected) in cases {
            // `recoveryObjective` appears twice when overridden; the YAML parser would refuse, so
            // build that case from the pools alone.
            let spec = if extra.starts_with("recoveryObjective") {
                spec(&format!(
                    "pools:\n  - name: east\n    workload: {{kind: Deployment, name: a}}\n    replicas: 1\n{POOL_B}{extra}"
                ))
            } else {
                minimal_with(extra)
            };
            let message = refusal(&spec);
            assert!(
                message.starts_with(expected),
                "for {extra:?}: got {message:?}, expected {expected:?}"
            );
        }
    }

    #[test]
    fn pools_are_named_by_position_and_found_by_name() {
        let spec = spec(MINIMAL);
        assert_eq!(pool_name(&spec, Pool::A), "east");
        assert_eq!(pool_name(&spec, Pool::B), "west");
        assert_eq!(pool_by_name(&spec, "east"), Some(Pool::A));
        assert_eq!(pool_by_name(&spec, "west"), Some(Pool::B));
        assert_eq!(pool_by_name(&spec, "north"), None);
        for pool in [Pool::A, Pool::B] {
            assert_eq!(pool_by_name(&spec, pool_name(&spec, pool)), Some(pool));
        }
    }

    #[test]
    fn an_empty_standby_list_means_every_replica_hot() {
        let spec = spec(MINIMAL);
        let groups = spec.pools[0].standby_groups();
        assert_eq!(groups.len(), 1);
        assert_eq!((groups[0].tier, groups[0].replicas), (Tier::Hot, 2));
    }

    #[test]
    fn a_pool_all_pilot_light_keeps_one_replica_running_hot_and_reserves_one_gpu_fewer() {
        let all_pilot = |groups: &str| {
            with_pools(&format!(
                "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 4\n    \
                 standby:\n{groups}"
            ))
        };
        let spec = all_pilot("      - {tier: pilotLight, replicas: 4, reserveGpus: true}\n");
        assert!(validate(&spec).is_ok());
        let groups = spec.pools[1].standby_groups();
        let tiers: Vec<(Tier, u32, bool)> = groups
            .iter()
            .map(|g| (g.tier, g.replicas, g.reserve_gpus()))
            .collect();
        assert_eq!(tiers, [(Tier::Hot, 1, false), (Tier::PilotLight, 3, true)]);
        let shape = spec.pools[1].standby_shape();
        assert_eq!((shape.replicas, shape.pilot_light, shape.warm), (4, 3, 0));
        assert_eq!(shape.round_quorum(understudy_core::quorum::Role::Standby), 1);

        // The kept replica comes from a reserved group, which needs one placeholder fewer.
        let spec = all_pilot(
            "      - {tier: pilotLight, replicas: 3}\n      - {tier: pilotLight, replicas: 1, reserveGpus: true}\n",
        );
        let tiers: Vec<(Tier, u32, bool)> = spec.pools[1]
            .standby_groups()
            .iter()
            .map(|g| (g.tier, g.replicas, g.reserve_gpus()))
            .collect();
        assert_eq!(tiers, [(Tier::Hot, 1, false), (Tier::PilotLight, 3, false)]);

        // A pool with anything but pilot light keeps its tiers as written.
        let spec = all_pilot("      - {tier: warm, replicas: 1}\n      - {tier: pilotLight, replicas: 3}\n");
        assert_eq!(spec.pools[1].standby_groups(), spec.pools[1].standby);
    }

    #[test]
    fn warm_replicas_sleep_at_level_one_and_pilot_lights_reserve_nothing_unless_told() {
        let spec = with_pools(&format!(
            "{POOL_B}  - name: east\n    workload: {{kind: StatefulSet, name: llm}}\n    replicas: 4\n    \
             standby:\n      - {{tier: warm, replicas: 2}}\n      - {{tier: pilotLight, replicas: 2}}\n"
        ));
        let groups = spec.pools[1].standby_groups();
        assert_eq!(groups[0].sleep_level(), 1);
        assert!(!groups[1].reserve_gpus());
        assert!(validate(&spec).is_ok());
    }
}

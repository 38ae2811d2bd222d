//! FailoverPolicies and GameDays, read for people: a row per policy, a policy described (its
//! pools, conditions, last failover step by step, standby proof, GPU reserve), its cold starts
//! stage by stage per replica and per tier, and the game days' runs and verdicts.
//!
//! Pure functions of the objects: what status does not say is printed as `-` or `none`, never
//! guessed.

use std::fmt::Write as _;

use understudy_api::crd::{
    ColdStartBreakdown, Condition, ConditionStatus, FailoverPolicy, FailoverPolicyStatus, FailoverTimeline,
    GameDay, GameDayRun, GrantsStatus, LoadProofRecord, RolloutMode, Tier, TierGroup, condition_type,
};
use understudy_core::recovery::Stage;

use crate::table::Table;

/// A duration in seconds, short: `0s`, `0.4ms`, `166ms`, `4.9s`, `92.2s`, `160s`.
#[must_use]
pub fn seconds(s: f64) -> String {
    if s <= 0.0 {
        "0s".to_owned()
    } else if s >= 100.0 {
        format!("{s:.0}s")
    } else if s >= 1.0 {
        format!("{s:.1}s")
    } else if s >= 0.001 {
        format!("{:.0}ms", s * 1000.0)
    } else {
        format!("{:.1}ms", s * 1000.0)
    }
}

fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn status_word(condition: Option<&Condition>) -> &'static str {
    match condition.map(|c| c.status) {
        Some(ConditionStatus::True) => "True",
        Some(ConditionStatus::False) => "False",
        Some(ConditionStatus::Unknown) | None => "Unknown",
    }
}

fn condition<'a>(policy: &'a FailoverPolicy, kind: &str) -> Option<&'a Condition> {
    policy.status.as_ref().and_then(|s| s.conditions.get(kind))
}

/// One row per policy: its primary, epoch, state, and the word of each condition.
#[must_use]
pub fn policies(policies: &[FailoverPolicy], all_namespaces: bool) -> String {
    let mut header = vec![
        "NAME",
        "PRIMARY",
        "EPOCH",
        "STATE",
        "READY",
        "STANDBY",
        "PARITY",
        "OBJECTIVE",
        "GRANTS",
    ];
    if all_namespaces {
        header.insert(0, "NAMESPACE");
    }
    let mut table = Table::new(header);
    for policy in policies {
        let status = policy.status.as_ref();
        let mut row = vec![
            policy.metadata.name.clone().unwrap_or_default(),
            or_dash(
                status
                    .and_then(|s| s.primary_pool.as_ref())
                    .map(|pool| at_cluster(policy, pool)),
            ),
            or_dash(status.and_then(|s| s.epoch)),
            or_dash(status.and_then(|s| s.state.as_ref())),
        ];
        for kind in [
            condition_type::READY,
            condition_type::STANDBY_PROVEN,
            condition_type::PARITY_HOLDS,
            condition_type::OBJECTIVE_MET,
        ] {
            row.push(status_word(condition(policy, kind)).to_owned());
        }
        row.push(
            status
                .and_then(|s| s.grants.as_ref())
                .map_or_else(|| "-".to_owned(), grants_short),
        );
        if all_namespaces {
            row.insert(0, policy.metadata.namespace.clone().unwrap_or_default());
        }
        table.row(row);
    }
    if table.is_empty() {
        return "No FailoverPolicies found.\n".to_owned();
    }
    table.render("")
}

/// `pool`, with the cluster it lives in when that is not the operator's own: `east@us-east`.
fn at_cluster(policy: &FailoverPolicy, pool: &str) -> String {
    let cluster = policy
        .spec
        .pools
        .iter()
        .find(|p| p.name == pool)
        .and_then(|p| p.cluster_name());
    match cluster {
        Some(cluster) => format!("{pool}@{cluster}"),
        None => pool.to_owned(),
    }
}

/// The holder's fences that serve, of all its fences: `2/2 serving`.
fn grants_short(grants: &GrantsStatus) -> String {
    let holder = grants.pools.iter().find(|p| p.pool == grants.holder);
    let count = |standing: &str| holder.and_then(|p| p.fences.get(standing)).copied().unwrap_or(0);
    let all: u32 = holder.map_or(0, |p| p.fences.values().sum());
    format!("{}/{all} serving", count("serving") + count("failsafe"))
}

/// Each pool's fences by the standing of their grants, as they answered the operator's last round.
fn describe_grants(out: &mut String, grants: Option<&GrantsStatus>) {
    let Some(grants) = grants else {
        line(
            out,
            "Grants",
            "none: the fences read the Lease themselves, or the operator has no fence token",
        );
        return;
    };
    let mut said = format!(
        "epoch {} held by {}, granted {}",
        grants.epoch, grants.holder, grants.granted_at
    );
    if let Some(left) = grants.expires_in_seconds {
        said.push_str(&format!("; serving {} more without another", seconds(left)));
    }
    if !grants.prior_revoked {
        said.push_str("; the old holder's fences were not all told (the new holder waits out their grants)");
    }
    line(out, "Grants", &said);
    let mut pools = Table::new(["POOL", "FENCES"]);
    for pool in &grants.pools {
        let fences: Vec<String> = pool.fences.iter().map(|(s, n)| format!("{n} {s}")).collect();
        pools.row([pool.pool.clone(), fences.join(", ")]);
    }
    out.push_str(&pools.render("  "));
}

fn tiers(groups: &[TierGroup]) -> String {
    groups
        .iter()
        .map(|group| match group.tier {
            Tier::Hot => format!("{} hot", group.replicas),
            Tier::Warm => format!("{} warm (level {})", group.replicas, group.sleep_level()),
            Tier::PilotLight if group.reserve_gpus() => {
                format!("{} pilot light (GPUs reserved)", group.replicas)
            }
            Tier::PilotLight => format!("{} pilot light", group.replicas),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A policy described: what `kubectl describe` would say if it knew what the fields mean.
#[must_use]
pub fn describe(policy: &FailoverPolicy) -> String {
    let mut out = String::new();
    let status = policy.status.clone().unwrap_or_default();
    line(
        &mut out,
        "Name",
        policy.metadata.name.as_deref().unwrap_or_default(),
    );
    line(
        &mut out,
        "Namespace",
        policy.metadata.namespace.as_deref().unwrap_or_default(),
    );
    let primary = match (&status.primary_pool, status.epoch) {
        (Some(pool), Some(epoch)) => format!("{pool} at epoch {epoch}"),
        _ => "not known yet".to_owned(),
    };
    line(&mut out, "Primary", &primary);
    line(&mut out, "State", status.state.as_deref().unwrap_or("-"));
    line(&mut out, "Objective", &policy.spec.recovery_objective.to_string());
    if policy.spec.paused {
        line(
            &mut out,
            "Paused",
            "yes: the operator promotes nothing on its own",
        );
    }
    describe_pools(&mut out, policy);
    describe_grants(&mut out, status.grants.as_ref());
    describe_conditions(&mut out, &status);
    match &status.last_failover {
        None => line(&mut out, "Last failover", "none"),
        Some(last) => describe_last_failover(&mut out, last),
    }

    let proof = status.standby_proof.as_ref().map_or_else(
        || "never".to_owned(),
        |p| {
            let verdict = if p.passed { "passed" } else { "FAILED" };
            format!("{verdict} {} on {} {}: {}", p.at, p.pool, p.replica, p.detail)
        },
    );
    line(&mut out, "Standby proof", &proof);
    if let Some(load) = &policy.spec.load_proof {
        let last = status.load_proof.as_ref().map_or_else(
            || format!("not run yet (every {})", load.every),
            LoadProofRecord::summary,
        );
        line(&mut out, "Load proof", &last);
    }
    if policy.spec.rollout == RolloutMode::StandbyFirst {
        let rollout = status.rollout.as_ref().map_or_else(
            || "standby first; nothing held yet".to_owned(),
            |r| {
                let change = if r.change.is_empty() {
                    String::new()
                } else {
                    format!(" [{}]", r.change)
                };
                format!("{} since {}: {}{change}", r.phase.as_str(), r.since, r.message)
            },
        );
        line(&mut out, "Rollout", &rollout);
    }
    let reserve = status.gpu_reserve.as_ref().map_or_else(
        || "none".to_owned(),
        |r| {
            format!(
                "{} placeholder replica(s) for {} in Deployment {}",
                r.replicas, r.pool, r.deployment
            )
        },
    );
    line(&mut out, "GPU reserve", &reserve);
    let starts = status.cold_start.len();
    line(
        &mut out,
        "Cold starts",
        &format!(
            "{starts} measured (kubectl understudy coldstart {})",
            policy.metadata.name.as_deref().unwrap_or_default()
        ),
    );
    out
}

/// One `Key:   value` line of a description, the values aligned.
fn line(out: &mut String, key: &str, value: &str) {
    let _ = writeln!(out, "{:<16}{value}", format!("{key}:"));
}

/// Each pool, with the tiers it waits in as the standby.
fn describe_pools(out: &mut String, policy: &FailoverPolicy) {
    out.push_str("Pools:\n");
    let mut pools = Table::new(["NAME", "CLUSTER", "WORKLOAD", "REPLICAS", "WAITS AS STANDBY WITH"]);
    for pool in &policy.spec.pools {
        let groups = pool.standby_groups();
        pools.row([
            pool.name.clone(),
            pool.cluster_name().unwrap_or("(the operator's)").to_owned(),
            format!("{:?}/{}", pool.workload.kind, pool.workload.name),
            pool.replicas.to_string(),
            tiers(&groups),
        ]);
    }
    out.push_str(&pools.render("  "));
}

/// Every condition type a policy always reports, in a fixed order, whether or not status has it
/// yet; then those it reports only when asked, when it has them.
fn describe_conditions(out: &mut String, status: &FailoverPolicyStatus) {
    out.push_str("Conditions:\n");
    let mut conditions = Table::new(["TYPE", "STATUS", "REASON", "MESSAGE"]);
    let asked = condition_type::WHEN_ASKED
        .into_iter()
        .filter(|kind| status.conditions.contains_key(*kind));
    for kind in condition_type::ALL.into_iter().chain(asked) {
        let found = status.conditions.get(kind);
        conditions.row([
            kind.to_owned(),
            status_word(found).to_owned(),
            found.map_or_else(|| "-".to_owned(), |c| c.reason.clone()),
            found.map_or_else(String::new, |c| c.message.clone()),
        ]);
    }
    out.push_str(&conditions.render("  "));
}

/// The last failover, and its steps one by one.
fn describe_last_failover(out: &mut String, last: &FailoverTimeline) {
    let kind = serde_json::to_value(last.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let finished = last
        .finished_at
        .as_deref()
        .map_or_else(|| "not finished".to_owned(), |at| format!("finished {at}"));
    line(
        out,
        "Last failover",
        &format!(
            "{kind} {} → {} at epoch {}, started {}, {finished}",
            last.from_pool, last.to_pool, last.epoch, last.started_at
        ),
    );
    if let Some(seen) = &last.fault_seen_at {
        line(out, "Fault seen", seen);
    }
    let mut steps = Table::new(["STEP", "DONE AT", "TOOK", "NOTE"]);
    for step in &last.steps {
        let mut note = step.note.clone().unwrap_or_default();
        if step.handed_off {
            note = format!("(handed off) {note}");
        }
        steps.row([
            step.step.clone(),
            step.at.clone(),
            or_dash(step.milliseconds.map(|ms| seconds(ms as f64 / 1000.0))),
            note,
        ]);
    }
    out.push_str(&steps.render("  "));
}

/// Every stage in the order a replica goes through them: a cold start's, or a wake's, then the
/// first token after either.
const IN_ORDER: [Stage; 10] = [
    Stage::Node,
    Stage::ImagePull,
    Stage::ContainerStart,
    Stage::EngineStart,
    Stage::WeightLoad,
    Stage::Warmup,
    Stage::ApiReady,
    Stage::WakeLevel1,
    Stage::WakeLevel2,
    Stage::FirstToken,
];

/// The stages `has` says yes to, in the order a replica goes through them.
fn stages_where(has: impl Fn(&str) -> bool) -> Vec<Stage> {
    IN_ORDER.into_iter().filter(|stage| has(stage.as_str())).collect()
}

fn total(breakdown: &ColdStartBreakdown) -> f64 {
    breakdown.stages.values().flatten().sum()
}

/// The policy's cold starts: a row per replica with each stage's seconds and their sum, then
/// per tier the median and the worst of each stage.
#[must_use]
pub fn cold_starts(policy: &FailoverPolicy) -> String {
    let status = policy.status.clone().unwrap_or_default();
    if status.cold_start.is_empty() {
        return format!(
            "No cold starts measured for {} yet: they are timed when a promotion wakes or starts replicas.\n",
            policy.metadata.name.as_deref().unwrap_or_default()
        );
    }
    let stages = stages_where(|name| {
        status
            .cold_start
            .iter()
            .any(|b| matches!(b.stages.get(name), Some(Some(_))))
    });
    let mut header = vec!["REPLICA".to_owned(), "POOL".to_owned(), "TIER".to_owned()];
    header.extend(stages.iter().map(|s| s.as_str().to_ascii_uppercase()));
    header.push("TOTAL".to_owned());
    let mut replicas = Table::new(header);
    for breakdown in &status.cold_start {
        let mut row = vec![
            breakdown.replica.clone(),
            breakdown.pool.clone(),
            or_dash(breakdown.tier.as_ref()),
        ];
        for stage in &stages {
            let measured = breakdown.stages.get(stage.as_str()).copied().flatten();
            row.push(or_dash(measured.map(seconds)));
        }
        row.push(seconds(total(breakdown)));
        replicas.row(row);
    }
    let mut out = replicas.render("");
    if !status.cold_start_summary.is_empty() {
        let stages = stages_where(|name| {
            status
                .cold_start_summary
                .iter()
                .any(|s| s.stages.contains_key(name))
        });
        let mut header = vec!["TIER".to_owned(), "REPLICAS".to_owned()];
        header.extend(stages.iter().map(|s| s.as_str().to_ascii_uppercase()));
        let mut summary = Table::new(header);
        for tier in &status.cold_start_summary {
            let mut row = vec![tier.tier.clone(), tier.replicas.to_string()];
            for stage in &stages {
                row.push(tier.stages.get(stage.as_str()).map_or_else(
                    || "-".to_owned(),
                    |s| format!("{} / {}", seconds(s.median), seconds(s.worst)),
                ));
            }
            summary.row(row);
        }
        out.push_str("\nPer tier (median / worst):\n");
        out.push_str(&summary.render(""));
    }
    out
}

fn verdict_word<T: serde::Serialize>(value: Option<&T>) -> String {
    value
        .and_then(|v| serde_json::to_value(v).ok())
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "-".to_owned())
}

fn run_row(run: &GameDayRun) -> [String; 7] {
    let recovered = run
        .recovery
        .as_ref()
        .and_then(|r| r.seconds)
        .map_or_else(|| "-".to_owned(), |s| format!("{s}s"));
    let route = match (&run.from_pool, &run.to_pool) {
        (Some(from), Some(to)) => format!("{from} → {to}"),
        _ => "-".to_owned(),
    };
    let requests = run.requests.map_or_else(
        || "-".to_owned(),
        |r| format!("{} sent, {} failed, {} shed", r.sent, r.failed, r.shed),
    );
    [
        run.id.clone(),
        verdict_word(Some(&run.phase)),
        route,
        recovered,
        requests,
        verdict_word(run.verdict.as_ref()),
        run.reason.clone().unwrap_or_default(),
    ]
}

/// The game days, a row each, then every run each one keeps, newest first.
#[must_use]
pub fn gamedays(gamedays: &[GameDay], all_namespaces: bool) -> String {
    if gamedays.is_empty() {
        return "No GameDays found.\n".to_owned();
    }
    let mut header = vec!["NAME", "POLICY", "SCHEDULE", "PHASE", "LAST VERDICT", "NEXT RUN"];
    if all_namespaces {
        header.insert(0, "NAMESPACE");
    }
    let mut table = Table::new(header);
    let mut runs = Table::new([
        "GAMEDAY",
        "RUN",
        "PHASE",
        "PROMOTED",
        "RECOVERED IN",
        "REQUESTS SINCE THE FAULT",
        "VERDICT",
        "WHY",
    ]);
    for gameday in gamedays {
        let name = gameday.metadata.name.clone().unwrap_or_default();
        let status = gameday.status.clone().unwrap_or_default();
        let mut row = vec![
            name.clone(),
            gameday.spec.policy_ref.name.clone(),
            or_dash(gameday.spec.schedule.as_ref()),
            or_dash(status.phase.as_ref()),
            verdict_word(status.last_verdict.as_ref()),
            or_dash(status.next_run_at.as_ref()),
        ];
        if all_namespaces {
            row.insert(0, gameday.metadata.namespace.clone().unwrap_or_default());
        }
        table.row(row);
        for run in status.current_run.iter().chain(&status.last_runs) {
            let mut row = vec![name.clone()];
            row.extend(run_row(run));
            runs.row(row);
        }
    }
    let mut out = table.render("");
    if !runs.is_empty() {
        out.push_str("\nRuns:\n");
        out.push_str(&runs.render(""));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_has_its_place_in_the_order() {
        for stage in Stage::ALL {
            assert!(IN_ORDER.contains(&stage), "{stage:?}");
        }
    }

    #[test]
    fn durations_are_short_and_keep_what_matters() {
        let shown: Vec<String> = [0.0, 0.0004, 0.1659, 4.93, 92.25, 160.0].map(seconds).into();
        assert_eq!(shown, ["0s", "0.4ms", "166ms", "4.9s", "92.2s", "160s"]);
    }
}

//! What `understudy-gameday simulate` prints: a table for people, JSON for programs.

use std::fmt::Write as _;
use std::ops::RangeInclusive;

use serde::Serialize;

use understudy_core::duration;
use understudy_core::failover::FailbackPolicy;

use super::{CheckKind, Outcome, Rules, Schedule, simulate_with, without_failover};

/// The outcome of one schedule, or of the same schedule over a range of thresholds.
#[derive(Debug, Serialize)]
pub struct Report {
    /// A one-line description of the schedule and the policy.
    pub schedule: String,
    /// What the schedule costs with no failover at all.
    pub without_failover: Baseline,
    /// The run of the schedule as written; its counts sit at the top level of the JSON.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub run: Option<Run>,
    /// One run per `promote_after` value, for a sweep.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sweep: Vec<Run>,
}

#[derive(Debug, Serialize)]
pub struct Baseline {
    pub served: u32,
    pub dropped: u32,
    pub silent_lost: u32,
}

#[derive(Debug, Serialize)]
pub struct Run {
    pub promote_after: u32,
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl Report {
    /// The schedule under one set of rules.
    pub fn single(schedule: &Schedule, rules: &Rules) -> Report {
        let mut report = Report::build(schedule, rules, Vec::new());
        let promote_after = rules.config.promote_after;
        report.run = Some(Run {
            promote_after,
            outcome: simulate_with(schedule, rules),
        });
        report
    }

    /// The schedule once per `promote_after` in `range`, everything else as in `rules`.
    pub fn sweep(schedule: &Schedule, rules: &Rules, range: RangeInclusive<u32>) -> Report {
        let sweep = range
            .map(|promote_after| {
                let mut variant = rules.clone();
                let config = &mut variant.config;
                // Hard failures that promoted with the soft threshold keep doing so.
                let hard_follows = config.hard_promote_after == config.promote_after;
                config.promote_after = promote_after;
                config.suspect_after = config.suspect_after.min(promote_after);
                config.hard_promote_after = if hard_follows {
                    promote_after
                } else {
                    config.hard_promote_after.min(promote_after)
                };
                Run {
                    promote_after,
                    outcome: simulate_with(schedule, &variant),
                }
            })
            .collect();
        Report::build(schedule, rules, sweep)
    }

    fn build(schedule: &Schedule, rules: &Rules, sweep: Vec<Run>) -> Report {
        let baseline = without_failover(schedule);
        Report {
            schedule: describe(schedule, rules),
            without_failover: Baseline {
                served: baseline.served,
                dropped: baseline.dropped,
                silent_lost: baseline.silent_lost,
            },
            run: None,
            sweep,
        }
    }

    /// The report as a table, the way the seed prints it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let b = &self.without_failover;
        let _ = writeln!(out, "{}", self.schedule);
        let _ = writeln!(
            out,
            "no failover: served {}, dropped {}, silent lost {}\n",
            b.served, b.dropped, b.silent_lost
        );
        let _ = writeln!(
            out,
            "promote after | failovers | false failovers | failbacks | transition rounds | dropped | silent lost"
        );
        let _ = writeln!(
            out,
            "--------------|-----------|-----------------|-----------|-------------------|---------|------------"
        );
        for run in self.run.iter().chain(&self.sweep) {
            let o = &run.outcome;
            let _ = writeln!(
                out,
                "{:>13} | {:>9} | {:>15} | {:>9} | {:>17} | {:>7} | {:>11}",
                run.promote_after,
                o.failovers,
                o.false_failovers,
                o.failbacks,
                o.transition_rounds,
                o.dropped,
                o.silent_lost
            );
        }
        if let Some(run) = &self.run {
            let _ = writeln!(out, "\ntransitions:");
            for t in &run.outcome.transitions {
                let finished = t.finished.map_or_else(
                    || "unfinished".to_owned(),
                    |round| format!("serving after round {round}"),
                );
                let _ = writeln!(
                    out,
                    "  round {:>4}  {:<8}  {} -> {}  epoch {:<3} {finished}",
                    t.decided, t.kind, t.from, t.to, t.epoch
                );
            }
        }
        out
    }
}

fn describe(schedule: &Schedule, rules: &Rules) -> String {
    let length = |list: &[[u32; 2]]| list.iter().map(|[first, last]| last - first + 1).sum::<u32>();
    let faults = &schedule.replica_a;
    let config = &rules.config;
    let check = match rules.check {
        CheckKind::Shallow => "shallow",
        CheckKind::Generating => "generating",
    };
    let failback = match config.failback {
        FailbackPolicy::Manual => "manual failback".to_owned(),
        FailbackPolicy::Automatic { healthy_checks } => {
            format!("automatic failback after {healthy_checks} healthy rounds")
        }
    };
    format!(
        "{} rounds of {}. Replica A: {} rounds unresponsive, {} stopped, {} half-failed; B always up.\n\
         Policy: {check} checks, promote after {} failed ({} if refused), promotion takes {} round(s), \
         {failback}, dwell {}.",
        schedule.rounds,
        duration::format(rules.round),
        length(&faults.unresponsive),
        length(&faults.stopped),
        length(&faults.half_failed),
        config.promote_after,
        config.hard_promote_after,
        rules.promotion_rounds,
        duration::format(config.min_dwell),
    )
}

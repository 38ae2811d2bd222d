//! The failure schedule a simulation runs, as written in YAML, and its checks.

use serde::Deserialize;

/// A failure schedule for replica A (the home primary) and the policy to run it under.
/// Replica B is always up.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Rounds to run; a round is one check interval. Rounds are numbered from 1.
    pub rounds: u32,
    #[serde(default)]
    pub replica_a: Faults,
    /// The policy, in rounds. May be left out when a FailoverPolicy supplies it instead.
    #[serde(default)]
    pub policy: Option<SimPolicy>,
}

/// When replica A misbehaves, as inclusive `[first, last]` round intervals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Stops answering (timeouts) and recovers on its own.
    #[serde(default)]
    pub unresponsive: Vec<[u32; 2]>,
    /// Really down: connections are refused.
    #[serde(default)]
    pub stopped: Vec<[u32; 2]>,
    /// Answers health checks but cannot do its work.
    #[serde(default)]
    pub half_failed: Vec<[u32; 2]>,
}

/// The policy under test, in rounds.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimPolicy {
    /// Consecutive failed checks before promotion.
    pub promote_after: u32,
    /// Consecutive failed checks before the primary is suspect (default 1).
    #[serde(default = "one")]
    pub suspect_after: u32,
    /// Consecutive hard failures (refused connections) that promote on their own
    /// (default: `promote_after`).
    #[serde(default)]
    pub hard_promote_after: Option<u32>,
    /// Consecutive passing checks before a standby may be promoted (default 1).
    #[serde(default = "one")]
    pub standby_ready_after: u32,
    /// Rounds a promotion takes from decision to serving (default 1).
    #[serde(default = "one")]
    pub promotion_rounds: u32,
    /// Rounds after a promotion during which no other starts (default 0).
    #[serde(default)]
    pub min_dwell_rounds: u32,
    pub failback: SimFailback,
    #[serde(default)]
    pub check: CheckKind,
}

fn one() -> u32 {
    1
}

/// Failback in the simulator's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase", deny_unknown_fields)]
pub enum SimFailback {
    Manual,
    Automatic { healthy_rounds: u32 },
}

/// What the policy's check asks a replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    /// "Does it respond": a half-failed replica passes.
    #[default]
    Shallow,
    /// A real generation with its answer checked: a half-failed replica fails.
    Generating,
}

/// What replica A is doing in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    Up,
    Unresponsive,
    Stopped,
    HalfFailed,
}

/// A schedule that cannot be run, with what is wrong in it.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("cannot read the schedule: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("rounds must be at least 1")]
    NoRounds,
    #[error("the schedule has no policy: add a `policy:` section or pass a FailoverPolicy")]
    NoPolicy,
    #[error("policy.{field} must be at least 1")]
    Zero { field: &'static str },
    #[error("replica_a.{kind} interval [{first}, {last}] is empty: the first round comes after the last")]
    Reversed {
        kind: &'static str,
        first: u32,
        last: u32,
    },
    #[error("replica_a.{kind} interval [{first}, {last}] is outside rounds 1 to {rounds}")]
    OutOfRange {
        kind: &'static str,
        first: u32,
        last: u32,
        rounds: u32,
    },
    #[error(
        "replica_a.{kind} [{first}, {last}] overlaps replica_a.{other_kind} [{other_first}, {other_last}]"
    )]
    Overlap {
        kind: &'static str,
        first: u32,
        last: u32,
        other_kind: &'static str,
        other_first: u32,
        other_last: u32,
    },
    #[error("policy.{0}")]
    Policy(understudy_core::failover::ConfigError),
}

impl Schedule {
    /// Reads and checks a schedule.
    pub fn from_yaml(text: &str) -> Result<Schedule, ScheduleError> {
        let schedule: Schedule = serde_yaml::from_str(text)?;
        schedule.check()?;
        Ok(schedule)
    }

    /// Refuses schedules that do not describe one clear sequence of events.
    pub fn check(&self) -> Result<(), ScheduleError> {
        if self.rounds == 0 {
            return Err(ScheduleError::NoRounds);
        }
        if let Some(policy) = &self.policy {
            policy.check()?;
        }
        self.replica_a.check(self.rounds)
    }
}

impl SimPolicy {
    /// Refuses thresholds the state machine could not run: its own rules, in the schedule's words.
    pub fn check(&self) -> Result<(), ScheduleError> {
        if let SimFailback::Automatic { healthy_rounds: 0 } = self.failback {
            return Err(ScheduleError::Zero {
                field: "failback.healthy_rounds",
            });
        }
        super::failover_config(self)
            .check()
            .map_err(ScheduleError::Policy)
    }
}

impl Faults {
    fn check(&self, rounds: u32) -> Result<(), ScheduleError> {
        let intervals = self.intervals();
        for &(kind, [first, last]) in &intervals {
            if first > last {
                return Err(ScheduleError::Reversed { kind, first, last });
            }
            if first < 1 || last > rounds {
                return Err(ScheduleError::OutOfRange {
                    kind,
                    first,
                    last,
                    rounds,
                });
            }
        }
        for (i, &(kind, [first, last])) in intervals.iter().enumerate() {
            for &(other_kind, [other_first, other_last]) in &intervals[i + 1..] {
                if first <= other_last && other_first <= last {
                    return Err(ScheduleError::Overlap {
                        kind,
                        first,
                        last,
                        other_kind,
                        other_first,
                        other_last,
                    });
                }
            }
        }
        Ok(())
    }

    fn intervals(&self) -> Vec<(&'static str, [u32; 2])> {
        let named = [
            ("unresponsive", &self.unresponsive),
            ("stopped", &self.stopped),
            ("half_failed", &self.half_failed),
        ];
        named
            .into_iter()
            .flat_map(|(kind, list)| list.iter().map(move |interval| (kind, *interval)))
            .collect()
    }

    /// What replica A does in round `t`.
    pub fn condition(&self, t: u32) -> Condition {
        let within = |list: &[[u32; 2]]| list.iter().any(|&[first, last]| (first..=last).contains(&t));
        if within(&self.stopped) {
            Condition::Stopped
        } else if within(&self.unresponsive) {
            Condition::Unresponsive
        } else if within(&self.half_failed) {
            Condition::HalfFailed
        } else {
            Condition::Up
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_faults(faults: &str) -> String {
        format!(
            "rounds: 50\nreplica_a:\n{faults}\npolicy:\n  promote_after: 3\n  failback: {{mode: manual}}\n"
        )
    }

    fn error_of(text: &str) -> String {
        match Schedule::from_yaml(text) {
            Ok(_) => panic!("schedule should have been refused:\n{text}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn overlapping_intervals_are_refused_naming_both() {
        let message = error_of(&with_faults("  stopped: [[10, 20]]\n  half_failed: [[20, 25]]"));
        assert_eq!(
            message,
            "replica_a.stopped [10, 20] overlaps replica_a.half_failed [20, 25]"
        );
        let message = error_of(&with_faults("  stopped: [[10, 20], [15, 16]]"));
        assert!(message.contains("overlaps"), "{message}");
    }

    #[test]
    fn rounds_out_of_range_are_refused() {
        let message = error_of(&with_faults("  stopped: [[40, 51]]"));
        assert_eq!(
            message,
            "replica_a.stopped interval [40, 51] is outside rounds 1 to 50"
        );
        let message = error_of(&with_faults("  unresponsive: [[0, 2]]"));
        assert!(message.contains("outside rounds 1 to 50"), "{message}");
        let message = error_of(&with_faults("  unresponsive: [[9, 2]]"));
        assert!(message.contains("first round comes after the last"), "{message}");
    }

    #[test]
    fn zero_thresholds_are_refused() {
        let text = "rounds: 10\npolicy:\n  promote_after: 0\n  failback: {mode: manual}\n";
        assert_eq!(error_of(text), "policy.promote_after must be at least 1");
        let text =
            "rounds: 10\npolicy:\n  promote_after: 2\n  failback: {mode: automatic, healthy_rounds: 0}\n";
        assert_eq!(
            error_of(text),
            "policy.failback.healthy_rounds must be at least 1"
        );
        let text = "rounds: 0\npolicy:\n  promote_after: 2\n  failback: {mode: manual}\n";
        assert_eq!(error_of(text), "rounds must be at least 1");
    }

    #[test]
    fn unknown_keys_and_modes_are_refused() {
        let text = "rounds: 10\npolicy:\n  promote_afer: 2\n  failback: {mode: manual}\n";
        assert!(error_of(text).contains("unknown field `promote_afer`"));
        let text = "rounds: 10\npolicy:\n  promote_after: 2\n  failback: {mode: sometimes}\n";
        assert!(error_of(text).contains("unknown variant `sometimes`"));
    }
}

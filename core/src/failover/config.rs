//! What the state machine needs to know of a policy, already validated.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The failover policy as the state machine sees it: counts and durations, nothing else.
///
/// Built from a FailoverPolicy's spec by the operator and from a schedule's policy by the
/// simulator; [`FailoverConfig::check`] is the one place its rules are enforced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailoverConfig {
    /// Consecutive failed checks of the primary before it is suspect.
    pub suspect_after: u32,
    /// Consecutive failed checks of the primary (any kind) before the standby is promoted.
    pub promote_after: u32,
    /// Consecutive hard failures (connection refused, reset, 5xx) that promote on their own.
    /// At most `promote_after`: a refused connection is stronger evidence than a timeout.
    pub hard_promote_after: u32,
    /// Consecutive passing checks before a standby is eligible for promotion.
    pub standby_ready_after: u32,
    /// No promotion starts within this long after the previous one finished.
    pub min_dwell: Duration,
    /// Whether and when the home pool takes the primary role back.
    pub failback: FailbackPolicy,
    /// Automatic promotion is off while paused; commands still work.
    pub paused: bool,
}

/// When the home pool (pool A) takes the primary role back after a failover.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailbackPolicy {
    /// Only on an explicit failback command.
    Manual,
    /// After the home pool has passed this many consecutive checks as the standby.
    Automatic { healthy_checks: u32 },
}

/// A policy the state machine refuses to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{field} must be at least 1")]
    Zero { field: &'static str },
    #[error("promote_after ({promote_after}) must not be below suspect_after ({suspect_after})")]
    PromoteBeforeSuspect { suspect_after: u32, promote_after: u32 },
    #[error("hard_promote_after ({hard}) must not be above promote_after ({promote_after})")]
    HardAfterSoft { hard: u32, promote_after: u32 },
}

impl FailoverConfig {
    /// Checks the rules the schema also enforces, so a config built by hand cannot skip them.
    pub fn check(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("suspect_after", self.suspect_after),
            ("promote_after", self.promote_after),
            ("hard_promote_after", self.hard_promote_after),
            ("standby_ready_after", self.standby_ready_after),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if let FailbackPolicy::Automatic { healthy_checks: 0 } = self.failback {
            return Err(ConfigError::Zero {
                field: "failback.healthy_checks",
            });
        }
        if self.promote_after < self.suspect_after {
            return Err(ConfigError::PromoteBeforeSuspect {
                suspect_after: self.suspect_after,
                promote_after: self.promote_after,
            });
        }
        if self.hard_promote_after > self.promote_after {
            return Err(ConfigError::HardAfterSoft {
                hard: self.hard_promote_after,
                promote_after: self.promote_after,
            });
        }
        Ok(())
    }
}

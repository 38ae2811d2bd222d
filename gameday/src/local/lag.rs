//! The runner's own scheduling lag: how late its timers fire. A game day's figures (detection,
//! the gap, requests timed out) are times on a machine the run shares with everything else; when
//! another build takes both cores, the routers, fences, replicas and this process all run late,
//! and a failure then says more about the machine than about failover. A tick every
//! [`TICK`] measures how late each wake-up came; the run reports the spread, and a run that failed
//! while the machine was too loaded ([`SchedulingLag::too_loaded`]) is inconclusive, not failed.
//!
//! This module only measures. It must never change what the run does.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use super::lock;

/// How often the runner checks its own timers.
pub const TICK: Duration = Duration::from_millis(10);
/// A 99th-percentile lateness at or above this means the machine is too loaded to judge by:
/// a tenth of a second on most wake-ups bends every figure measured in tens of milliseconds.
pub const TOO_LATE_P99: Duration = Duration::from_millis(100);
/// A single stall this long means the same: it is a whole probe interval in most scenarios.
pub const TOO_LATE_ONCE: Duration = Duration::from_secs(1);

/// How late the runner's timers fired over a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SchedulingLag {
    /// Wake-ups measured.
    pub ticks: u64,
    /// The 99th percentile of lateness, in milliseconds.
    pub p99_ms: f64,
    /// The latest wake-up, in milliseconds, and when it came (from the start of load).
    pub max_ms: f64,
    pub max_at_ms: f64,
}

impl SchedulingLag {
    /// The lag from each wake-up's lateness and when it came. Pure.
    #[must_use]
    pub fn from_samples(samples: &[(Duration, Duration)]) -> Self {
        if samples.is_empty() {
            return SchedulingLag::default();
        }
        let mut late: Vec<Duration> = samples.iter().map(|(_, l)| *l).collect();
        late.sort_unstable();
        let p99 = late[(late.len() * 99).div_ceil(100).saturating_sub(1)];
        let (max_at, max) = samples
            .iter()
            .copied()
            .max_by_key(|(_, l)| *l)
            .unwrap_or_default();
        SchedulingLag {
            ticks: samples.len() as u64,
            p99_ms: ms(p99),
            max_ms: ms(max),
            max_at_ms: ms(max_at),
        }
    }

    /// Why the machine was too loaded for the run's figures to be judged, if it was.
    #[must_use]
    pub fn too_loaded(&self) -> Option<String> {
        let over = self.p99_ms >= ms(TOO_LATE_P99) || self.max_ms >= ms(TOO_LATE_ONCE);
        over.then(|| {
            format!(
                "the machine was too loaded to judge by: this process's timers fired {:.0} ms late \
                 at the 99th percentile and {:.0} ms late at {:.0} ms (the bounds are {} ms and {} ms)",
                self.p99_ms,
                self.max_ms,
                self.max_at_ms,
                TOO_LATE_P99.as_millis(),
                TOO_LATE_ONCE.as_millis()
            )
        })
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

/// Wakes every [`TICK`] from `start` and records how late each wake-up came, until dropped.
pub async fn watch(start: Instant, samples: Arc<Mutex<Vec<(Duration, Duration)>>>) {
    let mut due = Instant::now() + TICK;
    loop {
        tokio::time::sleep_until(due).await;
        let now = Instant::now();
        lock(&samples).push((
            now.saturating_duration_since(start),
            now.saturating_duration_since(due),
        ));
        due = now + TICK;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(ms: u64, late_ms: u64) -> (Duration, Duration) {
        (Duration::from_millis(ms), Duration::from_millis(late_ms))
    }

    #[test]
    fn a_quiet_machine_is_fit_to_judge_by() {
        let samples: Vec<_> = (0..1000).map(|i| at(i * 10, i % 3)).collect();
        let lag = SchedulingLag::from_samples(&samples);
        assert_eq!((lag.ticks, lag.p99_ms, lag.max_ms), (1000, 2.0, 2.0));
        assert_eq!(lag.too_loaded(), None);
    }

    #[test]
    fn one_long_stall_or_a_late_tail_makes_the_run_unfit_to_judge_by() {
        let mut samples: Vec<_> = (0..1000).map(|i| at(i * 10, 1)).collect();
        samples[500] = at(5_000, 1_300);
        let stalled = SchedulingLag::from_samples(&samples);
        assert_eq!((stalled.max_ms, stalled.max_at_ms), (1300.0, 5000.0));
        let why = stalled.too_loaded().unwrap();
        assert!(why.contains("1300 ms late at 5000 ms"), "{why}");
        let tail: Vec<_> = (0..1000)
            .map(|i| at(i * 10, if i % 50 == 0 { 150 } else { 1 }))
            .collect();
        let late = SchedulingLag::from_samples(&tail);
        assert_eq!(late.p99_ms, 150.0);
        assert!(late.too_loaded().is_some());
        assert_eq!(SchedulingLag::from_samples(&[]).too_loaded(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_records_each_wake_up_from_the_start() {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let task = tokio::spawn(watch(start, Arc::clone(&samples)));
        tokio::time::sleep(TICK * 5 + TICK / 2).await;
        task.abort();
        let seen = lock(&samples).clone();
        assert_eq!(seen.len(), 5);
        assert_eq!(seen[4].0, TICK * 5);
        assert!(
            seen.iter().all(|(_, late)| late.is_zero()),
            "time is paused: {seen:?}"
        );
    }
}

//! The controllers' watchdog: notices a leader whose controllers are stuck (a deadlock, a request
//! the API server never answers: the client has no read timeout) rather than merely idle.
//!
//! Every reconcile holds a [`Reconciling`] while it runs, as it holds the metrics timer; progress
//! is a reconcile finishing. A controller is stalled while one of its reconciles has run for
//! `stall_after` or longer. An idle controller is never stalled: with nothing to reconcile,
//! nothing is in flight. Two readers act on a [`Stall`]: `/live` answers 503 while this replica
//! leads ([`crate::admin`]), and the leader elector stops renewing the leader Lease
//! ([`crate::leader`]), so that another replica takes over after the lease duration.
//!
//! What it must never do: decide anything about a failover, count a reconcile that was cancelled
//! as still running (its guard is dropped with it), or read any clock but the local monotonic one
//! ([`tokio::time::Instant`]).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio::time::Instant;

/// How long a reconcile may run before its controller counts as stalled, unless configured:
/// longer than the longest a healthy one takes, a Wake from sleep level 2 (four calls in a row to
/// each replica, of up to [`understudy_prober::sleep::DEFAULT_WAKE_TIMEOUT`] each).
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(600);

/// The controllers the watchdog watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciler {
    FailoverPolicy,
    GameDay,
}

impl fmt::Display for Reconciler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reconciler::FailoverPolicy => f.write_str("the FailoverPolicy controller"),
            Reconciler::GameDay => f.write_str("the GameDay controller"),
        }
    }
}

/// A controller with a reconcile that has not finished in time: the oldest one in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stall {
    pub reconciler: Reconciler,
    /// The object being reconciled, `namespace/name`.
    pub object: String,
    /// How long that reconcile has run.
    pub running_for: Duration,
}

impl fmt::Display for Stall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Whole seconds: a probe's reader wants the order of magnitude, not the nanoseconds.
        let running_for = Duration::from_secs(self.running_for.as_secs());
        write!(
            f,
            "{} is stalled: its reconcile of {} has run for {} without finishing",
            self.reconciler,
            self.object,
            understudy_core::duration::format(running_for)
        )
    }
}

/// The shared record of the reconciles in flight. Cloning shares it.
#[derive(Clone, Debug)]
pub struct Watchdog(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    stall_after: Duration,
    in_flight: Mutex<InFlight>,
}

#[derive(Debug, Default)]
struct InFlight {
    next_id: u64,
    /// Keyed by an id handed out in start order, so the first entry is the oldest.
    started: BTreeMap<u64, (Reconciler, String, Instant)>,
}

impl Default for Watchdog {
    fn default() -> Self {
        Watchdog::new(DEFAULT_STALL_AFTER)
    }
}

impl Watchdog {
    /// A watchdog that calls a controller stalled once one of its reconciles has run for
    /// `stall_after`.
    #[must_use]
    pub fn new(stall_after: Duration) -> Self {
        Watchdog(Arc::new(Shared {
            stall_after,
            in_flight: Mutex::new(InFlight::default()),
        }))
    }

    /// Records that `reconciler` started a reconcile of `object`; it finishes when the returned
    /// guard is dropped.
    pub fn reconciling(&self, reconciler: Reconciler, object: &ObjectMeta) -> Reconciling {
        let object = format!(
            "{}/{}",
            object.namespace.as_deref().unwrap_or_default(),
            object.name.as_deref().unwrap_or_default()
        );
        let mut in_flight = self.0.in_flight();
        let id = in_flight.next_id;
        in_flight.next_id += 1;
        in_flight.started.insert(id, (reconciler, object, Instant::now()));
        Reconciling {
            shared: self.0.clone(),
            id,
        }
    }

    /// The oldest reconcile in flight if it has run for `stall_after` or longer.
    #[must_use]
    pub fn stall(&self) -> Option<Stall> {
        let in_flight = self.0.in_flight();
        let (_, (reconciler, object, started)) = in_flight.started.first_key_value()?;
        let running_for = started.elapsed();
        (running_for >= self.0.stall_after).then(|| Stall {
            reconciler: *reconciler,
            object: object.clone(),
            running_for,
        })
    }
}

impl Shared {
    fn in_flight(&self) -> MutexGuard<'_, InFlight> {
        // Every change leaves the map whole; a panic elsewhere while it was held loses nothing.
        self.in_flight.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One reconcile in flight, from [`Watchdog::reconciling`] until it is dropped.
#[derive(Debug)]
#[must_use = "a reconcile counts as in flight only while its guard is held"]
pub struct Reconciling {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Reconciling {
    fn drop(&mut self) {
        self.shared.in_flight().started.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use tokio::time::advance;

    use super::*;

    const STALL_AFTER: Duration = Duration::from_secs(60);

    fn meta(name: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: Some("serving".into()),
            name: Some(name.into()),
            ..ObjectMeta::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_controller_is_never_stalled() {
        let watchdog = Watchdog::new(STALL_AFTER);
        advance(Duration::from_secs(3600)).await;
        assert_eq!(watchdog.stall(), None);
        drop(watchdog.reconciling(Reconciler::FailoverPolicy, &meta("llama")));
        advance(Duration::from_secs(3600)).await;
        assert_eq!(watchdog.stall(), None, "a finished reconcile is progress");
    }

    #[tokio::test(start_paused = true)]
    async fn a_reconcile_running_for_stall_after_stalls_its_controller_until_it_finishes() {
        let watchdog = Watchdog::new(STALL_AFTER);
        let stuck = watchdog.reconciling(Reconciler::GameDay, &meta("weekly"));
        advance(Duration::from_secs(59)).await;
        assert_eq!(watchdog.stall(), None);
        advance(Duration::from_secs(1)).await;
        let stall = watchdog.stall().unwrap_or_else(|| panic!("not stalled"));
        assert_eq!(
            (stall.reconciler, stall.object.as_str(), stall.running_for),
            (Reconciler::GameDay, "serving/weekly", STALL_AFTER)
        );
        assert_eq!(
            stall.to_string(),
            "the GameDay controller is stalled: its reconcile of serving/weekly has run for 1m0s \
             without finishing"
        );
        drop(stuck);
        assert_eq!(watchdog.stall(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_oldest_reconcile_in_flight_is_the_one_reported_whatever_finishes_around_it() {
        let watchdog = Watchdog::new(STALL_AFTER);
        let stuck = watchdog.reconciling(Reconciler::FailoverPolicy, &meta("llama"));
        // Other reconciles start and finish around it: they are not progress for the stuck one.
        for _ in 0..10 {
            advance(Duration::from_secs(10)).await;
            drop(watchdog.reconciling(Reconciler::GameDay, &meta("weekly")));
        }
        let later = watchdog.reconciling(Reconciler::GameDay, &meta("daily"));
        let stall = watchdog.stall().unwrap_or_else(|| panic!("not stalled"));
        assert_eq!(
            (stall.reconciler, stall.object.as_str()),
            (Reconciler::FailoverPolicy, "serving/llama")
        );
        assert_eq!(stall.running_for, Duration::from_secs(100));
        drop(stuck);
        assert_eq!(watchdog.stall(), None, "the later one has run for no time");
        drop(later);
    }
}

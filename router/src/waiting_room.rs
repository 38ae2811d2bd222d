//! The waiting room: when no endpoint of the current epoch can take a request (no route yet, or
//! every endpoint refused or is ejected while a promotion is under way), the request waits here,
//! in a bounded room and up to a deadline, for a new route or an endpoint's return, instead of
//! failing.
//!
//! Each priority class may fill its share of the room ([`Priority::share`]: all of it for
//! interactive, three quarters for the default class, two fifths for batch), so that while a
//! promotion holds requests, batch work is shed (429, to be retried) before it can keep an
//! interactive request out. A request also leaves at its client's deadline when it sent one
//! (`x-understudy-deadline-ms`): waiting past it serves nobody.
//!
//! This module only counts and waits. It must never pick an endpoint, and never let more than
//! its bound wait: the one past the bound (or its class's share of it) is refused at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::admission::Priority;
use crate::metrics::Metrics;
use crate::table::{RouteSet, Routed};

/// How many may wait and for how long.
#[derive(Clone, Copy, Debug)]
pub struct WaitingRoomConfig {
    /// Requests waiting at once.
    pub bound: usize,
    /// How long one request may wait in all.
    pub deadline: Duration,
}

impl Default for WaitingRoomConfig {
    fn default() -> Self {
        WaitingRoomConfig {
            bound: 1024,
            deadline: Duration::from_secs(30),
        }
    }
}

/// Why a request left the waiting room without a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Turnaway {
    /// The room held its class's share of requests already.
    #[error("the waiting room is full")]
    Full,
    /// The room is closed (`--queue-bound 0`): this router holds no request.
    #[error("this router holds no request (its waiting room is off)")]
    Closed,
    /// The deadline passed with no endpoint to take the request.
    #[error("no endpoint could take the request before the waiting room's deadline")]
    Deadline,
}

/// The room.
#[derive(Debug)]
pub struct WaitingRoom {
    config: WaitingRoomConfig,
    waiting: AtomicUsize,
}

/// One request's place in the room; leaving frees it.
#[derive(Debug)]
pub struct Seat {
    room: Arc<WaitingRoom>,
    metrics: Arc<Metrics>,
    since: Instant,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.room.waiting.fetch_sub(1, Relaxed);
        self.metrics.queue_depth(-1);
        self.metrics.queue_wait(self.since.elapsed());
    }
}

impl WaitingRoom {
    /// An empty room.
    #[must_use]
    pub fn new(config: WaitingRoomConfig) -> Self {
        WaitingRoom {
            config,
            waiting: AtomicUsize::new(0),
        }
    }

    /// The latest a request that arrived at `arrived` may leave.
    #[must_use]
    pub fn deadline(&self, arrived: Instant) -> Instant {
        arrived + self.config.deadline
    }

    /// Requests waiting now.
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.waiting.load(Relaxed)
    }

    /// Takes a seat, or refuses when the room holds its class's share of the bound already.
    pub fn enter(self: &Arc<Self>, priority: Priority, metrics: &Arc<Metrics>) -> Result<Seat, Turnaway> {
        if self.config.bound == 0 {
            return Err(Turnaway::Closed);
        }
        let share = ((self.config.bound as f64 * priority.share()) as usize).max(1);
        self.waiting
            .fetch_update(Relaxed, Relaxed, |n| (n < share).then_some(n + 1))
            .map_err(|_| Turnaway::Full)?;
        metrics.queue_depth(1);
        Ok(Seat {
            room: Arc::clone(self),
            metrics: Arc::clone(metrics),
            since: Instant::now(),
        })
    }
}

/// Waits until the route a request for `model` takes is no longer `seen`, or until `wake_at` (an
/// endpoint's return), or the deadline, whichever is first; the deadline alone is a
/// [`Turnaway::Deadline`]. A change to another policy's route does not wake it.
pub async fn wait(
    mut routes: watch::Receiver<Arc<RouteSet>>,
    model: Option<&str>,
    seen: Option<&Arc<Routed>>,
    wake_at: Option<Instant>,
    deadline: Instant,
) -> Result<(), Turnaway> {
    let changed = |set: &RouteSet| match (set.for_model(model), seen) {
        (Some(a), Some(b)) => !Arc::ptr_eq(a, b),
        (None, None) => false,
        _ => true,
    };
    // The route may have changed between the caller's look and this subscription.
    if changed(&routes.borrow_and_update()) {
        return Ok(());
    }
    let until = wake_at.map_or(deadline, |w| w.min(deadline));
    loop {
        tokio::select! {
            r = routes.changed() => {
                if r.is_err() {
                    // The table is gone: nothing will ever come.
                    tokio::time::sleep_until(deadline).await;
                    return Err(Turnaway::Deadline);
                }
                if changed(&routes.borrow_and_update()) {
                    return Ok(());
                }
            }
            () = tokio::time::sleep_until(until) => {
                return if until >= deadline { Err(Turnaway::Deadline) } else { Ok(()) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::table::RouteTable;

    fn route(epoch: u64) -> understudy_api::route::Route {
        serde_json::from_value(serde_json::json!({
            "pool": "b", "endpoints": ["127.0.0.1:1"], "epoch": epoch
        }))
        .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_is_released_by_a_new_route_before_its_deadline() {
        let table = Arc::new(RouteTable::new(None).unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        let t = Arc::clone(&table);
        let pusher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            t.update(route(1)).unwrap();
        });
        wait(table.subscribe(), None, None, None, deadline).await.unwrap();
        assert!(table.current_for(None).is_some());
        assert!(Instant::now() < deadline);
        pusher.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_with_nothing_coming_is_turned_away_at_its_deadline() {
        let table = RouteTable::new(None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        assert_eq!(
            wait(table.subscribe(), None, None, None, deadline).await,
            Err(Turnaway::Deadline)
        );
        assert_eq!(Instant::now(), deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn another_policys_new_route_does_not_wake_a_waiter() {
        let table = Arc::new(RouteTable::new(None).unwrap());
        let of = |policy: &str, model: &str, epoch| understudy_api::route::Route {
            policy: policy.to_owned(),
            models: vec![model.to_owned()],
            ..route(epoch)
        };
        table.update(of("ns/chat", "llama", 1)).unwrap();
        table.update(of("ns/code", "coder", 1)).unwrap();
        let seen = table.current_for(Some("llama"));
        let deadline = Instant::now() + Duration::from_secs(10);
        let t = Arc::clone(&table);
        let pusher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            t.update(of("ns/code", "coder", 2)).unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
            t.update(of("ns/chat", "llama", 2)).unwrap();
        });
        let start = Instant::now();
        wait(table.subscribe(), Some("llama"), seen.as_ref(), None, deadline)
            .await
            .unwrap();
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(3),
            "woken by its own policy's route"
        );
        pusher.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_room_refuses_past_its_bound_and_frees_seats_on_leave() {
        let room = Arc::new(WaitingRoom::new(WaitingRoomConfig {
            bound: 2,
            deadline: Duration::from_secs(1),
        }));
        let m = Arc::new(Metrics::default());
        let a = room.enter(Priority::Interactive, &m).unwrap();
        let _b = room.enter(Priority::Interactive, &m).unwrap();
        assert_eq!(room.enter(Priority::Interactive, &m).unwrap_err(), Turnaway::Full);
        drop(a);
        assert_eq!(room.waiting(), 1);
        assert!(room.enter(Priority::Interactive, &m).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn batch_is_turned_away_first_and_interactive_last() {
        let room = Arc::new(WaitingRoom::new(WaitingRoomConfig {
            bound: 10,
            deadline: Duration::from_secs(1),
        }));
        let m = Arc::new(Metrics::default());
        let seated = |priority| std::iter::from_fn(|| room.enter(priority, &m).ok()).collect::<Vec<_>>();
        // Batch fills two fifths of the room, the default class up to three quarters, and
        // interactive the rest.
        let batch = seated(Priority::Batch);
        let default = seated(Priority::Default);
        let interactive = seated(Priority::Interactive);
        assert_eq!((batch.len(), default.len(), interactive.len()), (4, 3, 3));
    }
}

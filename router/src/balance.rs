//! Picking an endpoint: power of two choices by least outstanding requests, among endpoints that
//! are neither ejected, held back by their fence, nor already tried by this request; in panic (too few endpoints left that
//! are not ejected, see [`crate::endpoint::EjectionPolicy::panic_below_percent`]), among all
//! that this request has not tried.
//!
//! This module must never allocate or lock: it runs once per attempt on the hot path.

use std::cell::Cell;
use std::sync::Arc;

use tokio::time::Instant;

use crate::endpoint::Endpoint;

/// The endpoints one request has already tried, as a bit set over their index in the route.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tried(u64);

impl Tried {
    /// Marks endpoint `i` as tried (indices past 63 are not remembered: they stay eligible).
    pub fn insert(&mut self, i: usize) {
        if i < 64 {
            self.0 |= 1 << i;
        }
    }

    /// True when endpoint `i` was tried.
    #[must_use]
    pub fn contains(self, i: usize) -> bool {
        i < 64 && self.0 & (1 << i) != 0
    }
}

/// Picks an endpoint index, or `None` when every endpoint is ejected or tried. Ejections are
/// ignored while fewer than `panic_below_percent` of the endpoints are not ejected, unless all are.
#[must_use]
pub fn pick(
    endpoints: &[Arc<Endpoint>],
    tried: Tried,
    now: Instant,
    panic_below_percent: u32,
) -> Option<usize> {
    // Counted only when an ejected endpoint is met: the common case never scans.
    let panic: Cell<Option<bool>> = Cell::new(None);
    let panicking = || {
        let known = panic
            .get()
            .unwrap_or_else(|| in_panic(endpoints, now, panic_below_percent));
        panic.set(Some(known));
        known
    };
    // A held-back endpoint is never picked, panic or not: its fence would refuse the request.
    let eligible = |i: usize| {
        if tried.contains(i) {
            return false;
        }
        let (ejected, held) = endpoints[i].standing(now);
        !held && (!ejected || panicking())
    };
    let n = endpoints.len();
    if n == 0 {
        return None;
    }
    // Two random probes first; fall back to a scan when they both miss.
    let a = fastrand::usize(..n);
    let b = fastrand::usize(..n);
    let pair = match (eligible(a), eligible(b)) {
        (true, true) => Some(if endpoints[b].outstanding() < endpoints[a].outstanding() {
            b
        } else {
            a
        }),
        (true, false) => Some(a),
        (false, true) => Some(b),
        (false, false) => None,
    };
    pair.or_else(|| {
        (0..n)
            .filter(|&i| eligible(i))
            .min_by_key(|&i| endpoints[i].outstanding())
    })
}

/// Whether too few endpoints are left that are not ejected, but some are. No allocation.
fn in_panic(endpoints: &[Arc<Endpoint>], now: Instant, panic_below_percent: u32) -> bool {
    let serving = endpoints.iter().filter(|e| !e.is_ejected(now)).count();
    serving > 0 && serving * 100 < panic_below_percent as usize * endpoints.len()
}

/// The earliest moment an ejected or held-back, untried endpoint comes back, if any.
#[must_use]
pub fn next_return(endpoints: &[Arc<Endpoint>], tried: Tried, now: Instant) -> Option<Instant> {
    endpoints
        .iter()
        .enumerate()
        .filter(|(i, _)| !tried.contains(*i))
        .filter_map(|(_, e)| e.back_at(now))
        .min()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoint::{EjectionPolicy, Outcome, Outstanding};

    fn endpoints(n: u16) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| Arc::new(Endpoint::new(format!("127.0.0.1:{}", 9000 + i).parse().unwrap())))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejected_or_tried_endpoint_is_never_picked() {
        let eps = endpoints(3);
        let now = Instant::now();
        eps[0].record(Outcome::Refused, &EjectionPolicy::default(), now);
        let mut tried = Tried::default();
        tried.insert(1);
        for _ in 0..100 {
            assert_eq!(pick(&eps, tried, now, 50), Some(2));
        }
        tried.insert(2);
        assert_eq!(pick(&eps, tried, now, 50), None);
        assert!(next_return(&eps, tried, now).is_some(), "endpoint 0 comes back");
    }

    #[tokio::test(start_paused = true)]
    async fn with_too_few_endpoints_left_ejections_are_ignored_but_not_when_all_are_ejected() {
        let eps = endpoints(4);
        let now = Instant::now();
        let eject = |i: usize| eps[i].record(Outcome::Refused, &EjectionPolicy::default(), now);
        let picked = |threshold| {
            (0..400)
                .filter_map(|_| pick(&eps, Tried::default(), now, threshold))
                .collect::<std::collections::BTreeSet<_>>()
        };
        // Two of four left (50 %): not below the threshold, only those two take requests.
        eject(0);
        eject(1);
        assert_eq!(picked(50), [2, 3].into());
        // One of four (25 %): panic, all four take requests; with the threshold off, one does.
        eject(2);
        assert_eq!(picked(50), [0, 1, 2, 3].into());
        assert_eq!(picked(0), [3].into());
        // None left: the pool is down, the request waits for a route.
        eject(3);
        assert_eq!(pick(&eps, Tried::default(), now, 50), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_less_loaded_endpoint_wins_most_picks() {
        let eps = endpoints(2);
        let _busy: Vec<_> = (0..10).map(|_| Outstanding::begin(&eps[0])).collect();
        let picks_of_1 = (0..1000)
            .filter(|_| pick(&eps, Tried::default(), Instant::now(), 50) == Some(1))
            .count();
        // Endpoint 0 wins only when both probes land on it: about a quarter of the time.
        assert!(picks_of_1 > 650, "{picks_of_1}");
    }
}

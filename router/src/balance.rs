//! Picking an endpoint: power of two choices by least outstanding requests, among endpoints that
//! are neither ejected nor already tried by this request.
//!
//! This module must never allocate or lock: it runs once per attempt on the hot path.

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

/// Picks an endpoint index, or `None` when every endpoint is ejected or tried.
#[must_use]
pub fn pick(endpoints: &[Arc<Endpoint>], tried: Tried, now: Instant) -> Option<usize> {
    let eligible = |i: usize| !tried.contains(i) && !endpoints[i].is_ejected(now);
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

/// The earliest moment an ejected, untried endpoint comes back, if any.
#[must_use]
pub fn next_return(endpoints: &[Arc<Endpoint>], tried: Tried, now: Instant) -> Option<Instant> {
    endpoints
        .iter()
        .enumerate()
        .filter(|(i, _)| !tried.contains(*i))
        .filter_map(|(_, e)| e.ejected_until(now))
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
            assert_eq!(pick(&eps, tried, now), Some(2));
        }
        tried.insert(2);
        assert_eq!(pick(&eps, tried, now), None);
        assert!(next_return(&eps, tried, now).is_some(), "endpoint 0 comes back");
    }

    #[tokio::test(start_paused = true)]
    async fn the_less_loaded_endpoint_wins_most_picks() {
        let eps = endpoints(2);
        let _busy: Vec<_> = (0..10).map(|_| Outstanding::begin(&eps[0])).collect();
        let picks_of_1 = (0..1000)
            .filter(|_| pick(&eps, Tried::default(), Instant::now()) == Some(1))
            .count();
        // Endpoint 0 wins only when both probes land on it: about a quarter of the time.
        assert!(picks_of_1 > 650, "{picks_of_1}");
    }
}

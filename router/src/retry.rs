//! The retry budget: retries in flight may be at most a share of the requests in flight, with a
//! small floor (Envoy's `retry_budget`: 20 %, at least 3).
//!
//! This module only counts. It must never decide what is retryable (that is the gateway: only
//! failures before any response byte) and never lock.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counts active requests and retries in flight.
#[derive(Debug)]
pub struct RetryBudget {
    active: AtomicUsize,
    retries: AtomicUsize,
    percent: usize,
    floor: usize,
}

/// How large the retry budget is: `percent` of the requests in flight, never below `floor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryLimits {
    pub percent: usize,
    pub floor: usize,
}

impl RetryLimits {
    /// No retries at all: a failed try is the request's answer, as with a proxy that never
    /// retries a POST (nginx's default for non-idempotent requests).
    pub const NONE: RetryLimits = RetryLimits { percent: 0, floor: 0 };
}

impl Default for RetryLimits {
    fn default() -> Self {
        RetryLimits {
            percent: 20,
            floor: 3,
        }
    }
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget::new(RetryLimits::default())
    }
}

impl RetryBudget {
    /// A budget of `limits.percent` of active requests, never below `limits.floor`.
    #[must_use]
    pub fn new(limits: RetryLimits) -> Self {
        RetryBudget {
            active: AtomicUsize::new(0),
            retries: AtomicUsize::new(0),
            percent: limits.percent,
            floor: limits.floor,
        }
    }

    /// A request starts; [`RetryBudget::finish`] ends it.
    pub fn start(&self) {
        self.active.fetch_add(1, Relaxed);
    }

    /// A request ends, with the retries it held.
    pub fn finish(&self, retries_held: usize) {
        self.active.fetch_sub(1, Relaxed);
        if retries_held > 0 {
            self.retries.fetch_sub(retries_held, Relaxed);
        }
    }

    /// Gives back one retry taken for a try that turned out not to be one (its fence had not
    /// read the epoch: nothing was sent).
    pub fn give_back(&self) {
        self.retries.fetch_sub(1, Relaxed);
    }

    /// Takes one retry if the budget allows it.
    #[must_use]
    pub fn try_retry(&self) -> bool {
        let allowed = (self.active.load(Relaxed) * self.percent / 100).max(self.floor);
        self.retries
            .fetch_update(Relaxed, Relaxed, |r| (r < allowed).then_some(r + 1))
            .is_ok()
    }

    /// Retries in flight now.
    #[must_use]
    pub fn retries_in_flight(&self) -> usize {
        self.retries.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_allows_three_retries_even_with_one_request() {
        let b = RetryBudget::default();
        b.start();
        assert!(b.try_retry() && b.try_retry() && b.try_retry());
        assert!(!b.try_retry());
        b.finish(3);
        assert_eq!(b.retries_in_flight(), 0);
    }

    #[test]
    fn no_retries_means_none_however_many_requests_are_in_flight() {
        let b = RetryBudget::new(RetryLimits::NONE);
        for _ in 0..100 {
            b.start();
        }
        assert!(!b.try_retry());
    }

    #[test]
    fn with_many_requests_the_budget_is_a_fifth_of_them() {
        let b = RetryBudget::default();
        for _ in 0..100 {
            b.start();
        }
        let granted = (0..100).filter(|_| b.try_retry()).count();
        assert_eq!(granted, 20);
    }
}

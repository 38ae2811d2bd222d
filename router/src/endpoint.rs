//! One upstream endpoint of the current route: how many requests it has outstanding, what
//! happened to the last ones (the passive signals), and whether it is ejected or held back for
//! now.
//!
//! An ejection answers failures, and grows per burst of them: the failures of requests that were
//! already on their way when the endpoint was ejected belong to the burst that ejected it, so 30
//! requests refused together eject it once, not 30 times. A hold-back answers a fence that says
//! its replica may not serve yet (it has not read the new epoch): not a failure, and short, unless
//! the fence keeps saying so past [`HOLD_BACK_PATIENCE`], when it is stuck and refuses.
//!
//! Everything here is an atomic, because every request touches it. This module must never take a
//! lock, allocate, or decide anything about a whole pool (that is [`crate::signals`]). The
//! endpoint's idle connections are kept beside it, in [`crate::upstream`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::upstream::Pool;

/// What one attempt against an endpoint came to, as the data path sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Outcome {
    /// A response came back (below 500).
    Ok = 1,
    /// The connection was refused (nothing listens): the request never reached a replica.
    Refused = 2,
    /// The connection broke before any response byte.
    Reset = 3,
    /// No response headers within the first-token timeout.
    Timeout = 4,
    /// A 5xx came back.
    ServerError = 5,
    /// The stream broke after bytes had gone to the client.
    Cut = 6,
}

impl Outcome {
    fn from_u8(v: u8) -> Option<Outcome> {
        Some(match v {
            1 => Outcome::Ok,
            2 => Outcome::Refused,
            3 => Outcome::Reset,
            4 => Outcome::Timeout,
            5 => Outcome::ServerError,
            6 => Outcome::Cut,
            _ => return None,
        })
    }

    /// True for outcomes that count towards ejection.
    #[must_use]
    pub fn is_failure(self) -> bool {
        !matches!(self, Outcome::Ok)
    }
}

/// How endpoints are ejected: `base × consecutive ejections`, capped, with jitter.
#[derive(Clone, Copy, Debug)]
pub struct EjectionPolicy {
    /// The first ejection's length.
    pub base: Duration,
    /// The longest ejection.
    pub max: Duration,
    /// Consecutive 5xx or timeouts before an ejection (refused and reset eject at once).
    pub consecutive_soft: u32,
    /// Envoy's panic threshold: when fewer than this percentage of a route's endpoints are not
    /// ejected (but some are), ejections are ignored and every endpoint takes requests, so that
    /// ejections cannot pile the whole load onto the few left. 0 turns it off. When every
    /// endpoint is ejected the pool is down: requests wait for a route instead.
    pub panic_below_percent: u32,
}

impl Default for EjectionPolicy {
    fn default() -> Self {
        EjectionPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(30),
            consecutive_soft: 5,
            panic_below_percent: 50,
        }
    }
}

/// The first hold-back after a fence's "not yet": a fence reads its epoch every 100 ms in a
/// local game day and every second by default in a cluster, so waiting requests try again a few
/// times within one read, never many.
pub const HOLD_BACK_FIRST: Duration = Duration::from_millis(10);
/// The longest hold-back.
pub const HOLD_BACK_MAX: Duration = Duration::from_millis(100);
/// How long a fence may keep answering "fenced" before it counts as a refusal: three of a
/// cluster fence's Lease reads.
pub const HOLD_BACK_PATIENCE: Duration = Duration::from_secs(3);

impl EjectionPolicy {
    /// How long the `n`-th consecutive ejection lasts, before jitter. Pure.
    #[must_use]
    pub fn backoff(&self, n: u32) -> Duration {
        self.base.saturating_mul(n.max(1)).min(self.max)
    }
}

/// Counters for one endpoint, read by `GET /signals`.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointSnapshot {
    /// `ip:port`.
    pub addr: SocketAddr,
    /// Requests in flight now.
    pub outstanding: u32,
    /// Ejected at the moment of the snapshot.
    pub ejected: bool,
    /// The last attempt's outcome.
    pub last: Option<Outcome>,
    /// Totals since the route arrived.
    pub refused: u64,
    /// Resets before any response byte.
    pub reset: u64,
    /// First-token timeouts.
    pub timeouts: u64,
    /// Answers from its fence that it may not serve yet (not failures).
    pub held_back: u64,
    /// 5xx answers.
    pub server_errors: u64,
    /// Streams cut after bytes went out.
    pub cut: u64,
    /// Moving average of time to the first response byte, in milliseconds (0: none yet).
    pub ttft_ms: f64,
}

/// One upstream endpoint.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    host: http::HeaderValue,
    connections: Pool,
    born: Instant,
    outstanding: AtomicU32,
    /// Microseconds after `born` until which the endpoint is ejected.
    ejected_until_us: AtomicU64,
    /// Microseconds after `born` until which its fence asked not to be sent work.
    held_until_us: AtomicU64,
    /// Hold-backs since the last answer served: each one twice as long as the last, up to
    /// [`HOLD_BACK_MAX`].
    holds: AtomicU32,
    /// Microseconds after `born` when the hold-backs since the last answer served began.
    held_since_us: AtomicU64,
    held_back: AtomicU64,
    consecutive_failures: AtomicU32,
    ejections: AtomicU32,
    last: AtomicU8,
    refused: AtomicU64,
    reset: AtomicU64,
    timeouts: AtomicU64,
    server_errors: AtomicU64,
    cut: AtomicU64,
    ttft_ewma_us: AtomicU64,
}

impl Endpoint {
    /// A fresh endpoint: nothing outstanding, not ejected.
    #[must_use]
    pub fn new(addr: SocketAddr) -> Self {
        let host = http::HeaderValue::try_from(addr.to_string())
            .unwrap_or_else(|_| http::HeaderValue::from_static("0.0.0.0"));
        Endpoint {
            addr,
            host,
            connections: Pool::default(),
            born: Instant::now(),
            outstanding: AtomicU32::new(0),
            ejected_until_us: AtomicU64::new(0),
            held_until_us: AtomicU64::new(0),
            holds: AtomicU32::new(0),
            held_since_us: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            last: AtomicU8::new(0),
            refused: AtomicU64::new(0),
            reset: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            server_errors: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            ttft_ewma_us: AtomicU64::new(0),
        }
    }

    /// `ip:port`.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `Host` header for requests to it.
    #[must_use]
    pub fn host(&self) -> &http::HeaderValue {
        &self.host
    }

    /// Its idle keep-alive connections.
    #[must_use]
    pub fn connections(&self) -> &Pool {
        &self.connections
    }

    /// Requests in flight.
    #[must_use]
    pub fn outstanding(&self) -> u32 {
        self.outstanding.load(Relaxed)
    }

    fn micros(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.born).as_micros()).unwrap_or(u64::MAX)
    }

    /// True while ejected.
    #[must_use]
    pub fn is_ejected(&self, now: Instant) -> bool {
        self.micros(now) < self.ejected_until_us.load(Relaxed)
    }

    /// Whether it is ejected and whether it is held back, at `now`: one reading of the clock for
    /// both, for the picker.
    #[must_use]
    pub fn standing(&self, now: Instant) -> (bool, bool) {
        let at = self.micros(now);
        (
            at < self.ejected_until_us.load(Relaxed),
            at < self.held_until_us.load(Relaxed),
        )
    }

    /// True while its fence has asked not to be sent work.
    #[must_use]
    pub fn is_held_back(&self, now: Instant) -> bool {
        self.micros(now) < self.held_until_us.load(Relaxed)
    }

    /// When it may take requests again, if it is ejected or held back now.
    #[must_use]
    pub fn back_at(&self, now: Instant) -> Option<Instant> {
        let until = self
            .ejected_until_us
            .load(Relaxed)
            .max(self.held_until_us.load(Relaxed));
        (self.micros(now) < until).then(|| self.born + Duration::from_micros(until))
    }

    /// Its fence answered that its replica may not serve yet: sends to it pause for a moment,
    /// doubling from [`HOLD_BACK_FIRST`] to [`HOLD_BACK_MAX`] while the fence keeps saying so,
    /// so that requests waiting for it find it within a moment of its fence reading the epoch.
    /// Not a failure: nothing counts towards an ejection. A refusal from a request sent before
    /// the hold-back began belongs to it, and does not lengthen it.
    ///
    /// A fence that keeps saying so for longer than [`HOLD_BACK_PATIENCE`] is not behind but stuck
    /// (it cannot read the Lease, or its pool lost it and no new route came): `false`, and the
    /// caller counts the answer as a refusal, which ejects the endpoint and shows in the pool's
    /// passive signals.
    pub fn hold_back(&self, now: Instant) -> bool {
        self.held_back.fetch_add(1, Relaxed);
        let at = self.micros(now);
        if self.holds.load(Relaxed) == 0 {
            self.held_since_us.store(at, Relaxed);
        }
        let patience = u64::try_from(HOLD_BACK_PATIENCE.as_micros()).unwrap_or(u64::MAX);
        if at.saturating_sub(self.held_since_us.load(Relaxed)) > patience {
            return false;
        }
        if self.is_held_back(now) {
            return true;
        }
        let n = self.holds.fetch_add(1, Relaxed).min(8);
        let pause = HOLD_BACK_FIRST.saturating_mul(1 << n).min(HOLD_BACK_MAX);
        self.held_until_us.store(self.micros(now + pause), Relaxed);
        true
    }

    /// Records an outcome; returns `true` when it ejected the endpoint.
    pub fn record(&self, outcome: Outcome, policy: &EjectionPolicy, now: Instant) -> bool {
        self.last.store(outcome as u8, Relaxed);
        let counter = match outcome {
            Outcome::Ok => {
                self.consecutive_failures.store(0, Relaxed);
                self.ejections.store(0, Relaxed);
                self.holds.store(0, Relaxed);
                return false;
            }
            Outcome::Refused => &self.refused,
            Outcome::Reset => &self.reset,
            Outcome::Timeout => &self.timeouts,
            Outcome::ServerError => &self.server_errors,
            Outcome::Cut => &self.cut,
        };
        counter.fetch_add(1, Relaxed);
        if self.is_ejected(now) {
            // Sent before the ejection: part of the burst that caused it.
            return false;
        }
        let consecutive = self.consecutive_failures.fetch_add(1, Relaxed) + 1;
        let eject_now = match outcome {
            Outcome::Refused | Outcome::Reset | Outcome::Cut => true,
            _ => consecutive >= policy.consecutive_soft,
        };
        if !eject_now {
            return false;
        }
        self.consecutive_failures.store(0, Relaxed);
        let n = self.ejections.fetch_add(1, Relaxed) + 1;
        let backoff = policy.backoff(n);
        // ±15 % jitter, so that endpoints ejected together do not come back together.
        let jitter = 0.85 + 0.3 * fastrand::f64();
        let until = now + backoff.mul_f64(jitter);
        self.ejected_until_us.store(self.micros(until), Relaxed);
        true
    }

    /// Folds one time-to-first-byte sample into the moving average (weight 1/8).
    pub fn record_ttft(&self, ttft: Duration) {
        let sample = u64::try_from(ttft.as_micros()).unwrap_or(u64::MAX);
        let old = self.ttft_ewma_us.load(Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.ttft_ewma_us.store(new, Relaxed);
    }

    /// The last attempt's outcome.
    #[must_use]
    pub fn last(&self) -> Option<Outcome> {
        Outcome::from_u8(self.last.load(Relaxed))
    }

    /// The counters, for `GET /signals`.
    #[must_use]
    pub fn snapshot(&self, now: Instant) -> EndpointSnapshot {
        EndpointSnapshot {
            addr: self.addr,
            outstanding: self.outstanding(),
            ejected: self.is_ejected(now),
            last: self.last(),
            refused: self.refused.load(Relaxed),
            reset: self.reset.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
            held_back: self.held_back.load(Relaxed),
            server_errors: self.server_errors.load(Relaxed),
            cut: self.cut.load(Relaxed),
            ttft_ms: self.ttft_ewma_us.load(Relaxed) as f64 / 1000.0,
        }
    }
}

/// A request counted among an endpoint's outstanding ones until this is dropped, however its
/// future ends: a request whose client goes away while it waits for the upstream is dropped, not
/// finished, and must not stay counted for ever.
#[derive(Debug)]
pub struct Outstanding(Arc<Endpoint>);

impl Outstanding {
    /// Counts one more request in flight on `endpoint`.
    #[must_use]
    pub fn begin(endpoint: &Arc<Endpoint>) -> Self {
        endpoint.outstanding.fetch_add(1, Relaxed);
        Outstanding(Arc::clone(endpoint))
    }
}

impl std::ops::Deref for Outstanding {
    type Target = Endpoint;

    fn deref(&self) -> &Endpoint {
        &self.0
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ep() -> Endpoint {
        Endpoint::new("127.0.0.1:9".parse().unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_connection_ejects_at_once_and_the_ejection_ends_on_its_own() {
        let e = ep();
        let policy = EjectionPolicy::default();
        assert!(e.record(Outcome::Refused, &policy, Instant::now()));
        assert!(e.is_ejected(Instant::now()));
        tokio::time::advance(Duration::from_millis(1200)).await;
        assert!(
            !e.is_ejected(Instant::now()),
            "one base (1 s) plus at most 15 % jitter"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn repeated_ejections_back_off_multiplicatively_until_the_cap() {
        let e = ep();
        let policy = EjectionPolicy::default();
        for _ in 0..3 {
            assert!(e.record(Outcome::Refused, &policy, Instant::now()));
            let back = e.back_at(Instant::now()).unwrap();
            tokio::time::advance(back - Instant::now()).await;
        }
        e.record(Outcome::Refused, &policy, Instant::now());
        // The fourth ejection lasts 4 s ± 15 %: still ejected after 2.5 s.
        tokio::time::advance(Duration::from_millis(2500)).await;
        assert!(e.is_ejected(Instant::now()));
        assert_eq!(policy.backoff(100), policy.max);
    }

    #[tokio::test(start_paused = true)]
    async fn soft_failures_eject_only_after_several_in_a_row_and_a_success_resets_them() {
        let e = ep();
        let policy = EjectionPolicy::default();
        for _ in 0..4 {
            assert!(!e.record(Outcome::ServerError, &policy, Instant::now()));
        }
        e.record(Outcome::Ok, &policy, Instant::now());
        for _ in 0..4 {
            assert!(!e.record(Outcome::Timeout, &policy, Instant::now()));
        }
        assert!(e.record(Outcome::Timeout, &policy, Instant::now()));
        let s = e.snapshot(Instant::now());
        assert_eq!(
            (s.server_errors, s.timeouts, s.last),
            (4, 5, Some(Outcome::Timeout))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn thirty_refusals_in_one_burst_eject_once_for_the_first_back_off() {
        let e = ep();
        let policy = EjectionPolicy::default();
        let ejected = (0..30)
            .filter(|_| e.record(Outcome::Refused, &policy, Instant::now()))
            .count();
        assert_eq!(ejected, 1, "the other 29 were sent before the ejection");
        assert_eq!(
            e.snapshot(Instant::now()).refused,
            30,
            "each one is still counted"
        );
        tokio::time::advance(Duration::from_millis(1200)).await;
        assert!(!e.is_ejected(Instant::now()), "one base, not 30");
        // The next burst is the second: twice the base.
        assert!(e.record(Outcome::Refused, &policy, Instant::now()));
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(e.is_ejected(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_not_yet_serving_holds_back_briefly_and_never_ejects() {
        let e = ep();
        let policy = EjectionPolicy::default();
        for _ in 0..60 {
            assert!(e.hold_back(Instant::now()));
        }
        assert!(!e.is_ejected(Instant::now()));
        assert!(e.is_held_back(Instant::now()));
        assert_eq!(e.back_at(Instant::now()), Some(Instant::now() + HOLD_BACK_FIRST));
        // Each hold-back after the last one ended is twice as long, up to the cap.
        let mut pauses = Vec::new();
        for _ in 0..6 {
            let until = e.back_at(Instant::now()).unwrap();
            pauses.push((until - Instant::now()).as_millis());
            tokio::time::advance(until - Instant::now()).await;
            e.hold_back(Instant::now());
        }
        assert_eq!(pauses, [10, 20, 40, 80, 100, 100]);
        // A served answer starts the doubling over.
        tokio::time::advance(HOLD_BACK_MAX).await;
        e.record(Outcome::Ok, &policy, Instant::now());
        e.hold_back(Instant::now());
        assert_eq!(e.back_at(Instant::now()), Some(Instant::now() + HOLD_BACK_FIRST));
        assert_eq!(e.snapshot(Instant::now()).held_back, 67);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_that_keeps_refusing_past_its_patience_counts_as_refusing() {
        let e = ep();
        let start = Instant::now();
        while Instant::now() - start <= HOLD_BACK_PATIENCE {
            assert!(
                e.hold_back(Instant::now()),
                "held back, not failed, within its patience"
            );
            tokio::time::advance(HOLD_BACK_MAX).await;
        }
        assert!(
            !e.hold_back(Instant::now()),
            "stuck: the caller counts it as a refusal"
        );
        // A served answer ends the streak.
        e.record(Outcome::Ok, &EjectionPolicy::default(), Instant::now());
        assert!(e.hold_back(Instant::now()));
    }
}

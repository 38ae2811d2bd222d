//! The router's metrics, in Prometheus text format on the admin port: requests by outcome and
//! priority, the latency the router adds, the waiting room, sheds, retries, ejections, and the
//! epoch and pool routed.
//!
//! Every series is a fixed array of atomics indexed by enums, so recording is one relaxed add and
//! never a lock, a map lookup or an allocation. Only rendering allocates.

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::admission::{Priority, Shed};

/// How a request ended, as far as the router's answer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The upstream answered below 500 (streamed on).
    Forwarded,
    /// The upstream answered 5xx.
    UpstreamError,
    /// The router refused it: malformed, too large, a control path (4xx).
    Rejected,
    /// Admission control shed it (429).
    Shed,
    /// No endpoint could take it within the waiting room's deadline or bound (503).
    Unavailable,
    /// Every try failed before any byte, or the retry budget ran out (502), or timed out (504).
    UpstreamFailed,
}

impl RequestOutcome {
    const ALL: [RequestOutcome; 6] = [
        RequestOutcome::Forwarded,
        RequestOutcome::UpstreamError,
        RequestOutcome::Rejected,
        RequestOutcome::Shed,
        RequestOutcome::Unavailable,
        RequestOutcome::UpstreamFailed,
    ];

    fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Forwarded => "forwarded",
            RequestOutcome::UpstreamError => "upstream_error",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::Shed => "shed",
            RequestOutcome::Unavailable => "unavailable",
            RequestOutcome::UpstreamFailed => "upstream_failed",
        }
    }
}

/// Upper bounds, in microseconds, of the added-latency buckets.
const ADDED_US: [u64; 10] = [25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 50_000, 250_000];
/// Upper bounds, in milliseconds, of the waiting-room buckets.
const WAIT_MS: [u64; 8] = [10, 50, 100, 500, 1_000, 5_000, 15_000, 60_000];

/// Upper bounds, in milliseconds, of the time-to-first-token buckets.
const TTFT_MS: [u64; 12] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 20_000, 30_000, 60_000,
];

/// A histogram with fixed buckets.
#[derive(Debug)]
struct Histogram<const N: usize> {
    bounds: [u64; N],
    buckets: [AtomicU64; N],
    count: AtomicU64,
    sum: AtomicU64,
}

impl<const N: usize> Histogram<N> {
    fn new(bounds: [u64; N]) -> Self {
        Histogram {
            bounds,
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }

    fn observe(&self, v: u64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum.fetch_add(v, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, scale: f64) {
        let mut cumulative = 0;
        for (b, n) in self.bounds.iter().zip(&self.buckets) {
            cumulative += n.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {cumulative}", *b as f64 / scale);
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum.load(Relaxed) as f64 / scale);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// All of the router's series.
#[derive(Debug)]
pub struct Metrics {
    requests: [[AtomicU64; 3]; 6],
    added: Histogram<10>,
    queue_depth: AtomicI64,
    queue_wait: Histogram<8>,
    ttft: Histogram<12>,
    shed: [[AtomicU64; 3]; Shed::ALL.len()],
    retries: AtomicU64,
    retry_overflow: AtomicU64,
    ejections: AtomicU64,
    streams_cut: AtomicU64,
    continuations: AtomicU64,
    stale_routes: AtomicU64,
    moved: AtomicU64,
    fence_holds: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            added: Histogram::new(ADDED_US),
            queue_depth: AtomicI64::new(0),
            queue_wait: Histogram::new(WAIT_MS),
            ttft: Histogram::new(TTFT_MS),
            shed: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            retries: AtomicU64::new(0),
            retry_overflow: AtomicU64::new(0),
            ejections: AtomicU64::new(0),
            streams_cut: AtomicU64::new(0),
            continuations: AtomicU64::new(0),
            stale_routes: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            fence_holds: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// One request answered.
    pub fn request(&self, outcome: RequestOutcome, priority: Priority) {
        self.requests[outcome as usize][priority as usize].fetch_add(1, Relaxed);
    }
    /// Time the router added before the response headers went out (not counting the upstream).
    pub fn added_latency(&self, d: Duration) {
        self.added
            .observe(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }
    /// A request entered (+1) or left (-1) the waiting room.
    pub fn queue_depth(&self, delta: i64) {
        self.queue_depth.fetch_add(delta, Relaxed);
    }
    /// How long a request waited in the waiting room.
    pub fn queue_wait(&self, d: Duration) {
        self.queue_wait
            .observe(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    }
    /// A request's time to its first token: from its arrival until the first byte of its
    /// answer's body went out.
    pub fn ttft(&self, d: Duration) {
        self.ttft
            .observe(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    }
    /// A request shed by admission control.
    pub fn shed(&self, reason: Shed, priority: Priority) {
        self.shed[reason as usize][priority as usize].fetch_add(1, Relaxed);
    }
    /// A retry taken.
    pub fn retry(&self) {
        self.retries.fetch_add(1, Relaxed);
    }
    /// A retry refused by the budget.
    pub fn retry_overflow(&self) {
        self.retry_overflow.fetch_add(1, Relaxed);
    }
    /// An endpoint ejected.
    pub fn ejection(&self) {
        self.ejections.fetch_add(1, Relaxed);
    }
    /// A stream cut after bytes went out.
    pub fn stream_cut(&self) {
        self.streams_cut.fetch_add(1, Relaxed);
    }
    /// A cut stream carried on by a continuation.
    pub fn continuation(&self) {
        self.continuations.fetch_add(1, Relaxed);
    }
    /// A request sent to a pool that lost the route before its first byte, sent to the new route.
    pub fn moved(&self) {
        self.moved.fetch_add(1, Relaxed);
    }
    /// A fence answered that its replica may not serve yet: its endpoint was held back.
    pub fn fence_hold(&self) {
        self.fence_holds.fetch_add(1, Relaxed);
    }
    /// A route update refused as stale.
    pub fn stale_route(&self) {
        self.stale_routes.fetch_add(1, Relaxed);
    }

    /// The Prometheus text exposition, with each policy's routed pool and epoch.
    #[must_use]
    pub fn render(&self, routed: &[Routing<'_>]) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str("# TYPE understudy_router_requests_total counter\n");
        for o in RequestOutcome::ALL {
            for p in Priority::ALL {
                let n = self.requests[o as usize][p as usize].load(Relaxed);
                let _ = writeln!(
                    out,
                    "understudy_router_requests_total{{outcome=\"{}\",priority=\"{}\"}} {n}",
                    o.as_str(),
                    p.as_str()
                );
            }
        }
        out.push_str("# TYPE understudy_router_added_latency_seconds histogram\n");
        self.added
            .render(&mut out, "understudy_router_added_latency_seconds", 1e6);
        out.push_str("# TYPE understudy_router_queue_depth gauge\n");
        let _ = writeln!(
            out,
            "understudy_router_queue_depth {}",
            self.queue_depth.load(Relaxed)
        );
        out.push_str("# TYPE understudy_router_queue_wait_seconds histogram\n");
        self.queue_wait
            .render(&mut out, "understudy_router_queue_wait_seconds", 1e3);
        out.push_str("# TYPE understudy_router_ttft_seconds histogram\n");
        self.ttft.render(&mut out, "understudy_router_ttft_seconds", 1e3);
        out.push_str("# TYPE understudy_router_shed_total counter\n");
        for r in Shed::ALL {
            for p in Priority::ALL {
                let n = self.shed[r as usize][p as usize].load(Relaxed);
                let _ = writeln!(
                    out,
                    "understudy_router_shed_total{{reason=\"{}\",priority=\"{}\"}} {n}",
                    r.as_str(),
                    p.as_str()
                );
            }
        }
        for (name, v) in [
            ("understudy_router_retries_total", &self.retries),
            ("understudy_router_retry_overflow_total", &self.retry_overflow),
            ("understudy_router_ejections_total", &self.ejections),
            ("understudy_router_streams_cut_total", &self.streams_cut),
            ("understudy_router_continuations_total", &self.continuations),
            ("understudy_router_stale_routes_total", &self.stale_routes),
            ("understudy_router_requests_moved_total", &self.moved),
            ("understudy_router_fence_holds_total", &self.fence_holds),
        ] {
            let _ = writeln!(out, "# TYPE {name} counter\n{name} {}", v.load(Relaxed));
        }
        out.push_str("# TYPE understudy_router_epoch gauge\n");
        out.push_str("# TYPE understudy_router_route_info gauge\n");
        for r in routed {
            let policy = r.policy.replace(['"', '\\', '\n'], "");
            let _ = writeln!(out, "understudy_router_epoch{{policy=\"{policy}\"}} {}", r.epoch);
            let _ = writeln!(
                out,
                "understudy_router_route_info{{policy=\"{policy}\",pool=\"{}\"}} 1",
                r.pool.replace(['"', '\\', '\n'], "")
            );
        }
        out
    }
}

/// One policy's route, as the metrics show it.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a> {
    /// The policy (empty for the unnamed one).
    pub policy: &'a str,
    /// The pool routed to.
    pub pool: &'a str,
    /// The epoch it is routed under.
    pub epoch: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_carries_outcomes_by_priority_sheds_and_the_route() {
        let m = Metrics::default();
        m.request(RequestOutcome::Shed, Priority::Batch);
        m.shed(Shed::Concurrency, Priority::Batch);
        m.added_latency(Duration::from_micros(40));
        m.ttft(Duration::from_millis(300));
        let text = m.render(&[
            Routing {
                policy: "ns/chat",
                pool: "pool-b",
                epoch: 4,
            },
            Routing {
                policy: "ns/code",
                pool: "pool-a",
                epoch: 9,
            },
        ]);
        assert!(text.contains("understudy_router_ttft_seconds_bucket{le=\"0.25\"} 0\n"));
        assert!(text.contains("understudy_router_ttft_seconds_bucket{le=\"0.5\"} 1\n"));
        assert!(text.contains("understudy_router_ttft_seconds_count 1\n"));
        assert!(text.contains("understudy_router_requests_total{outcome=\"shed\",priority=\"batch\"} 1"));
        assert!(text.contains("understudy_router_shed_total{reason=\"concurrency\",priority=\"batch\"} 1"));
        assert!(text.contains("understudy_router_added_latency_seconds_bucket{le=\"0.00005\"} 1"));
        assert!(text.contains("understudy_router_epoch{policy=\"ns/chat\"} 4\n"));
        assert!(text.contains("understudy_router_epoch{policy=\"ns/code\"} 9\n"));
        assert!(text.contains("understudy_router_route_info{policy=\"ns/chat\",pool=\"pool-b\"} 1"));
    }
}

//! What the routers counted while a game day ran: requests sent, failed and shed, and their time to
//! first token, read from each router's `GET /metrics` (the admin port, with the operator's
//! token) and summed over the routers.
//!
//! A run keeps the counters it read when it injected its fault, so its record of loss is the
//! difference since; a stop condition is judged over the samples of the last `window`. Counters
//! only grow, so a router restarted in between (its counters back at zero) can only make the loss
//! look smaller, never invent one. Parsing is pure; [`sample`] does the reading.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;

use crate::router_admin::{RouterAdminUrl, RouterToken, get_metrics};

/// The request outcomes that are a failure for the client: an upstream's 5xx, no route or no
/// endpoint in time, every try failed. `forwarded` is served, `shed` is counted apart, and
/// `rejected` is the client's own bad request.
const FAILED: [&str; 3] = ["upstream_error", "unavailable", "upstream_failed"];

/// The routers' counters at one moment, summed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub sent: u64,
    pub failed: u64,
    pub shed: u64,
    /// Time to first token: cumulative count per bucket upper bound in seconds, `+Inf` last.
    pub ttft: BTreeMap<u64, u64>,
}

/// A bucket bound as a key that sorts: microseconds, `u64::MAX` for `+Inf`.
fn bound_key(le: &str) -> Option<u64> {
    if le == "+Inf" {
        return Some(u64::MAX);
    }
    let seconds: f64 = le.parse().ok()?;
    Some((seconds * 1e6).round() as u64)
}

/// The value of a sample line's label `name`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key.trim() == name).then(|| value.trim().trim_matches('"'))
    })
}

impl Counters {
    /// Reads a router's Prometheus text; lines it does not know are skipped.
    #[must_use]
    pub fn parse(text: &str) -> Counters {
        let mut counters = Counters::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let value = value.max(0.0) as u64;
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            match name {
                "understudy_router_requests_total" => {
                    counters.sent += value;
                    if label(labels, "outcome").is_some_and(|o| FAILED.contains(&o)) {
                        counters.failed += value;
                    } else if label(labels, "outcome") == Some("shed") {
                        counters.shed += value;
                    }
                }
                "understudy_router_ttft_seconds_bucket" => {
                    if let Some(key) = label(labels, "le").and_then(bound_key) {
                        *counters.ttft.entry(key).or_default() += value;
                    }
                }
                _ => {}
            }
        }
        counters
    }

    /// Adds another router's counters.
    pub fn add(&mut self, other: &Counters) {
        self.sent += other.sent;
        self.failed += other.failed;
        self.shed += other.shed;
        for (key, count) in &other.ttft {
            *self.ttft.entry(*key).or_default() += count;
        }
    }

    /// What was counted since `before`.
    #[must_use]
    pub fn since(&self, before: &Counters) -> Counters {
        Counters {
            sent: self.sent.saturating_sub(before.sent),
            failed: self.failed.saturating_sub(before.failed),
            shed: self.shed.saturating_sub(before.shed),
            ttft: self
                .ttft
                .iter()
                .map(|(key, count)| {
                    (
                        *key,
                        count.saturating_sub(before.ttft.get(key).copied().unwrap_or(0)),
                    )
                })
                .collect(),
        }
    }

    /// The 99th percentile of time to first token, as the upper bound of its bucket; `None`
    /// without a first token, and `Duration::MAX` when it is beyond the last bound.
    #[must_use]
    pub fn ttft_p99(&self) -> Option<Duration> {
        let total = *self.ttft.get(&u64::MAX)?;
        if total == 0 {
            return None;
        }
        let wanted = total - total / 100;
        let (bound, _) = self.ttft.iter().find(|(_, count)| **count >= wanted)?;
        Some(if *bound == u64::MAX {
            Duration::MAX
        } else {
            Duration::from_micros(*bound)
        })
    }
}

/// Every router's counters now, summed; the routers that could not be read, and why.
pub async fn sample(routers: &[RouterAdminUrl], token: &RouterToken) -> (Counters, Vec<String>) {
    let reads = join_all(
        routers
            .iter()
            .map(|router| tokio::time::timeout(Duration::from_secs(3), get_metrics(router, token))),
    )
    .await;
    let mut total = Counters::default();
    let mut unread = Vec::new();
    for (router, read) in routers.iter().zip(reads) {
        match read {
            Ok(Ok(text)) => total.add(&Counters::parse(&text)),
            Ok(Err(why)) => unread.push(format!("{router}: {why}")),
            Err(_) => unread.push(format!("{router}: no answer within 3s")),
        }
    }
    (total, unread)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ROUTER: &str = "\
# TYPE understudy_router_requests_total counter
understudy_router_requests_total{outcome=\"forwarded\",priority=\"interactive\"} 90
understudy_router_requests_total{outcome=\"upstream_failed\",priority=\"interactive\"} 6
understudy_router_requests_total{outcome=\"unavailable\",priority=\"batch\"} 2
understudy_router_requests_total{outcome=\"shed\",priority=\"batch\"} 5
understudy_router_requests_total{outcome=\"rejected\",priority=\"batch\"} 1
# TYPE understudy_router_ttft_seconds histogram
understudy_router_ttft_seconds_bucket{le=\"0.25\"} 50
understudy_router_ttft_seconds_bucket{le=\"0.5\"} 89
understudy_router_ttft_seconds_bucket{le=\"2.5\"} 90
understudy_router_ttft_seconds_bucket{le=\"+Inf\"} 90
understudy_router_ttft_seconds_sum 20.5
understudy_router_ttft_seconds_count 90
";

    #[test]
    fn a_routers_counters_read_as_sent_failed_shed_and_first_token_times() {
        let counters = Counters::parse(ROUTER);
        assert_eq!((counters.sent, counters.failed, counters.shed), (104, 8, 5));
        // 89 of 90 within 0.5 s: the 99th percentile is in the 2.5 s bucket.
        assert_eq!(counters.ttft_p99(), Some(Duration::from_millis(2500)));
        let mut two = counters.clone();
        two.add(&counters);
        assert_eq!(two.since(&counters), counters);
        assert_eq!(Counters::parse("garbage\n{}} x\n").sent, 0);
    }

    #[test]
    fn a_router_restarted_between_samples_makes_the_loss_smaller_never_negative() {
        let later = Counters::parse("understudy_router_requests_total{outcome=\"upstream_failed\"} 3\n");
        let before = Counters::parse(ROUTER);
        let since = later.since(&before);
        assert_eq!((since.sent, since.failed), (0, 0));
        assert_eq!(since.ttft_p99(), None);
    }
}

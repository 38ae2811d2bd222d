//! What the prober hands on: observations for the failover state machine, a JSON document a
//! caller can request, and Prometheus metrics for the admin port.
//!
//! All three are built from the same round, so they never disagree. This module formats and
//! counts; it must never probe, and it must never decide failover (the state machine does).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Serialize;
use understudy_core::Pool;
use understudy_core::failover::{CheckResult, Input};

use crate::outcome::{ProbeOutcome, pool_verdict};
use crate::parity::DriftReport;
use crate::probe::ProbeReport;

/// One pool's round of probes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRound {
    pub pool: Pool,
    pub min_serving: usize,
    pub reports: Vec<ProbeReport>,
}

impl PoolRound {
    /// The round's check, or `None` when the replicas rejected the probe itself
    /// ([`pool_verdict`]).
    pub fn verdict(&self) -> Option<CheckResult> {
        let outcomes: Vec<_> = self.reports.iter().map(|r| r.outcome.clone()).collect();
        pool_verdict(&outcomes, self.min_serving)
    }

    /// The first replica that rejected the probe as wrong, with its status, for a person to
    /// read: `10.0.0.5:8000 answered 404`.
    pub fn rejection(&self) -> Option<String> {
        self.reports
            .iter()
            .find(|r| r.outcome.is_probe_rejected())
            .map(|r| {
                let code = match r.outcome {
                    ProbeOutcome::HttpError(code) => code,
                    _ => 0,
                };
                format!("{} answered {code} to the probe", r.endpoint)
            })
    }
}

/// A verdict as people read it: the check, or that the probe was rejected.
pub fn describe(verdict: Option<CheckResult>) -> String {
    verdict.map_or_else(
        || "ProbeRejected (the replicas refused the probe itself: see the http-error codes)".to_owned(),
        |check| format!("{check:?}"),
    )
}

/// The inputs the failover state machine consumes for one round: a check per pool, and parity
/// when it was compared this round.
pub fn observations(rounds: &[PoolRound], parity: Option<&DriftReport>) -> Vec<Input> {
    let mut inputs: Vec<Input> = rounds
        .iter()
        .filter_map(|r| {
            Some(Input::Check {
                pool: r.pool,
                result: r.verdict()?,
            })
        })
        .collect();
    if let Some(report) = parity {
        inputs.push(Input::Parity {
            holds: report.holds(),
        });
    }
    inputs
}

/// The JSON document of a round.
#[derive(Debug, Serialize)]
pub struct RoundDocument<'a> {
    pub pools: Vec<PoolDocument<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parity: Option<&'a DriftReport>,
}

#[derive(Debug, Serialize)]
pub struct PoolDocument<'a> {
    pub pool: Pool,
    pub verdict: String,
    pub min_serving: usize,
    pub replicas: &'a [ProbeReport],
}

impl<'a> RoundDocument<'a> {
    pub fn new(rounds: &'a [PoolRound], parity: Option<&'a DriftReport>) -> Self {
        RoundDocument {
            pools: rounds
                .iter()
                .map(|r| PoolDocument {
                    pool: r.pool,
                    verdict: describe(r.verdict()),
                    min_serving: r.min_serving,
                    replicas: &r.reports,
                })
                .collect(),
            parity,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    pool: String,
    endpoint: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    pool: String,
    endpoint: String,
}

/// The prober's metrics. Probe traffic is counted here and nowhere near user metrics. Parity and
/// cold-start results are reported by the commands that compute them, not here: a gauge that
/// nothing sets would read as "no drift".
#[derive(Debug)]
pub struct ProberMetrics {
    registry: Registry,
    probes: Family<ProbeLabels, Counter>,
    first_token: Family<EndpointLabels, Histogram>,
}

impl Default for ProberMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("understudy_prober");
        let probes = Family::<ProbeLabels, Counter>::default();
        registry.register("probes", "Generating probes by outcome", probes.clone());
        let first_token = Family::<EndpointLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
        });
        registry.register(
            "first_token_seconds",
            "Time to first token of passing probes",
            first_token.clone(),
        );
        ProberMetrics {
            registry,
            probes,
            first_token,
        }
    }
}

impl ProberMetrics {
    pub fn record_round(&self, round: &PoolRound) {
        let pool = format!("{:?}", round.pool);
        for r in &round.reports {
            let endpoint = r.endpoint.to_string();
            self.probes
                .get_or_create(&ProbeLabels {
                    pool: pool.clone(),
                    endpoint: endpoint.clone(),
                    outcome: r.outcome.as_str().to_owned(),
                })
                .inc();
            if let ProbeOutcome::Ok { first_token, .. } = r.outcome {
                self.first_token
                    .get_or_create(&EndpointLabels {
                        pool: pool.clone(),
                        endpoint,
                    })
                    .observe(first_token.as_secs_f64());
            }
        }
    }

    /// The OpenMetrics text for `/metrics`.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::parity::Fingerprint;
    use crate::probe::Endpoint;
    use std::time::Duration;

    fn report(port: u16, outcome: ProbeOutcome) -> ProbeReport {
        ProbeReport {
            endpoint: Endpoint::new("10.0.0.1", port),
            outcome,
            text: String::new(),
            first_token: None,
            total: None,
        }
    }

    fn ok() -> ProbeOutcome {
        ProbeOutcome::Ok {
            first_token: Duration::from_millis(120),
            total: Duration::from_millis(400),
        }
    }

    #[test]
    fn a_round_becomes_one_check_per_pool_and_parity_when_compared() {
        let rounds = vec![
            PoolRound {
                pool: Pool::A,
                min_serving: 1,
                reports: vec![
                    report(1, ProbeOutcome::Refused),
                    report(2, ProbeOutcome::HttpError(500)),
                ],
            },
            PoolRound {
                pool: Pool::B,
                min_serving: 1,
                reports: vec![report(3, ok())],
            },
        ];
        let mut a = Fingerprint::default();
        a.insert("runtime.version", "0.11.0");
        let drift = a.drift(&Fingerprint::default());
        assert_eq!(
            observations(&rounds, Some(&drift)),
            vec![
                Input::Check {
                    pool: Pool::A,
                    result: CheckResult::HardFail
                },
                Input::Check {
                    pool: Pool::B,
                    result: CheckResult::Pass
                },
                Input::Parity { holds: false },
            ]
        );
        assert_eq!(observations(&rounds[1..], None).len(), 1);
        let doc = serde_json::to_value(RoundDocument::new(&rounds, Some(&drift))).unwrap();
        assert_eq!(doc["pools"][0]["verdict"], "HardFail");
        assert_eq!(doc["pools"][0]["replicas"][1]["outcome"], "http-error");
        assert_eq!(doc["pools"][0]["replicas"][1]["http_status"], 500);
        assert_eq!(doc["parity"]["differences"][0]["key"], "runtime.version");
    }

    #[test]
    fn metrics_count_outcomes_and_time_passing_probes() {
        let metrics = ProberMetrics::default();
        let round = PoolRound {
            pool: Pool::A,
            min_serving: 1,
            reports: vec![report(1, ok()), report(2, ProbeOutcome::Stalled)],
        };
        metrics.record_round(&round);
        metrics.record_round(&round);
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"understudy_prober_probes_total{pool="A",endpoint="http://10.0.0.1:2",outcome="stalled"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"understudy_prober_first_token_seconds_count{pool="A",endpoint="http://10.0.0.1:1"} 2"#
            ),
            "{text}"
        );
        assert!(!text.contains(r#"first_token_seconds_count{pool="A",endpoint="http://10.0.0.1:2"}"#));
    }
}

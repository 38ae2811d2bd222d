//! The operator's Prometheus metrics and the registry that holds them.
//!
//! Served as text by [`crate::admin`] on `/metrics`. Labels are bounded: an error is counted by its
//! [`crate::controller::Error::category`], never by its message, and per-policy series are keyed by
//! namespace and name only. Nothing here talks to Kubernetes or decides anything.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, text::encode};
use prometheus_client::metrics::{
    counter::Counter,
    family::Family,
    gauge::Gauge,
    histogram::{Histogram, exponential_buckets},
};
use prometheus_client::registry::Registry;

use crate::crd::{ColdStartBreakdown, Condition, ConditionStatus, LoadProofRecord, condition_type};

/// A condition status as its label reads.
fn status_label(status: ConditionStatus) -> &'static str {
    match status {
        ConditionStatus::True => "True",
        ConditionStatus::False => "False",
        ConditionStatus::Unknown => "Unknown",
    }
}

/// Labels of a reconcile error: its phase, from a closed list.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub category: &'static str,
}

/// Labels of a per-policy series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub namespace: String,
    pub policy: String,
}

/// Labels of one status of one of a policy's conditions.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    pub namespace: String,
    pub policy: String,
    pub condition: String,
    pub status: &'static str,
}

/// Labels of a finished load proof.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadProofLabels {
    pub namespace: String,
    pub policy: String,
    /// `Proven`, `Failed` or `NotRun`.
    pub result: String,
}

/// Labels of one figure of a policy's last load proof.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadFigureLabels {
    pub namespace: String,
    pub policy: String,
    /// `ttft_p99_seconds`, `itl_p99_seconds`, `error_ratio` or `replayed_rate`.
    pub figure: &'static str,
}

/// The figures of a load proof kept as gauges, in [`Metrics::load_proof`]'s order.
const LOAD_FIGURES: [&str; 4] = [
    "ttft_p99_seconds",
    "itl_p99_seconds",
    "error_ratio",
    "replayed_rate",
];

/// Labels of a finished promotion.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailoverLabels {
    pub namespace: String,
    pub policy: String,
    /// `failover`, `failback` or `manual`.
    pub kind: &'static str,
}

/// Labels of a cold-start stage: the tier the replica waited in and the stage, both from closed
/// lists.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    pub tier: String,
    pub stage: String,
}

/// Labels of a grant round or a renewal skipped.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrantRoundLabels {
    pub namespace: String,
    pub policy: String,
    /// `granted`, or why nothing was: `no_lease`, `lease_unreadable`.
    pub outcome: &'static str,
}

/// Labels of a pool's fences in one grant standing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrantFenceLabels {
    pub namespace: String,
    pub policy: String,
    pub pool: String,
    /// From a closed list: `serving`, `failsafe`, `waiting`, `fenced`, `expired`, `none`,
    /// `takesNoGrants`, `unreachable`.
    pub standing: &'static str,
}

/// Every metric the operator exports, registered once.
pub struct Metrics {
    registry: Registry,
    reconciliations: Counter,
    errors: Family<ErrorLabels, Counter>,
    duration: Histogram,
    epoch: Family<PolicyLabels, Gauge>,
    failovers: Family<FailoverLabels, Counter>,
    cold_start: Family<StageLabels, Histogram>,
    conditions: Family<ConditionLabels, Gauge>,
    grant_rounds: Family<GrantRoundLabels, Counter>,
    grant_fences: Family<GrantFenceLabels, Gauge>,
    grants_refused: Family<PolicyLabels, Counter>,
    load_proofs: Family<LoadProofLabels, Counter>,
    load_proof_figures: Family<LoadFigureLabels, Gauge<f64, AtomicU64>>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric under the `understudy` prefix.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("understudy");
        let reconciliations = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        // 5 ms to about 40 s: a reconcile is a handful of API calls, a slow one waits on timeouts.
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        let epoch = Family::<PolicyLabels, Gauge>::default();
        let failovers = Family::<FailoverLabels, Counter>::default();
        // 1 s to about an hour: a first token after a wake, up to a node provisioned and 140 GB
        // of weights loaded.
        let cold_start = Family::<StageLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(1.0, 2.0, 13))) as fn() -> Histogram,
        );
        registry.register(
            "reconciliations",
            "FailoverPolicy reconciliations started",
            reconciliations.clone(),
        );
        registry.register(
            "reconcile_errors",
            "FailoverPolicy reconciliations that failed, by phase",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time one FailoverPolicy reconciliation took",
            duration.clone(),
        );
        registry.register(
            "epoch",
            "The fencing epoch of each policy's primary, as last read from its Lease",
            epoch.clone(),
        );
        registry.register(
            "failovers",
            "Promotions this operator finished, by kind",
            failovers.clone(),
        );
        let conditions = Family::<ConditionLabels, Gauge>::default();
        registry.register(
            "policy_condition",
            "Each condition of each policy as its status last recorded it: 1 on the status it has, 0 on the others",
            conditions.clone(),
        );
        registry.register(
            "coldstart_stage_seconds",
            "Time each stage of a replica's start took, for the replicas promotions started",
            cold_start.clone(),
        );
        let grant_rounds = Family::<GrantRoundLabels, Counter>::default();
        registry.register(
            "grant_rounds",
            "Rounds of serving grants pushed to the fences, and renewals skipped, by outcome",
            grant_rounds.clone(),
        );
        let grant_fences = Family::<GrantFenceLabels, Gauge>::default();
        registry.register(
            "grant_fences",
            "Each pool's fences by the standing of their grant, as they answered the last round",
            grant_fences.clone(),
        );
        let grants_refused = Family::<PolicyLabels, Counter>::default();
        registry.register(
            "grants_refused",
            "Grants a fence refused because it had seen a higher epoch",
            grants_refused.clone(),
        );
        let load_proofs = Family::<LoadProofLabels, Counter>::default();
        registry.register(
            "load_proofs",
            "Load proofs of the standby that finished, by result",
            load_proofs.clone(),
        );
        let load_proof_figures = Family::<LoadFigureLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "load_proof",
            "The last load proof's figures as the replay's client saw them: TTFT and inter-token p99 in seconds, the share of requests that failed, the rate replayed",
            load_proof_figures.clone(),
        );
        Metrics {
            registry,
            reconciliations,
            errors,
            duration,
            epoch,
            failovers,
            cold_start,
            conditions,
            grant_rounds,
            grant_fences,
            grants_refused,
            load_proofs,
            load_proof_figures,
        }
    }

    /// Counts a finished load proof and keeps its figures (a proof that did not run has none, and
    /// leaves the last one's).
    pub fn load_proof(&self, namespace: &str, policy: &str, record: &LoadProofRecord) {
        self.load_proofs
            .get_or_create(&LoadProofLabels {
                namespace: namespace.to_owned(),
                policy: policy.to_owned(),
                result: record.result.clone(),
            })
            .inc();
        if record.requests == 0 {
            return;
        }
        let seconds = |ms: Option<u64>| ms.map(|ms| ms as f64 / 1000.0);
        let values = [
            seconds(record.ttft_p99_ms),
            seconds(record.itl_p99_ms),
            Some(f64::from(record.errors) / f64::from(record.requests)),
            record.replayed_rate,
        ];
        for (figure, value) in LOAD_FIGURES.into_iter().zip(values) {
            let labels = LoadFigureLabels {
                namespace: namespace.to_owned(),
                policy: policy.to_owned(),
                figure,
            };
            // A figure this proof lacks is not the last one's.
            match value {
                Some(value) => {
                    self.load_proof_figures.get_or_create(&labels).set(value);
                }
                None => {
                    self.load_proof_figures.remove(&labels);
                }
            }
        }
    }

    /// Records the conditions a policy's status was just written with.
    pub fn set_conditions(&self, namespace: &str, policy: &str, conditions: &BTreeMap<String, Condition>) {
        for (condition, now) in conditions {
            for status in [
                ConditionStatus::True,
                ConditionStatus::False,
                ConditionStatus::Unknown,
            ] {
                let labels = ConditionLabels {
                    namespace: namespace.to_owned(),
                    policy: policy.to_owned(),
                    condition: condition.clone(),
                    status: status_label(status),
                };
                self.conditions
                    .get_or_create(&labels)
                    .set(i64::from(now.status == status));
            }
        }
    }

    /// Counts a reconciliation and returns a timer that records its duration when dropped, so
    /// that early returns and errors are measured too.
    #[must_use]
    pub fn reconcile_started(&self) -> ReconcileTimer<'_> {
        self.reconciliations.inc();
        ReconcileTimer {
            started: Instant::now(),
            histogram: &self.duration,
        }
    }

    /// Counts a failed reconciliation.
    pub fn reconcile_failed(&self, category: &'static str) {
        self.errors.get_or_create(&ErrorLabels { category }).inc();
    }

    /// Records the epoch a policy's primary holds.
    pub fn set_epoch(&self, namespace: &str, policy: &str, epoch: u64) {
        let labels = PolicyLabels {
            namespace: namespace.to_owned(),
            policy: policy.to_owned(),
        };
        self.epoch
            .get_or_create(&labels)
            .set(i64::try_from(epoch).unwrap_or(i64::MAX));
    }

    /// Counts a finished promotion.
    pub fn failover_finished(&self, namespace: &str, policy: &str, kind: &'static str) {
        let labels = FailoverLabels {
            namespace: namespace.to_owned(),
            policy: policy.to_owned(),
            kind,
        };
        self.failovers.get_or_create(&labels).inc();
    }

    /// Records each measured stage of one replica's start.
    pub fn cold_start(&self, breakdown: &ColdStartBreakdown) {
        let tier = breakdown.tier.clone().unwrap_or_else(|| "unknown".to_owned());
        for (stage, seconds) in &breakdown.stages {
            if let Some(seconds) = seconds {
                let labels = StageLabels {
                    tier: tier.clone(),
                    stage: stage.clone(),
                };
                self.cold_start.get_or_create(&labels).observe(*seconds);
            }
        }
    }

    /// Records a grant round: its count, each pool's fences by standing, and the stale refusals.
    pub fn grant_round(&self, namespace: &str, policy: &str, round: &understudy_api::grant::GrantRound) {
        self.grant_rounds
            .get_or_create(&GrantRoundLabels {
                namespace: namespace.to_owned(),
                policy: policy.to_owned(),
                outcome: "granted",
            })
            .inc();
        for pool in round.pools() {
            let counts = round.standings(pool);
            for standing in understudy_api::grant::STANDINGS {
                let n = counts.iter().find(|(s, _)| *s == standing).map_or(0, |(_, n)| *n);
                self.grant_fences
                    .get_or_create(&GrantFenceLabels {
                        namespace: namespace.to_owned(),
                        policy: policy.to_owned(),
                        pool: pool.to_owned(),
                        standing,
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        let stale = round
            .answers
            .iter()
            .filter(|a| matches!(a.answer, understudy_api::grant::GrantAnswer::Stale(_)))
            .count();
        if stale > 0 {
            self.grants_refused
                .get_or_create(&PolicyLabels {
                    namespace: namespace.to_owned(),
                    policy: policy.to_owned(),
                })
                .inc_by(stale as u64);
        }
    }

    /// Counts a renewal skipped for `outcome` (`no_lease`, `lease_unreadable`).
    pub fn grant_renewal_skipped(&self, namespace: &str, policy: &str, outcome: &'static str) {
        self.grant_rounds
            .get_or_create(&GrantRoundLabels {
                namespace: namespace.to_owned(),
                policy: policy.to_owned(),
                outcome,
            })
            .inc();
    }

    /// Forgets a deleted policy's series, so a gauge does not outlive its policy.
    pub fn forget_policy(&self, namespace: &str, policy: &str) {
        for figure in LOAD_FIGURES {
            self.load_proof_figures.remove(&LoadFigureLabels {
                namespace: namespace.to_owned(),
                policy: policy.to_owned(),
                figure,
            });
        }
        self.epoch.remove(&PolicyLabels {
            namespace: namespace.to_owned(),
            policy: policy.to_owned(),
        });
        for condition in condition_type::ALL.into_iter().chain(condition_type::WHEN_ASKED) {
            for status in [
                ConditionStatus::True,
                ConditionStatus::False,
                ConditionStatus::Unknown,
            ] {
                self.conditions.remove(&ConditionLabels {
                    namespace: namespace.to_owned(),
                    policy: policy.to_owned(),
                    condition: condition.to_owned(),
                    status: status_label(status),
                });
            }
        }
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Records the time since [`Metrics::reconcile_started`] when dropped.
#[derive(Debug)]
pub struct ReconcileTimer<'a> {
    started: Instant,
    histogram: &'a Histogram,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.histogram.observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn each_measured_stage_is_observed_under_its_tier() {
        let metrics = Metrics::new();
        metrics.cold_start(&ColdStartBreakdown {
            pool: "west".into(),
            replica: "west-5".into(),
            tier: Some("pilotLight".into()),
            stages: [("weightLoad".to_owned(), Some(70.0)), ("node".to_owned(), None)].into(),
        });
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(
                "understudy_coldstart_stage_seconds_sum{tier=\"pilotLight\",stage=\"weightLoad\"} 70.0"
            ),
            "{text}"
        );
        assert!(
            !text.contains("stage=\"node\""),
            "an unknown stage is not observed: {text}"
        );
    }

    #[test]
    fn a_dropped_timer_records_one_observation_even_on_an_early_return() {
        let metrics = Metrics::new();
        let run = |fail: bool| -> Result<(), ()> {
            let _timer = metrics.reconcile_started();
            if fail {
                return Err(());
            }
            Ok(())
        };
        run(true).unwrap_err();
        run(false).unwrap();
        let text = metrics.encode().unwrap();
        assert!(text.contains("understudy_reconciliations_total 2"), "{text}");
        assert!(
            text.contains("understudy_reconcile_duration_seconds_count 2"),
            "{text}"
        );
    }

    #[test]
    fn errors_are_counted_by_category_and_epochs_per_policy() {
        let metrics = Metrics::new();
        metrics.reconcile_failed("lease_unreachable");
        metrics.reconcile_failed("lease_unreachable");
        metrics.set_epoch("serving", "llama", 7);
        metrics.failover_finished("serving", "llama", "manual");
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(r#"understudy_reconcile_errors_total{category="lease_unreachable"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"understudy_epoch{namespace="serving",policy="llama"} 7"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"understudy_failovers_total{namespace="serving",policy="llama",kind="manual"} 1"#
            ),
            "{text}"
        );
        metrics.forget_policy("serving", "llama");
        assert!(!metrics.encode().unwrap().contains("understudy_epoch{"));
    }

    #[test]
    fn each_condition_is_one_on_the_status_it_has_and_zero_on_the_others_until_its_policy_goes() {
        let metrics = Metrics::new();
        let condition = |status| Condition {
            status,
            reason: "Drift".to_owned(),
            message: String::new(),
            last_transition_time: None,
        };
        let mut conditions = BTreeMap::new();
        conditions.insert("ParityHolds".to_owned(), condition(ConditionStatus::False));
        metrics.set_conditions("serving", "llama", &conditions);
        conditions.insert("ParityHolds".to_owned(), condition(ConditionStatus::True));
        metrics.set_conditions("serving", "llama", &conditions);
        let text = metrics.encode().unwrap();
        let series = |status: &str, value: u8| {
            format!(
                r#"understudy_policy_condition{{namespace="serving",policy="llama",condition="ParityHolds",status="{status}"}} {value}"#
            )
        };
        for (status, value) in [("True", 1), ("False", 0), ("Unknown", 0)] {
            assert!(text.contains(&series(status, value)), "{text}");
        }
        metrics.forget_policy("serving", "llama");
        assert!(!metrics.encode().unwrap().contains("understudy_policy_condition{"));
    }
}

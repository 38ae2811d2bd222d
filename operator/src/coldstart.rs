//! The cold starts a promotion causes, timed stage by stage.
//!
//! A promotion scales the new primary up, and its pilot-light replicas start cold. For a while
//! after, every reconcile reads each pod the promotion created through the prober's cold-start
//! reader (the pod, its events, its log: the same record `understudy-prober coldstart` reads,
//! with the first token from the operator's own first passing probe of it) until it has served
//! a first token, and keeps the breakdown in `status.coldStart`, with a summary
//! per tier (median and worst of each stage) and `understudy_coldstart_stage_seconds{tier,stage}`.
//!
//! A warm replica's start is its wake: the Wake step times each replica it wakes, and the
//! promotion's serving check its first token after (`super::controller`'s executor); those
//! breakdowns, tier `warm`, go into the same status, summary and histogram.
//!
//! Reading is all this module does: it never decides anything, and a pod whose record cannot be
//! read is left out of this reconcile, not guessed at.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use understudy_core::recovery::Stage;
use understudy_prober::coldstart::source::Recorded;
use understudy_prober::coldstart::{ColdStartStage, Timeline};

use crate::clusters::Clusters;
use crate::crd::{ColdStartBreakdown, ColdStartSummary, PoolSpec, StageSummary};
use crate::ports::ResolveError;
use crate::replicas::{KubeReplicas, replica_endpoint};

/// How many breakdowns `status.coldStart` keeps, newest last.
pub const STATUS_LIMIT: usize = 32;

/// How long after a promotion started its pods are still read: a replica that has not answered
/// by then is failing, and its events say why.
pub const MEASURE_FOR: Duration = Duration::from_secs(30 * 60);

/// The tier a promotion's cold-started replicas waited in.
pub const PILOT_LIGHT: &str = "pilotLight";

/// The status name of a stage the prober times.
fn stage_of(stage: ColdStartStage) -> Stage {
    match stage {
        ColdStartStage::Node => Stage::Node,
        ColdStartStage::Image => Stage::ImagePull,
        ColdStartStage::ContainerStart => Stage::ContainerStart,
        ColdStartStage::EngineStart => Stage::EngineStart,
        ColdStartStage::WeightLoad => Stage::WeightLoad,
        ColdStartStage::Warmup => Stage::Warmup,
        ColdStartStage::Ready => Stage::ApiReady,
        ColdStartStage::FirstToken => Stage::FirstToken,
    }
}

/// One replica's timeline as status keeps it: seconds per stage, `None` for a stage not known.
#[must_use]
pub fn breakdown(pool: &str, tier: &str, timeline: &Timeline) -> ColdStartBreakdown {
    let stages = ColdStartStage::ALL
        .into_iter()
        .map(|stage| {
            let seconds = timeline.duration(stage).map(|d| d.as_secs_f64());
            (stage_of(stage).as_str().to_owned(), seconds)
        })
        .collect();
    ColdStartBreakdown {
        pool: pool.to_owned(),
        replica: timeline.pod.clone(),
        tier: Some(tier.to_owned()),
        stages,
    }
}

/// Whether the replica's start is over: its API answered, and a probe had its first token.
#[must_use]
pub fn complete(breakdown: &ColdStartBreakdown) -> bool {
    [Stage::ApiReady, Stage::FirstToken]
        .iter()
        .all(|stage| matches!(breakdown.stages.get(stage.as_str()), Some(Some(_))))
}

/// `previous` with `measured` in: a replica measured again replaces its old breakdown, a new one
/// is added last, and only the newest [`STATUS_LIMIT`] are kept.
#[must_use]
pub fn merge(previous: &[ColdStartBreakdown], measured: Vec<ColdStartBreakdown>) -> Vec<ColdStartBreakdown> {
    let mut merged: Vec<ColdStartBreakdown> = previous
        .iter()
        .filter(|old| {
            !measured
                .iter()
                .any(|new| new.pool == old.pool && new.replica == old.replica)
        })
        .cloned()
        .collect();
    merged.extend(measured);
    let excess = merged.len().saturating_sub(STATUS_LIMIT);
    merged.drain(..excess);
    merged
}

/// Per tier, each stage's median and worst over the replicas that have it.
#[must_use]
pub fn summarize(breakdowns: &[ColdStartBreakdown]) -> Vec<ColdStartSummary> {
    let mut by_tier: BTreeMap<&str, Vec<&ColdStartBreakdown>> = BTreeMap::new();
    for b in breakdowns {
        by_tier
            .entry(b.tier.as_deref().unwrap_or("unknown"))
            .or_default()
            .push(b);
    }
    by_tier
        .into_iter()
        .map(|(tier, replicas)| {
            let mut stages = BTreeMap::new();
            for stage in Stage::ALL {
                let mut seconds: Vec<f64> = replicas
                    .iter()
                    .filter_map(|b| b.stages.get(stage.as_str()).copied().flatten())
                    .collect();
                if seconds.is_empty() {
                    continue;
                }
                seconds.sort_by(f64::total_cmp);
                let middle = seconds.len() / 2;
                let median = if seconds.len() % 2 == 1 {
                    seconds[middle]
                } else {
                    f64::midpoint(seconds[middle - 1], seconds[middle])
                };
                let worst = seconds[seconds.len() - 1];
                stages.insert(stage.as_str().to_owned(), StageSummary { median, worst });
            }
            ColdStartSummary {
                tier: tier.to_owned(),
                replicas: u32::try_from(replicas.len()).unwrap_or(u32::MAX),
                stages,
            }
        })
        .collect()
}

/// Reads the cold start of every pod of `pool` created at or after `since` whose start `known`
/// does not hold complete yet; `first_answered` says when a replica (`host:port`) first answered
/// a probe right, its first token. A pod whose record cannot be read is logged and left out.
pub async fn measure(
    clusters: &Arc<Clusters>,
    namespace: &str,
    pool: &PoolSpec,
    since: Timestamp,
    known: &[ColdStartBreakdown],
    first_answered: impl Fn(&str) -> Option<Timestamp>,
) -> Result<Vec<ColdStartBreakdown>, ResolveError> {
    let pods = KubeReplicas::in_clusters(clusters.clone())
        .pods(namespace, pool)
        .await?;
    let client = clusters.client(namespace, pool).await?;
    let done = |name: &str| {
        known
            .iter()
            .any(|b| b.pool == pool.name && b.replica == name && complete(b))
    };
    let mut measured = Vec::new();
    for pod in &pods {
        let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let name = pod.name_any();
        if created.is_none_or(|created| created < since) || done(&name) {
            continue;
        }
        // An answer from before the pod existed was another pod's at the same address.
        let first_token = replica_endpoint(pod, pool.port)
            .and_then(|endpoint| first_answered(&endpoint.authority()))
            .filter(|at| created.is_some_and(|created| *at > created));
        let timeline = match Recorded::from_api(client.clone(), namespace, &name, None).await {
            Ok(recorded) => recorded.timeline(first_token),
            Err(error) => Err(error),
        };
        match timeline {
            Ok(timeline) => measured.push(breakdown(&pool.name, PILOT_LIGHT, &timeline)),
            Err(error) => tracing::warn!(%namespace, pod = %name, %error, "could not read a cold start"),
        }
    }
    Ok(measured)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn measured(
        replica: &str,
        tier: &str,
        weight_load: Option<f64>,
        api_ready: Option<f64>,
    ) -> ColdStartBreakdown {
        ColdStartBreakdown {
            pool: "west".into(),
            replica: replica.into(),
            tier: Some(tier.into()),
            stages: BTreeMap::from([
                ("weightLoad".to_owned(), weight_load),
                ("apiReady".to_owned(), api_ready),
                ("firstToken".to_owned(), api_ready.map(|_| 1.0)),
            ]),
        }
    }

    #[test]
    fn a_replica_measured_again_replaces_its_breakdown_and_the_oldest_go_first() {
        let old = vec![
            measured("w-0", PILOT_LIGHT, Some(60.0), None),
            measured("w-1", PILOT_LIGHT, None, None),
        ];
        let merged = merge(&old, vec![measured("w-0", PILOT_LIGHT, Some(61.0), Some(3.0))]);
        let replicas: Vec<&str> = merged.iter().map(|b| b.replica.as_str()).collect();
        assert_eq!(replicas, ["w-1", "w-0"]);
        assert!(complete(&merged[1]) && !complete(&merged[0]));

        let many: Vec<ColdStartBreakdown> = (0..40)
            .map(|i| measured(&format!("w-{i}"), PILOT_LIGHT, None, None))
            .collect();
        let kept = merge(&[], many);
        assert_eq!(kept.len(), STATUS_LIMIT);
        assert_eq!(kept[0].replica, "w-8");
    }

    #[test]
    fn each_tier_gets_the_median_and_worst_of_each_stage_it_has() {
        let breakdowns = [
            measured("w-0", PILOT_LIGHT, Some(60.0), Some(2.0)),
            measured("w-1", PILOT_LIGHT, Some(80.0), None),
            measured("w-2", PILOT_LIGHT, Some(70.0), Some(4.0)),
            measured("w-3", "warm", None, None),
        ];
        let summary = summarize(&breakdowns);
        assert_eq!(summary.len(), 2);
        let pilot = summary.iter().find(|s| s.tier == PILOT_LIGHT).unwrap();
        assert_eq!(pilot.replicas, 3);
        assert_eq!(
            pilot.stages["weightLoad"],
            StageSummary {
                median: 70.0,
                worst: 80.0
            }
        );
        assert_eq!(
            pilot.stages["apiReady"],
            StageSummary {
                median: 3.0,
                worst: 4.0
            }
        );
        let warm = summary.iter().find(|s| s.tier == "warm").unwrap();
        assert!(warm.stages.is_empty(), "nothing measured is nothing summarized");
    }
}

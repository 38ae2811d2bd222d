//! The standby's pilot light scaled away through a scripted API server: the workload's scale
//! subresource is read, and lowered to the hot and warm replicas with a merge patch when it runs
//! more; it is raised only from nothing, as a pool that is all pilot light keeps one replica
//! running to be proven.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::json;
use support::{NS, play};
use understudy_operator::crd::PoolSpec;
use understudy_operator::replicas::FixedReplicas;
use understudy_operator::standby::{self, Kept, Sleep};
use understudy_operator::workload::Workload;
use understudy_prober::probe::ProbeSpec;
use understudy_prober::sleep::WakeTimeouts;

const SCALE_PATH: &str = "/apis/apps/v1/namespaces/serving/deployments/vllm-west/scale";

fn pool() -> PoolSpec {
    serde_json::from_value(json!({
        "name": "west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4,
        "standby": [{"tier": "hot", "replicas": 2}, {"tier": "pilotLight", "replicas": 2}],
    }))
    .unwrap()
}

fn scale(replicas: u32) -> serde_json::Value {
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": "vllm-west", "namespace": NS},
        "spec": {"replicas": replicas},
    })
}

async fn keep_once(running: u32) -> (Kept, Vec<String>) {
    keep_pool_once(pool(), running, 2).await
}

/// One pass of the keeper over `pool`, whose workload runs `running`; `target` is where it
/// should be patched to when it is patched at all.
async fn keep_pool_once(pool: PoolSpec, running: u32, target: u32) -> (Kept, Vec<String>) {
    let (client, mut server) = support::client();
    let scenario = async move {
        let mut seen = Vec::new();
        server
            .expect("GET", SCALE_PATH)
            .await
            .answer(200, &scale(running));
        if running > target || running == 0 {
            let patch = server.expect("PATCH", SCALE_PATH).await;
            assert_eq!(patch.content_type, "application/merge-patch+json");
            seen.push(patch.body.to_string());
            patch.answer(200, &scale(target));
        }
        server.expect_no_more().await;
        seen
    };
    play(scenario, async move {
        let workload = Workload::new(client, NS, &pool.workload);
        let replicas = FixedReplicas::default();
        standby::keep(
            &workload,
            &pool,
            &replicas,
            NS,
            &ProbeSpec::default(),
            Sleep::Not("no golden answer yet".to_owned()),
            WakeTimeouts::default(),
        )
        .await
        .unwrap()
    })
    .await
}

#[tokio::test]
async fn a_standby_running_its_pilot_light_is_scaled_down_to_its_hot_replicas() {
    let (kept, patches) = keep_once(4).await;
    assert_eq!(kept.scaled, Some((4, 2)));
    assert_eq!(patches, [r#"{"spec":{"replicas":2}}"#]);
    assert_eq!(
        kept.to_string(),
        "scaled from 4 to 2 replicas: its pilot light does not run"
    );
}

#[tokio::test]
async fn a_standby_in_shape_or_below_it_is_never_patched() {
    for running in [2, 1] {
        let (kept, patches) = keep_once(running).await;
        assert_eq!(kept, Kept::default(), "running {running}");
        assert!(patches.is_empty());
    }
}

#[tokio::test]
async fn a_standby_that_is_all_pilot_light_keeps_one_replica_running_and_is_raised_to_it_from_none() {
    let all_pilot: PoolSpec = serde_json::from_value(json!({
        "name": "west", "workload": {"kind": "Deployment", "name": "vllm-west"}, "replicas": 4,
        "standby": [{"tier": "pilotLight", "replicas": 4}],
    }))
    .unwrap();
    let (kept, patches) = keep_pool_once(all_pilot.clone(), 4, 1).await;
    assert_eq!(kept.scaled, Some((4, 1)));
    assert_eq!(patches, [r#"{"spec":{"replicas":1}}"#]);
    let (kept, patches) = keep_pool_once(all_pilot.clone(), 0, 1).await;
    assert_eq!(kept.scaled, Some((0, 1)));
    assert_eq!(patches, [r#"{"spec":{"replicas":1}}"#]);
    assert_eq!(
        kept.to_string(),
        "scaled from 0 to 1 replicas: a standby with nothing running cannot be proven"
    );
    let (kept, patches) = keep_pool_once(all_pilot, 1, 1).await;
    assert_eq!(kept, Kept::default());
    assert!(patches.is_empty());
}

//! The standby's pilot light scaled away through a scripted API server: the workload's scale
//! subresource is read, and lowered to the hot and warm replicas with a merge patch only when it
//! runs more; it is never raised.

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
    let (client, mut server) = support::client();
    let scenario = async move {
        let mut seen = Vec::new();
        server
            .expect("GET", SCALE_PATH)
            .await
            .answer(200, &scale(running));
        if running > 2 {
            let patch = server.expect("PATCH", SCALE_PATH).await;
            assert_eq!(patch.content_type, "application/merge-patch+json");
            seen.push(patch.body.to_string());
            patch.answer(200, &scale(2));
        }
        server.expect_no_more().await;
        seen
    };
    play(scenario, async move {
        let workload = Workload::new(client, NS, &pool().workload);
        let replicas = FixedReplicas::default();
        standby::keep(
            &workload,
            &pool(),
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
    assert_eq!(kept.scaled_down, Some((4, 2)));
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

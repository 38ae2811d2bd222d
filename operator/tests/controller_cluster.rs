//! The FailoverPolicy controller against a real API server (ignored without one).
//!
//! These tests are marked `#[ignore]`: they need a real cluster:
//!
//! ```text
//! kind create cluster
//! cargo run -q -p understudy-operator --bin crdgen | kubectl apply -f -
//! cargo test -p understudy-operator --test controller_cluster -- --ignored
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use serde_json::json;
use understudy_operator::controller::Context;
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::metrics::Metrics;

mod support;
use support::policy::*;

/// Cluster tests: a real API server, the CRD installed, nothing else.
mod cluster {
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::api::{Api, DeleteParams, PostParams};

    use super::*;

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn applied_policy_gets_a_status_and_an_epoch_lease() {
        let client = Client::try_default().await.unwrap();
        let namespace = client.default_namespace().to_owned();
        let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), &namespace);
        let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
        let mut object = policy();
        object["metadata"] = json!({"name": "understudy-cluster-test"});
        let _ = policies
            .delete("understudy-cluster-test", &DeleteParams::default())
            .await;
        policies
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap();

        let ctx = Arc::new(Context::new(client, Arc::new(Metrics::new()), None));
        let controller = tokio::spawn(async move {
            understudy_operator::controller::run(ctx, Some(&namespace), futures::stream::empty()).await;
        });
        let mut seen = None;
        for _ in 0..60 {
            let current = policies.get("understudy-cluster-test").await.unwrap();
            if current.status.as_ref().and_then(|s| s.epoch).is_some() {
                seen = Some(current);
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        controller.abort();
        let current = seen.expect("no status within a minute");
        let status = current.status.unwrap();
        assert_eq!(status.primary_pool.as_deref(), Some("us-east"));
        assert_eq!(status.epoch, Some(0));
        let lease = leases.get("understudy-cluster-test-epoch").await.unwrap();
        assert_eq!(
            lease.spec.and_then(|s| s.holder_identity).as_deref(),
            Some("us-east")
        );
        policies
            .delete("understudy-cluster-test", &DeleteParams::default())
            .await
            .unwrap();
    }

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn a_policy_the_schema_refuses_never_reaches_the_controller() {
        let client = Client::try_default().await.unwrap();
        let policies: Api<FailoverPolicy> = Api::default_namespaced(client);
        let mut object = policy();
        object["metadata"] = json!({"name": "understudy-cluster-refused"});
        object["spec"]["trigger"] = json!({"suspectAfter": 5, "promoteAfter": 3});
        let refused = policies
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("promoteAfter"), "{refused}");
    }

    #[tokio::test]
    #[ignore = "needs a cluster: tests/cluster/e2e.sh runs it; elsewhere kubectl apply -f crds/ and cargo test -- --ignored"]
    async fn a_standby_with_reserved_gpus_gets_placeholders_that_go_with_the_policy() {
        use k8s_openapi::api::apps::v1::Deployment;

        const POLICY: &str = "understudy-cluster-reserve";
        const RESERVE: &str = "understudy-cluster-reserve-us-west-reserve";
        let client = Client::try_default().await.unwrap();
        let namespace = client.default_namespace().to_owned();
        let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), &namespace);
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
        // The standby's workload, at zero replicas: only its template matters here.
        let mut workload = vllm("vllm-west", "us-west-2a");
        workload["metadata"] = json!({"name": "vllm-west"});
        workload["spec"]["replicas"] = json!(0);
        workload.as_object_mut().unwrap().remove("status");
        let _ = deployments.delete("vllm-west", &DeleteParams::default()).await;
        deployments
            .create(&PostParams::default(), &serde_json::from_value(workload).unwrap())
            .await
            .unwrap();
        let mut object = reserving_policy();
        object["metadata"] = json!({"name": POLICY});
        let _ = policies.delete(POLICY, &DeleteParams::default()).await;
        policies
            .create(&PostParams::default(), &serde_json::from_value(object).unwrap())
            .await
            .unwrap();

        let ctx = Arc::new(Context::new(client, Arc::new(Metrics::new()), None));
        let run_namespace = namespace.clone();
        let controller = tokio::spawn(async move {
            understudy_operator::controller::run(ctx, Some(&run_namespace), futures::stream::empty()).await;
        });
        let mut reserve = None;
        for _ in 0..60 {
            if let Some(found) = deployments.get_opt(RESERVE).await.unwrap() {
                reserve = Some(found);
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let reserve = reserve.expect("no reserve within a minute");
        assert_eq!(reserve.spec.as_ref().and_then(|s| s.replicas), Some(2));
        let owner = &reserve.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("FailoverPolicy", POLICY)
        );
        let status = policies.get(POLICY).await.unwrap().status.unwrap();
        assert_eq!(status.gpu_reserve.map(|r| r.deployment).as_deref(), Some(RESERVE));

        // Deleting the policy (the controller still running, to release its finalizer) takes
        // the placeholders with it, through the owner reference.
        policies.delete(POLICY, &DeleteParams::default()).await.unwrap();
        let mut gone = false;
        for _ in 0..60 {
            if deployments.get_opt(RESERVE).await.unwrap().is_none() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        controller.abort();
        let _ = deployments.delete("vllm-west", &DeleteParams::default()).await;
        assert!(gone, "the reserve outlived its policy");
    }
}

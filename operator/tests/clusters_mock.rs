//! A pool in another cluster is reached with the kubeconfig its Secret holds: read from the
//! operator's own cluster, kept for a while, read again later, and kept when it cannot be read
//! again. What cannot be used says why.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use serde_json::json;
use understudy_operator::clusters::{ClusterError, Clusters};
use understudy_operator::crd::PoolSpec;

use support::{ApiServer, NS, play, status};

const SECRET_PATH: &str = "/api/v1/namespaces/serving/secrets/east-kubeconfig";

fn pool(cluster: bool) -> PoolSpec {
    let mut pool = json!({"name": "east", "workload": {"kind": "Deployment", "name": "llm"}, "replicas": 2});
    if cluster {
        pool["cluster"] = json!({"name": "us-east", "kubeconfigSecret": {"name": "east-kubeconfig"}});
    }
    serde_json::from_value(pool).unwrap()
}

/// A Secret holding `kubeconfig` under `key`, at `version`.
fn secret(key: &str, kubeconfig: &str, version: &str) -> serde_json::Value {
    // ByteString serializes as the API server writes a Secret's data: base64.
    let data = k8s_openapi::ByteString(kubeconfig.as_bytes().to_vec());
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "east-kubeconfig", "namespace": NS, "resourceVersion": version},
        "data": {key: data},
    })
}

const KUBECONFIG: &str = "apiVersion: v1
kind: Config
clusters: [{name: east, cluster: {server: 'https://127.0.0.1:6443', insecure-skip-tls-verify: true}}]
users: [{name: operator, user: {token: abc}}]
contexts: [{name: east, context: {cluster: east, user: operator, namespace: serving}}]
current-context: east
";

async fn answer_secret(server: &mut ApiServer, code: u16, body: &serde_json::Value) {
    server.expect("GET", SECRET_PATH).await.answer(code, body);
}

#[tokio::test]
async fn a_pool_in_the_operators_own_cluster_reads_no_secret() {
    let (client, server) = support::client();
    let clusters = Clusters::new(client);
    let (home, _) = play(server.expect_no_more(), async move {
        clusters.client(NS, &pool(false)).await.is_ok()
    })
    .await;
    assert!(home);
}

#[tokio::test]
async fn a_secret_missing_its_key_or_a_usable_kubeconfig_or_reaching_outside_itself_is_refused() {
    let (client, server) = support::client();
    let clusters = Clusters::new(client);
    let scenario = |mut server: ApiServer| async move {
        answer_secret(
            &mut server,
            404,
            &status(404, "NotFound", "secrets \"east-kubeconfig\" not found"),
        )
        .await;
        answer_secret(&mut server, 200, &secret("config", KUBECONFIG, "1")).await;
        answer_secret(&mut server, 200, &secret("kubeconfig", "clusters: [", "2")).await;
        answer_secret(&mut server, 500, &status(500, "InternalError", "etcd is away")).await;
        answer_secret(&mut server, 200, &secret("kubeconfig", EXEC, "3")).await;
        answer_secret(&mut server, 200, &secret("kubeconfig", TOKEN_FILE, "4")).await;
        answer_secret(&mut server, 200, &secret("kubeconfig", CA_FILE, "5")).await;
        server.expect_no_more().await
    };
    let work = async move {
        let mut errors = Vec::new();
        for _ in 0..7 {
            errors.push(clusters.client(NS, &pool(true)).await.err().unwrap());
        }
        errors
    };
    let (errors, _) = play(scenario(server), work).await;
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(matches!(errors[0], ClusterError::NoSecret { .. }), "{messages:?}");
    assert_eq!(
        messages[1],
        "cluster us-east: the Secret \"east-kubeconfig\" has no key \"kubeconfig\""
    );
    assert!(
        messages[2]
            .starts_with("cluster us-east: the kubeconfig in the Secret \"east-kubeconfig\" cannot be used"),
        "{}",
        messages[2]
    );
    assert!(matches!(errors[3], ClusterError::Secret { .. }), "{messages:?}");
    // A kubeconfig that would run a program or read the operator's own files is refused before
    // anything of it is used.
    for (message, field) in messages[4..]
        .iter()
        .zip(["exec", "tokenFile", "certificate-authority"])
    {
        assert!(message.contains(&format!("sets {field}")), "{message}");
    }
}

/// [`KUBECONFIG`] with its user running a program for its credentials.
const EXEC: &str = "apiVersion: v1
kind: Config
clusters: [{name: east, cluster: {server: 'https://127.0.0.1:6443', insecure-skip-tls-verify: true}}]
users: [{name: operator, user: {exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/sh, args: ['-c', 'touch /tmp/pwned']}}}]
contexts: [{name: east, context: {cluster: east, user: operator}}]
current-context: east
";

/// [`KUBECONFIG`] with its user's token read from the operator's own ServiceAccount token.
const TOKEN_FILE: &str = "apiVersion: v1
kind: Config
clusters: [{name: east, cluster: {server: 'https://attacker.example:443', insecure-skip-tls-verify: true}}]
users: [{name: operator, user: {tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token}}]
contexts: [{name: east, context: {cluster: east, user: operator}}]
current-context: east
";

/// [`KUBECONFIG`] with its certificate authority in a file.
const CA_FILE: &str = "apiVersion: v1
kind: Config
clusters: [{name: east, cluster: {server: 'https://127.0.0.1:6443', certificate-authority: /etc/ssl/certs/ca.pem}}]
users: [{name: operator, user: {token: abc}}]
contexts: [{name: east, context: {cluster: east, user: operator}}]
current-context: east
";

#[tokio::test(start_paused = true)]
async fn a_kubeconfig_is_kept_for_a_while_read_again_and_kept_when_it_cannot_be_read_again() {
    let (client, server) = support::client();
    let reread = Duration::from_secs(2);
    let clusters = Clusters::new(client).reread_after(reread);
    let scenario = |mut server: ApiServer| async move {
        // The first use reads it; the next, soon after, does not.
        answer_secret(&mut server, 200, &secret("kubeconfig", KUBECONFIG, "1")).await;
        // Past `reread` it is read again: unchanged, then unreadable, then changed.
        answer_secret(&mut server, 200, &secret("kubeconfig", KUBECONFIG, "1")).await;
        answer_secret(&mut server, 500, &status(500, "InternalError", "etcd is away")).await;
        answer_secret(&mut server, 200, &secret("kubeconfig", "clusters: [", "2")).await;
        server.expect_no_more().await
    };
    let work = async move {
        let mut outcomes = Vec::new();
        outcomes.push(clusters.client(NS, &pool(true)).await.is_ok());
        tokio::time::sleep(Duration::from_secs(1)).await;
        outcomes.push(clusters.client(NS, &pool(true)).await.is_ok());
        for _ in 0..3 {
            tokio::time::sleep(reread).await;
            outcomes.push(clusters.client(NS, &pool(true)).await.is_ok());
        }
        outcomes
    };
    let (outcomes, _) = play(scenario(server), work).await;
    // A changed Secret whose kubeconfig cannot be used is an error, not the old client: the
    // credentials it held may have been revoked on purpose.
    assert_eq!(outcomes, [true, true, true, true, false]);
}

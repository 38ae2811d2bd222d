//! The cluster tier: a real kube-apiserver, controller manager and scheduler, emulated GPU nodes
//! whose pods are `vllm-emulator` processes on their own loopback addresses, and the operator
//! binary running as the chart's ServiceAccount. `tests/cluster/e2e.sh` brings all of it up and
//! runs these; without it (no `UNDERSTUDY_CLUSTER_KUBECONFIG`) each test says so and passes
//! without checking anything, as the mock API server's tests cover the calls.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use serde_json::json;
use understudy_api::crd::{ColdStartBreakdown, FailoverPolicy};
use understudy_api::lease::EPOCH_ANNOTATION;
use understudy_prober::coldstart::source::Recorded;
use understudy_prober::coldstart::{self, ColdStartStage};
use understudy_tests::cluster::{
    Clients, FENCE_PORT, FENCE_TOKEN, MODEL, client_from, container_pid, delete_namespace, eventually,
    exchange, extended_on_failsafe, fence_access, fence_grants, fenced_deployment, http, is_ready, namespace,
    pod_ip, ready_pods_within, serving_model, sigkill, sigkill_group, status_of, vllm_deployment,
};
use understudy_tests::process::{Process, router_gateway};

const ROUTER: &str = env!("CARGO_BIN_EXE_understudy-router-e2e");
const ADMIN_TOKEN: &str = "cluster-test-admin-token";
const GPU: &str = "nvidia.com/gpu";

/// The cluster's admin client, or `None` (with a note) when no cluster is up.
async fn cluster() -> Option<Client> {
    let Ok(path) = std::env::var("UNDERSTUDY_CLUSTER_KUBECONFIG") else {
        eprintln!("skipped: no cluster is up (tests/cluster/e2e.sh runs this suite against one)");
        return None;
    };
    Some(client_from(&PathBuf::from(path)).await)
}

/// vLLM's CPU image: the emulated nodes run it as real vLLM (`understudy-gpu-nodes --vllm-cpu`).
const VLLM_CPU_IMAGE: &str = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0";

/// [`vllm_deployment`] of vLLM's CPU image, real vLLM serving the tier's tiny model: its own
/// context, no sleep mode (the CPU build has none), and two minutes to start.
fn vllm_cpu_deployment(name: &str, replicas: u32) -> Deployment {
    let mut deployment = serde_json::to_value(vllm_deployment(name, replicas)).unwrap();
    let vllm = &mut deployment["spec"]["template"]["spec"]["containers"][0];
    vllm["image"] = VLLM_CPU_IMAGE.into();
    vllm["args"] = json!([MODEL, "--port", "8000"]);
    vllm["env"] = json!([]);
    serde_json::from_value(deployment).unwrap()
}

/// What serves in both pools of a [`TwoPools`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// `vllm-emulator`: two replicas a pool, fast probes.
    Emulated,
    /// Real vLLM's CPU build: one replica a pool (each takes 4 GB), probes that give a
    /// generation on two busy cores time to finish.
    RealCpu,
}

/// The pods of `app`, once `count` of them are Ready.
async fn ready_pods(pods: &Api<Pod>, app: &str, count: usize) -> Vec<Pod> {
    ready_pods_within(pods, app, count, Duration::from_secs(90)).await
}

fn restart_count(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |s| s[0].restart_count)
}

#[tokio::test]
async fn emulated_gpu_nodes_run_a_vllm_deployment_as_a_kubelet_would() {
    let Some(client) = cluster().await else { return };
    const NS: &str = "e2e-nodes";
    namespace(&client, NS).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &vllm_deployment("llm", 2))
        .await
        .unwrap();

    // The scheduler placed them on GPU nodes; each has an address of its own that serves.
    let ready = ready_pods(&pods, "llm", 2).await;
    let ips: BTreeSet<IpAddr> = ready.iter().map(pod_ip).collect();
    assert_eq!(ips.len(), 2, "every pod has its own address: {ips:?}");
    for pod in &ready {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap();
        assert!(node.starts_with("gpu-node-"), "{node}");
        let (status, body) = http(SocketAddr::new(pod_ip(pod), 8000), "GET", "/v1/models", &[], "");
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(MODEL), "{body}");
    }

    // What a cold start is read from: the kubelet's events, and vLLM's log through pods/log.
    let pod = &ready[0];
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let params = ListParams::default().fields(&format!("involvedObject.uid={}", pod.uid().unwrap()));
    let reasons: Vec<String> = events
        .list(&params)
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|e| e.reason.clone())
        .collect();
    for reason in ["Scheduled", "Pulled", "Created", "Started"] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "no {reason} event: {reasons:?}"
        );
    }
    let log = pods
        .logs(
            &pod.name_any(),
            &LogParams {
                timestamps: true,
                ..LogParams::default()
            },
        )
        .await
        .unwrap();
    assert!(log.contains("Starting vLLM server on"), "{log}");
    // The prober's own reader, through the API server as the operator reads it.
    let recorded = Recorded::from_api(client.clone(), NS, &pod.name_any(), None)
        .await
        .unwrap();
    let timeline = recorded.timeline(None).unwrap();
    assert_eq!(timeline.container.as_deref(), Some("vllm"));
    for stage in [
        ColdStartStage::Node,
        ColdStartStage::ContainerStart,
        ColdStartStage::WeightLoad,
        ColdStartStage::Ready,
    ] {
        assert!(
            timeline.duration(stage).is_some(),
            "{stage} not timed:\n{}",
            coldstart::render_table(&timeline)
        );
    }

    // A process that dies is restarted as the pod's policy says, and serves again.
    let name = pod.name_any();
    sigkill(container_pid(pod));
    let restarted = eventually(
        Duration::from_secs(60),
        "the killed container restarted",
        || async {
            let pod = pods.get(&name).await.unwrap();
            (restart_count(&pod) == 1 && is_ready(&pod)).then_some(pod)
        },
    )
    .await;
    assert_eq!(
        pod_ip(&restarted),
        pod_ip(pod),
        "a restarted container keeps its pod's address"
    );

    // Deleting the workload stops its processes: their ports refuse.
    deployments.delete("llm", &DeleteParams::default()).await.unwrap();
    eventually(Duration::from_secs(60), "the pods gone", || async {
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    for ip in ips {
        assert!(TcpStream::connect_timeout(&SocketAddr::new(ip, 8000), Duration::from_secs(1)).is_err());
    }
}

/// Two pools of vLLM replicas (`chat-east`, the home primary, and `chat-west`, the standby)
/// under the FailoverPolicy `chat`, and a real router process, in namespace `ns`.
struct TwoPools {
    client: Client,
    ns: &'static str,
    east: Vec<Pod>,
    west: Vec<Pod>,
    /// Kept for its lifetime: dropping it stops the router.
    _router: Process,
    admin: SocketAddr,
    /// Where the router's gateway takes clients' requests.
    gateway: SocketAddr,
    dir: tempfile::TempDir,
    policies: Api<FailoverPolicy>,
    /// Whether a fence stands in front of every replica, on [`FENCE_PORT`].
    fenced: bool,
}

/// How the standby pool `west` waits.
struct Standby {
    /// `spec.pools[].replicas`: what it serves with once promoted.
    replicas: u32,
    /// The replicas its Deployment runs while it waits (the pilot-light ones are not running).
    running: u32,
    /// `spec.pools[].standby`: its tiers; `null` for all hot.
    tiers: serde_json::Value,
}

impl Standby {
    /// Two hot replicas.
    fn hot() -> Standby {
        Standby {
            replicas: 2,
            running: 2,
            tiers: serde_json::Value::Null,
        }
    }
}

impl Drop for TwoPools {
    /// A test failing with its pools up scales their workloads to zero. On a thread of its own,
    /// with a client of its own: the test's runtime is unwinding and polls nothing.
    fn drop(&mut self) {
        let Ok(path) = std::env::var("UNDERSTUDY_CLUSTER_KUBECONFIG") else {
            return;
        };
        if !std::thread::panicking() {
            return;
        }
        let ns = self.ns;
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async move {
                let Ok(kubeconfig) = Kubeconfig::read_from(&path) else {
                    return;
                };
                let Ok(config) =
                    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await
                else {
                    return;
                };
                let Ok(client) = Client::try_from(config) else {
                    return;
                };
                let deployments: Api<Deployment> = Api::namespaced(client, ns);
                let Ok(listed) = deployments.list(&ListParams::default()).await else {
                    return;
                };
                let none = json!({"spec": {"replicas": 0}});
                for deployment in listed.items {
                    let name = deployment.name_any();
                    let _ = deployments
                        .patch_scale(&name, &PatchParams::default(), &Patch::Merge(&none))
                        .await;
                }
            });
        })
        .join();
    }
}

impl TwoPools {
    /// `trigger` is merged over the policy's fast-detection trigger.
    async fn start(
        client: Client,
        ns: &'static str,
        standby: Standby,
        trigger: serde_json::Value,
    ) -> TwoPools {
        Self::start_with(client, ns, standby, trigger, false, Engine::Emulated, None).await
    }

    /// One hot replica in each pool, real vLLM's CPU build.
    async fn start_real(client: Client, ns: &'static str) -> TwoPools {
        let standby = Standby {
            replicas: 1,
            running: 1,
            tiers: serde_json::Value::Null,
        };
        Self::start_with(client, ns, standby, json!({}), false, Engine::RealCpu, None).await
    }

    /// Two hot pools whose replicas each have a fence in front ([`fenced_deployment`]), which
    /// the policy's pools name as their port.
    async fn start_fenced(client: Client, ns: &'static str, trigger: serde_json::Value) -> TwoPools {
        Self::start_with(client, ns, Standby::hot(), trigger, true, Engine::Emulated, None).await
    }

    /// With `models`, each pool loads its model from `models/POOL` on its node (a hostPath, as
    /// `HF_HOME`), and the policy compares the model files in full (`artifactDigest: full`).
    async fn start_with(
        client: Client,
        ns: &'static str,
        standby: Standby,
        trigger: serde_json::Value,
        fenced: bool,
        engine: Engine,
        models: Option<&std::path::Path>,
    ) -> TwoPools {
        let (east_replicas, ready_within, probe) = match engine {
            Engine::Emulated => (
                2,
                Duration::from_secs(90),
                json!({"interval": "1s", "timeout": "800ms", "budgets": {"firstToken": "500ms", "total": "800ms"}}),
            ),
            Engine::RealCpu => (
                1,
                Duration::from_secs(300),
                json!({"interval": "2s", "timeout": "1500ms", "budgets": {"firstToken": "1s", "total": "1500ms"}}),
            ),
        };
        namespace(&client, ns).await;
        if fenced {
            fence_access(&client, ns).await;
        }
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        for (name, pool, running) in [
            ("chat-east", "east", east_replicas),
            ("chat-west", "west", standby.running),
        ] {
            let mut deployment = match (fenced, engine) {
                (true, _) => fenced_deployment(name, running, pool),
                (false, Engine::Emulated) => vllm_deployment(name, running),
                (false, Engine::RealCpu) => vllm_cpu_deployment(name, running),
            };
            if let Some(models) = models {
                let host = models.join(pool);
                let mut value = serde_json::to_value(&deployment).unwrap();
                let spec = &mut value["spec"]["template"]["spec"];
                spec["volumes"] = json!([{"name": "models", "hostPath": {"path": host.to_str().unwrap()}}]);
                let vllm = &mut spec["containers"][0];
                vllm["volumeMounts"] = json!([{"name": "models", "mountPath": "/models"}]);
                vllm["env"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "HF_HOME", "value": "/models"}));
                deployment = serde_json::from_value(value).unwrap();
            }
            deployments
                .create(&PostParams::default(), &deployment)
                .await
                .unwrap();
        }
        let east = ready_pods_within(&pods, "chat-east", east_replicas as usize, ready_within).await;
        let west = ready_pods_within(&pods, "chat-west", standby.running as usize, ready_within).await;

        let dir = tempfile::tempdir().unwrap();
        let (router, admin, gateway) = router_process(dir.path());

        let mut spec_trigger = json!({
            "suspectAfter": 1, "promoteAfter": 3, "hardFailure": {"promoteAfter": 2}, "standbyReadyAfter": 2,
        });
        for (key, value) in trigger.as_object().unwrap() {
            spec_trigger[key] = value.clone();
        }
        let mut west_spec = json!({"name": "west", "workload": {"kind": "Deployment", "name": "chat-west"}, "replicas": standby.replicas});
        if !standby.tiers.is_null() {
            west_spec["standby"] = standby.tiers;
        }
        let mut east_spec = json!({"name": "east", "workload": {"kind": "Deployment", "name": "chat-east"}, "replicas": east_replicas});
        if fenced {
            east_spec["port"] = FENCE_PORT.into();
            west_spec["port"] = FENCE_PORT.into();
        }
        let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), ns);
        let mut policy = json!({
            "apiVersion": "understudy.dev/v1alpha1",
            "kind": "FailoverPolicy",
            "metadata": {"name": "chat"},
            "spec": {
                "pools": [east_spec, west_spec],
                "recoveryObjective": "1m",
                "probe": probe,
                "trigger": spec_trigger,
            },
        });
        if models.is_some() {
            policy["spec"]["parity"] = json!({"artifactDigest": "full"});
        }
        let policy = serde_json::from_value(policy).unwrap();
        policies.create(&PostParams::default(), &policy).await.unwrap();
        TwoPools {
            client,
            ns,
            east,
            west,
            _router: router,
            admin,
            gateway,
            dir,
            policies,
            fenced,
        }
    }

    /// The operator binary as the chart's ServiceAccount, pushing routes to the router with the
    /// token `token`.
    fn operator(&self, identity: &str, token: &str) -> Process {
        self.operator_with(identity, token, &[])
    }

    /// [`Self::operator`], with `extra` flags.
    fn operator_with(&self, identity: &str, token: &str, extra: &[&str]) -> Process {
        let token_file = self.dir.path().join(format!("{identity}-token"));
        std::fs::write(&token_file, token).unwrap();
        let router = format!("http://{}", self.admin);
        let token_file = token_file.to_str().unwrap();
        let mut flags = vec!["--router-admin", &router, "--router-token-file", token_file];
        let fence_token_file = self.dir.path().join("fence-token");
        if self.fenced {
            std::fs::write(&fence_token_file, FENCE_TOKEN).unwrap();
            flags.extend(["--replica-token-file", fence_token_file.to_str().unwrap()]);
        }
        flags.extend(extra);
        operator_process(identity, self.ns, &flags)
    }

    /// What the router holds, once it holds `pool` at `epoch`.
    async fn routed(&self, pool: &str, epoch: u64) -> serde_json::Value {
        let what = format!("the router holding {pool} at epoch {epoch}");
        eventually(Duration::from_secs(60), &what, || async {
            let auth = format!("Bearer {ADMIN_TOKEN}");
            let path = format!("/route?policy={}/chat", self.ns);
            let (status, body) = http(self.admin, "GET", &path, &[("authorization", &auth)], "");
            let holds: serde_json::Value = serde_json::from_str(&body).ok()?;
            (status == 200 && holds["route"]["pool"] == pool && holds["route"]["epoch"] == epoch)
                .then_some(holds)
        })
        .await
    }

    /// Waits until the router holds `pool` at `epoch` with exactly `endpoints`: a route moves with
    /// the replicas that passed a generating probe and grows as the rest pass.
    async fn routed_to(&self, pool: &str, epoch: u64, endpoints: &BTreeSet<String>) -> serde_json::Value {
        let what = format!("the router holding {pool} at epoch {epoch} with {endpoints:?}");
        eventually(Duration::from_secs(60), &what, || async {
            let holds = self.routed(pool, epoch).await;
            (endpoints_held(&holds) == *endpoints).then_some(holds)
        })
        .await
    }

    /// The epoch Lease's epoch and holder.
    async fn lease(&self) -> (String, String) {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), self.ns);
        let lease = leases.get("chat-epoch").await.unwrap();
        let epoch = lease
            .annotations()
            .get(EPOCH_ANNOTATION)
            .cloned()
            .unwrap_or_default();
        (
            epoch,
            lease.spec.and_then(|s| s.holder_identity).unwrap_or_default(),
        )
    }

    /// Deletes the namespace and with it both pools, so that the next test has their GPUs, and
    /// then stops `operator`, which meanwhile takes its finalizer off the policy. A test that
    /// fails leaves its namespace for a look (the next run deletes it first), its workloads
    /// scaled to zero ([`Drop`]) so that the GPUs they held go to the tests after it.
    async fn stop(self, operator: Process) {
        delete_namespace(&self.client, self.ns).await;
        drop(operator);
    }

    /// Waits until the policy is steady enough for a game day to inject: its standby proven by
    /// the probes, and, with `parity`, the pools compared and agreeing.
    async fn until_steady(&self, parity: bool) {
        use understudy_api::crd::ConditionStatus::True;
        eventually(Duration::from_secs(60), "the standby proven", || async {
            let status = self.policies.get("chat").await.unwrap().status?;
            let proven = status.conditions.get("StandbyProven")?.status == True;
            let agree = !parity || status.conditions.get("ParityHolds")?.status == True;
            (proven && agree).then_some(())
        })
        .await;
    }

    /// Creates the GameDay `name` on the policy with `spec` (and `run` to run it now), and waits
    /// up to `within` for its verdict; its status.
    async fn game_day(
        &self,
        name: &str,
        run: bool,
        spec: serde_json::Value,
        within: Duration,
    ) -> understudy_api::crd::GameDayStatus {
        use understudy_api::crd::GameDay;
        let gamedays: Api<GameDay> = Api::namespaced(self.client.clone(), self.ns);
        let mut object = json!({
            "apiVersion": "understudy.dev/v1alpha1", "kind": "GameDay",
            "metadata": {"name": name}, "spec": spec,
        });
        object["spec"]["policyRef"] = json!({"name": "chat"});
        if run {
            object["metadata"]["annotations"] = json!({"understudy.dev/command": "run"});
        }
        let gameday: GameDay = serde_json::from_value(object).unwrap();
        gamedays.create(&PostParams::default(), &gameday).await.unwrap();
        eventually(within, "a verdict", || async {
            let status = gamedays.get(name).await.unwrap().status?;
            status.last_verdict.is_some().then_some(status)
        })
        .await
    }

    /// The timeline of the failover to epoch 1, once it finished, waiting up to `within`.
    async fn failed_over_to_epoch_1(&self, within: Duration) -> understudy_api::crd::FailoverTimeline {
        eventually(within, "the failover finished", || async {
            let status = self.policies.get("chat").await.unwrap().status?;
            status
                .last_failover
                .filter(|f| f.finished_at.is_some() && f.epoch == 1)
        })
        .await
    }

    /// The Route step of the failover to west at epoch 1, once it finished, after asserting that
    /// the Lease says so and that the step's note says `target` sends to west at epoch 1.
    async fn routed_to_west(&self, target: &str) -> understudy_api::crd::TimelineStep {
        assert_eq!(self.lease().await, ("1".to_owned(), "west".to_owned()));
        let failover = self.failed_over_to_epoch_1(Duration::from_secs(120)).await;
        let routed = failover.steps.iter().find(|s| s.step == "Routed");
        assert_eq!(
            routed.and_then(|s| s.note.as_deref()),
            Some(format!("{target} sends to west at epoch 1").as_str()),
            "{failover:?}"
        );
        routed.unwrap().clone()
    }

    /// Kills every process of the primary east; the kubelet's back-off keeps them down 10 s.
    fn crash_east(&self) {
        for pod in &self.east {
            sigkill(container_pid(pod));
        }
    }

    /// Kills every process of every container of the primary east, as a node's loss would: a
    /// real vLLM server's engine core and worker with its API server.
    fn crash_east_whole(&self) {
        for pod in &self.east {
            sigkill_group(container_pid(pod));
        }
    }
}

/// The operator binary as the chart's ServiceAccount, running the policies of namespace `ns`,
/// with `flags` besides.
fn operator_process(identity: &str, ns: &str, flags: &[&str]) -> Process {
    let binary = std::env::var("UNDERSTUDY_CLUSTER_OPERATOR").expect("the operator binary");
    let kubeconfig = std::env::var("UNDERSTUDY_CLUSTER_OPERATOR_KUBECONFIG").expect("its kubeconfig");
    Process::start(
        Command::new(binary)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .args([
                "--identity",
                identity,
                "--namespace",
                ns,
                "--admin-addr",
                "127.0.0.1:0",
            ])
            .args(flags),
    )
}

/// The `ip:8000` of each pod.
fn endpoints_of(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().map(|p| format!("{}:8000", pod_ip(p))).collect()
}

fn endpoints_held(holds: &serde_json::Value) -> BTreeSet<String> {
    serde_json::from_value(holds["route"]["endpoints"].clone()).unwrap()
}

/// The lines in which the API server refused the operator something.
fn refusals(operator: &Process) -> Vec<String> {
    operator
        .lines()
        .into_iter()
        .filter(|l| l.contains("forbidden") || l.contains("Forbidden"))
        .collect()
}

#[tokio::test]
async fn the_operator_as_the_charts_service_account_fails_a_crashed_primary_over_to_its_hot_standby() {
    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start(client, "e2e-failover", Standby::hot(), json!({})).await;
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);

    // It leads, takes east as the primary at epoch 0, and tells the router.
    let home = pools.routed("east", 0).await;
    assert_eq!(endpoints_held(&home), endpoints_of(&pools.east));

    pools.crash_east();
    let routed = pools.routed("west", 1).await;
    assert_eq!(endpoints_held(&routed), endpoints_of(&pools.west));

    // The epoch Lease moved once, by compare-and-set, and status tells the story.
    assert_eq!(pools.lease().await, ("1".to_owned(), "west".to_owned()));
    let status = eventually(
        Duration::from_secs(30),
        "status naming west at epoch 1",
        || async {
            let status = pools.policies.get("chat").await.unwrap().status?;
            (status.primary_pool.as_deref() == Some("west") && status.epoch == Some(1)).then_some(status)
        },
    )
    .await;
    let failover = status.last_failover.expect("the last failover's timeline");
    assert_eq!(
        (
            failover.from_pool.as_str(),
            failover.to_pool.as_str(),
            failover.epoch
        ),
        ("east", "west", 1)
    );
    assert!(failover.finished_at.is_some(), "{failover:?}");

    // The chart's ClusterRole was enough: nothing the operator asked for was refused.
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

#[tokio::test]
async fn two_pools_of_real_vllm_servers_fail_over_when_the_primarys_processes_are_killed() {
    let Some(client) = cluster().await else { return };
    if std::env::var_os("UNDERSTUDY_CLUSTER_REAL_VLLM").is_none() {
        // e2e.sh sets it when the real-vLLM tier is installed and the nodes run vLLM's CPU image.
        println!("SKIPPED: the emulated nodes run no real vLLM (tests/vllm/install.sh, then e2e.sh)");
        return;
    }
    let pools = TwoPools::start_real(client, "e2e-real-vllm").await;
    let operator = pools.operator("e2e-operator-real", ADMIN_TOKEN);
    let home = pools.routed("east", 0).await;
    assert_eq!(endpoints_held(&home), endpoints_of(&pools.east));
    let completion =
        json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
            .to_string();
    // The pods run real vLLM, not the emulator: their logs have a line only vLLM prints.
    let pods: Api<Pod> = Api::namespaced(pools.client.clone(), pools.ns);
    for pod in pools.east.iter().chain(&pools.west) {
        let log = pods.logs(&pod.name_any(), &LogParams::default()).await.unwrap();
        assert!(log.contains("Resolved architecture: LlamaForCausalLM"), "{log}");
        assert!(!log.contains("emulator API endpoint bound"), "{log}");
    }
    let served = |(status, body): (u16, String)| {
        assert_eq!(status, 200, "{body}");
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(
            answer["system_fingerprint"]
                .as_str()
                .is_some_and(|f| f.starts_with("vllm-0.32.0-")),
            "{answer}"
        );
        answer["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    let json = [("content-type", "application/json")];
    let before = served(http(pools.gateway, "POST", "/v1/completions", &json, &completion));

    // A node's loss: the API server, the engine core and the worker of every east replica.
    pools.crash_east_whole();
    let routed = pools.routed("west", 1).await;
    assert_eq!(endpoints_held(&routed), endpoints_of(&pools.west));
    assert_eq!(pools.lease().await, ("1".to_owned(), "west".to_owned()));
    // West serves the same model: greedy answers agree, the golden answer's premise.
    let after = served(http(pools.gateway, "POST", "/v1/completions", &json, &completion));
    assert_eq!(before, after);
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// The GPUs no running or pending pod holds, on every node.
async fn free_gpus(client: &Client) -> i64 {
    let gpus = |q: Option<&k8s_openapi::apimachinery::pkg::api::resource::Quantity>| {
        q.map_or(0, |q| q.0.parse::<i64>().unwrap())
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let allocatable: i64 = nodes
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|n| gpus(n.status.as_ref().and_then(|s| s.allocatable.as_ref()?.get(GPU))))
        .sum();
    let pods: Api<Pod> = Api::all(client.clone());
    let held: i64 = pods
        .list(&ListParams::default().fields("status.phase!=Succeeded,status.phase!=Failed"))
        .await
        .unwrap()
        .items
        .iter()
        .flat_map(|p| p.spec.iter().flat_map(|s| s.containers.iter()))
        .map(|c| gpus(c.resources.as_ref().and_then(|r| r.limits.as_ref()?.get(GPU))))
        .sum();
    allocatable - held
}

#[tokio::test]
async fn a_promoted_standby_wakes_its_warm_replica_and_its_pilot_light_replicas_preempt_the_gpu_reserve() {
    let Some(client) = cluster().await else { return };
    let standby = Standby {
        replicas: 4,
        running: 2,
        tiers: json!([
            {"tier": "hot", "replicas": 1},
            {"tier": "warm", "replicas": 1, "sleepLevel": 1},
            {"tier": "pilotLight", "replicas": 2, "reserveGpus": true},
        ]),
    };
    let pools = TwoPools::start(client.clone(), "e2e-tiers", standby, json!({})).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), pools.ns);
    // The warm replica sleeps, as whoever runs the pool puts it to sleep (vLLM's sleep mode).
    let warm = SocketAddr::new(pod_ip(&pools.west[1]), 8000);
    assert_eq!(http(warm, "POST", "/sleep?level=1", &[], "").0, 200);
    assert!(http(warm, "GET", "/is_sleeping", &[], "").1.contains("true"));

    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    pools.routed("east", 0).await;
    // The operator holds the pilot-light replicas' GPUs with two placeholders ...
    let reserve = ListParams::default().labels("app.kubernetes.io/component=gpu-reserve");
    let placeholders: BTreeSet<String> =
        eventually(Duration::from_secs(60), "two placeholders running", || async {
            let ready: Vec<Pod> = pods
                .list(&reserve)
                .await
                .unwrap()
                .items
                .into_iter()
                .filter(is_ready)
                .collect();
            (ready.len() == 2).then(|| ready.iter().map(|p| p.name_any()).collect())
        })
        .await;
    // ... and something else takes every GPU left, so the replicas can only have theirs.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), pools.ns);
    let others = free_gpus(&client).await;
    let mut filler = vllm_deployment("other", u32::try_from(others).unwrap());
    let template = filler.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
    template.containers[0].image = Some("registry.k8s.io/pause:3.10".to_owned());
    template.containers[0].readiness_probe = None;
    deployments.create(&PostParams::default(), &filler).await.unwrap();
    let others = ready_pods(&pods, "other", others as usize).await;
    assert_eq!(free_gpus(&client).await, 0);

    pools.crash_east();
    pools.routed("west", 1).await;
    let west = ready_pods(&pods, "chat-west", 4).await;
    pools.routed_to("west", 1, &endpoints_of(&west)).await;
    // The sleeping replica was woken before the route moved to it.
    assert!(http(warm, "GET", "/is_sleeping", &[], "").1.contains("false"));
    // The scheduler made room by preempting the placeholders, and nothing else.
    let events: Api<Event> = Api::namespaced(client.clone(), pools.ns);
    let preempted: BTreeSet<String> = events
        .list(&ListParams::default().fields("reason=Preempted"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.involved_object.name)
        .collect();
    assert_eq!(preempted, placeholders);
    for pod in others {
        let now = pods.get(&pod.name_any()).await.unwrap();
        assert!(
            now.metadata.deletion_timestamp.is_none() && is_ready(&now),
            "{now:?}"
        );
    }
    assert_eq!(pools.lease().await, ("1".to_owned(), "west".to_owned()));
    // The two pilot-light replicas the promotion started are timed stage by stage in status,
    // from their pods, events and logs, and summarized for their tier.
    let started: BTreeSet<String> = west
        .iter()
        .filter(|p| !pools.west.iter().any(|before| before.name_any() == p.name_any()))
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(started.len(), 2, "{started:?}");
    let (all, summary) = eventually(Duration::from_secs(60), "two cold starts in status", || async {
        let status = pools.policies.get("chat").await.unwrap().status?;
        // Complete: the API answered, and the operator's probe got its first token.
        let answered = |b: &&ColdStartBreakdown| {
            ["apiReady", "firstToken"]
                .iter()
                .all(|stage| b.stages.get(*stage).copied().flatten().is_some())
        };
        (status.cold_start.iter().filter(answered).count() == 2)
            .then_some((status.cold_start, status.cold_start_summary))
    })
    .await;
    // The warm replica's start was its wake, timed by the promotion.
    let (woken, measured): (Vec<&ColdStartBreakdown>, Vec<&ColdStartBreakdown>) =
        all.iter().partition(|b| b.tier.as_deref() == Some("warm"));
    assert_eq!(woken.len(), 1, "{all:?}");
    assert_eq!(woken[0].replica, warm.to_string());
    assert!(
        woken[0].stages["wakeLevel1"].is_some_and(|s| s > 0.0),
        "{:?}",
        woken[0]
    );
    let measured_replicas: BTreeSet<String> = measured.iter().map(|b| b.replica.clone()).collect();
    assert_eq!(measured_replicas, started);
    for breakdown in &measured {
        assert_eq!(
            (breakdown.pool.as_str(), breakdown.tier.as_deref()),
            ("west", Some("pilotLight"))
        );
        assert!(
            breakdown.stages["weightLoad"].is_some_and(|s| s > 0.0),
            "{breakdown:?}"
        );
        assert!(
            breakdown.stages["firstToken"].is_some_and(|s| s >= 0.0),
            "{breakdown:?}"
        );
    }
    let tiers: Vec<(&str, u32)> = summary.iter().map(|s| (s.tier.as_str(), s.replicas)).collect();
    assert_eq!(tiers, [("pilotLight", 2), ("warm", 1)], "{summary:?}");
    assert!(summary[0].stages.contains_key("weightLoad"), "{summary:?}");
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    kubectl_understudy_reads_and_pauses(&pools, &all).await;
    pools.stop(operator).await;
}

/// Runs `kubectl understudy` (the binary `tests/cluster/e2e.sh` names in `UNDERSTUDY_CLUSTER_CLI`)
/// in `ns` with the admin's kubeconfig and no terminal; its exit status and what it printed.
/// `None` (with a note) without one.
fn kubectl_understudy(ns: &str, args: &[&str]) -> Option<(bool, String)> {
    let (Ok(cli), Ok(kubeconfig)) = (
        std::env::var("UNDERSTUDY_CLUSTER_CLI"),
        std::env::var("UNDERSTUDY_CLUSTER_KUBECONFIG"),
    ) else {
        eprintln!("kubectl understudy not checked: no UNDERSTUDY_CLUSTER_CLI");
        return None;
    };
    let output = Command::new(&cli)
        .args(["--kubeconfig", &kubeconfig, "-n", ns])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let printed =
        String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    // Shown with `--nocapture`: the README's output comes from here.
    eprintln!("$ kubectl understudy {}\n{printed}", args.join(" "));
    Some((output.status.success(), printed))
}

/// `kubectl understudy` against the real API server: its cold starts are status's, `get` and
/// `describe` show the promotion, and a pause and a resume it is told to make without asking land
/// in the spec, while one it would have to ask about is not made.
async fn kubectl_understudy_reads_and_pauses(pools: &TwoPools, cold_starts: &[ColdStartBreakdown]) {
    let run = |args: &[&str]| {
        let (ok, printed) = kubectl_understudy(pools.ns, args)?;
        assert!(ok, "{args:?}: {printed}");
        Some(printed)
    };
    let Some(json) = run(&["coldstart", "chat", "-o", "json"]) else {
        return;
    };
    let read: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(read["coldStart"], serde_json::to_value(cold_starts).unwrap());
    let table = run(&["coldstart", "chat"]).unwrap();
    assert!(table.starts_with("REPLICA "), "{table}");
    assert_eq!(
        table.lines().filter(|l| l.contains(" pilotLight ")).count(),
        2,
        "{table}"
    );
    let listed = run(&["get"]).unwrap();
    let row: Vec<&str> = listed.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(row[..4], ["chat", "west", "1", "Serving"], "{listed}");
    let described = run(&["describe", "chat"]).unwrap();
    assert!(
        described.contains("Last failover:  failover east → west at epoch 1"),
        "{described}"
    );
    // Without --yes and nothing to answer on stdin, nothing is written.
    let (ok, said) = kubectl_understudy(pools.ns, &["pause", "chat"]).unwrap();
    assert!(!ok && said.contains("nothing was changed"), "{said}");
    assert!(!pools.policies.get("chat").await.unwrap().spec.paused);
    run(&["pause", "chat", "--yes"]);
    assert!(pools.policies.get("chat").await.unwrap().spec.paused);
    run(&["resume", "chat", "--yes"]);
    assert!(!pools.policies.get("chat").await.unwrap().spec.paused);
}

#[tokio::test]
async fn an_operator_lost_between_the_lease_write_and_the_route_push_is_succeeded_by_one_that_finishes_at_the_same_epoch()
 {
    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start(client, "e2e-restart", Standby::hot(), json!({})).await;
    // The first operator's router token is wrong: it can move the Lease but never the route.
    let first = pools.operator("e2e-operator-1", "not-the-token");
    eventually(Duration::from_secs(60), "east primary at epoch 0", || async {
        let status = pools.policies.get("chat").await.unwrap().status?;
        (status.primary_pool.as_deref() == Some("east") && status.epoch == Some(0)).then_some(())
    })
    .await;
    pools.crash_east();
    eventually(Duration::from_secs(60), "the Lease at epoch 1", || async {
        (pools.lease().await.0 == "1").then_some(())
    })
    .await;
    // Lost without a goodbye (its leader Lease runs out), after the Lease write and before any
    // router took the route.
    drop(first);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let path = format!("/route?policy={}/chat", pools.ns);
    let (_, body) = http(pools.admin, "GET", &path, &[("authorization", &auth)], "");
    assert!(
        !body.contains("\"west\""),
        "the route moved without a token: {body}"
    );

    let second = pools.operator("e2e-operator-2", ADMIN_TOKEN);
    let routed = pools.routed("west", 1).await;
    assert_eq!(endpoints_held(&routed), endpoints_of(&pools.west));
    // It finished the promotion the first began: the same epoch, not another.
    assert_eq!(pools.lease().await, ("1".to_owned(), "west".to_owned()));
    assert!(refusals(&second).is_empty(), "{:#?}", refusals(&second));
    pools.stop(second).await;
}

#[tokio::test]
async fn a_scheduled_game_day_fails_over_for_real_holds_fails_back_and_records_passed() {
    use understudy_api::crd::Verdict;

    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start(
        client.clone(),
        "e2e-gameday",
        Standby::hot(),
        json!({"minDwell": "2s"}),
    )
    .await;
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    pools.routed("east", 0).await;
    // A game day starts only from a steady state; the next minute's run must not find a standby
    // the probes have not proven yet.
    pools.until_steady(false).await;
    // Every minute; the first run comes at the next minute's start.
    let spec = json!({
        "schedule": "* * * * *",
        "fault": "failover",
        "steadyState": {"readyFor": "1s"},
        "maxRecovery": "1m",
        "failback": {"mode": "after", "after": "3s"},
    });
    let status = pools
        .game_day("chat-drill", false, spec, Duration::from_secs(150))
        .await;
    let verdict = status.last_verdict.unwrap();
    assert_eq!(verdict, Verdict::Passed, "{status:#?}");
    // It failed over for real (epoch 1, west) and back (epoch 2, east).
    assert_eq!(pools.lease().await, ("2".to_owned(), "east".to_owned()));
    let routed = pools.routed("east", 2).await;
    assert_eq!(endpoints_held(&routed), endpoints_of(&pools.east));
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    if let Some((ok, listed)) = kubectl_understudy(pools.ns, &["gamedays"]) {
        assert!(ok, "{listed}");
        let row: Vec<&str> = listed.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!((row[0], row[1]), ("chat-drill", "chat"), "{listed}");
        assert!(listed.contains("Passed"), "{listed}");
    }
    pools.stop(operator).await;
}

#[tokio::test]
async fn a_game_day_that_crashes_the_primary_sees_the_policy_promote_its_standby_on_its_own() {
    use understudy_api::crd::Verdict;

    let Some(client) = cluster().await else { return };
    // The emulated nodes bring a deleted pod back in about a second, where a GPU node takes
    // minutes to load weights: one hard-failed round promotes, or the crash might heal unseen.
    let trigger = json!({"minDwell": "2s", "hardFailure": {"promoteAfter": 1}});
    let pools = TwoPools::start(client.clone(), "e2e-crash", Standby::hot(), trigger).await;
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    pools.routed("east", 0).await;
    pools.until_steady(false).await;
    let spec = json!({
        "fault": "crash",
        "steadyState": {"readyFor": "1s"},
        "maxRecovery": "1m",
        "failback": {"mode": "manual"},
    });
    let status = pools
        .game_day("chat-crash", true, spec, Duration::from_secs(120))
        .await;
    let verdict = status.last_verdict.unwrap();
    assert_eq!(verdict, Verdict::Passed, "{status:#?}");
    let run = &status.last_runs[0];
    assert_eq!(run.command, None, "a crash gives the policy no command");
    assert_eq!(run.injected.as_deref(), Some("deleted the serving pods of east"));
    assert!(
        run.reason.as_deref().unwrap().contains("after the crash"),
        "{run:?}"
    );
    // The policy promoted west by itself, and east's pods were really deleted.
    assert_eq!(pools.lease().await, ("1".to_owned(), "west".to_owned()));
    let pods: Api<Pod> = Api::namespaced(client.clone(), pools.ns);
    for pod in &pools.east {
        let now = pods.get_opt(&pod.name_any()).await.unwrap();
        assert!(
            now.is_none_or(|p| p.metadata.uid != pod.metadata.uid),
            "{} survived",
            pod.name_any()
        );
    }
    let events: Api<Event> = Api::namespaced(client, pools.ns);
    let injected = events
        .list(&ListParams::default().fields("reason=FaultInjected"))
        .await
        .unwrap()
        .items;
    assert_eq!(injected.len(), 1, "{injected:?}");
    let note = injected[0].message.as_deref().unwrap_or_default();
    assert!(
        note.starts_with("crashed east: deleted its 2 serving pod(s) with no grace period"),
        "{note}"
    );
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

#[tokio::test]
async fn a_game_day_that_drifts_the_standby_sees_the_policy_report_it_promote_nothing_and_recover() {
    use understudy_api::crd::Verdict;

    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start(
        client.clone(),
        "e2e-drift",
        Standby::hot(),
        json!({"minDwell": "2s"}),
    )
    .await;
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    pools.routed("east", 0).await;
    pools.until_steady(true).await;
    let spec = json!({"fault": "drift", "steadyState": {"readyFor": "1s"}, "maxRecovery": "90s"});
    let status = pools
        .game_day("chat-drift", true, spec, Duration::from_secs(200))
        .await;
    let verdict = status.last_verdict.unwrap();
    assert_eq!(verdict, Verdict::Passed, "{status:#?}");
    let run = &status.last_runs[0];
    assert!(
        run.reason.as_deref().unwrap().contains("promoted nothing"),
        "{run:?}"
    );
    // Nothing moved, and west runs without the variable again.
    assert_eq!(pools.lease().await, ("0".to_owned(), "east".to_owned()));
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), pools.ns);
    let west = deployments.get("chat-west").await.unwrap();
    let env = west.spec.unwrap().template.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap_or_default();
    assert!(
        env.iter().all(|v| v.name != "VLLM_UNDERSTUDY_GAMEDAY_DRIFT"),
        "{env:?}"
    );
    // The policy sends its Event just after the status write the run passed on.
    events_told(
        client,
        pools.ns,
        &["FaultInjected", "ParityDrift", "FaultTakenBack", "ParityRestored"],
    )
    .await;
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// Waits up to 10 s until the Events of namespace `ns` include every reason in `told`.
async fn events_told(client: Client, ns: &str, told: &[&str]) {
    let events: Api<Event> = Api::namespaced(client, ns);
    eventually(Duration::from_secs(10), &format!("Events {told:?}"), || async {
        let reasons: Vec<String> = events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|e| e.reason)
            .collect();
        told.iter()
            .all(|reason| reasons.iter().any(|r| r == reason))
            .then_some(())
    })
    .await;
}

/// The serving keys a pod's vLLM container was started with that this test changes: its
/// `VLLM_UNDERSTUDY_ROLLOUT` and whether it carries an emulator fault.
fn rollout_version(pod: &Pod) -> (Option<String>, bool) {
    let vllm = &pod.spec.as_ref().unwrap().containers[0];
    let version = vllm
        .env
        .iter()
        .flatten()
        .find(|v| v.name == "VLLM_UNDERSTUDY_ROLLOUT")
        .and_then(|v| v.value.clone());
    let faulty = vllm.args.iter().flatten().any(|a| a == "--emu-fault");
    (version, faulty)
}

/// Sets `deployment`'s vLLM container to serve as `version`, broken (`faulty`: every generation
/// fails while `/health` answers 200) or not, as its owner would: a strategic merge patch of its
/// template.
async fn set_version(deployments: &Api<Deployment>, deployment: &str, version: &str, faulty: bool) {
    let mut args = json!([
        MODEL,
        "--port",
        "8000",
        "--max-model-len",
        "4096",
        "--enable-sleep-mode"
    ]);
    if faulty {
        args.as_array_mut()
            .unwrap()
            .extend([json!("--emu-fault"), json!("half-failed")]);
    }
    let patch = json!({"spec": {"template": {"spec": {"containers": [{
        "name": "vllm", "args": args,
        "env": [{"name": "VLLM_UNDERSTUDY_ROLLOUT", "value": version}],
    }]}}}});
    deployments
        .patch(deployment, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_standby_first_rollout_rolls_the_primary_only_after_the_standby_passed_and_never_to_a_version_broken_on_it()
 {
    use understudy_api::crd::RolloutPhase;

    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start(client.clone(), "e2e-rollout", Standby::hot(), json!({})).await;
    let rollout = json!({"spec": {"rollout": "standbyFirst"}});
    pools
        .policies
        .patch("chat", &PatchParams::default(), &Patch::Merge(&rollout))
        .await
        .unwrap();
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    pools.routed("east", 0).await;
    pools.until_steady(true).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), pools.ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), pools.ns);
    let phase_is = |phase: RolloutPhase| {
        let policies = pools.policies.clone();
        async move {
            let status = policies.get("chat").await.unwrap().status?;
            let rollout = status.rollout?;
            (rollout.phase == phase).then_some(rollout)
        }
    };
    let paused = |name: &'static str| {
        let deployments = deployments.clone();
        async move { deployments.get(name).await.unwrap().spec.unwrap().paused == Some(true) }
    };
    eventually(
        Duration::from_secs(30),
        "the primary held while it runs its template",
        || async {
            (paused("chat-east").await).then_some(())?;
            phase_is(RolloutPhase::UpToDate).await
        },
    )
    .await;
    assert!(!paused("chat-west").await, "the standby is never held");
    let east_before: BTreeSet<String> = pools.east.iter().map(ResourceExt::name_any).collect();
    let east_now = || async {
        pods.list(&ListParams::default().labels("app=chat-east"))
            .await
            .unwrap()
            .items
    };

    // v2 on the primary alone is held: the standby does not run it.
    set_version(&deployments, "chat-east", "v2", false).await;
    let held = eventually(Duration::from_secs(30), "v2 held on the primary", || {
        phase_is(RolloutPhase::Holding)
    })
    .await;
    assert!(
        held.message.contains("env.VLLM_UNDERSTUDY_ROLLOUT") && held.change.contains("-> v2"),
        "{held:?}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let east: BTreeSet<String> = east_now().await.iter().map(ResourceExt::name_any).collect();
    assert_eq!(east, east_before, "the held primary's pods are the ones it had");

    // v2 on the standby too: the standby rolls, passes on it, and only then the primary rolls.
    set_version(&deployments, "chat-west", "v2", false).await;
    let rolled = eventually(Duration::from_secs(120), "the primary rolled to v2", || async {
        let rollout = phase_is(RolloutPhase::UpToDate).await?;
        let east = east_now().await;
        let on_v2 = east
            .iter()
            .all(|pod| rollout_version(pod) == (Some("v2".to_owned()), false));
        (rollout.target == held.target && east.len() == 2 && on_v2).then_some(east)
    })
    .await;
    assert!(paused("chat-east").await, "held again for the next change");
    let west_v2 = pods
        .list(&ListParams::default().labels("app=chat-west"))
        .await
        .unwrap()
        .items;
    let created = |pod: &Pod| pod.metadata.creation_timestamp.clone().unwrap().0;
    let standby_ready = west_v2.iter().map(created).max().unwrap();
    for pod in &rolled {
        assert!(
            created(pod) >= standby_ready,
            "{} started before the standby ran v2",
            pod.name_any()
        );
    }

    // v3 is broken: the standby fails on it and the primary never runs it.
    let east_v2: BTreeSet<String> = rolled.iter().map(ResourceExt::name_any).collect();
    set_version(&deployments, "chat-east", "v3", true).await;
    set_version(&deployments, "chat-west", "v3", true).await;
    let stopped = eventually(Duration::from_secs(120), "the v3 rollout stopped", || {
        phase_is(RolloutPhase::Stopped)
    })
    .await;
    assert!(stopped.message.contains("failed"), "{stopped:?}");
    assert!(paused("chat-east").await);
    let east: Vec<Pod> = east_now().await;
    assert_eq!(
        east.iter().map(ResourceExt::name_any).collect::<BTreeSet<_>>(),
        east_v2,
        "the primary is untouched"
    );
    assert!(
        east.iter()
            .all(|pod| rollout_version(pod) == (Some("v2".to_owned()), false))
    );
    assert_eq!(
        pools.lease().await,
        ("0".to_owned(), "east".to_owned()),
        "nothing promoted"
    );
    // The policy sends its Events just after the status write.
    let told = [
        "RolloutHeld",
        "RolloutProving",
        "RolloutStarted",
        "RolloutUpToDate",
        "RolloutStopped",
    ];
    events_told(client, pools.ns, &told).await;
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// The node agents as the chart runs them with `agent.modelCacheHostPath`, in `ns`: every node's
/// `understudy-prober agent`, reading the model cache at `models` (every emulated node's, since
/// they share this host's files).
async fn model_reading_agents(client: &Client, ns: &str, models: &std::path::Path) {
    let models = models.to_str().unwrap();
    let agents: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "gpu-agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "gpu-agent"}},
            "template": {
                "metadata": {"labels": {"app": "gpu-agent"}},
                "spec": {
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{
                        "name": "agent",
                        "image": "understudy-prober:test",
                        "args": ["agent", "--admin-addr", "0.0.0.0:9400", "--interval", "1s",
                                 "--model-cache", "/models", "--model-cache-host-path", models],
                        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": true}],
                    }],
                    "volumes": [{"name": "models", "hostPath": {"path": models, "type": "Directory"}}],
                },
            },
        },
    }))
    .unwrap();
    Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &agents)
        .await
        .unwrap();
}

/// A model directory in `models/POOL` as vLLM finds `MODEL` under `HF_HOME`: a safetensors file
/// of four F32 weights `weights`, its config and tokenizer config.
fn write_model(models: &std::path::Path, pool: &str, weights: [u8; 16]) {
    let dir = models
        .join(pool)
        .join("hub")
        .join(format!("models--{}", MODEL.replace('/', "--")));
    std::fs::create_dir_all(&dir).unwrap();
    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&weights);
    // Whole or not at all, as a download lands: a reading never sees it half written.
    std::fs::write(dir.join("model.partial"), file).unwrap();
    std::fs::rename(dir.join("model.partial"), dir.join("model.safetensors")).unwrap();
    for (name, text) in [("config.json", "{}"), ("tokenizer_config.json", "{}")] {
        if !dir.join(name).exists() {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }
}

#[tokio::test]
async fn a_weight_file_that_drifted_on_the_standbys_node_is_named_by_key_and_blocks_promotion() {
    use understudy_api::crd::ConditionStatus::{False, True};

    let Some(client) = cluster().await else { return };
    let models = tempfile::tempdir().unwrap();
    write_model(models.path(), "east", [1; 16]);
    write_model(models.path(), "west", [1; 16]);
    let pools = TwoPools::start_with(
        client.clone(),
        "e2e-weights",
        Standby::hot(),
        json!({"minDwell": "2s"}),
        false,
        Engine::Emulated,
        Some(models.path()),
    )
    .await;
    model_reading_agents(&client, pools.ns, models.path()).await;
    let agents = [
        "--gpu-agent-selector",
        "app=gpu-agent",
        "--gpu-agent-namespace",
        pools.ns,
        "--gpu-agent-port",
        "9400",
    ];
    let operator = pools.operator_with("e2e-operator-1", ADMIN_TOKEN, &agents);
    pools.routed("east", 0).await;
    let condition = |status: &understudy_api::crd::FailoverPolicyStatus, name: &str| {
        status.conditions.get(name).map(|c| (c.status, c.message.clone()))
    };
    let steady = eventually(Duration::from_secs(90), "the model files compared", || async {
        let status = pools.policies.get("chat").await.unwrap().status?;
        let (compared, _) = condition(&status, "ArtifactDigestCompared")?;
        let (holds, _) = condition(&status, "ParityHolds")?;
        (compared == True && holds == True).then_some(status)
    })
    .await;
    let parity = steady.parity.as_ref().unwrap();
    assert!(parity.artifact_keys >= 5, "{parity:?}");
    println!(
        "ArtifactDigestCompared: {}",
        condition(&steady, "ArtifactDigestCompared").unwrap().1
    );

    // One weight of west's model changes on its node, the file's size the same.
    let mut drifted = [1; 16];
    drifted[15] = 2;
    write_model(models.path(), "west", drifted);
    let key = "artifact.model.file.model.safetensors.sha256";
    let drifted_at = Instant::now();
    let status = eventually(Duration::from_secs(60), "the drifted weights named", || async {
        let status = pools.policies.get("chat").await.unwrap().status?;
        let parity = status.parity.clone()?;
        let named = parity.drift.iter().map(|d| d.key.as_str()).collect::<Vec<_>>() == [key];
        (named && condition(&status, "ParityHolds")?.0 == False).then_some(status)
    })
    .await;
    println!(
        "drift named {:.1} s after the write; ParityHolds: {}",
        drifted_at.elapsed().as_secs_f64(),
        condition(&status, "ParityHolds").unwrap().1
    );

    // East crashes: with parity broken, west is not promoted while east is down (its kubelet
    // keeps it down 10 s; a standby in parity is promoted in about 3).
    pools.crash_east();
    let crashed = Instant::now();
    while crashed.elapsed() < Duration::from_secs(8) {
        assert_eq!(
            pools.lease().await,
            ("0".to_owned(), "east".to_owned()),
            "promoted a drifted standby"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let status = pools.policies.get("chat").await.unwrap().status.unwrap();
    assert_eq!(condition(&status, "ParityHolds").unwrap().0, False, "{status:#?}");

    // The control, once east serves again (or parity restored now would rightly promote west):
    // west's weights put back, parity holds again, and the next crash promotes it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), pools.ns);
    let east = eventually(Duration::from_secs(60), "east restarted and serving", || async {
        let east = pods
            .list(&ListParams::default().labels("app=chat-east"))
            .await
            .ok()?
            .items;
        let restarted = east.iter().all(|pod| restart_count(pod) >= 1 && is_ready(pod));
        let status = pools.policies.get("chat").await.ok()?.status?;
        (restarted && status.state.as_deref() == Some("Serving")).then_some(east)
    })
    .await;
    write_model(models.path(), "west", [1; 16]);
    pools.until_steady(true).await;
    pools.routed("east", 0).await;
    for pod in &east {
        // Its processes as they run since the restart.
        sigkill(container_pid(pod));
    }
    let crashed = Instant::now();
    pools.routed("west", 1).await;
    println!(
        "with parity restored, west routed at epoch 1 {:.1} s after the crash",
        crashed.elapsed().as_secs_f64()
    );
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// The fault each of `pods`' fences plays, as it answers the operator's token.
fn fence_faults(pods: &[Pod]) -> Vec<serde_json::Value> {
    let auth = format!("Bearer {FENCE_TOKEN}");
    pods.iter()
        .map(|pod| {
            let fence = SocketAddr::new(pod_ip(pod), FENCE_PORT);
            let (status, body) = http(fence, "GET", "/understudy/fault", &[("authorization", &auth)], "");
            assert_eq!(status, 200, "{body}");
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["fault"].clone()
        })
        .collect()
}

#[tokio::test]
async fn game_days_that_hang_and_half_fail_the_primary_through_its_fences_see_the_policy_promote_on_its_own()
{
    use understudy_api::crd::Verdict;

    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start_fenced(client.clone(), "e2e-fence-faults", json!({"minDwell": "2s"})).await;
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    // The router reaches east through its fences, and the standby is proven through west's,
    // which are fenced: the operator's probes carry the fences' token.
    let routed = pools.routed("east", 0).await;
    let fences: BTreeSet<String> = pools
        .east
        .iter()
        .map(|p| format!("{}:{FENCE_PORT}", pod_ip(p)))
        .collect();
    assert_eq!(endpoints_held(&routed), fences);
    pools.until_steady(true).await;
    let west = SocketAddr::new(pod_ip(&pools.west[0]), FENCE_PORT);
    let prompt = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}).to_string();
    let (status, _) = http(west, "POST", "/v1/completions", &[], &prompt);
    assert_eq!(status, 503, "a client of the standby is fenced");

    // A hang, under load, failing back once east is healed.
    let clients = Clients::start(pools.gateway);
    let spec = json!({"fault": "hang", "steadyState": {"readyFor": "1s"}, "maxRecovery": "90s",
                      "failback": {"mode": "after", "after": "3s"}});
    let status = pools
        .game_day("chat-hang", true, spec, Duration::from_secs(200))
        .await;
    let answered = clients.stop();
    assert_eq!(status.last_verdict, Some(Verdict::Passed), "{status:#?}");
    let run = &status.last_runs[0];
    assert!(
        run.reason.as_deref().unwrap().contains("after the hang"),
        "{run:?}"
    );
    assert_eq!(run.injected.as_deref(), Some("hung the fences of east"));
    let requests = run.requests.unwrap();
    assert!(
        requests.sent > 0 && answered > 0,
        "{requests:?}, {answered} answered"
    );
    eprintln!("the hang's record of loss: {requests:?}; the clients saw {answered} answered");
    assert_eq!(fence_faults(&pools.east), [json!(null), json!(null)]);
    pools.routed("east", 2).await;

    // A half-failure: east's fences answer wrongly and only the golden-answer probe sees it.
    pools.until_steady(true).await;
    let spec = json!({"fault": "halfFailed", "steadyState": {"readyFor": "1s"}, "maxRecovery": "90s"});
    let status = pools
        .game_day("chat-half", true, spec, Duration::from_secs(200))
        .await;
    assert_eq!(status.last_verdict, Some(Verdict::Passed), "{status:#?}");
    let run = &status.last_runs[0];
    assert!(
        run.reason.as_deref().unwrap().contains("after the half-failure"),
        "{run:?}"
    );
    assert_eq!(pools.lease().await, ("3".to_owned(), "west".to_owned()));
    assert_eq!(fence_faults(&pools.east), [json!(null), json!(null)]);

    let events: Api<Event> = Api::namespaced(client, pools.ns);
    let told = |reason: &str| {
        let events = events.clone();
        let params = ListParams::default().fields(&format!("reason={reason}"));
        async move { events.list(&params).await.unwrap().items.len() }
    };
    assert_eq!(told("FaultInjected").await, 2);
    assert_eq!(told("FaultTakenBack").await, 2);
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

#[tokio::test]
async fn an_operator_whose_leader_lease_another_replica_took_stops_leading_and_exits() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    let Some(client) = cluster().await else { return };
    const NS: &str = "e2e-leadership";
    namespace(&client, NS).await;
    let mut operator = operator_process("e2e-leader", NS, &[]);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let holder = |lease: &Lease| lease.spec.as_ref().and_then(|s| s.holder_identity.clone());
    let mut lease = eventually(Duration::from_secs(60), "the operator leading", || async {
        let lease = leases.get_opt("understudy-operator").await.unwrap()?;
        (holder(&lease).as_deref() == Some("e2e-leader")).then_some(lease)
    })
    .await;
    // Another replica holds it now, as after a partition the old leader did not see.
    let spec = lease.spec.as_mut().unwrap();
    spec.holder_identity = Some("e2e-other".to_owned());
    spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    leases
        .replace("understudy-operator", &PostParams::default(), &lease)
        .await
        .unwrap();
    // Its next renewal loses the compare-and-set; it stops leading and the process ends, so that
    // a fresh one contends again, rather than acting on a leadership it no longer has.
    let until = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = operator.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < until, "still running: {:#?}", operator.lines());
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(!status.success(), "{status:?}");
    let lines = operator.lines();
    assert!(lines.iter().any(|l| l.contains("lost leadership")), "{lines:#?}");
    // And it did not take the Lease back on its way out.
    let now = leases.get("understudy-operator").await.unwrap();
    assert_eq!(holder(&now).as_deref(), Some("e2e-other"));
    delete_namespace(&client, NS).await;
}

/// One router process for every policy of a test; its admin and gateway addresses.
fn router_process(dir: &std::path::Path) -> (Process, SocketAddr, SocketAddr) {
    let token_file = dir.join("router-token");
    std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
    router_gateway(std::path::Path::new(ROUTER), &token_file)
}

/// The policy `name` in `ns`: pools `{name}-east` (the home primary) and `{name}-west` of one
/// replica each, serving `model` (`--served-model-name`); the pods of each.
async fn policy_serving(client: &Client, ns: &str, name: &str, model: &str) -> (Vec<Pod>, Vec<Pod>) {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for pool in ["east", "west"] {
        let deployment = serving_model(vllm_deployment(&format!("{name}-{pool}"), 1), model);
        deployments
            .create(&PostParams::default(), &deployment)
            .await
            .unwrap();
    }
    let east = ready_pods(&pods, &format!("{name}-east"), 1).await;
    let west = ready_pods(&pods, &format!("{name}-west"), 1).await;
    let policies: Api<FailoverPolicy> = Api::namespaced(client.clone(), ns);
    let pool = |pool: &str| json!({"name": pool, "workload": {"kind": "Deployment", "name": format!("{name}-{pool}")}, "replicas": 1});
    let policy = serde_json::from_value(json!({
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "FailoverPolicy",
        "metadata": {"name": name},
        "spec": {
            "pools": [pool("east"), pool("west")],
            "recoveryObjective": "1m",
            "probe": {"interval": "1s", "timeout": "800ms", "budgets": {"firstToken": "500ms", "total": "800ms"}},
            "trigger": {"suspectAfter": 1, "promoteAfter": 3, "hardFailure": {"promoteAfter": 2}, "standbyReadyAfter": 2},
        },
    }))
    .unwrap();
    policies.create(&PostParams::default(), &policy).await.unwrap();
    (east, west)
}

/// What the router at `admin` holds for `policy`, once it holds `pool` at `epoch`.
async fn routed_for(admin: SocketAddr, policy: &str, pool: &str, epoch: u64) -> serde_json::Value {
    let what = format!("the router holding {pool} at epoch {epoch} for {policy}");
    eventually(Duration::from_secs(60), &what, || async {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        let path = format!("/route?policy={policy}");
        let (status, body) = http(admin, "GET", &path, &[("authorization", &auth)], "");
        let holds: serde_json::Value = serde_json::from_str(&body).ok()?;
        (status == 200 && holds["route"]["pool"] == pool && holds["route"]["epoch"] == epoch).then_some(holds)
    })
    .await
}

/// One request's model, when it was sent, and the status it got.
type Sent = (&'static str, Instant, u16);

/// Sends completions for `model` through `gateway`, about 20 a second, one after another, until
/// `stop` is set; what each got.
fn load(
    gateway: SocketAddr,
    model: &'static str,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<Sent>> {
    std::thread::spawn(move || {
        let mut sent = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let body = json!({"model": model, "prompt": "hi", "max_tokens": 2}).to_string();
            let at = Instant::now();
            let (status, _) = http(
                gateway,
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                &body,
            );
            sent.push((model, at, status));
            std::thread::sleep(Duration::from_millis(50));
        }
        sent
    })
}

#[tokio::test]
async fn two_policies_behind_one_router_set_fail_over_apart_under_load() {
    let Some(client) = cluster().await else { return };
    let ns = "e2e-two-policies";
    namespace(&client, ns).await;
    let (chat_east, chat_west) = policy_serving(&client, ns, "chat", "chat-model").await;
    let (code_east, code_west) = policy_serving(&client, ns, "code", "code-model").await;
    let dir = tempfile::tempdir().unwrap();
    let (_router, admin, gateway) = router_process(dir.path());
    let router = format!("http://{admin}");
    let token_file = dir.path().join("router-token");
    let operator = operator_process(
        "e2e-operator-two-policies",
        ns,
        &[
            "--router-admin",
            &router,
            "--router-token-file",
            token_file.to_str().unwrap(),
        ],
    );
    let (chat, code) = (format!("{ns}/chat"), format!("{ns}/code"));
    // One operator keeps both policies' home routes on the one router, each with its model.
    let home = routed_for(admin, &chat, "east", 0).await;
    assert_eq!(home["route"]["models"], json!(["chat-model"]));
    assert_eq!(endpoints_held(&home), endpoints_of(&chat_east));
    let home = routed_for(admin, &code, "east", 0).await;
    assert_eq!(home["route"]["models"], json!(["code-model"]));

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A client per model, so that one policy's held requests never hold the other's up.
    let clients = [
        load(gateway, "chat-model", Arc::clone(&stop)),
        load(gateway, "code-model", Arc::clone(&stop)),
    ];
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Chat's primary dies: chat fails over, code's route and epoch stay as they were.
    let chat_crash = Instant::now();
    for pod in &chat_east {
        sigkill(container_pid(pod));
    }
    let routed = routed_for(admin, &chat, "west", 1).await;
    assert_eq!(endpoints_held(&routed), endpoints_of(&chat_west));
    let code_held = routed_for(admin, &code, "east", 0).await;
    assert_eq!(endpoints_held(&code_held), endpoints_of(&code_east));
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Then code's: it fails over on its own, to its own epoch 1.
    let code_crash = Instant::now();
    for pod in &code_east {
        sigkill(container_pid(pod));
    }
    let routed = routed_for(admin, &code, "west", 1).await;
    assert_eq!(endpoints_held(&routed), endpoints_of(&code_west));
    routed_for(admin, &chat, "west", 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent: Vec<Sent> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();

    // Counted by the load: code's requests were never touched by chat's failover, and neither
    // policy lost a request to its own (held by the router, then served by the new primary).
    let failed =
        |model: &str| -> Vec<&Sent> { sent.iter().filter(|(m, _, s)| *m == model && *s != 200).collect() };
    let of = |model: &str| sent.iter().filter(|(m, _, _)| *m == model).count();
    let code_during_chats = sent
        .iter()
        .filter(|(m, at, _)| *m == "code-model" && *at >= chat_crash && *at < code_crash)
        .count();
    assert!(
        code_during_chats > 10,
        "the load ran through chat's failover: {code_during_chats}"
    );
    assert!(
        of("chat-model") > 40 && of("code-model") > 40,
        "{} and {}",
        of("chat-model"),
        of("code-model")
    );
    assert_eq!(failed("code-model"), Vec::<&Sent>::new());
    assert_eq!(failed("chat-model"), Vec::<&Sent>::new());
    // The GPUs go to the tests after this one; the operator takes its finalizers off meanwhile.
    delete_namespace(&client, ns).await;
    drop(operator);
}

/// The operator's cluster lost, in one cluster: the operator killed while its pools serve under
/// load. The primary's fences serve on past their grants' time to live, extending them only
/// because the standby's fences vouch that nobody knows a newer epoch; no client sees an error and
/// nothing is promoted; a new operator's grants take over again at the same epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_operator_gone_the_primary_serves_on_under_grants_the_standby_vouches_for() {
    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start_fenced(client.clone(), "e2e-grants", json!({})).await;
    let grants = json!({"spec": {"grants": {"ttl": "6s", "renewEvery": "1s", "clockSkew": "500ms"}}});
    pools
        .policies
        .patch("chat", &PatchParams::default(), &Patch::Merge(&grants))
        .await
        .unwrap();
    let operator = pools.operator("e2e-operator-grants", ADMIN_TOKEN);
    pools.routed("east", 0).await;
    eventually(
        Duration::from_secs(60),
        "east's fences serving under grants",
        || async {
            let status = pools.policies.get("chat").await.unwrap().status?;
            let grants = status.grants?;
            let east = grants.pools.iter().find(|p| p.pool == "east")?;
            (grants.holder == "east" && east.fences.get("serving") == Some(&2)).then_some(())
        },
    )
    .await;
    let views = fence_grants(&pools.east);
    assert!(
        views
            .iter()
            .all(|v| v["remainingMs"].as_u64().is_some_and(|ms| ms <= 6_000)),
        "{views:?}"
    );
    assert!(
        fence_grants(&pools.west)
            .iter()
            .all(|v| v["standing"] == "fenced")
    );

    let clients = Clients::start(pools.gateway);
    drop(operator);
    // Three extensions each, two renewal periods apart: well past the 6 s a grant lasts.
    let extended = extended_on_failsafe(&pools.east, 3).await;
    assert!(extended.iter().all(|v| v["epoch"] == 0), "{extended:?}");
    assert_eq!(pools.lease().await, ("0".to_owned(), "east".to_owned()));

    let operator = pools.operator("e2e-operator-grants-2", ADMIN_TOKEN);
    eventually(Duration::from_secs(60), "the new operator's grants", || async {
        fence_grants(&pools.east)
            .iter()
            .all(|v| v["standing"] == "serving")
            .then_some(())
    })
    .await;
    let (sent, answered) = clients.stop_counting();
    assert!(sent > 50, "{sent} sent");
    assert_eq!(
        answered, sent,
        "every request answered while the operator was gone"
    );
    assert_eq!(
        pools.lease().await,
        ("0".to_owned(), "east".to_owned()),
        "nothing promoted"
    );
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// What an HTTPRoute sends west's share to.
enum WestBackend {
    /// Service `chat-west`.
    Service,
    /// InferencePool `chat-west`, of west's pods, its endpoint picker failing closed. Nothing
    /// here runs the picker: the route is written and accepted, not served.
    InferencePool,
}

/// Routes `pools`' policy through HTTPRoute `chat` (parent: Gateway `edge`), which sends to
/// Service `chat-east` on `port` and to `west`'s backend, each at weight 1, with Services
/// `chat-east` and `chat-west` on `port`, one per pool; the routes.
async fn route_through_http_route(
    pools: &TwoPools,
    port: u16,
    west: WestBackend,
) -> Api<kube::api::DynamicObject> {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    use understudy_operator::route_target::http_route_resource;
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(pools.client.clone(), pools.ns);
    for pool in ["chat-east", "chat-west"] {
        let service = json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": pool},
            "spec": {"selector": {"app": pool}, "ports": [{"port": port, "targetPort": port}]},
        });
        services
            .create(&PostParams::default(), &serde_json::from_value(service).unwrap())
            .await
            .unwrap();
    }
    let (west_ref, west_backend) = match west {
        WestBackend::Service => (
            json!({"name": "chat-west", "port": port, "weight": 1}),
            json!({"pool": "west", "name": "chat-west"}),
        ),
        WestBackend::InferencePool => {
            let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
            let pools_api: Api<DynamicObject> =
                Api::namespaced_with(pools.client.clone(), pools.ns, &ApiResource::from_gvk(&gvk));
            let pool = json!({
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "chat-west"},
                "spec": {
                    "selector": {"matchLabels": {"app": "chat-west"}},
                    "targetPorts": [{"number": port}],
                    "endpointPickerRef": {"name": "chat-west-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
                },
            });
            pools_api
                .create(&PostParams::default(), &serde_json::from_value(pool).unwrap())
                .await
                .unwrap();
            (
                json!({"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat-west", "weight": 1}),
                json!({"pool": "west", "kind": "InferencePool", "name": "chat-west"}),
            )
        }
    };
    let routes = Api::namespaced_with(pools.client.clone(), pools.ns, &http_route_resource());
    let route = json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "chat"},
        "spec": {
            "parentRefs": [{"name": "edge"}],
            "rules": [{"backendRefs": [{"name": "chat-east", "port": port, "weight": 1}, west_ref]}],
        },
    });
    routes
        .create(&PostParams::default(), &serde_json::from_value(route).unwrap())
        .await
        .unwrap();
    let target = json!({"spec": {"route": {"httpRoute": {"name": "chat", "backends": [
        {"pool": "east", "name": "chat-east"}, west_backend,
    ]}}}});
    pools
        .policies
        .patch("chat", &PatchParams::default(), &Patch::Merge(&target))
        .await
        .unwrap();
    routes
}

/// When a stand-in gateway accepted each generation of an HTTPRoute.
type Acceptances = Arc<std::sync::Mutex<Vec<(i64, jiff::Timestamp)>>>;

/// A stand-in for a gateway's controller, which the cluster tier does not run: it accepts HTTPRoute
/// `name` in `ns` at each new generation `delay` after it first sees it, writing
/// `status.parents` as a gateway would; the times it accepted each generation, by generation.
/// There is no data plane behind it.
fn accept_http_routes(
    client: Client,
    ns: &'static str,
    name: &'static str,
    delay: Duration,
) -> (tokio::task::JoinHandle<()>, Acceptances) {
    use kube::api::DynamicObject;
    use understudy_operator::route_target::http_route_resource;
    let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = Arc::clone(&accepted);
    let task = tokio::spawn(async move {
        let routes: Api<DynamicObject> = Api::namespaced_with(client, ns, &http_route_resource());
        let mut seen = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Ok(route) = routes.get(name).await else {
                continue;
            };
            let generation = route.metadata.generation.unwrap_or_default();
            if generation == seen {
                continue;
            }
            tokio::time::sleep(delay).await;
            let status = json!({"status": {"parents": [{
                "parentRef": {"name": "edge"},
                "controllerName": "understudy.dev/e2e-stand-in",
                "conditions": [{
                    "type": "Accepted", "status": "True", "observedGeneration": generation,
                    "lastTransitionTime": jiff::Timestamp::now().to_string(), "reason": "Accepted", "message": "",
                }],
            }]}});
            if routes
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .is_ok()
            {
                record.lock().unwrap().push((generation, jiff::Timestamp::now()));
                seen = generation;
            }
        }
    });
    (task, accepted)
}

/// An HTTPRoute from east's Service to west's InferencePool, on the real API server with the
/// Gateway API's and InferencePool's CRDs, and a stand-in gateway that accepts each generation
/// 3 s late: a crash moves the weights to the InferencePool at epoch 1, and the Route step is
/// done only once the gateway accepted that generation.
#[tokio::test]
async fn a_failover_moves_the_httproutes_weights_at_the_new_epoch_and_routes_once_its_gateway_accepted_them()
{
    use kube::api::DynamicObject;

    let Some(client) = cluster().await else { return };
    let pools = TwoPools::start(client.clone(), "e2e-httproute", Standby::hot(), json!({})).await;
    let ns = pools.ns;
    let routes = route_through_http_route(&pools, 8000, WestBackend::InferencePool).await;
    let (gateway, accepted) = accept_http_routes(client.clone(), ns, "chat", Duration::from_secs(3));
    let operator = pools.operator("e2e-operator-1", ADMIN_TOKEN);
    let weights = |route: &DynamicObject| {
        let refs = route.data["spec"]["rules"][0]["backendRefs"]
            .as_array()
            .unwrap()
            .clone();
        let epoch = route.annotations().get("understudy.dev/epoch").cloned();
        (refs[0]["weight"].as_u64(), refs[1]["weight"].as_u64(), epoch)
    };

    // Between promotions the route is kept on the home primary, at epoch 0.
    eventually(
        Duration::from_secs(60),
        "the HTTPRoute sending to east",
        || async {
            let route = routes.get("chat").await.unwrap();
            (weights(&route) == (Some(1), Some(0), Some("0".to_owned()))).then_some(())
        },
    )
    .await;
    pools.until_steady(true).await;

    pools.crash_east();
    let moved = eventually(
        Duration::from_secs(60),
        "the HTTPRoute sending to west at epoch 1",
        || async {
            let route = routes.get("chat").await.unwrap();
            (weights(&route) == (Some(0), Some(1), Some("1".to_owned()))).then_some(route)
        },
    )
    .await;
    let routed = pools.routed_to_west("HTTPRoute chat").await;
    // The step was done only once the gateway accepted the generation the operator wrote.
    let generation = moved.metadata.generation.unwrap();
    let acceptance = accepted
        .lock()
        .unwrap()
        .iter()
        .find(|(g, _)| *g >= generation)
        .map(|(_, at)| *at)
        .unwrap_or_else(|| panic!("generation {generation} never accepted"));
    let routed_at: jiff::Timestamp = routed.at.parse().unwrap();
    // Status times are to the second.
    assert!(
        routed_at.as_second() >= acceptance.as_second(),
        "routed at {routed_at}, accepted at {acceptance}"
    );
    gateway.abort();
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// Traefik as a Gateway API implementation of namespace `ns`, against the cluster tier's API
/// server as its admin, with one entry point on a loopback port of its own; the process and the
/// port.
fn traefik_process(ns: &str) -> (Process, u16) {
    let binary = std::env::var("UNDERSTUDY_CLUSTER_TRAEFIK")
        .expect("the cluster tier builds Traefik (tests/cluster/traefik.sh) and names it here");
    let path = std::env::var("UNDERSTUDY_CLUSTER_KUBECONFIG").unwrap();
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let cluster = kubeconfig.clusters[0].cluster.clone().unwrap();
    // The admin's token, as the kubeconfig holds it (kube keeps it behind a secret type).
    let raw: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let token = raw["users"][0]["user"]["token"].as_str().unwrap().to_owned();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let process = Process::start(Command::new(binary).args([
        "--log.level=INFO".to_owned(),
        format!("--entrypoints.web.address=127.0.0.1:{port}"),
        "--providers.kubernetesgateway=true".to_owned(),
        format!(
            "--providers.kubernetesgateway.endpoint={}",
            cluster.server.unwrap()
        ),
        format!("--providers.kubernetesgateway.token={token}"),
        format!(
            "--providers.kubernetesgateway.certauthfilepath={}",
            cluster.certificate_authority.unwrap()
        ),
        format!("--providers.kubernetesgateway.namespaces={ns}"),
        "--providers.kubernetesgateway.throttleduration=0s".to_owned(),
        // To a Service's cluster IP, which the emulated nodes forward as kube-proxy would: the
        // pods' loopback addresses cannot be in the EndpointSlices Traefik reads otherwise.
        "--providers.kubernetesgateway.nativelbbydefault=true".to_owned(),
    ]));
    (process, port)
}

/// What a client got for one completion through a gateway.
#[derive(Debug)]
struct Answer {
    sent: Instant,
    answered: Instant,
    status: u16,
    /// The pool whose fence let it through (`x-understudy-served-by`).
    served_by: Option<String>,
    /// The epoch of the fence that refused it (`x-understudy-fenced`), and its pool, as its
    /// refusal names it.
    refused: Option<(String, String)>,
}

impl Answer {
    /// Whether `pool`'s fence let it through and it was answered 200.
    fn served_by(&self, pool: &str) -> bool {
        self.status == 200 && self.served_by.as_deref() == Some(pool)
    }
}

/// One completion through `gateway` on a fresh connection; one that could not be sent or read
/// has status 0.
fn complete(gateway: SocketAddr) -> Answer {
    let sent = Instant::now();
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}).to_string();
    let headers = [("Content-Type", "application/json")];
    let raw = exchange(gateway, "POST", "/v1/completions", &headers, &body).unwrap_or_default();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name).then(|| value.trim().to_owned())
        })
    };
    let refused = header("x-understudy-fenced").map(|epoch| {
        // "pool east does not hold epoch 1: fenced"
        let pool = body.split("pool ").nth(1).and_then(|rest| rest.split(' ').next());
        (epoch, pool.unwrap_or_default().to_owned())
    });
    Answer {
        sent,
        answered: Instant::now(),
        status: status_of(&raw),
        served_by: header("x-understudy-served-by"),
        refused,
    }
}

/// Two clients' load through a failover, 50 completions a second between them, each on a fresh
/// connection, and a poller that notes when every fence of the old primary east said it is
/// fenced at epoch 1: no later than that, each had seen the new epoch.
struct FailoverLoad {
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Completions served by west so far, as the clients count them.
    west: Arc<std::sync::atomic::AtomicUsize>,
    clients: Vec<std::thread::JoinHandle<Vec<Answer>>>,
    /// The poller, once the failover was commanded.
    fenced: Option<std::thread::JoinHandle<Option<Instant>>>,
    commanded: Instant,
}

impl FailoverLoad {
    /// Once east serves through `through`, starts the load there, and once the clients counted
    /// 40 completions served by east, commands `pools`' policy to fail over, watching east's
    /// fences.
    async fn fail_over(through: SocketAddr, pools: &TwoPools) -> FailoverLoad {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        eventually(
            Duration::from_secs(30),
            &format!("{through} serving from east"),
            || async {
                let answer = tokio::task::spawn_blocking(move || complete(through))
                    .await
                    .unwrap();
                answer.served_by("east").then_some(())
            },
        )
        .await;
        let stop = Arc::new(AtomicBool::new(false));
        let (east, west) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let clients = (0..2)
            .map(|_| {
                let (stop, east, west) = (Arc::clone(&stop), Arc::clone(&east), Arc::clone(&west));
                std::thread::spawn(move || {
                    let mut answers = Vec::new();
                    let mut next = Instant::now();
                    while !stop.load(Relaxed) {
                        let answer = complete(through);
                        for (pool, count) in [("east", &east), ("west", &west)] {
                            if answer.served_by(pool) {
                                count.fetch_add(1, Relaxed);
                            }
                        }
                        answers.push(answer);
                        // Every 40 ms, or at once after a slow answer, without a burst to catch up.
                        next = (next + Duration::from_millis(40)).max(Instant::now());
                        std::thread::sleep(next.saturating_duration_since(Instant::now()));
                    }
                    answers
                })
            })
            .collect();
        let mut load = FailoverLoad {
            stop,
            west,
            clients,
            fenced: None,
            commanded: Instant::now(),
        };
        eventually(Duration::from_secs(30), "40 completions served by east", || {
            let served = east.load(Relaxed);
            async move { (served >= 40).then_some(()) }
        })
        .await;
        let fences = pools.east.clone();
        load.fenced = Some(std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(120);
            while Instant::now() < until {
                let fenced = |v: &serde_json::Value| v["standing"] == "fenced" && v["epoch"] == 1;
                if fence_grants(&fences).iter().all(fenced) {
                    return Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            None
        }));
        load.commanded = Instant::now();
        let command = json!({"metadata": {"annotations": {"understudy.dev/command": "failover@load"}}});
        pools
            .policies
            .patch("chat", &PatchParams::default(), &Patch::Merge(&command))
            .await
            .unwrap();
        load
    }

    /// Once the clients counted 40 more completions served by west, what they counted: east
    /// served nothing sent after its fences saw epoch 1, everything answered before the failover
    /// was served by east, the load ended on west, every refusal was east's fences' 503 at epoch
    /// 1, and nothing else failed. Prints the counts; `via` is what passed the refusals on.
    async fn finish(mut self, route: &str, via: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let west = Arc::clone(&self.west);
        let then = west.load(Relaxed);
        eventually(
            Duration::from_secs(30),
            "40 more completions served by west",
            || {
                let served = west.load(Relaxed);
                async move { (served >= then + 40).then_some(()) }
            },
        )
        .await;
        self.stop.store(true, Relaxed);
        let answers: Vec<Answer> = std::mem::take(&mut self.clients)
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect();
        let fenced = self
            .fenced
            .take()
            .and_then(|poller| poller.join().unwrap())
            .expect("east's fences fenced at epoch 1 within two minutes");
        let served_by = |pool: &'static str| answers.iter().filter(move |a| a.served_by(pool));
        let after_fencing: Vec<&Answer> = served_by("east").filter(|a| a.sent >= fenced).collect();
        assert!(
            after_fencing.is_empty(),
            "east served after its fences saw epoch 1: {after_fencing:?}"
        );
        let before: Vec<&Answer> = answers.iter().filter(|a| a.answered < self.commanded).collect();
        assert!(before.iter().all(|a| a.served_by("east")), "{before:?}");
        let mut in_order: Vec<&Answer> = answers.iter().collect();
        in_order.sort_by_key(|a| a.sent);
        let last = &in_order[in_order.len().saturating_sub(20)..];
        assert!(last.iter().all(|a| a.served_by("west")), "{last:?}");
        let refused: Vec<&Answer> = answers.iter().filter(|a| a.refused.is_some()).collect();
        assert!(
            refused.iter().all(|a| a.status == 503
                && a.refused
                    .as_ref()
                    .map(|(epoch, pool)| (epoch.as_str(), pool.as_str()))
                    == Some(("1", "east"))),
            "{refused:?}"
        );
        let failed: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status != 200 && a.refused.is_none())
            .collect();
        assert!(failed.is_empty(), "failed otherwise: {failed:?}");
        println!(
            "{route}, {} completions over {:.1} s: east served {} (none sent after its fences saw \
             epoch 1, by {:.2} s after the command), west {}; east's fences refused {} (503s {via} \
             passed on), none failed otherwise",
            answers.len(),
            in_order[in_order.len() - 1]
                .sent
                .duration_since(in_order[0].sent)
                .as_secs_f64(),
            served_by("east").count(),
            fenced.duration_since(self.commanded).as_secs_f64(),
            served_by("west").count(),
            refused.len(),
        );
    }
}

impl Drop for FailoverLoad {
    /// A test that fails midway stops its clients.
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Traefik, a real Gateway API implementation, as the gateway of a policy's HTTPRoute, under load
/// (two clients, about 50 completions a second between them). Traefik sends to each pool's
/// Service by its cluster IP (`nativeLB`), which the emulated nodes forward to the pool's ready
/// pods as kube-proxy would, since the pods' loopback addresses cannot be in EndpointSlices.
/// A planned failover fences east at epoch 1, then moves the route's weights to west; the Route
/// step is done once Traefik accepted the generation with its backends resolved. Counted by the
/// clients: east served nothing sent after its fences saw epoch 1 (a poller's upper bound on when
/// they did), everything answered before the failover was served by east, the load ended on west, and
/// east's Service, reached the way a gateway that never moved would, is refused at epoch 1. The
/// requests Traefik still sent to east's fences are refused with a 503 it does not retry: they are
/// counted and printed, not hidden.
#[tokio::test]
async fn a_failover_through_traefik_under_load_moves_the_httproute_and_the_old_pool_serves_nothing_once_fenced()
 {
    use kube::api::DynamicObject;

    let Some(client) = cluster().await else { return };
    let ns = "e2e-traefik";
    let pools = TwoPools::start_fenced(client.clone(), ns, json!({})).await;
    let (traefik, port) = traefik_process(ns);
    let gvk = |kind: &str| {
        kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "gateway.networking.k8s.io",
            "v1",
            kind,
        ))
    };
    let classes: Api<DynamicObject> = Api::all_with(client.clone(), &gvk("GatewayClass"));
    let class = json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
        "metadata": {"name": ns}, "spec": {"controllerName": "traefik.io/gateway-controller"},
    });
    let _ = classes.delete(ns, &DeleteParams::default()).await;
    classes
        .create(&PostParams::default(), &serde_json::from_value(class).unwrap())
        .await
        .unwrap();
    let gateways: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &gvk("Gateway"));
    let gateway = json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "edge"},
        "spec": {"gatewayClassName": ns, "listeners": [{"name": "web", "port": port, "protocol": "HTTP"}]},
    });
    gateways
        .create(&PostParams::default(), &serde_json::from_value(gateway).unwrap())
        .await
        .unwrap();
    let routes = route_through_http_route(&pools, FENCE_PORT, WestBackend::Service).await;
    let operator = pools.operator("e2e-operator-traefik", ADMIN_TOKEN);
    // The route sends to `east` and `west` at these weights, at `epoch`, and Traefik has
    // accepted the generation that says so, its backends resolved.
    let moved_to = |east: u64, west: u64, epoch: &'static str| {
        let routes = routes.clone();
        async move {
            let route = routes.get("chat").await.unwrap();
            let refs = route.data["spec"]["rules"][0]["backendRefs"].clone();
            let generation = route.metadata.generation.unwrap_or_default();
            let by_traefik = route.data["status"]["parents"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| {
                    let conditions = p["conditions"].as_array().cloned().unwrap_or_default();
                    let holds = |kind: &str| {
                        conditions.iter().any(|c| {
                            c["type"] == kind
                                && c["status"] == "True"
                                && c["observedGeneration"].as_i64() == Some(generation)
                        })
                    };
                    p["controllerName"] == "traefik.io/gateway-controller"
                        && holds("Accepted")
                        && holds("ResolvedRefs")
                });
            (refs[0]["weight"] == east
                && refs[1]["weight"] == west
                && route
                    .annotations()
                    .get("understudy.dev/epoch")
                    .map(String::as_str)
                    == Some(epoch)
                && by_traefik)
                .then_some(route)
        }
    };
    let home = eventually(
        Duration::from_secs(60),
        "the HTTPRoute on east, accepted and resolved by Traefik",
        || moved_to(1, 0, "0"),
    )
    .await;
    pools.until_steady(true).await;
    let through = SocketAddr::from(([127, 0, 0, 1], port));
    let load = FailoverLoad::fail_over(through, &pools).await;
    let moved = eventually(
        Duration::from_secs(60),
        "the HTTPRoute on west at epoch 1, accepted and resolved by Traefik",
        || moved_to(0, 1, "1"),
    )
    .await;
    assert!(moved.metadata.generation > home.metadata.generation);
    pools.routed_to_west("HTTPRoute chat").await;
    load.finish("through Traefik", "Traefik").await;

    // A gateway that never moved, sending to east's Service as before, is refused at epoch 1.
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), ns);
    let east_ip = services
        .get("chat-east")
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    let stale = SocketAddr::new(east_ip.parse().unwrap(), FENCE_PORT);
    let answer = tokio::task::spawn_blocking(move || complete(stale))
        .await
        .unwrap();
    assert_eq!(
        (answer.status, answer.refused),
        (503, Some(("1".to_owned(), "east".to_owned()))),
        "east's Service at {stale}"
    );
    drop(traefik);
    let _ = classes.delete(ns, &DeleteParams::default()).await;
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

/// A policy whose route is a Service, under load through its cluster IP, which the emulated nodes
/// forward to the ready pods its selector matches as kube-proxy would: a planned failover fences
/// east at epoch 1, then moves the Service's selector to west's pods and records the epoch on it.
/// Counted by the clients as through Traefik: east served nothing sent after its fences saw epoch
/// 1, and the load ended on west.
#[tokio::test]
async fn a_failover_moves_a_services_selector_under_load_and_the_old_pool_serves_nothing_once_fenced() {
    use k8s_openapi::api::core::v1::Service;

    let Some(client) = cluster().await else { return };
    let ns = "e2e-service-target";
    let pools = TwoPools::start_fenced(client.clone(), ns, json!({})).await;
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let service = json!({
        "metadata": {"name": "chat"},
        "spec": {"selector": {"app": "chat-east"}, "ports": [{"port": FENCE_PORT, "targetPort": "fence"}]},
    });
    let service = services
        .create(&PostParams::default(), &serde_json::from_value(service).unwrap())
        .await
        .unwrap();
    let target = json!({"spec": {"route": {"service": {"name": "chat"}}}});
    pools
        .policies
        .patch("chat", &PatchParams::default(), &Patch::Merge(&target))
        .await
        .unwrap();
    let operator = pools.operator("e2e-operator-service", ADMIN_TOKEN);
    // The Service selects `app`'s pods at `epoch`.
    let selects = |app: &'static str, epoch: &'static str| {
        let services = services.clone();
        async move {
            let service = services.get("chat").await.unwrap();
            let selector = service.spec.as_ref()?.selector.clone()?;
            let at = service.annotations().get(EPOCH_ANNOTATION).map(String::as_str);
            (selector == std::collections::BTreeMap::from([("app".to_owned(), app.to_owned())])
                && at == Some(epoch))
            .then_some(())
        }
    };
    eventually(Duration::from_secs(60), "the Service on east at epoch 0", || {
        selects("chat-east", "0")
    })
    .await;
    pools.until_steady(true).await;
    let cluster_ip = service.spec.unwrap().cluster_ip.unwrap();
    let through = SocketAddr::new(cluster_ip.parse().unwrap(), FENCE_PORT);
    let load = FailoverLoad::fail_over(through, &pools).await;
    eventually(Duration::from_secs(60), "the Service on west at epoch 1", || {
        selects("chat-west", "1")
    })
    .await;
    pools.routed_to_west("Service chat").await;
    load.finish("through the Service's cluster IP", "the cluster IP")
        .await;
    assert!(refusals(&operator).is_empty(), "{:#?}", refusals(&operator));
    pools.stop(operator).await;
}

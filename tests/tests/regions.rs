//! The cluster tier's regional suite: a management cluster that holds the policy, its epoch Lease
//! and the operator, and two regions, east and west, each a control plane of its own with emulated
//! GPU nodes, a fenced pool and the chart's router. `tests/cluster/regions.sh` brings them up and
//! runs these; without it (no `UNDERSTUDY_REGIONS_MANAGEMENT`) each test says so and passes without
//! checking anything.
//!
//! Clients are counted as a GameDay record counts them: each request sent to a region's router,
//! answered 200 or not. The tests run one at a time in name order; the last one loses east for
//! good.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use understudy_api::crd::FailoverPolicy;
use understudy_api::lease::EPOCH_ANNOTATION;
use understudy_tests::cluster::{
    Clients, FENCE_PORT, FENCE_TOKEN, client_from, container_pids, eventually, extended_on_failsafe,
    fence_access, fence_grants, fenced_deployment, http, namespace, pod_ip, ready_pods_within, serving_model,
};
use understudy_tests::process::Process;

/// The routers' admin port, as the chart runs them.
const ROUTER_ADMIN_PORT: u16 = 9091;
/// The routers' gateway port, as the chart runs them.
const ROUTER_PORT: u16 = 8080;

/// One region: its control plane's run directory (its components' PID files), its admin client,
/// and the kubeconfig the operator reaches it with.
struct Region {
    name: &'static str,
    run: PathBuf,
    client: Client,
    operator_kubeconfig: String,
}

impl Region {
    async fn at(name: &'static str, run: PathBuf) -> Region {
        Region {
            name,
            client: client_from(&run.join("kubeconfig")).await,
            operator_kubeconfig: std::fs::read_to_string(run.join("operator.kubeconfig")).unwrap(),
            run,
        }
    }

    /// The chart's router in this region: its admin and gateway addresses.
    async fn router(&self) -> (SocketAddr, SocketAddr) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), "understudy-system");
        let params = ListParams::default().labels("app.kubernetes.io/component=router");
        let router = eventually(
            Duration::from_secs(60),
            "a router pod with an address",
            || async {
                let listed = pods.list(&params).await.unwrap().items;
                listed
                    .into_iter()
                    .find(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some())
            },
        )
        .await;
        let ip = pod_ip(&router);
        (
            SocketAddr::new(ip, ROUTER_ADMIN_PORT),
            SocketAddr::new(ip, ROUTER_PORT),
        )
    }

    /// Its API server's address, `https://127.0.0.1:PORT`, as its kubeconfig names it.
    fn api_server(&self) -> String {
        let line = self
            .operator_kubeconfig
            .split('"')
            .find(|part| part.starts_with("https://"))
            .unwrap();
        line.to_owned()
    }

    /// Loses the region whole: every process of every pod killed, then its emulated nodes and its
    /// control plane, as a region's outage takes them.
    async fn lose(&self) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let pods = pods.list(&ListParams::default()).await.unwrap().items;
        for pid in pods.iter().flat_map(container_pids) {
            // A container between restarts has already gone.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .status();
        }
        for component in [
            "nodes",
            "kube-apiserver",
            "etcd",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            signal("KILL", &pid_of(&self.run, component));
        }
    }
}

/// A cluster's API server and etcd stopped (SIGSTOP) until this is dropped (SIGCONT), however the
/// test ends: a cluster left stopped would hang the tests after it.
struct Stopped {
    pids: Vec<String>,
}

impl Stopped {
    fn management(run: &Path) -> Stopped {
        let pids = vec![pid_of(run, "kube-apiserver"), pid_of(run, "etcd")];
        for pid in &pids {
            signal("STOP", pid);
        }
        Stopped { pids }
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in self.pids.iter().rev() {
            let _ = Command::new("kill").args(["-CONT", pid]).status();
        }
    }
}

fn pid_of(run: &Path, component: &str) -> String {
    std::fs::read_to_string(run.join(format!("{component}.pid")))
        .unwrap()
        .trim()
        .to_owned()
}

fn signal(name: &str, pid: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_owned()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}

/// A TCP relay on 127.0.0.1 to `upstream`, which a test cuts (every connection through it closed,
/// new ones closed as they come) and heals: the operator's link to a region's API server, cut
/// where the machine has no firewall to cut it with. Its kube client keeps connections open, which
/// the cut library ([`CUT_LIBRARY`]) does not touch.
struct Relay {
    addr: SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, cut_seen) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if *cut_seen.borrow() {
                    continue;
                }
                let mut cut_seen = cut_seen.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_seen.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Relay { addr, cut, task }
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }

    fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The environment variable naming the cut library (`tests/cut`, `libunderstudy_cut.so`), which
/// refuses the operator's new connections to what a file lists.
const CUT_LIBRARY: &str = "UNDERSTUDY_REGIONS_CUT_LIBRARY";

/// Each fence's standing, sampled every 100 ms from the test (which no cut touches) until
/// stopped: when each pool's fences served.
struct Standings {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Sample>>,
}

/// When, whether each of east's fences served and at what epoch, and whether each of west's served.
struct Sample {
    at: Instant,
    east: Vec<(bool, u64)>,
    west: Vec<bool>,
}

impl Standings {
    fn watch(east: &[Pod], west: &[Pod]) -> Standings {
        let fences = |pods: &[Pod]| -> Vec<SocketAddr> {
            pods.iter()
                .map(|p| SocketAddr::new(pod_ip(p), FENCE_PORT))
                .collect()
        };
        let (east, west) = (fences(east), fences(west));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
                let at = Instant::now();
                let east = east.iter().map(|fence| standing(*fence)).collect();
                let west = west.iter().map(|fence| standing(*fence).0).collect();
                samples.push(Sample { at, east, west });
                std::thread::sleep(Duration::from_millis(100));
            }
            samples
        });
        Standings { stop, thread }
    }

    fn stop(self) -> Vec<Sample> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Whether the fence at `fence` serves, and the epoch it knows; a fence that cannot be asked
/// serves nothing.
fn standing(fence: SocketAddr) -> (bool, u64) {
    let Ok(stream) = std::net::TcpStream::connect_timeout(&fence, Duration::from_secs(1)) else {
        return (false, 0);
    };
    drop(stream);
    let (status, body) = http(fence, "GET", "/understudy/grant", &[], "");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let serves = status == 200 && matches!(view["standing"].as_str(), Some("serving" | "failsafe"));
    (serves, view["epoch"].as_u64().unwrap_or(0))
}

/// The three clusters, or `None` (with a note) when they are not up.
struct Regions {
    management: Client,
    management_run: PathBuf,
    east: Region,
    west: Region,
    router_token: String,
}

async fn regions() -> Option<Regions> {
    let Ok(management) = std::env::var("UNDERSTUDY_REGIONS_MANAGEMENT") else {
        eprintln!(
            "skipped: no regions are up (tests/cluster/regions.sh runs this suite against three control planes)"
        );
        return None;
    };
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name}"));
    let management_run = PathBuf::from(management);
    Some(Regions {
        management: client_from(&management_run.join("kubeconfig")).await,
        management_run,
        east: Region::at("east", PathBuf::from(var("UNDERSTUDY_REGIONS_EAST"))).await,
        west: Region::at("west", PathBuf::from(var("UNDERSTUDY_REGIONS_WEST"))).await,
        router_token: var("UNDERSTUDY_REGIONS_ROUTER_TOKEN"),
    })
}

/// What a [`RegionalPolicy`] has besides.
#[derive(Default)]
struct Extra {
    /// The operator reaches east's API server here (a [`Relay`] to it).
    east_api: Option<SocketAddr>,
    /// West's standby tiers; all hot without.
    west_standby: Option<serde_json::Value>,
}

/// A policy in the management cluster whose pools live in the two regions, each a fenced
/// Deployment `chat` of two replicas serving `model`, under grants that last `ttl`, renewed every
/// second; the pods of each. Each test's policy serves a model of its own: the regions' routers
/// keep a deleted policy's route, and a model is routed by one policy.
struct RegionalPolicy {
    ns: &'static str,
    model: &'static str,
    policies: Api<FailoverPolicy>,
    east_pods: Vec<Pod>,
    west_pods: Vec<Pod>,
    dir: tempfile::TempDir,
}

impl Regions {
    async fn policy(&self, ns: &'static str, model: &'static str, ttl: &str) -> RegionalPolicy {
        self.policy_with(ns, model, ttl, Extra::default()).await
    }

    /// [`Regions::policy`], with `extra`.
    async fn policy_with(
        &self,
        ns: &'static str,
        model: &'static str,
        ttl: &str,
        extra: Extra,
    ) -> RegionalPolicy {
        let Extra {
            east_api,
            west_standby,
        } = extra;
        let mut pods = Vec::new();
        for region in [&self.east, &self.west] {
            namespace(&region.client, ns).await;
            fence_access(&region.client, ns).await;
            let deployments: Api<Deployment> = Api::namespaced(region.client.clone(), ns);
            let deployment = serving_model(fenced_deployment("chat", 2, region.name), model);
            deployments
                .create(&PostParams::default(), &deployment)
                .await
                .unwrap();
        }
        for region in [&self.east, &self.west] {
            let api: Api<Pod> = Api::namespaced(region.client.clone(), ns);
            pods.push(ready_pods_within(&api, "chat", 2, Duration::from_secs(90)).await);
        }
        namespace(&self.management, ns).await;
        let secrets: Api<Secret> = Api::namespaced(self.management.clone(), ns);
        for region in [&self.east, &self.west] {
            let mut kubeconfig = region.operator_kubeconfig.clone();
            if let (Some(relay), "east") = (east_api, region.name) {
                let server = region.api_server();
                kubeconfig = kubeconfig.replace(&server, &format!("https://{relay}"));
            }
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": format!("{}-kubeconfig", region.name)},
                "stringData": {"kubeconfig": kubeconfig},
            }))
            .unwrap();
            secrets.create(&PostParams::default(), &secret).await.unwrap();
        }
        let pool = |name: &str| {
            let mut pool = json!({
                "name": name,
                "cluster": {"name": format!("us-{name}"), "kubeconfigSecret": {"name": format!("{name}-kubeconfig")}},
                "workload": {"kind": "Deployment", "name": "chat"},
                "replicas": 2,
                "port": FENCE_PORT,
            });
            if let (Some(standby), "west") = (&west_standby, name) {
                pool["standby"] = standby.clone();
            }
            pool
        };
        let policy = serde_json::from_value(json!({
            "apiVersion": "understudy.dev/v1alpha1",
            "kind": "FailoverPolicy",
            "metadata": {"name": "chat"},
            "spec": {
                "pools": [pool("east"), pool("west")],
                "recoveryObjective": "1m",
                "probe": {"interval": "1s", "timeout": "800ms", "budgets": {"firstToken": "500ms", "total": "800ms"}},
                "trigger": {"suspectAfter": 1, "promoteAfter": 3, "hardFailure": {"promoteAfter": 2}, "standbyReadyAfter": 2},
                "grants": {"ttl": ttl, "renewEvery": "1s", "clockSkew": "500ms"},
            },
        }))
        .unwrap();
        let policies: Api<FailoverPolicy> = Api::namespaced(self.management.clone(), ns);
        policies.create(&PostParams::default(), &policy).await.unwrap();
        let west_pods = pods.pop().unwrap();
        let east_pods = pods.pop().unwrap();
        RegionalPolicy {
            ns,
            model,
            policies,
            east_pods,
            west_pods,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// The operator binary as the chart's ServiceAccount in the management cluster, running the
    /// policies of `policy`'s namespace, finding the routers by the chart's label in
    /// understudy-system of every cluster the pools live in.
    fn operator(&self, policy: &RegionalPolicy, identity: &str) -> Process {
        self.operator_with(policy, identity, &[])
    }

    /// [`Regions::operator`] with `env` besides.
    fn operator_with(&self, policy: &RegionalPolicy, identity: &str, env: &[(&str, &Path)]) -> Process {
        let router_token = policy.dir.path().join("router-token");
        std::fs::write(&router_token, &self.router_token).unwrap();
        let fence_token = policy.dir.path().join("fence-token");
        std::fs::write(&fence_token, FENCE_TOKEN).unwrap();
        let binary = std::env::var("UNDERSTUDY_CLUSTER_OPERATOR").expect("the operator binary");
        Process::start(
            Command::new(binary)
                .env("KUBECONFIG", self.management_run.join("operator.kubeconfig"))
                .env("RUST_LOG", "info")
                .env("NO_COLOR", "1")
                .args(["--identity", identity, "--namespace", policy.ns])
                .args(["--admin-addr", "127.0.0.1:0"])
                .args(["--router-selector", "app.kubernetes.io/component=router"])
                .args(["--router-namespace", "understudy-system"])
                .arg("--router-token-file")
                .arg(&router_token)
                .arg("--replica-token-file")
                .arg(&fence_token)
                .envs(env.iter().map(|(k, v)| (*k, *v))),
        )
    }

    /// Waits until the router at `admin` holds `pool` at `epoch` for `policy`.
    async fn routed(&self, admin: SocketAddr, policy: &RegionalPolicy, pool: &str, epoch: u64) {
        let what = format!("the router at {admin} holding {pool} at epoch {epoch}");
        let auth = format!("Bearer {}", self.router_token);
        eventually(Duration::from_secs(90), &what, || async {
            let path = format!("/route?policy={}/chat", policy.ns);
            let (status, body) = http(admin, "GET", &path, &[("authorization", &auth)], "");
            let holds: serde_json::Value = serde_json::from_str(&body).ok()?;
            (status == 200 && holds["route"]["pool"] == pool && holds["route"]["epoch"] == epoch)
                .then_some(())
        })
        .await;
    }
}

impl RegionalPolicy {
    /// The epoch Lease's epoch and holder, in the management cluster.
    async fn lease(&self, management: &Client) -> (String, String) {
        let leases: Api<Lease> = Api::namespaced(management.clone(), self.ns);
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

    /// Waits until the status says `pool`'s two fences serve under the operator's grants.
    async fn serving_under_grants(&self, pool: &str) {
        eventually(
            Duration::from_secs(60),
            &format!("{pool}'s fences serving under grants"),
            || async {
                let grants = self.policies.get("chat").await.unwrap().status?.grants?;
                let fences = grants.pools.iter().find(|p| p.pool == pool)?;
                (grants.holder == pool && fences.fences.get("serving") == Some(&2)).then_some(())
            },
        )
        .await;
    }
}

/// A GameDay in the management cluster crashes east in its own cluster: the GameDay controller
/// deletes east's serving pods through east's kubeconfig, the policy promotes west on its own, and
/// the run's record of loss comes from the regions' routers (the management cluster runs none).
/// West waits as one warm replica and one pilot light, all through west's kubeconfig: scaled to
/// its shape and put to sleep before, woken and grown by the promotion, and its new replica's cold
/// start read from west's pod events and log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_game_day_crashes_east_in_its_region_and_the_policy_promotes_west() {
    use understudy_api::crd::{GameDay, Verdict};

    let Some(regions) = regions().await else { return };
    let standby = json!([{"tier": "warm", "replicas": 1}, {"tier": "pilotLight", "replicas": 1}]);
    let extra = Extra {
        west_standby: Some(standby),
        ..Extra::default()
    };
    let policy = regions
        .policy_with("regions-game-day", "chat-game-day", "4s", extra)
        .await;
    // The emulated nodes bring a deleted pod back in about a second, where a GPU node takes
    // minutes: one hard-failed round promotes, or the crash might heal unseen.
    let trigger = json!({"spec": {"trigger": {"minDwell": "2s", "hardFailure": {"promoteAfter": 1}}}});
    policy
        .policies
        .patch("chat", &PatchParams::default(), &Patch::Merge(&trigger))
        .await
        .unwrap();
    let operator = regions.operator(&policy, "regions-operator-game-day");
    let (west_admin, west_gateway) = regions.west.router().await;
    regions.routed(west_admin, &policy, "east", 0).await;
    policy.serving_under_grants("east").await;
    // West kept in its shape in its own cluster: one replica running, asleep.
    let west_deployments: Api<Deployment> = Api::namespaced(regions.west.client.clone(), policy.ns);
    eventually(
        Duration::from_secs(60),
        "west scaled to its warm replica",
        || async {
            let deployment = west_deployments.get("chat").await.unwrap();
            (deployment.spec?.replicas == Some(1)).then_some(())
        },
    )
    .await;
    eventually(Duration::from_secs(60), "the standby proven", || async {
        let status = policy.policies.get("chat").await.unwrap().status?;
        (status.conditions.get("StandbyProven")?.status == understudy_api::crd::ConditionStatus::True)
            .then_some(())
    })
    .await;
    let clients = Clients::start_for(west_gateway, policy.model);
    let gamedays: Api<GameDay> = Api::namespaced(regions.management.clone(), policy.ns);
    let gameday: GameDay = serde_json::from_value(json!({
        "apiVersion": "understudy.dev/v1alpha1", "kind": "GameDay",
        "metadata": {"name": "east-crash", "annotations": {"understudy.dev/command": "run"}},
        "spec": {
            "policyRef": {"name": "chat"}, "fault": "crash", "steadyState": {"readyFor": "1s"},
            "maxRecovery": "1m", "failback": {"mode": "manual"},
        },
    }))
    .unwrap();
    gamedays.create(&PostParams::default(), &gameday).await.unwrap();
    let status = eventually(Duration::from_secs(120), "a verdict", || async {
        let status = gamedays.get("east-crash").await.unwrap().status?;
        status.last_verdict.is_some().then_some(status)
    })
    .await;
    let (sent, answered) = clients.stop_counting();
    assert_eq!(status.last_verdict, Some(Verdict::Passed), "{status:#?}");
    let run = &status.last_runs[0];
    eprintln!(
        "the game day: {:?}, {}; its record: {:?}; west's router's clients: {answered} of {sent} answered",
        status.last_verdict,
        run.reason.as_deref().unwrap_or_default(),
        run.requests
    );
    assert_eq!(run.injected.as_deref(), Some("deleted the serving pods of east"));
    assert!(
        run.requests.is_some_and(|r| r.sent > 0),
        "the run's record of loss, from the regions' routers: {run:?}"
    );
    assert_eq!(
        policy.lease(&regions.management).await,
        ("1".to_owned(), "west".to_owned())
    );
    // West's warm replica woken, and its pilot light grown, in west's cluster.
    let status = policy.policies.get("chat").await.unwrap().status.unwrap();
    let timeline = serde_json::to_string(&status.last_failover).unwrap();
    assert!(timeline.contains("from sleep level 1"), "{timeline}");
    let grown = eventually(
        Duration::from_secs(60),
        "west's new replica's cold start",
        || async {
            let status = policy.policies.get("chat").await.unwrap().status?;
            status.cold_start.into_iter().find(|b| {
                b.pool == "west"
                    && b.tier.as_deref() == Some("pilotLight")
                    && b.stages.get("imagePull").is_some_and(Option::is_some)
            })
        },
    )
    .await;
    eprintln!("west's pilot light, read from west's cluster: {grown:?}");
    // East's pods were deleted in east's own cluster.
    let pods: Api<Pod> = Api::namespaced(regions.east.client.clone(), policy.ns);
    for pod in &policy.east_pods {
        let now = pods.get_opt(&pod.name_any()).await.unwrap();
        assert!(
            now.is_none_or(|p| p.metadata.uid != pod.metadata.uid),
            "{} survived",
            pod.name_any()
        );
    }
    drop(operator);
}

/// West holds the Lease at epoch 1, and its router's clients sent enough to tell and lost at most
/// one request: west's router holds what it cannot place until west's route comes (detection,
/// then east's 4 s grants and 0.5 s of skew waited out, about 6 s), so what a client can lose is
/// the request east had when it went.
async fn west_took_over(regions: &Regions, policy: &RegionalPolicy, sent: usize, answered: usize) {
    assert!(sent > 20, "{sent} sent");
    assert!(
        sent - answered <= 1,
        "{} of {sent} requests to west's router lost",
        sent - answered
    );
    assert_eq!(
        policy.lease(&regions.management).await,
        ("1".to_owned(), "west".to_owned())
    );
}

/// `kubectl understudy ARGS` on the management cluster's policy in `ns`, as its admin; what it
/// printed.
fn kubectl_understudy(regions: &Regions, ns: &str, args: &[&str]) -> String {
    let cli = std::env::var("UNDERSTUDY_CLUSTER_CLI").expect("kubectl-understudy");
    let output = Command::new(cli)
        .arg("--kubeconfig")
        .arg(regions.management_run.join("kubeconfig"))
        .args(["-n", ns])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    // Shown with `--nocapture`: docs/cli.md's regional output comes from here.
    eprintln!("$ kubectl understudy {}\n{printed}", args.join(" "));
    printed
}

/// The management cluster lost: its API server and etcd stopped and the operator, which runs
/// there, killed, while clients load both regions' routers. The pools serve on at epoch 0: east's
/// fences extend their own grants on west's fences' word and never stop, west's never serve, and no
/// client sees an error; when the management cluster is back, a new operator's grants take over at
/// the same epoch, with the Lease where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_management_cluster_stops_no_traffic_in_either_region_and_promotes_nothing() {
    let Some(regions) = regions().await else { return };
    let policy = regions
        .policy("regions-management-lost", "chat-management-lost", "6s")
        .await;
    let operator = regions.operator(&policy, "regions-operator");
    let (east_admin, east_gateway) = regions.east.router().await;
    let (west_admin, west_gateway) = regions.west.router().await;
    // The route is pushed to the routers of both regions, found by label in each.
    regions.routed(east_admin, &policy, "east", 0).await;
    regions.routed(west_admin, &policy, "east", 0).await;
    policy.serving_under_grants("east").await;
    // Each pool's cluster, and the holder's fences under their grants.
    let got = kubectl_understudy(&regions, policy.ns, &["get"]);
    assert!(
        got.contains("chat   east@us-east   0 ") && got.contains("2/2 serving"),
        "{got}"
    );
    let described = kubectl_understudy(&regions, policy.ns, &["describe", "chat"]);
    assert!(
        described.contains("  east   us-east   Deployment/chat")
            && described.contains("  west   us-west   Deployment/chat"),
        "{described}"
    );

    let standings = Standings::watch(&policy.east_pods, &policy.west_pods);
    let clients = [
        Clients::start_for(east_gateway, policy.model),
        Clients::start_for(west_gateway, policy.model),
    ];
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The operator runs in the management cluster and goes with it.
    drop(operator);
    let stopped = Stopped::management(&regions.management_run);
    let lost_at = Instant::now();
    // Three extensions each, two renewal periods apart: well past the 6 s a grant lasts.
    let extended = extended_on_failsafe(&policy.east_pods, 3).await;
    eprintln!(
        "east's {} fences on their failsafe at epoch 0, each extended 3 times, {:.1}s after the management cluster was lost",
        extended.len(),
        lost_at.elapsed().as_secs_f64()
    );
    assert!(extended.iter().all(|v| v["epoch"] == 0), "{extended:?}");
    drop(stopped);

    let operator = regions.operator(&policy, "regions-operator-2");
    eventually(Duration::from_secs(60), "the new operator's grants", || async {
        fence_grants(&policy.east_pods)
            .iter()
            .all(|v| v["standing"] == "serving")
            .then_some(())
    })
    .await;
    for (region, clients) in ["east", "west"].into_iter().zip(clients) {
        let (sent, answered) = clients.stop_counting();
        eprintln!("clients of {region}'s router: {answered} of {sent} answered");
        assert!(sent > 50, "{sent} sent to {region}'s router");
        assert_eq!(
            answered, sent,
            "every request to {region}'s router answered while the management cluster was lost"
        );
    }
    assert_eq!(
        policy.lease(&regions.management).await,
        ("0".to_owned(), "east".to_owned()),
        "nothing promoted"
    );
    let samples = standings.stop();
    assert!(
        samples.iter().all(|s| s.west.iter().all(|serves| !serves)),
        "west's fences served"
    );
    assert!(
        samples
            .iter()
            .filter(|s| s.at >= lost_at)
            .all(|s| s.east.iter().all(|(serves, epoch)| *serves && *epoch == 0)),
        "east's fences stopped serving at epoch 0 while the management cluster was lost"
    );
    drop(operator);
}

/// Region east cut off from the management cluster, its pods running on: the operator's new
/// connections to east's pods and routers are refused and its link to east's API server is closed,
/// under load on west's router. The operator probes east's replicas as last listed, cannot reach
/// them, and promotes west. East's fences, no longer renewed, serve on while west's fences vouch
/// for epoch 0, and stop once west's fences take epoch 1, within a grant's time to live; west's
/// fences serve only after every east fence stopped. When the cut heals, east's fences take
/// epoch 1 and never serve again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_east_cut_off_from_the_management_cluster_stops_serving_before_west_serves() {
    let Some(regions) = regions().await else { return };
    let library = PathBuf::from(std::env::var(CUT_LIBRARY).expect(CUT_LIBRARY));
    let east_api: SocketAddr = regions
        .east
        .api_server()
        .trim_start_matches("https://")
        .parse()
        .unwrap();
    let relay = Relay::start(east_api).await;
    let policy = regions
        .policy_with(
            "regions-east-cut",
            "chat-east-cut",
            "4s",
            Extra {
                east_api: Some(relay.addr),
                ..Extra::default()
            },
        )
        .await;
    let cut_file = policy.dir.path().join("cut");
    let operator = regions.operator_with(
        &policy,
        "regions-operator-cut",
        &[("LD_PRELOAD", &library), ("UNDERSTUDY_CUT_FILE", &cut_file)],
    );
    let (east_admin, _) = regions.east.router().await;
    let (west_admin, west_gateway) = regions.west.router().await;
    regions.routed(east_admin, &policy, "east", 0).await;
    regions.routed(west_admin, &policy, "east", 0).await;
    policy.serving_under_grants("east").await;

    let standings = Standings::watch(&policy.east_pods, &policy.west_pods);
    let clients = Clients::start_for(west_gateway, policy.model);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // East's pods (and its router) and east's API server, from the operator only.
    std::fs::write(&cut_file, format!("127.0.1.0/24\n{}\n", relay.addr)).unwrap();
    relay.cut();
    let cut_at = Instant::now();
    regions.routed(west_admin, &policy, "west", 1).await;
    let routed_after = cut_at.elapsed();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (sent, answered) = clients.stop_counting();

    std::fs::remove_file(&cut_file).unwrap();
    relay.heal();
    let healed_at = Instant::now();
    eventually(
        Duration::from_secs(60),
        "east's fences told epoch 1 once the cut healed",
        || async {
            fence_grants(&policy.east_pods)
                .iter()
                .all(|v| v["epoch"] == 1 && v["standing"] == "fenced")
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let samples = standings.stop();

    let after_cut: Vec<&Sample> = samples.iter().filter(|s| s.at >= cut_at).collect();
    let east_serves = |s: &Sample| s.east.iter().any(|(serves, _)| *serves);
    let east_stopped = after_cut
        .iter()
        .find(|s| !east_serves(s))
        .expect("east's fences never stopped serving")
        .at;
    let west_served = after_cut
        .iter()
        .find(|s| s.west.iter().any(|serves| *serves))
        .expect("west's fences never served")
        .at;
    eprintln!(
        "east's fences stopped serving {:.1}s after the cut; west's served from {:.1}s, routed west at epoch 1 {:.1}s; \
         west's router's clients: {answered} of {sent} answered",
        (east_stopped - cut_at).as_secs_f64(),
        (west_served - cut_at).as_secs_f64(),
        routed_after.as_secs_f64(),
    );
    assert!(
        east_stopped < west_served,
        "west's fences served while east's still did"
    );
    assert!(
        after_cut
            .iter()
            .filter(|s| s.at >= east_stopped)
            .all(|s| !east_serves(s)),
        "east's fences served again after they stopped (the cut healed {:.1}s after it began)",
        (healed_at - cut_at).as_secs_f64()
    );
    assert!(
        samples
            .iter()
            .filter(|s| s.at >= healed_at)
            .all(|s| s.east.iter().all(|(_, epoch)| *epoch <= 1)),
        "an epoch past 1 at east"
    );
    west_took_over(&regions, &policy, sent, answered).await;
    drop(operator);
}

/// Region east lost whole, its API server and every process of its pods killed, under load on
/// west's router: the operator, which can no longer list east, probes east's replicas as last
/// listed, finds them gone, and promotes west; west's grant says east's fences were not revoked
/// (so west's fences wait out east's grants before serving), and west's router routes west at
/// epoch 1, having held its clients' requests meanwhile. Runs last: east does not come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_east_lost_whole_is_failed_over_to_west_which_serves() {
    let Some(regions) = regions().await else { return };
    let policy = regions.policy("regions-east-lost", "chat-east-lost", "4s").await;
    let operator = regions.operator(&policy, "regions-operator-3");
    let (east_admin, _) = regions.east.router().await;
    let (west_admin, west_gateway) = regions.west.router().await;
    regions.routed(east_admin, &policy, "east", 0).await;
    regions.routed(west_admin, &policy, "east", 0).await;
    policy.serving_under_grants("east").await;

    let clients = Clients::start_for(west_gateway, policy.model);
    tokio::time::sleep(Duration::from_secs(2)).await;
    regions.east.lose().await;
    let lost_at = Instant::now();

    regions.routed(west_admin, &policy, "west", 1).await;
    let routed_after = lost_at.elapsed();
    eventually(Duration::from_secs(30), "west's fences serving", || async {
        fence_grants(&policy.west_pods)
            .iter()
            .all(|v| v["standing"] == "serving" && v["epoch"] == 1)
            .then_some(())
    })
    .await;
    // West serves on: the load goes on past the move.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (sent, answered) = clients.stop_counting();
    eprintln!(
        "west's router routed west at epoch 1 {:.1}s after east was lost; its clients: {answered} of {sent} answered",
        routed_after.as_secs_f64()
    );
    west_took_over(&regions, &policy, sent, answered).await;
    let status = policy.policies.get("chat").await.unwrap().status.unwrap();
    assert_eq!(status.primary_pool.as_deref(), Some("west"));
    // East's fences could not be told: west's grant said so, and its fences waited out east's.
    let timeline = serde_json::to_string(&status.last_failover).unwrap();
    assert!(timeline.contains("the old holder not revoked"), "{timeline}");
    drop(operator);
}

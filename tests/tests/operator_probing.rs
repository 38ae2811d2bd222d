//! The operator's observations come from real generating probes: `ProbingObservations` probes two
//! in-process vLLM emulators on loopback (found through the fixed-list resolver, where the
//! operator would list the workloads' pods), and its checks, fed to the failover state machine
//! round by round with a tick after each as the reconciler does, promote the standby once the
//! primary has failed for as many rounds as the policy's trigger says.
//!
//! With routers to read, each round also reads a real gateway's `/signals`: when every endpoint
//! of the primary refuses the gateway's traffic, that is a hard failed check even while the
//! primary's probes give no evidence.
//!
//! Each round also compares the pools (parity), and, with a node agent to read, fails a pool
//! whose replicas hold failed GPUs whatever its probes say.
//!
//! Rounds are driven one at a time with `probe_now`, with no jitter; nothing here asserts a time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../prober/tests/emulated/mod.rs"]
mod prober_support;
#[path = "../../router/tests/support/mod.rs"]
mod router_support;

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use prober_support::Emulator;
use understudy_core::Pool;
use understudy_core::failover::{CheckResult, FailoverConfig, FailoverState, Input, PassiveSignal, Phase};
use understudy_operator::crd::FailoverPolicy;
use understudy_operator::crd::{ArtifactDigest, FailoverPolicyStatus};
use understudy_operator::gpu_health::GpuAgents;
use understudy_operator::observe::ProbingObservations;
use understudy_operator::parity::ServingConfig;
use understudy_operator::peers::Routers;
use understudy_operator::policy;
use understudy_operator::ports::ModelPlace;
use understudy_operator::ports::{Observation, ObservationSource, ProbeFindings};
use understudy_operator::replicas::FixedReplicas;
use understudy_operator::router_admin::{RouterAdminUrl, RouterToken};
use understudy_prober::agent::Agent;
use understudy_prober::gpu::{GpuInventory, GpuState, Thresholds};
use understudy_prober::model_cache::ModelCache;
use understudy_prober::podresources::{self, PodDevices};
use understudy_router::gateway::GatewayConfig;
use understudy_router::waiting_room::WaitingRoomConfig;

/// A dead engine answers 500 instead of taking the process down, so the fault is a hard failure
/// the same way every time.
const KEEP_ALIVE: &[(&str, &str)] = &[("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1")];

/// East is the home primary, west the hot standby, one replica each; the trigger spelled out is
/// the default one. No `expect.value`: the golden answer is recorded from the primary.
fn failover_policy() -> FailoverPolicy {
    let spec = serde_yaml::from_str(
        "
pools:
  - {name: east, workload: {kind: Deployment, name: vllm-east}, replicas: 1}
  - {name: west, workload: {kind: Deployment, name: vllm-west}, replicas: 1}
recoveryObjective: 5m
probe: {interval: 10s, timeout: 5s, budgets: {firstToken: 2s, total: 4s}}
trigger: {suspectAfter: 2, promoteAfter: 4, hardFailure: {promoteAfter: 2}, standbyReadyAfter: 2}
",
    )
    .unwrap();
    let mut policy = FailoverPolicy::new("llama", spec);
    policy.metadata.namespace = Some("serving".to_owned());
    policy
}

fn check(pool: Pool, result: CheckResult) -> Observation {
    Observation::Check { pool, result }
}

/// The operator's probing side for one policy over two emulators, and the state machine its
/// reconciler would run.
struct Operator {
    observations: ProbingObservations,
    /// Where the replicas are, and what their workloads' templates say (none until a test sets it).
    replicas: FixedReplicas,
    /// Whether each round found parity holding, when it could compare the pools.
    parity: Vec<bool>,
    machine: FailoverState,
    config: FailoverConfig,
    interval: Duration,
    now: Duration,
}

impl Operator {
    fn new(east: &Emulator, west: &Emulator) -> Operator {
        Operator::observing(east, west, None, failover_policy())
    }

    /// The same, also reading the gateway `router`'s `/signals` every round.
    fn reading_signals_of(east: &Emulator, west: &Emulator, router: &router_support::Router) -> Operator {
        let admin: RouterAdminUrl = format!("http://127.0.0.1:{}", router.admin).parse().unwrap();
        let token = RouterToken::new(router_support::TOKEN).unwrap();
        Operator::observing(east, west, Some((vec![admin], token)), failover_policy())
    }

    fn observing(
        east: &Emulator,
        west: &Emulator,
        routers: Option<(Vec<RouterAdminUrl>, RouterToken)>,
        policy: FailoverPolicy,
    ) -> Operator {
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![east.endpoint.clone()])
            .with_pool("west", vec![west.endpoint.clone()]);
        let mut observations =
            ProbingObservations::new(Arc::new(replicas.clone())).with_max_jitter(Duration::ZERO);
        if let Some((routers, token)) = routers {
            observations = observations.with_router_signals(Routers::At(routers), token);
        }
        let validated = policy::validate(&policy.spec).unwrap();
        observations.track(&policy);
        Operator {
            observations,
            replicas,
            parity: Vec::new(),
            machine: FailoverState::new(),
            config: validated.failover,
            interval: validated.probe.interval,
            now: Duration::from_secs(1_000),
        }
    }

    /// One probe round, then what the next reconcile does with it: drain, feed, tick. Returns
    /// the round's checks and passive signals; its parity goes to [`Self::parity`].
    async fn round(&mut self) -> Vec<Observation> {
        // The policy is found by tracking, as the reconciler's `track` leaves it.
        let key = self.key();
        assert!(self.observations.probe_now(&key).await);
        let observed = self.observations.drain(&key);
        for observation in &observed {
            self.feed(&Input::from(*observation));
        }
        self.feed(&Input::Tick);
        self.now += self.interval;
        let (parity, checks): (Vec<Observation>, Vec<Observation>) = observed
            .into_iter()
            .partition(|o| matches!(o, Observation::Parity { .. }));
        self.parity.extend(
            parity
                .into_iter()
                .map(|o| matches!(o, Observation::Parity { holds: true })),
        );
        checks
    }

    /// Two rounds in which the primary fails hard and the standby passes: one is not enough, the
    /// second promotes the standby (`hardFailure.promoteAfter: 2`).
    async fn fails_hard_twice_and_promotes(&mut self) {
        let failing = [
            check(Pool::A, CheckResult::HardFail),
            check(Pool::B, CheckResult::Pass),
        ];
        assert_eq!(self.round().await, failing);
        assert_eq!(self.promoting(), None, "one hard failure is not enough");
        assert_eq!(self.round().await, failing);
        assert_eq!(self.promoting(), Some(Pool::B), "hardFailure.promoteAfter is 2");
    }

    fn key(&self) -> ObjectRef<FailoverPolicy> {
        self.observations.tracked().pop().expect("the policy is tracked")
    }

    fn feed(&mut self, input: &Input) {
        let (next, _) = self.machine.step(&self.config, self.now, input);
        self.machine = next;
    }

    /// The pool a promotion under way is promoting, if one is.
    fn promoting(&self) -> Option<Pool> {
        match &self.machine.phase {
            Phase::Promoting(promotion) => Some(promotion.to),
            _ => None,
        }
    }
}

#[tokio::test]
async fn both_healthy_pools_pass_their_probes_round_after_round() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    for _ in 0..3 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::Pass),
                check(Pool::B, CheckResult::Pass)
            ]
        );
    }
    assert_eq!(operator.promoting(), None);
    assert_eq!(operator.machine.health[Pool::B.index()].passes, 3);
}

#[tokio::test]
async fn a_replicas_first_answer_is_kept_from_the_first_round_it_passed() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    west.inject("wrong-output");
    let mut operator = Operator::new(&east, &west);
    let before = k8s_openapi::jiff::Timestamp::now();
    operator.round().await;
    let first = operator.observations.first_answered(&east.endpoint.authority());
    assert!(first.is_some_and(|at| at >= before), "{first:?}");
    // A replica that answered wrong has not answered yet.
    assert_eq!(
        operator.observations.first_answered(&west.endpoint.authority()),
        None
    );
    operator.round().await;
    assert_eq!(
        operator.observations.first_answered(&east.endpoint.authority()),
        first,
        "the first answer, not the latest"
    );
}

#[tokio::test]
async fn a_dead_engine_on_the_primary_fails_hard_and_promotes_the_standby_after_hard_failure_promote_after_rounds()
 {
    let east = Emulator::ready(&[], KEEP_ALIVE);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    // Two healthy rounds prove the standby (standbyReadyAfter: 2).
    for _ in 0..2 {
        operator.round().await;
    }
    east.inject("engine-dead");
    operator.fails_hard_twice_and_promotes().await;
}

#[tokio::test]
async fn a_primary_that_stops_giving_its_own_golden_answer_fails_softly_and_the_standby_is_promoted_after_promote_after_rounds()
 {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    // The first round records east's answer as the golden prefix.
    for _ in 0..2 {
        operator.round().await;
    }
    // Still an answer, so only the recorded golden answer can tell it is wrong.
    east.inject("wrong-output");
    let failing = [
        check(Pool::A, CheckResult::SoftFail),
        check(Pool::B, CheckResult::Pass),
    ];
    for round in 1..4 {
        assert_eq!(operator.round().await, failing, "failing round {round}");
        assert_eq!(operator.promoting(), None, "after {round} soft failures");
    }
    assert_eq!(operator.round().await, failing);
    assert_eq!(operator.promoting(), Some(Pool::B), "promoteAfter is 4");
}

#[tokio::test]
async fn a_standby_that_answers_otherwise_than_the_primary_did_first_is_never_proven() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    west.inject("wrong-output");
    let mut operator = Operator::new(&east, &west);
    // From the very first round: the standby is judged by the answer the primary just gave.
    for _ in 0..3 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::Pass),
                check(Pool::B, CheckResult::SoftFail)
            ]
        );
    }
    east.inject("engine-dead");
    for _ in 0..3 {
        operator.round().await;
    }
    assert_eq!(
        operator.promoting(),
        None,
        "an unproven standby is not promoted, however dead the primary"
    );
}

/// A gateway routing east at epoch 0 to an address where nothing listens, with one request sent
/// through it so that its data path has seen the refusals.
fn gateway_that_sees_east_refuse() -> (router_support::Router, understudy_emulator::local::ClosedPort) {
    let gone = understudy_emulator::local::ClosedPort::bind();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", gone.port).parse().unwrap();
    // Refused, then held in the waiting room no longer than a moment.
    let config = GatewayConfig {
        waiting_room: WaitingRoomConfig {
            deadline: Duration::from_millis(300),
            ..WaitingRoomConfig::default()
        },
        ..GatewayConfig::default()
    };
    let router = router_support::Router::start(config, None);
    // The route the operator would have pushed for the policy `serving/llama`: its signals are
    // the ones the operator reads.
    let mut route = router_support::route("east", 0, &[addr]);
    route["policy"] = "serving/llama".into();
    assert_eq!(router.put_route(&route).status, 200);
    let answer = router.complete(&router_support::completion(4, false), &[]);
    assert_ne!(answer.status, 200, "{}", answer.text());
    (router, gone)
}

/// East's replica answers only with a key: its probes are rejected, no evidence either way.
fn silent_east_and_healthy_west() -> (Emulator, Emulator) {
    (
        Emulator::ready(&["--api-key", "k3y"], &[]),
        Emulator::ready(&[], &[]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_whose_traffic_is_refused_everywhere_is_replaced_when_its_probes_say_nothing() {
    let (router, _gone) = gateway_that_sees_east_refuse();
    let signals = router.admin_get("/signals").json();
    assert_eq!(signals["pools"][0]["signal"], "AllRefused", "{signals}");
    let (east, west) = silent_east_and_healthy_west();
    let mut operator = Operator::reading_signals_of(&east, &west, &router);

    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.extend(operator.round().await);
    }
    // No active check of east at all, a passing one of west, and the data path's refusals.
    assert!(
        !seen
            .iter()
            .any(|o| matches!(o, Observation::Check { pool: Pool::A, .. })),
        "{seen:?}"
    );
    let refused = Observation::Passive {
        pool: Pool::A,
        signal: PassiveSignal::AllRefused,
    };
    assert_eq!(seen.iter().filter(|o| **o == refused).count(), 3, "{seen:?}");
    assert_eq!(operator.promoting(), Some(Pool::B));
}

#[tokio::test]
async fn without_routers_a_primary_whose_probes_say_nothing_is_never_replaced() {
    // The control: the same rounds with no router to read give no evidence about east.
    let (east, west) = silent_east_and_healthy_west();
    let mut operator = Operator::new(&east, &west);
    for _ in 0..3 {
        operator.round().await;
    }
    assert_eq!(operator.machine.phase, Phase::Serving);
}

/// How the pool's template starts vLLM: `vllm serve MODEL` and `extra`, with `env`.
fn serving(extra: &[&str], env: &[(&str, &str)]) -> ServingConfig {
    let mut argv: Vec<String> = ["vllm", "serve", prober_support::MODEL].map(str::to_owned).into();
    argv.extend(extra.iter().map(|a| (*a).to_owned()));
    ServingConfig {
        argv,
        image: Some("vllm/vllm-openai:v0.11.0".to_owned()),
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

#[tokio::test]
async fn pools_that_agree_are_compared_key_by_key_and_parity_holds() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    for pool in ["east", "west"] {
        operator.replicas.set_config(
            pool,
            serving(&["--max-model-len", "8192"], &[("VLLM_USE_V1", "1")]),
        );
    }
    operator.round().await;
    assert_eq!(operator.parity, [true]);
    let parity = operator.observations.parity(&operator.key()).unwrap();
    assert!(
        parity.drift.is_empty() && parity.not_compared.is_empty(),
        "{parity:?}"
    );
    // The template (model, flags, environment, image) and the runtime (version, the model's
    // context, root, tokenizer and chat template) were all read.
    assert!(parity.compared >= 9, "{parity:?}");
}

#[tokio::test]
async fn a_standby_serving_a_shorter_context_drifts_and_is_not_promoted_when_the_primary_fails() {
    let east = Emulator::ready(&[], KEEP_ALIVE);
    let west = Emulator::ready(&["--max-model-len", "4096"], &[]);
    let mut operator = Operator::new(&east, &west);
    for _ in 0..2 {
        operator.round().await;
    }
    assert_eq!(operator.parity, [false, false]);
    let parity = operator.observations.parity(&operator.key()).unwrap();
    let keys: Vec<&str> = parity.drift.iter().map(|d| d.key.as_str()).collect();
    let key = format!("served.{}.max-model-len", prober_support::MODEL);
    assert_eq!(keys, [key.as_str()], "{parity:?}");
    assert_eq!(parity.drift[0].standby.as_deref(), Some("4096"));
    // Without the templates, what the replicas report is all that is compared, and that is said.
    assert_eq!(parity.not_compared.len(), 2, "{parity:?}");
    assert!(
        parity.not_compared[0].starts_with("east's serving flags and environment"),
        "{parity:?}"
    );

    east.inject("engine-dead");
    for round in 0..4 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::HardFail),
                check(Pool::B, CheckResult::Pass)
            ]
        );
        assert_eq!(
            operator.promoting(),
            None,
            "a drifted standby was promoted in round {round}"
        );
    }
}

#[tokio::test]
async fn the_control_a_standby_that_agrees_is_promoted_when_the_primary_fails_the_same_way() {
    let east = Emulator::ready(&[], KEEP_ALIVE);
    let west = Emulator::ready(&[], &[]);
    let mut operator = Operator::new(&east, &west);
    for _ in 0..2 {
        operator.round().await;
    }
    east.inject("engine-dead");
    operator.fails_hard_twice_and_promotes().await;
    assert_eq!(operator.parity, [true; 4]);
}

#[tokio::test]
async fn template_drift_names_each_flag_and_keys_the_policy_allows_block_nothing() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let mut policy = failover_policy();
    policy.spec.parity.allow_drift = vec!["env.VLLM_ENGINE_*".to_owned()];
    let mut operator = Operator::observing(&east, &west, None, policy);
    operator.replicas.set_config(
        "east",
        serving(
            &["--enable-prefix-caching", "--port", "8000"],
            &[("VLLM_ENGINE_ITERATION_TIMEOUT_S", "60")],
        ),
    );
    operator.replicas.set_config(
        "west",
        serving(
            &["--port=9000", "--kv-cache-dtype", "fp8"],
            &[("VLLM_ENGINE_ITERATION_TIMEOUT_S", "120")],
        ),
    );
    operator.round().await;
    let parity = operator.observations.parity(&operator.key()).unwrap();
    let drift: Vec<(&str, Option<&str>, Option<&str>)> = parity
        .drift
        .iter()
        .map(|d| (d.key.as_str(), d.primary.as_deref(), d.standby.as_deref()))
        .collect();
    // --port is ignored by default; the iteration timeout differs by design.
    assert_eq!(
        drift,
        [
            ("flag.enable-prefix-caching", Some("true"), None),
            ("flag.kv-cache-dtype", None, Some("fp8")),
        ]
    );
    assert_eq!(parity.allowed[0].key, "env.VLLM_ENGINE_ITERATION_TIMEOUT_S");
    assert_eq!(operator.parity, [false]);
}

/// GPUs a test changes while the agent reads them.
#[derive(Clone, Default)]
struct SharedGpus(Arc<std::sync::Mutex<Vec<GpuState>>>);

impl GpuInventory for SharedGpus {
    fn read(&mut self) -> Result<Vec<GpuState>, understudy_prober::gpu::Error> {
        Ok(self.0.lock().unwrap().clone())
    }
}

fn healthy_gpu(index: u32) -> GpuState {
    GpuState {
        index,
        uuid: format!("GPU-{index}"),
        xid_events: Vec::new(),
        ecc_uncorrectable: 0,
        row_remap_pending: false,
        retired_pages_pending: false,
        temperature_c: 50,
        throttle_reasons: Vec::new(),
        memory_used_bytes: 70 << 30,
        memory_total_bytes: 80 << 30,
        processes: 1,
        fallen_off_bus: false,
    }
}

/// A real node agent over `gpus` (east's replica holds GPU-0, west's GPU-1, as the kubelet's
/// pod-resources API says), reading every 20 ms, served on loopback; its port.
async fn gpu_agent(dir: &std::path::Path, gpus: SharedGpus) -> u16 {
    gpu_agent_reading(dir, gpus, None).await
}

/// [`gpu_agent`], reading the node's model cache `models` for parity.
async fn gpu_agent_reading(dir: &std::path::Path, gpus: SharedGpus, models: Option<Arc<ModelCache>>) -> u16 {
    gpu_agent_on(dir, gpus, models, understudy_prober::agent::MEMINFO.into()).await
}

/// [`gpu_agent_reading`], reading the node's memory from `meminfo`.
async fn gpu_agent_on(
    dir: &std::path::Path,
    gpus: SharedGpus,
    models: Option<Arc<ModelCache>>,
    meminfo: std::path::PathBuf,
) -> u16 {
    let socket = dir.join("kubelet.sock");
    let held = |pod: &str, gpu: &str| PodDevices {
        namespace: "serving".to_owned(),
        pod: pod.to_owned(),
        container: "vllm".to_owned(),
        resource: podresources::NVIDIA_GPU.to_owned(),
        devices: vec![gpu.to_owned()],
    };
    let pods = vec![held("vllm-east-0", "GPU-0"), held("vllm-west-0", "GPU-1")];
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(podresources::serve(listener, Arc::new(move || pods.clone())));
    let agent = Agent {
        node: "gpu-node-1".to_owned(),
        inventory: Box::new(gpus),
        no_nvml: None,
        socket,
        resource: podresources::NVIDIA_GPU.to_owned(),
        limits: Thresholds::default(),
        meminfo,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let published = understudy_prober::agent::Published::default();
    tokio::spawn(understudy_prober::agent::serve(
        listener,
        Default::default(),
        published.clone(),
        models,
    ));
    tokio::spawn(understudy_prober::agent::run(
        agent,
        Duration::from_millis(20),
        published,
    ));
    port
}

/// The operator's probing side, reading the agent at `port`, with the pods' names known.
fn reading_gpus(east: &Emulator, west: &Emulator, port: u16) -> Operator {
    let mut operator = Operator::new(east, west);
    let replicas = FixedReplicas::default()
        .with_pool("east", vec![east.endpoint.clone()])
        .with_pool("west", vec![west.endpoint.clone()])
        .with_names("east", vec!["vllm-east-0".to_owned()])
        .with_names("west", vec!["vllm-west-0".to_owned()]);
    operator.observations = ProbingObservations::new(Arc::new(replicas.clone()))
        .with_max_jitter(Duration::ZERO)
        .with_gpu_agents(GpuAgents::At(vec![("127.0.0.1".to_owned(), port)]));
    operator.observations.track(&failover_policy());
    operator.replicas = replicas;
    operator
}

/// Waits until the agent at `port` reports `pod` on a failed GPU.
async fn agent_fails(port: u16, pod: &str) {
    for _ in 0..200 {
        let (reports, _) = GpuAgents::At(vec![("127.0.0.1".to_owned(), port)])
            .reports(None)
            .await;
        if reports
            .iter()
            .any(|(_, r)| r.failed_pods().iter().any(|p| p == pod))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the agent never reported {pod} on a failed GPU");
}

#[tokio::test]
async fn a_primary_whose_gpu_falls_off_the_bus_is_replaced_while_it_still_answers() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let gpus = SharedGpus::default();
    *gpus.0.lock().unwrap() = vec![healthy_gpu(0), healthy_gpu(1)];
    let port = gpu_agent(dir.path(), gpus.clone()).await;
    let mut operator = reading_gpus(&east, &west, port);
    for _ in 0..2 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::Pass),
                check(Pool::B, CheckResult::Pass)
            ]
        );
    }
    // East's GPU is lost (Xid 79); the emulator behind it still answers its probes.
    gpus.0.lock().unwrap()[0].fallen_off_bus = true;
    agent_fails(port, "serving/vllm-east-0").await;
    operator.fails_hard_twice_and_promotes().await;
}

#[tokio::test]
async fn the_control_a_standbys_failed_gpu_fails_the_standby_not_the_primary() {
    let east = Emulator::ready(&[], &[]);
    let west = Emulator::ready(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let gpus = SharedGpus::default();
    let mut lost = healthy_gpu(1);
    lost.xid_events = vec![48];
    *gpus.0.lock().unwrap() = vec![healthy_gpu(0), lost];
    let port = gpu_agent(dir.path(), gpus).await;
    agent_fails(port, "serving/vllm-west-0").await;
    let mut operator = reading_gpus(&east, &west, port);
    for _ in 0..4 {
        assert_eq!(
            operator.round().await,
            [
                check(Pool::A, CheckResult::Pass),
                check(Pool::B, CheckResult::HardFail)
            ]
        );
    }
    assert_eq!(operator.promoting(), None);
}

/// A model directory with one safetensors file of `weights` (16 bytes: four F32), its config and
/// its tokenizer config, as a node's model cache holds one.
fn model_dir(dir: &std::path::Path, weights: &[u8; 16]) {
    std::fs::create_dir_all(dir).unwrap();
    write_weights(dir, weights);
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures":["LlamaForCausalLM"]}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template":"{{ messages }}"}"#,
    )
    .unwrap();
}

/// Writes the model's safetensors file in `dir`, holding `weights`.
fn write_weights(dir: &std::path::Path, weights: &[u8; 16]) {
    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(weights);
    // Whole or not at all, as a download lands: a reading never sees it half written.
    std::fs::write(dir.join("model.partial"), file).unwrap();
    std::fs::rename(dir.join("model.partial"), dir.join("model.safetensors")).unwrap();
}

/// Waits until the agent at `port` has a full reading of `path` whose weights digest is not
/// `not`; that digest.
async fn full_reading(
    port: u16,
    path: &str,
    not: Option<&str>,
) -> understudy_prober::model_cache::ModelReading {
    let key = "model.file.model.safetensors.sha256";
    for _ in 0..500 {
        let reading = understudy_operator::gpu_health::read_model("127.0.0.1", port, path, "full")
            .await
            .unwrap();
        let taken = |r: &understudy_prober::model_cache::ModelReading| {
            r.fingerprint
                .get(key)
                .is_some_and(|d| Some(d) != not && !d.starts_with("changed since"))
        };
        if let Some(reading) = reading.filter(taken) {
            return reading;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the agent never read {path} in full");
}

#[tokio::test]
async fn a_standby_whose_weights_differ_on_its_node_drifts_by_key_and_is_not_promoted() {
    let east = Emulator::ready(&[], KEEP_ALIVE);
    let west = Emulator::ready(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    // The node's model cache: east's replica loads one directory of it, west's another.
    let cache = dir.path().join("models");
    let (east_dir, west_dir) = (cache.join("east/m"), cache.join("west/m"));
    model_dir(&east_dir, &[1; 16]);
    model_dir(&west_dir, &[1; 16]);
    let digests = dir.path().join("digests.json");
    let models = ModelCache::new(cache.clone(), cache.clone(), Some(digests.clone()));
    let port = gpu_agent_reading(dir.path(), SharedGpus::default(), Some(Arc::new(models))).await;

    let place = |pod: &str, path: &std::path::Path| ModelPlace {
        pod: pod.to_owned(),
        endpoint: format!("{pod}:8000"),
        node: "gpu-node-1".to_owned(),
        path: Ok(path.to_str().unwrap().to_owned()),
    };
    let mut policy = failover_policy();
    policy.spec.parity.artifact_digest = Some(ArtifactDigest::Full);
    let mut operator = Operator::observing(&east, &west, None, policy.clone());
    let replicas = operator
        .replicas
        .clone()
        .with_model_places("east", vec![place("vllm-east-0", &east_dir)])
        .with_model_places("west", vec![place("vllm-west-0", &west_dir)]);
    for pool in ["east", "west"] {
        replicas.set_config(pool, serving(&[], &[]));
    }
    let observing = |replicas: &FixedReplicas| {
        ProbingObservations::new(Arc::new(replicas.clone()))
            .with_max_jitter(Duration::ZERO)
            .with_gpu_agents(GpuAgents::At(vec![("127.0.0.1".to_owned(), port)]))
    };
    operator.observations = observing(&replicas);
    operator.observations.track(&policy);

    let agents = GpuAgents::At(vec![("127.0.0.1".to_owned(), port)]);
    while agents.reports(None).await.0.is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The first full digests are taken in the background: not compared yet, and said.
    operator.round().await;
    let parity = operator.observations.parity(&operator.key()).unwrap();
    assert_eq!(parity.artifact_keys, 0, "{parity:?}");
    assert!(
        parity.not_compared.contains(
            &"east's model files on node gpu-node-1: the first full digest is being taken".to_owned()
        ),
        "{parity:?}"
    );
    let before = full_reading(port, west_dir.to_str().unwrap(), None).await;
    full_reading(port, east_dir.to_str().unwrap(), None).await;
    operator.round().await;
    let parity = operator.observations.parity(&operator.key()).unwrap();
    assert!(parity.drift.is_empty() && parity.artifact_keys >= 5, "{parity:?}");
    assert_eq!(operator.parity.last(), Some(&true));

    // One weight of west's changes in place, its size the same: only the full digest sees it.
    let mut changed = [1; 16];
    changed[15] = 2;
    write_weights(&west_dir, &changed);
    let digest = before.fingerprint.get("model.file.model.safetensors.sha256");
    // Asked at once, the agent does not answer the old digest: the file changed since it read it.
    let now =
        understudy_operator::gpu_health::read_model("127.0.0.1", port, west_dir.to_str().unwrap(), "full")
            .await
            .unwrap()
            .unwrap();
    assert!(
        now.fingerprint
            .get("model.file.model.safetensors.sha256")
            .is_some_and(|d| d.starts_with("changed since ")),
        "{now:?}"
    );
    let after = full_reading(port, west_dir.to_str().unwrap(), digest).await;
    assert_eq!(
        after.cost.files_hashed, 1,
        "only the rewritten file is hashed again: {:?}",
        after.cost
    );
    assert_eq!(after.cost.files_known, 2, "{:?}", after.cost);
    let kept = std::fs::read_to_string(&digests).unwrap();
    assert!(
        kept.contains(west_dir.join("model.safetensors").to_str().unwrap()),
        "{kept}"
    );

    // East fails, and its model files can no longer be read (as when its node is lost): they
    // are compared as last read, so west stays drifted.
    east.inject("engine-dead");
    std::fs::remove_dir_all(&east_dir).unwrap();
    for _ in 0..4 {
        operator.round().await;
        let parity = operator.observations.parity(&operator.key()).unwrap();
        let keys: Vec<&str> = parity.drift.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(
            keys,
            ["artifact.model.file.model.safetensors.sha256"],
            "{parity:?}"
        );
    }
    let parity = operator.observations.parity(&operator.key()).unwrap();
    assert!(
        parity
            .not_compared
            .iter()
            .any(|line| line.starts_with("east's model files: compared as read at ")),
        "{parity:?}"
    );
    assert_eq!(operator.parity.last(), Some(&false));
    assert_eq!(
        operator.promoting(),
        None,
        "a standby with other weights is not promoted"
    );

    // An operator that starts now has each pool's files from status, by their digest alone:
    // east's still cannot be read, and west is compared with it by digest.
    let mut recorded = policy.clone();
    recorded.status = Some(FailoverPolicyStatus {
        parity: operator.observations.parity(&operator.key()),
        ..FailoverPolicyStatus::default()
    });
    assert_eq!(
        recorded
            .status
            .as_ref()
            .unwrap()
            .parity
            .as_ref()
            .unwrap()
            .model_files
            .len(),
        2
    );
    let restarted = observing(&replicas);
    restarted.track(&recorded);
    let key = operator.key();
    assert!(restarted.probe_now(&key).await);
    let parity = restarted.parity(&key).unwrap();
    let keys: Vec<&str> = parity.drift.iter().map(|d| d.key.as_str()).collect();
    assert_eq!(keys, ["artifact.digest"], "{parity:?}");

    // The control: west's weight put back, its digest is east's recorded one, and parity holds.
    write_weights(&west_dir, &[1; 16]);
    full_reading(
        port,
        west_dir.to_str().unwrap(),
        after.fingerprint.get("model.file.model.safetensors.sha256"),
    )
    .await;
    let restarted = observing(&replicas);
    restarted.track(&recorded);
    assert!(restarted.probe_now(&key).await);
    let parity = restarted.parity(&key).unwrap();
    assert!(parity.drift.is_empty() && parity.artifact_keys == 1, "{parity:?}");
}

#[tokio::test]
async fn a_warm_replica_whose_node_lacks_host_memory_for_its_weights_sleeps_at_level_two() {
    use understudy_operator::standby::{self, Sleep};

    const DEV_MODE: &[(&str, &str)] = &[("VLLM_SERVER_DEV_MODE", "1")];
    let east = Emulator::ready(&[], &[]);
    let west: Vec<Emulator> = (0..3)
        .map(|_| Emulator::ready(&["--enable-sleep-mode"], DEV_MODE))
        .collect();
    let mut endpoints: Vec<_> = west.iter().map(|e| e.endpoint.clone()).collect();
    endpoints.sort_by_key(ToString::to_string);
    let dir = tempfile::tempdir().unwrap();
    // Two nodes' worth of one: the node has 3 MiB available, each replica's weights take 2 MiB.
    let cache = dir.path().join("models");
    let model = cache.join("m");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("model.safetensors"), vec![0u8; 2 << 20]).unwrap();
    let meminfo = dir.path().join("meminfo");
    std::fs::write(&meminfo, "MemTotal: 8192 kB\nMemAvailable: 3072 kB\n").unwrap();
    let models = ModelCache::new(cache.clone(), cache.clone(), None);
    let port = gpu_agent_on(dir.path(), SharedGpus::default(), Some(Arc::new(models)), meminfo).await;
    let agents = GpuAgents::At(vec![("127.0.0.1".to_owned(), port)]);
    while agents.reports(None).await.0.is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let spec = serde_yaml::from_str(
        "
pools:
  - {name: east, workload: {kind: Deployment, name: vllm-east}, replicas: 1}
  - name: west
    workload: {kind: Deployment, name: vllm-west}
    replicas: 3
    standby: [{tier: hot, replicas: 1}, {tier: warm, replicas: 2, sleepLevel: 1}]
recoveryObjective: 5m
probe: {interval: 10s, timeout: 5s}
",
    )
    .unwrap();
    let mut policy = FailoverPolicy::new("llama", spec);
    policy.metadata.namespace = Some("serving".to_owned());
    let places = endpoints
        .iter()
        .enumerate()
        .map(|(i, endpoint)| ModelPlace {
            pod: format!("vllm-west-{i}"),
            endpoint: endpoint.authority(),
            node: "gpu-node-1".to_owned(),
            path: Ok(model.to_str().unwrap().to_owned()),
        })
        .collect();
    let replicas = FixedReplicas::default()
        .with_pool("east", vec![east.endpoint.clone()])
        .with_pool("west", endpoints.clone())
        .with_model_places("west", places);
    let observations = ProbingObservations::new(Arc::new(replicas.clone()))
        .with_max_jitter(Duration::ZERO)
        .with_gpu_agents(agents);
    observations.track(&policy);
    let key = ObjectRef::from_obj(&policy);
    assert!(observations.probe_now(&key).await);
    let room = observations.host_room(&key, Pool::B);
    assert_eq!(room.available["gpu-node-1"], 3 << 20, "{room:?}");
    assert_eq!(room.replicas.len(), 3, "{room:?}");

    // Kept in shape: the first to sleep takes 2 MiB of the 3; the next has no room at level 1.
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let workload = understudy_operator::workload::Workload::new(
        kube::Client::try_from(config).unwrap(),
        "serving",
        &policy.spec.pools[1].workload,
    );
    let probe = understudy_operator::judge::probe_spec(
        &policy.spec.probe,
        &policy::validate(&policy.spec).unwrap().probe,
        understudy_prober::probe::Expectation::NonEmpty,
    );
    let kept = standby::keep(
        &workload,
        &policy.spec.pools[1],
        &replicas,
        "serving",
        &probe,
        Sleep::AfterProbe(understudy_prober::probe::Expectation::NonEmpty, room),
        understudy_prober::sleep::WakeTimeouts::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        kept.put_to_sleep,
        [
            format!("{} (level 1)", endpoints[2]),
            format!("{} (level 2)", endpoints[1])
        ]
    );
    assert_eq!(kept.deeper.len(), 1, "{kept}");
    assert_eq!(
        kept.deeper[0].1,
        "node gpu-node-1 has 1.0 MiB of host memory available and its weights need 2.2 MiB with a tenth to spare"
    );
    assert!(kept.to_string().contains("not 1: node gpu-node-1"), "{kept}");
    // The rounds read the levels the status counts the standby's wake by: of the replicas the
    // round before found asleep.
    assert!(observations.probe_now(&key).await);
    assert!(observations.probe_now(&key).await);
    let mut levels = observations.asleep_levels(&key, Pool::B);
    levels.sort();
    assert_eq!(levels, [Some(1), Some(2)]);
}

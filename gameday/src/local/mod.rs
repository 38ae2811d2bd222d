//! The local game day: the whole failover system on one machine, against emulated vLLM.
//!
//! [`run`] starts each pool's replicas as real `vllm-emulator` processes on loopback ports they
//! pick, a fence process in front of each replica and two router gateway processes
//! ([`system`]), the fences reading one compare-and-set lease in a file of the run's own. The failover
//! logic is the operator's: the prober's generating probes feed core's state machine every
//! interval, and core's `drive` carries each promotion step out through the local executor
//! ([`executor`]). Open-loop load goes through the routers while the scenario's faults hit the
//! replicas with real signals, and the report says what clients saw.
//!
//! A run never leaves a process behind: replicas, routers and fences die with their handles,
//! whether the run ends, fails, or is interrupted, and the run's folder goes with them.

pub mod executor;
pub mod grants;
pub mod http;
pub mod lag;
pub mod links;
pub mod load;
pub mod pilot;
pub mod process;
pub mod replicas;
pub mod report;
pub mod rollout;
pub mod scenario;
pub mod system;
pub mod timeline;
pub mod vllm;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use understudy_api::crd::{AdmissionSpec, RolloutPhase};
use understudy_api::grant::GrantStanding;
use understudy_api::lease::{EpochLease, FileLease};
use understudy_api::route::AdmissionSettings;
use understudy_core::drive::{StepOutcome, drive};
use understudy_core::failover::{
    CheckResult, Command, ControlPlane, Event, FailbackPolicy, FailoverConfig, FailoverState, Input, Phase,
    Step,
};
use understudy_core::load_proof::{self, ShapeSample, plan_samples};
use understudy_core::quorum::{Role, StandbyShape};
use understudy_core::{Epoch, Pool};
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::parity::DriftReport;
use understudy_prober::parity::flags::{FlagPolicy, flags_fingerprint};
use understudy_prober::parity::runtime::runtime_fingerprint;
use understudy_prober::probe::{
    Bearer, Endpoint, Expectation, GOLDEN_PREFIX_CHARS, ProbeReport, ProbeSpec, probe_round,
};
use understudy_prober::replay::{ReplayLimits, replay};
use understudy_prober::report::PoolRound;
use understudy_prober::sleep::{WakeTimeouts, wake_replica_at_its_level};
use understudy_router::admission::Priority;

use self::executor::{LOCAL_POLICY, LogicLease, PoolAddrs, ProcessExecutor, Routed, RouterAdmin, pool_name};
use self::grants::Granter;
use self::load::{RequestOutcome, RequestRecord};
use self::pilot::{ColdStart, Growth, PilotLight};
use self::replicas::{Launcher, Replica, ReplicaError, Startup};
use self::report::{
    AppliedFault, LoadProofRun, RouteChange, RouterCounts, RunReport, SelfFence, StepSpan, Transition,
    Verdict,
};
use self::rollout::{Rollout, RolloutRun};
use self::scenario::{Checked, CheckedLoadProof, Engine, FaultKind, PoolName, ProbeKind, Topology};
use self::system::{RunDir, System};

/// How a run shows its progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// One status line, rewritten in place.
    Terminal,
    /// A plain line a second, for logs and pipes.
    Lines,
    Quiet,
}

impl Progress {
    /// A status line on a terminal, plain lines otherwise.
    #[must_use]
    pub fn for_stderr() -> Progress {
        if std::io::stderr().is_terminal() {
            Progress::Terminal
        } else {
            Progress::Lines
        }
    }
}

/// How to run a scenario.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// How replicas start (`vllm-emulator`).
    pub launcher: Launcher,
    /// How routers and fences start (`understudy-router`).
    pub router: Launcher,
    /// Seeds the load's arrivals, prompts and lengths.
    pub seed: u64,
    pub progress: Progress,
}

/// Why a run could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    Tier(#[from] vllm::NotInstalled),
    #[error("a router or fence: {0}")]
    System(#[from] process::ProcessError),
    #[error("the run's folder: {0}")]
    RunDir(#[source] std::io::Error),
    #[error("the policy cannot run: {0}")]
    Policy(#[from] understudy_core::failover::ConfigError),
    #[error("the lease: {0}")]
    Lease(#[from] understudy_api::lease::LeaseError),
    #[error("the system did not come up: {0}")]
    FirstRoute(String),
    #[error("a fault could not be applied: {0}")]
    Fault(String),
    #[error("the warm tier could not be put to sleep: {0}")]
    Sleep(String),
}

/// How long a replica may take to start and report ready.
pub(crate) const START_LIMIT: Duration = Duration::from_secs(30);
/// How long a real vLLM server may take to be ready: about a minute on two idle cores, twice
/// that while a build runs beside it.
const VLLM_START_LIMIT: Duration = Duration::from_secs(300);
/// How long a load proof may still run once the load has ended: longer than one replayed request
/// may take.
const PROOF_LIMIT: Duration = Duration::from_secs(45);
/// How long requests still in flight at the end of the load get to finish.
const DRAIN_LIMIT: Duration = Duration::from_secs(35);

/// What the failover logic shares with the rest of the run.
struct Logic {
    config: FailoverConfig,
    shapes: [StandbyShape; 2],
    /// The lease as the failover logic reaches it (a `lost-lease` fault cuts it off).
    lease: LogicLease,
    /// Grants the fences their right to serve, from the lease.
    granter: Granter,
    /// Commands given and not yet fed to the machine.
    commands: Mutex<Vec<Command>>,
    /// Load proofs' findings not yet fed to the machine.
    load_proven: Mutex<Vec<Input>>,
    /// The last parity report between the pools, when both could be read.
    parity: Mutex<Option<DriftReport>>,
    /// The pools as they run: a pilot light joins its pool when it is grown.
    pools: Arc<Mutex<[PoolAddrs; 2]>>,
    /// Every replica process; dropping one kills it.
    replicas: Arc<Mutex<Vec<Replica>>>,
    /// The standby's pilot light, when it has one.
    growth: Option<Growth>,
    /// The scenario's standby-first rollout, when it sets a new version.
    rollout: Option<Rollout>,
    /// The routers and fences, the grown ones' too.
    system: Arc<System>,
    cold_starts: Arc<Mutex<Vec<ColdStart>>>,
    /// The route the routers hold.
    routed: Mutex<Option<Routed>>,
    routers: Vec<RouterAdmin>,
    probe: ProbeSpec,
    /// How each round judges a replica: generating (understudy's) or `/health` (a baseline).
    probe_kind: ProbeKind,
    admission: Option<AdmissionSpec>,
    interval: Duration,
    /// How long a promotion may take before its steps stop waiting for all they want.
    deadline: Duration,
    /// How long a planned move lets the old primary's streams finish.
    drain_for: Duration,
    /// When pool b, the standby again after a failback, is put back into its shape (its warm
    /// replicas to sleep), from the start of load.
    reshape_at: Mutex<Option<Duration>>,
    state: Mutex<FailoverState>,
    journal: Mutex<Journal>,
}

/// What the failover logic did, timed from the start of load.
#[derive(Debug, Default)]
struct Journal {
    events: Vec<(Duration, Event)>,
    transitions: Vec<Transition>,
    /// Each step's note, for the promotion under way.
    notes: Vec<(Step, String)>,
    /// The replicas' own time in the promotion under way (waking, starting).
    stage: Option<Duration>,
    /// Every route pushed, the first one's too.
    routes: Vec<RouteChange>,
    /// What was done to pool b when it became the standby again, timed.
    standby_shaped: Vec<String>,
    /// Each grant round that changed what the fences hold, timed.
    grants: Vec<String>,
    /// Each fence's standing each time it changed, as the fence itself answered it.
    standings: Vec<Standing>,
    /// The load proof, once it ended.
    load_proof: Option<LoadProofRun>,
}

/// A fence's standing from a moment on, as it answered it.
#[derive(Clone, Debug)]
struct Standing {
    at: Duration,
    pool: Pool,
    fence: SocketAddr,
    standing: GrantStanding,
    epoch: Option<Epoch>,
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a panicked task; what it guards is still the best record.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs one scenario to its end (or to Ctrl-C) and reports what happened.
pub async fn run(checked: &Checked, options: &RunOptions) -> Result<RunReport, RunError> {
    let scenario = &checked.scenario;
    let (logic, public) = set_up(checked, options).await?;
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let records = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = watch::channel(false);
    if scenario.topology == Topology::ActivePassive {
        tasks.spawn(failover_logic(Arc::clone(&logic), start, stopped.clone()));
    }
    tasks.spawn(keep_granting(Arc::clone(&logic), start));
    let proving = checked.load_proof.as_ref().map(|proof| {
        tokio::spawn(prove_load(
            Arc::clone(&logic),
            start,
            proof.clone(),
            scenario.model.clone(),
        ))
    });
    tasks.spawn(watch_fences(Arc::clone(&logic), start));
    tasks.spawn(show_progress(
        Arc::clone(&logic),
        Arc::clone(&records),
        start,
        checked.duration,
        options.progress,
        stopped,
    ));
    let memory = Arc::new(AtomicU64::new(0));
    tasks.spawn(sample_memory(Arc::clone(&logic), Arc::clone(&memory)));
    let lateness = Arc::new(Mutex::new(Vec::new()));
    tasks.spawn(lag::watch(start, Arc::clone(&lateness)));
    let faults = apply_faults(checked, &logic, start);
    let load = load::run(
        &scenario.load,
        &scenario.model,
        &public,
        options.seed,
        start,
        checked.duration,
        Arc::clone(&records),
    );
    let (interrupted, applied) = tokio::select! {
        (applied, ()) = async { tokio::join!(faults, async {
            if tokio::time::timeout(checked.duration + DRAIN_LIMIT, load).await.is_err() {
                tracing::warn!("requests still in flight after the drain limit are left out");
            }
        }) } => (false, applied),
        _ = tokio::signal::ctrl_c() => (true, Ok(Vec::new())),
    };
    if let Some(proving) = proving.filter(|_| !interrupted) {
        // A standby that falls behind answers the last replayed requests late: the proof is
        // judged on all of them, each bounded by the replay's own timeout.
        if tokio::time::timeout(PROOF_LIMIT, proving).await.is_err() {
            tracing::warn!("the load proof did not end within {PROOF_LIMIT:?}; it is left out");
        }
    }
    let _ = stop.send(true);
    let ended = start.elapsed();
    if options.progress == Progress::Terminal {
        eprintln!();
    }
    let applied = applied?;
    let mut routed = RouterCounts::default();
    for router in &logic.routers {
        routed.add(router_counts(router).await);
    }
    let records = lock(&records).clone();
    tasks.abort_all();
    if let Some(growth) = &logic.growth {
        growth.finish().await;
    }
    if let Some(rollout) = &logic.rollout {
        rollout.finish().await;
    }
    // Kills every router, fence and replica still running.
    logic.system.stop();
    lock(&logic.replicas).clear();
    let lag = lag::SchedulingLag::from_samples(&lock(&lateness));
    let mut report = build_report(checked, &logic, &records, applied, routed, ended, interrupted);
    report.judge_with(lag);
    report.seed = options.seed;
    let peak = memory.load(Ordering::Relaxed);
    report.memory_peak_mib = (peak > 0).then(|| (peak as f64 / 1024.0 * 10.0).round() / 10.0);
    report.records = records;
    Ok(report)
}

/// Starts the system the scenario describes (the lease, each pool's replicas behind their
/// fences, the routers, the standby's warm replicas asleep) and pushes the first route. Returns
/// what the failover logic shares, and the routers' public addresses for the load.
async fn set_up(checked: &Checked, options: &RunOptions) -> Result<(Arc<Logic>, Vec<SocketAddr>), RunError> {
    let scenario = &checked.scenario;
    let config = failover_config(checked);
    config.check()?;
    let system = System::new(
        options.router.clone(),
        RunDir::create(options.seed).map_err(RunError::RunDir)?,
    )
    .with_drain(checked.drain_for);
    let granter = Granter::new(checked.grant, system.token());
    let lease = FileLease::new(system.lease_file());
    lease.create(pool_name(Pool::A), Epoch(0)).await?;
    let argv = [&scenario.pools.a, &scenario.pools.b].map(|shape| serve_argv(scenario, shape));
    let (replicas, pools) = start_pools(scenario, options, &system, &argv).await?;
    let (routers, public) = start_routers(&system, checked).await?;
    let probe = golden_probe(checked, pools[Pool::A.index()].replicas[0]).await?;
    put_warm_to_sleep(&scenario.pools.b, &pools[Pool::B.index()]).await?;
    let first_route = pools[Pool::A.index()].replicas.clone();
    let (system, pools, replicas) = (
        Arc::new(system),
        Arc::new(Mutex::new(pools)),
        Arc::new(Mutex::new(replicas)),
    );
    let cold_starts = Arc::new(Mutex::new(Vec::new()));
    let growth = (scenario.pools.b.pilot_light > 0).then(|| {
        let pilot = PilotLight {
            pool: Pool::B,
            launcher: options.launcher.clone(),
            model: scenario.model.clone(),
            args: argv[Pool::B.index()][2..].to_vec(),
        };
        Growth::new(
            pilot,
            Arc::clone(&system),
            Arc::clone(&pools),
            Arc::clone(&replicas),
            Arc::clone(&cold_starts),
        )
    });
    let logic = Arc::new(Logic {
        shapes: [&scenario.pools.a, &scenario.pools.b].map(|shape| {
            StandbyShape {
                replicas: shape.replicas,
                warm: shape.warm,
                sleep_level: shape.sleep_level,
                pilot_light: shape.pilot_light,
                min_serving: None,
            }
            .serving_at(scenario.policy.min_serving_fraction)
        }),
        config,
        lease: LogicLease::new(lease),
        granter,
        commands: Mutex::new(Vec::new()),
        load_proven: Mutex::new(Vec::new()),
        parity: Mutex::new(None),
        pools,
        replicas,
        growth,
        rollout: checked.rollout.clone().map(|plan| {
            Rollout::new(
                plan,
                options.launcher.clone(),
                scenario.model.clone(),
                argv.clone().map(|argv| argv[2..].to_vec()),
            )
        }),
        system,
        cold_starts,
        routed: Mutex::new(None),
        routers,
        probe,
        probe_kind: scenario.policy.probe,
        admission: scenario
            .router
            .admission
            .as_ref()
            .map(scenario::LocalAdmission::spec),
        interval: checked.interval,
        deadline: checked.promotion_deadline,
        drain_for: checked.drain_for,
        reshape_at: Mutex::new(None),
        state: Mutex::new(FailoverState::new()),
        journal: Mutex::new(Journal::default()),
    });
    // The home primary's fences serve once granted: every other fence took the epoch.
    let round = logic
        .granter
        .round(&logic.lease, &logic.pools)
        .await
        .map_err(RunError::FirstRoute)?;
    if round.holders(GrantStanding::Serving) != round.answers.iter().filter(|a| a.pool == "a").count() {
        return Err(RunError::FirstRoute(format!(
            "the first grants: {}",
            round.summary()
        )));
    }
    let executor = executor_of(&logic);
    let mut first = executor.route_for(Pool::A, Epoch(0), &first_route);
    // Nothing is being promoted at the start: the first route opens no admission window.
    first.admission = AdmissionSettings::default();
    if let StepOutcome::NotYet(why) = executor.push(&first, None).await {
        return Err(RunError::FirstRoute(why));
    }
    *lock(&logic.routed) = Some(Routed {
        pool: Pool::A,
        epoch: Epoch(0),
        replicas: first_route,
    });
    note_route(&logic, Duration::ZERO);
    Ok((logic, public))
}

/// Starts each pool's replicas, each behind a fence of its own.
async fn start_pools(
    scenario: &scenario::Scenario,
    options: &RunOptions,
    system: &System,
    argv: &[Vec<String>; 2],
) -> Result<(Vec<Replica>, [PoolAddrs; 2]), RunError> {
    let mut replicas = Vec::new();
    let mut pools = [PoolAddrs::default(), PoolAddrs::default()];
    for (pool, shape) in [(Pool::A, &scenario.pools.a), (Pool::B, &scenario.pools.b)] {
        // Active-active: every replica serves under pool a's lease, in one route; faults still
        // strike the pool the scenario names.
        let serving = match scenario.topology {
            Topology::ActivePassive => pool,
            Topology::ActiveActive => Pool::A,
        };
        let args = argv[pool.index()][2..].to_vec();
        // The pilot light does not run until a promotion grows it.
        let names: Vec<String> = (0..shape.replicas - shape.pilot_light)
            .map(|i| format!("{}-{i}", pool_name(pool)))
            .collect();
        let started = match shape.engine {
            Engine::Emulated => names
                .iter()
                .map(|name| {
                    Replica::start(
                        &options.launcher,
                        name,
                        pool,
                        &scenario.model,
                        &args,
                        Startup::Instant,
                        START_LIMIT,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?,
            Engine::Vllm => {
                let (model, args) = (scenario.model.clone(), args.clone());
                tokio::task::spawn_blocking(move || start_real(&names, pool, &model, &args))
                    .await
                    .map_err(|e| RunError::Fault(format!("starting vLLM servers: {e}")))??
            }
        };
        for mut replica in started {
            let (link, fence) = system.front(serving, &mut replica).await?;
            pools[serving.index()].replicas.push(link);
            pools[serving.index()].fences.push(fence);
            replicas.push(replica);
        }
    }
    Ok((replicas, pools))
}

/// Starts a pool's real vLLM servers from the tier, all at once (each spends most of its minute
/// in Python imports and process starts, which overlap well enough on two cores), blocking until
/// all are ready: run it off the async workers.
fn start_real(names: &[String], pool: Pool, model: &str, args: &[String]) -> Result<Vec<Replica>, RunError> {
    let tier = vllm::VllmTier::find()?;
    std::thread::scope(|scope| {
        let starting: Vec<_> = names
            .iter()
            .map(|name| scope.spawn(|| Replica::start_vllm(&tier, name, pool, model, args, VLLM_START_LIMIT)))
            .collect();
        starting
            .into_iter()
            .map(|handle| match handle.join() {
                Ok(started) => started.map_err(RunError::from),
                Err(_) => Err(RunError::Fault(
                    "a thread starting a vLLM server panicked".to_owned(),
                )),
            })
            .collect()
    })
}

/// Starts the two routers: their admin addresses for the failover logic, their public ones for
/// the load.
async fn start_routers(
    system: &System,
    checked: &Checked,
) -> Result<(Vec<RouterAdmin>, Vec<SocketAddr>), RunError> {
    let mut routers = Vec::new();
    let mut public = Vec::new();
    for i in 0..2 {
        let router = system.router(i, checked).await?;
        public.push(router.public);
        routers.push(RouterAdmin {
            addr: router.admin,
            token: router.token,
        });
    }
    Ok((routers, public))
}

/// Puts the standby's warm replicas (its first `warm`) to sleep at the scenario's level, each
/// confirmed by `/is_sleeping`, before any load.
async fn put_warm_to_sleep(shape: &scenario::PoolShape, pool: &PoolAddrs) -> Result<(), RunError> {
    for addr in pool.replicas.iter().take(shape.warm as usize) {
        let endpoint = Endpoint::new(addr.ip().to_string(), addr.port());
        understudy_prober::sleep::put_to_sleep(
            &endpoint,
            shape.sleep_level,
            understudy_prober::sleep::WakeTimeouts::default(),
        )
        .await
        .map_err(|why| RunError::Sleep(format!("{addr}: {why}")))?;
    }
    Ok(())
}

/// A pool's `vllm serve` command line: the scenario's flags, and sleep mode on both pools when
/// the standby has a warm tier (the home pool must be able to sleep once it is the standby).
fn serve_argv(scenario: &scenario::Scenario, shape: &scenario::PoolShape) -> Vec<String> {
    let mut argv = vec!["serve".to_owned(), scenario.model.clone()];
    argv.extend(shape.args.iter().cloned());
    if scenario.pools.b.warm > 0 && !argv.iter().any(|a| a == "--enable-sleep-mode") {
        argv.push("--enable-sleep-mode".to_owned());
    }
    argv
}

fn failover_config(checked: &Checked) -> FailoverConfig {
    let policy = &checked.scenario.policy;
    FailoverConfig {
        suspect_after: policy.suspect_after,
        promote_after: policy.promote_after,
        hard_promote_after: policy.hard_promote_after,
        standby_ready_after: policy.standby_ready_after,
        min_dwell: checked.min_dwell,
        failback: match policy.failback {
            scenario::Failback::Manual => FailbackPolicy::Manual,
            scenario::Failback::Automatic { healthy_checks } => FailbackPolicy::Automatic { healthy_checks },
        },
        paused: false,
    }
}

fn probe_spec(checked: &Checked) -> ProbeSpec {
    ProbeSpec {
        model: Some(checked.scenario.model.clone()),
        expect: Expectation::NonEmpty,
        budget: understudy_prober::probe::Budget {
            first_token: checked.timeout / 2,
            total: checked.timeout,
        },
        timeout: checked.timeout,
        stall_after: checked.timeout / 2,
        ..ProbeSpec::default()
    }
}

/// The probe both pools are judged by: its golden answer is the home primary's first answer, as
/// the operator records it, so a replica that answers fluently but wrongly fails.
async fn golden_probe(checked: &Checked, replica: SocketAddr) -> Result<ProbeSpec, RunError> {
    let mut spec = probe_spec(checked);
    let endpoint = Endpoint::new(replica.ip().to_string(), replica.port());
    let first = understudy_prober::probe::probe(&endpoint, &spec).await;
    if !matches!(first.outcome, understudy_prober::outcome::ProbeOutcome::Ok { .. }) {
        return Err(RunError::FirstRoute(format!(
            "the home primary's first probe was {:?}, so there is no golden answer",
            first.outcome
        )));
    }
    spec.expect = Expectation::golden_prefix(&first.text, GOLDEN_PREFIX_CHARS);
    Ok(spec)
}

fn executor_of(logic: &Logic) -> ProcessExecutor<'_> {
    ProcessExecutor {
        lease: &logic.lease,
        granter: &logic.granter,
        pools: &logic.pools,
        replicas: &logic.replicas,
        cold_starts: &logic.cold_starts,
        growth: logic.growth.as_ref(),
        routed: &logic.routed,
        serving: None,
        routers: &logic.routers,
        probe: &logic.probe,
        admission: logic.admission.as_ref(),
        stage: None,
    }
}

/// Every interval: probe both pools, feed the machine, and drive a promotion it starts.
async fn failover_logic(logic: Arc<Logic>, start: Instant, mut stopped: watch::Receiver<bool>) {
    let mut ticks = tokio::time::interval(logic.interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let joined = async {
            match &logic.growth {
                Some(growth) => growth.joined().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = ticks.tick() => {}
            // A pilot-light replica joined its pool: a promotion waiting for replicas to serve
            // tries again now rather than at the next round, as a pod turning ready would wake
            // the operator.
            () = joined => {
                let state = lock(&logic.state).clone();
                if state.pending_action().is_some() {
                    carry_out(&logic, start, state).await;
                }
                continue;
            }
            _ = stopped.changed() => return,
        }
        let (inputs, passing) = round_inputs(&logic).await;
        let now = start.elapsed();
        let mut state = lock(&logic.state).clone();
        let mut events = Vec::new();
        for input in &inputs {
            let (next, actions) = state.step(&logic.config, now, input);
            state = next;
            events.extend(actions.into_iter().filter_map(|a| match a {
                understudy_core::failover::Action::Emit(event) => Some(event),
                _ => None,
            }));
        }
        record(&logic, now, events);
        *lock(&logic.state) = state.clone();
        rollout::keep(&logic, &state, &passing, start);
        carry_out(&logic, start, state).await;
        keep_route(&logic, &passing, start).await;
        keep_primary_awake(&logic);
        let due = {
            let mut reshape_at = lock(&logic.reshape_at);
            let due = reshape_at.is_some_and(|at| start.elapsed() >= at);
            if due {
                *reshape_at = None;
            }
            due
        };
        if due {
            tokio::spawn(put_standby_to_sleep(Arc::clone(&logic), start));
        }
    }
}

/// Puts pool b's warm replicas back to sleep once it is the standby again, as the operator's
/// standby keeper does: vLLM's default `mode=abort` ends whatever still runs on them, which is why
/// a planned move waits out its drain first. A pool no longer the standby is left as it is.
async fn put_standby_to_sleep(logic: Arc<Logic>, start: Instant) {
    let shape = logic.shapes[Pool::B.index()];
    let still_the_standby = || {
        let state = lock(&logic.state);
        state.primary == Pool::A && state.pending_action().is_none()
    };
    let warm: Vec<SocketAddr> = lock(&logic.pools)[Pool::B.index()]
        .replicas
        .iter()
        .take(shape.warm as usize)
        .copied()
        .collect();
    let mut slept = Vec::new();
    let mut failed = Vec::new();
    for addr in warm {
        // A promotion of b that began meanwhile has woken these: they stay awake.
        if !still_the_standby() {
            break;
        }
        let endpoint = Endpoint::new(addr.ip().to_string(), addr.port());
        match understudy_prober::sleep::put_to_sleep(&endpoint, shape.sleep_level, WakeTimeouts::default())
            .await
        {
            Ok(()) => slept.push(addr.to_string()),
            Err(why) => failed.push(format!("{addr}: {why}")),
        }
    }
    let mut line = format!(
        "{:.0} ms: put {} of b's warm replica(s) to sleep at level {}",
        report::to_ms(start.elapsed()),
        slept.len(),
        shape.sleep_level
    );
    if !failed.is_empty() {
        line.push_str(&format!("; not: {}", failed.join("; ")));
    }
    lock(&logic.journal).standby_shaped.push(line);
}

/// Renews every fence's grant each renewal period, as the operator does, writing down each round
/// that changed what the fences hold (and each time the lease could not be read).
async fn keep_granting(logic: Arc<Logic>, start: Instant) {
    let mut ticks = tokio::time::interval(logic.granter.timing.renew_every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut said = String::new();
    loop {
        ticks.tick().await;
        let line = match logic.granter.round(&logic.lease, &logic.pools).await {
            Ok(round) => round.summary(),
            Err(why) => format!("no grants renewed: {why}"),
        };
        if line != said {
            let at = report::to_ms(start.elapsed());
            lock(&logic.journal).grants.push(format!("{at:.0} ms: {line}"));
            said = line;
        }
    }
}

/// Asks every fence for its grant every 50 ms, straight rather than through the run's links (the
/// run's own watch, not the failover logic's), and writes down each change of standing.
async fn watch_fences(logic: Arc<Logic>, start: Instant) {
    let mut ticks = tokio::time::interval(Duration::from_millis(50));
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last: std::collections::HashMap<SocketAddr, (GrantStanding, Option<Epoch>)> =
        std::collections::HashMap::new();
    loop {
        ticks.tick().await;
        let fences: Vec<(Pool, SocketAddr)> = {
            let pools = lock(&logic.pools);
            [Pool::A, Pool::B]
                .into_iter()
                .flat_map(|pool| pools[pool.index()].fences.iter().map(move |f| (pool, f.data)))
                .collect()
        };
        let asks = fences.iter().map(|(pool, fence)| async move {
            let answer = http::exchange(
                *fence,
                "GET",
                understudy_api::grant::GRANT_PATH,
                &[],
                bytes::Bytes::new(),
                Duration::from_millis(500),
            )
            .await;
            let view = answer
                .ok()
                .and_then(|a| serde_json::from_slice::<understudy_api::grant::GrantView>(&a.body).ok());
            (*pool, *fence, view)
        });
        let views = futures::future::join_all(asks).await;
        let at = start.elapsed();
        let mut journal = lock(&logic.journal);
        for (pool, fence, view) in views {
            let Some(view) = view else { continue };
            let now = (view.standing, view.epoch);
            if last.insert(fence, now) != Some(now) {
                journal.standings.push(Standing {
                    at,
                    pool,
                    fence,
                    standing: view.standing,
                    epoch: view.epoch,
                });
            }
        }
    }
}

/// Between promotions, wakes the primary's replicas that still sleep (a promotion goes on once
/// enough of its warm tier is awake), as the operator does. Each wake runs on its own task, so a
/// hung replica holds up nothing, and one already under way is not started again.
fn keep_primary_awake(logic: &Logic) {
    let (primary, promoting) = {
        let state = lock(&logic.state);
        (state.primary, state.pending_action().is_some())
    };
    let shape = logic.shapes[primary.index()];
    if promoting || shape.warm == 0 {
        return;
    }
    for addr in lock(&logic.pools)[primary.index()].replicas.clone() {
        let endpoint = Endpoint::new(addr.ip().to_string(), addr.port());
        tokio::spawn(async move {
            wake_replica_at_its_level(&endpoint, shape.sleep_level, WakeTimeouts::default()).await;
        });
    }
}

/// Between promotions, grows the route with the primary's replicas that passed this round and
/// are not routed yet (a pilot light's, as each one passes), as the operator's route keeping does.
/// It never shrinks a route: the routers eject a replica that fails under them, and the checks
/// judge the pool.
async fn keep_route(logic: &Logic, passing: &[Vec<SocketAddr>; 2], start: Instant) {
    let (primary, epoch) = {
        let state = lock(&logic.state);
        if state.pending_action().is_some() {
            return;
        }
        (state.primary, state.epoch)
    };
    let Some(routed) = lock(&logic.routed).clone() else {
        return;
    };
    let joining: Vec<SocketAddr> = passing[primary.index()]
        .iter()
        .filter(|addr| !routed.replicas.contains(addr))
        .copied()
        .collect();
    if routed.pool != primary || routed.epoch != epoch || joining.is_empty() {
        return;
    }
    let executor = executor_of(logic);
    executor.first_tokens(&joining);
    let replicas = [routed.replicas, joining].concat();
    if let StepOutcome::Done(_) = executor.route_to(primary, epoch, replicas, None).await {
        note_route(logic, start.elapsed());
    }
}

/// Writes down the route the routers hold now, at `at`.
fn note_route(logic: &Logic, at: Duration) {
    let Some(routed) = lock(&logic.routed).clone() else {
        return;
    };
    lock(&logic.journal).routes.push(RouteChange {
        at_ms: report::to_ms(at),
        pool: pool_name(routed.pool).to_owned(),
        epoch: routed.epoch.0,
        replicas: routed.replicas.len(),
    });
}

/// The standby's load proof, as the operator's `spec.loadProof` runs it: at its time, the shapes
/// the routers recorded of the run's load, replayed against the standby through its fences with
/// the operator's token at the proof's share of the recorded rate; the standby's replicas are
/// probed first, as every round probes them. What it found is fed to the machine at the next
/// round, where a failure blocks promotion.
async fn prove_load(logic: Arc<Logic>, start: Instant, proof: CheckedLoadProof, model: String) {
    tokio::time::sleep_until(start + proof.at).await;
    let standby = lock(&logic.state).standby();
    let (replicas, fences) = {
        let pools = lock(&logic.pools);
        let pool = &pools[standby.index()];
        let endpoint = |a: SocketAddr| Endpoint::new(a.ip().to_string(), a.port());
        let bearer = Bearer::new(logic.system.token());
        let fences: Vec<Endpoint> = pool
            .fences
            .iter()
            .map(|f| endpoint(f.data).with_bearer(bearer.clone()))
            .collect();
        (
            pool.replicas.iter().copied().map(endpoint).collect::<Vec<_>>(),
            fences,
        )
    };
    let probed = probe_round(&replicas, &logic.probe, 0, 0, Duration::ZERO).await;
    let answered = executor::passed(&probed).len();
    let mut samples = Vec::new();
    for router in &logic.routers {
        let auth = format!("Bearer {}", router.token);
        let path = format!("/shapes?policy={LOCAL_POLICY}");
        let headers = [("authorization", auth.as_str())];
        let read = http::exchange(
            router.addr,
            "GET",
            &path,
            &headers,
            bytes::Bytes::new(),
            Duration::from_secs(5),
        );
        if let Ok(answer) = read.await
            && let Ok(sample) = serde_json::from_slice::<ShapeSample>(&answer.body)
        {
            samples.push(sample);
        }
    }
    let mut run = LoadProofRun {
        at_ms: report::to_ms(proof.at),
        pool: pool_name(standby).to_owned(),
        replicas: replicas.len(),
        answered_probe: answered,
        recorded_rate: None,
        replayed_rate: None,
        requests: 0,
        errors: 0,
        ttft_p99_ms: None,
        itl_p99_ms: None,
        proven: None,
        broken: Vec::new(),
        not_run: None,
    };
    match plan_samples(&samples, proof.rate_share, proof.duration) {
        Err(why) => run.not_run = Some(why.to_string()),
        Ok((rate, planned)) => {
            let limits = ReplayLimits {
                timeout: Duration::from_secs(30),
                stall_after: Duration::from_secs(10),
            };
            let replayed = replay(&fences, &planned, Some(&model), limits).await;
            let verdict = load_proof::judge(&replayed, &proof.thresholds);
            if verdict.replayer_behind() {
                run.not_run =
                    Some("the replayer fell behind its plan: its figures measure this machine".to_owned());
            } else {
                lock(&logic.load_proven).push(Input::LoadProof {
                    pool: standby,
                    proven: verdict.proven,
                });
                run.proven = Some(verdict.proven);
            }
            run.recorded_rate = Some(rate);
            run.replayed_rate = verdict.sent_rate;
            run.requests = verdict.requests;
            run.errors = verdict.errors;
            run.ttft_p99_ms = verdict.ttft_p99.map(report::to_ms);
            run.itl_p99_ms = verdict.itl_p99.map(report::to_ms);
            run.broken = verdict.broken;
        }
    }
    lock(&logic.journal).load_proof = Some(run);
}

/// One round's inputs, in the operator's order: the lease as read (or the store unreachable, and
/// nothing else), the pools' checks, their parity, the commands given since the last round, and
/// the tick on which the machine decides; beside them, each pool's replicas that passed.
async fn round_inputs(logic: &Logic) -> (Vec<Input>, [Vec<SocketAddr>; 2]) {
    let lease = match logic.lease.read().await {
        Ok(Some(record)) => Some(record),
        Ok(None) => None,
        Err(_) => {
            let inputs = vec![Input::ControlPlane(ControlPlane::Unreachable), Input::Tick];
            return (inputs, [Vec::new(), Vec::new()]);
        }
    };
    let mut inputs = vec![Input::ControlPlane(ControlPlane::Reachable)];
    if let Some(record) = lease {
        let holder = if record.holder == pool_name(Pool::B) {
            Pool::B
        } else {
            Pool::A
        };
        inputs.push(Input::LeaseObserved {
            holder,
            epoch: record.epoch,
        });
    }
    let (rounds, parity) = tokio::join!(probe_both(logic), parity_of(logic));
    // The standby's check first, as the simulator feeds them: a standby that just became ready
    // is promotable in the round the primary crosses its threshold.
    let standby = lock(&logic.state).standby();
    for pool in [standby, standby.other()] {
        // A probe the replicas rejected as wrong says nothing of the pool: no check this round.
        if let Some(result) = rounds[pool.index()].0 {
            inputs.push(Input::Check { pool, result });
        }
    }
    if let Some(report) = parity {
        inputs.push(Input::Parity {
            holds: report.holds(),
        });
        *lock(&logic.parity) = Some(report);
    }
    inputs.extend(lock(&logic.load_proven).drain(..));
    inputs.extend(lock(&logic.commands).drain(..).map(Input::Command));
    inputs.push(Input::Tick);
    let [(_, a), (_, b)] = rounds;
    (inputs, [a, b])
}

/// The pools' parity: each one's runtime (`/version`, `/v1/models`) read from its first replica,
/// and its serving flags; `None` when either pool cannot be read now (a crashed primary leaves
/// the last report standing).
async fn parity_of(logic: &Logic) -> Option<DriftReport> {
    let first = |pool: Pool| {
        lock(&logic.pools)[pool.index()]
            .replicas
            .first()
            .map(|a| Endpoint::new(a.ip().to_string(), a.port()))
    };
    let (a, b) = (first(Pool::A)?, first(Pool::B)?);
    let timeout = logic.probe.timeout;
    let (a_runtime, b_runtime) = tokio::join!(
        runtime_fingerprint(&a, None, timeout),
        runtime_fingerprint(&b, None, timeout)
    );
    let policy = FlagPolicy::default();
    let mut fingerprints = [a_runtime.ok()?, b_runtime.ok()?];
    // The flags its first running replica was started with: in a rollout, a pool's replicas may
    // run another version than its template names.
    for (fingerprint, pool) in fingerprints.iter_mut().zip([Pool::A, Pool::B]) {
        let argv = {
            let replicas = lock(&logic.replicas);
            let replica = replicas.iter().find(|r| r.pool == pool && r.running())?;
            let mut argv = vec!["serve".to_owned(), logic.probe.model.clone().unwrap_or_default()];
            argv.extend(replica.args.iter().cloned());
            argv
        };
        fingerprint.extend(flags_fingerprint(&argv, &policy));
    }
    Some(fingerprints[0].drift(&fingerprints[1]))
}

/// Drives the pending promotion until a step waits, recording each step.
async fn carry_out(logic: &Logic, start: Instant, mut state: FailoverState) {
    let mut executor = executor_of(logic);
    for _ in 0..=Step::ALL.len() {
        let Some(driven) = drive(
            &state,
            &logic.config,
            || start.elapsed(),
            &logic.shapes,
            logic.deadline,
            &mut executor,
        )
        .await
        else {
            break;
        };
        state = driven.state.clone();
        *lock(&logic.state) = state.clone();
        if let Some(took) = executor.stage.take() {
            let mut journal = lock(&logic.journal);
            journal.stage = Some(journal.stage.unwrap_or_default() + took);
        }
        if let StepOutcome::Done(done) = &driven.outcome {
            if let Some(note) = &done.note {
                lock(&logic.journal).notes.push((driven.step, note.clone()));
            }
            if driven.step == Step::Route {
                note_route(logic, start.elapsed());
            }
        }
        record(logic, start.elapsed(), driven.events.clone());
        if let Some(finished) = &driven.finished {
            // Pool b is the standby again: its warm tier goes back to sleep, once a planned move
            // (no failure started it) has let its streams finish.
            if finished.to == Pool::A && logic.shapes[Pool::B.index()].warm > 0 {
                let drain = if finished.fault_seen_at.is_none() {
                    logic.drain_for
                } else {
                    Duration::ZERO
                };
                *lock(&logic.reshape_at) = start.elapsed().checked_add(drain);
            }
            let mut journal = lock(&logic.journal);
            let notes = std::mem::take(&mut journal.notes);
            let stage = journal.stage.take();
            journal.transitions.push(transition(finished, &notes, stage));
        }
        if !driven.carries_on() {
            break;
        }
    }
}

fn record(logic: &Logic, at: Duration, events: Vec<Event>) {
    let mut journal = lock(&logic.journal);
    for event in events {
        if let Event::PromotionStarted { .. } = event {
            journal.notes.clear();
            journal.stage = None;
        }
        journal.events.push((at, event));
    }
}

/// A finished promotion as the report shows it: each step from the end of the one before.
fn transition(
    promotion: &understudy_core::failover::Promotion,
    notes: &[(Step, String)],
    stage: Option<Duration>,
) -> Transition {
    let mut started = promotion.started_at;
    let steps = promotion
        .done
        .iter()
        .map(|(step, ended)| {
            let span = StepSpan {
                step: format!("{step:?}"),
                started_ms: report::to_ms(started),
                ended_ms: report::to_ms(*ended),
                note: notes
                    .iter()
                    .rev()
                    .find(|(s, _)| s == step)
                    .map(|(_, n)| n.clone()),
            };
            started = *ended;
            span
        })
        .collect();
    let routed = promotion
        .done
        .iter()
        .find(|(step, _)| *step == Step::Route)
        .map(|(_, at)| *at);
    Transition {
        stage_ms: stage.map(report::to_ms),
        orchestration_ms: stage
            .zip(routed)
            .map(|(stage, at)| report::to_ms(at.saturating_sub(promotion.started_at).saturating_sub(stage))),
        kind: promotion.kind.as_str().to_owned(),
        from: pool_name(promotion.from).to_owned(),
        to: pool_name(promotion.to).to_owned(),
        epoch: promotion.epoch.0,
        started_ms: report::to_ms(promotion.started_at),
        steps,
    }
}

/// One round of generating probes of both pools, as each pool's verdict (`None`: the replicas
/// rejected the probe itself) and the replicas that passed. Each pool is judged by the operator's
/// quorum for the role it holds now ([`StandbyShape::round_quorum`]).
async fn probe_both(logic: &Logic) -> [(Option<CheckResult>, Vec<SocketAddr>); 2] {
    let primary = lock(&logic.state).primary;
    let round = |pool: Pool| async move {
        let addrs = lock(&logic.pools)[pool.index()].replicas.clone();
        let endpoints: Vec<Endpoint> = addrs
            .iter()
            .map(|a| Endpoint::new(a.ip().to_string(), a.port()))
            .collect();
        let reports = match logic.probe_kind {
            ProbeKind::Generate => probe_round(&endpoints, &logic.probe, 0, 0, Duration::ZERO).await,
            ProbeKind::Health => health_round(&addrs, logic.probe.timeout).await,
        };
        let quorum = logic.shapes[pool.index()].round_quorum(Role::of(pool == primary));
        let passed = executor::passed(&reports);
        let round = PoolRound {
            pool,
            min_serving: quorum as usize,
            reports,
        };
        (round.verdict(), passed)
    };
    let (a, b) = tokio::join!(round(Pool::A), round(Pool::B));
    [a, b]
}

/// The baseline's round: `GET /health` of each replica, passed on a 200 within `timeout`, as a
/// Kubernetes readiness probe judges it. Nothing is generated, so nothing is checked.
async fn health_round(addrs: &[SocketAddr], timeout: Duration) -> Vec<ProbeReport> {
    let checks = addrs.iter().map(|addr| async move {
        let sent = Instant::now();
        let answer = http::exchange(*addr, "GET", "/health", &[], bytes::Bytes::new(), timeout).await;
        let took = sent.elapsed();
        let outcome = match answer {
            Ok(answer) if answer.status == 200 => ProbeOutcome::Ok {
                first_token: took,
                total: took,
            },
            Ok(answer) => ProbeOutcome::HttpError(answer.status),
            Err(http::ExchangeError::Timeout(_)) => ProbeOutcome::Timeout,
            Err(http::ExchangeError::Connect(_)) => ProbeOutcome::Refused,
            Err(http::ExchangeError::NoAnswer(_)) => ProbeOutcome::Reset,
        };
        ProbeReport {
            endpoint: Endpoint::new(addr.ip().to_string(), addr.port()),
            outcome,
            text: String::new(),
            first_token: None,
            total: Some(took),
        }
    });
    futures::future::join_all(checks).await
}

/// One thing that happens to the system at a scenario time.
#[derive(Clone, Copy, Debug)]
enum Happening {
    /// Fault `i` begins.
    Fault(usize),
    /// Fault `i` ends.
    Heal(usize),
    /// Command `i` is given.
    Command(usize),
}

/// Applies each fault at its time to every replica of its pool (or to the failover logic's
/// lease), ends the ones that last, and queues each command for the failover logic's next round.
async fn apply_faults(
    checked: &Checked,
    logic: &Logic,
    start: Instant,
) -> Result<Vec<AppliedFault>, RunError> {
    let scenario = &checked.scenario;
    let mut schedule: Vec<(Duration, Happening)> = Vec::new();
    for (i, at) in checked.fault_times.iter().enumerate() {
        schedule.push((*at, Happening::Fault(i)));
        if let Some(end) = checked.fault_ends[i] {
            schedule.push((end, Happening::Heal(i)));
        }
    }
    for (i, at) in checked.command_times.iter().enumerate() {
        schedule.push((*at, Happening::Command(i)));
    }
    schedule.sort_by_key(|(at, _)| *at);
    let mut applied = Vec::new();
    // The pool each fault struck, so that its end reaches the same replicas.
    let mut struck = vec![Pool::A; scenario.faults.len()];
    let mut position = vec![None; scenario.faults.len()];
    for (at, happening) in schedule {
        tokio::time::sleep_until(start + at).await;
        match happening {
            Happening::Command(i) => {
                let command = match scenario.commands[i].command {
                    scenario::LocalCommand::Failover => Command::Failover,
                    scenario::LocalCommand::Failback => Command::Failback,
                    scenario::LocalCommand::ForceFailover => Command::ForceFailover,
                };
                lock(&logic.commands).push(command);
            }
            Happening::Fault(i) => {
                let fault = &scenario.faults[i];
                let pool = match fault.pool {
                    Some(PoolName::A) => Pool::A,
                    Some(PoolName::B) => Pool::B,
                    None => lock(&logic.state).primary,
                };
                struck[i] = pool;
                position[i] = Some(applied.len());
                let started = start.elapsed();
                let count = strike(logic, fault.fault, pool).await?;
                // The fault's time is when the last replica went down: a request sent while the
                // others went could still be taken by one, and dies with it as one in flight.
                let at = start.elapsed();
                let struck_what = if fault.fault == FaultKind::LostLease {
                    "the failover logic's lease"
                } else {
                    pool_name(pool)
                };
                applied.push(AppliedFault {
                    started_ms: report::to_ms(started),
                    at_ms: report::to_ms(at),
                    ended_ms: None,
                    fault: fault.fault.as_str().to_owned(),
                    pool: struck_what.to_owned(),
                    replicas: count,
                });
            }
            Happening::Heal(i) => {
                heal(logic, scenario.faults[i].fault, struck[i]).await?;
                let ended = report::to_ms(start.elapsed());
                if let Some(fault) = position[i].and_then(|p| applied.get_mut(p)) {
                    fault.ended_ms = Some(ended);
                }
            }
        }
    }
    Ok(applied)
}

/// Puts `kind` on every replica of `pool` (or on the logic's lease); how many it struck.
async fn strike(logic: &Logic, kind: FaultKind, pool: Pool) -> Result<usize, RunError> {
    if kind == FaultKind::LostLease {
        logic.lease.cut_off(true);
        return Ok(0);
    }
    if kind == FaultKind::Partition {
        logic.system.links.cut(pool, true);
        return Ok(lock(&logic.pools)[pool.index()].replicas.len());
    }
    let mut count = 0;
    if let Some(text) = kind.emulator_fault() {
        let targets = controls_of(logic, pool);
        for control in &targets {
            inject(*control, text).await?;
        }
        count += targets.len();
    }
    for replica in lock(&logic.replicas).iter_mut().filter(|r| r.pool == pool) {
        match kind {
            FaultKind::Hang => replica.hang(),
            FaultKind::Crash => replica.crash(),
            // A real vLLM server's engine hangs when its worker stops; the scenario's check
            // lets no other emulator fault reach a real server.
            FaultKind::HangEngine if replica.engine == Engine::Vllm => replica.signal_worker("-STOP"),
            _ => continue,
        }
        .map_err(|e| RunError::Fault(e.to_string()))?;
        count += 1;
    }
    Ok(count)
}

/// Ends `kind` on `pool`: a hung replica continues, an emulator fault is cleared, the lease is
/// given back.
async fn heal(logic: &Logic, kind: FaultKind, pool: Pool) -> Result<(), RunError> {
    match kind {
        FaultKind::LostLease => logic.lease.cut_off(false),
        FaultKind::Partition => logic.system.links.cut(pool, false),
        FaultKind::Hang => {
            for replica in lock(&logic.replicas).iter_mut().filter(|r| r.pool == pool) {
                replica.resume().map_err(|e| RunError::Fault(e.to_string()))?;
            }
        }
        FaultKind::Crash => {}
        FaultKind::HangEngine => {
            // A real server's worker continues; an emulated engine's fault is cleared below.
            for replica in lock(&logic.replicas)
                .iter_mut()
                .filter(|r| r.pool == pool && r.engine == Engine::Vllm)
            {
                replica
                    .signal_worker("-CONT")
                    .map_err(|e| RunError::Fault(e.to_string()))?;
            }
        }
        _ => {}
    }
    if kind.emulator_fault().is_some() {
        for control in controls_of(logic, pool) {
            inject(control, "clear").await?;
        }
    }
    Ok(())
}

fn controls_of(logic: &Logic, pool: Pool) -> Vec<SocketAddr> {
    lock(&logic.replicas)
        .iter()
        .filter(|r| r.pool == pool)
        .filter_map(|r| r.control)
        .collect()
}

/// Keeps the peak of the resident memory of this process, its replicas, routers and fences, in KiB.
async fn sample_memory(logic: Arc<Logic>, peak: Arc<AtomicU64>) {
    let mut ticks = tokio::time::interval(Duration::from_millis(500));
    loop {
        ticks.tick().await;
        let replicas: u64 = {
            let replicas = lock(&logic.replicas);
            // `/proc` is read once a tick, and only when a real server has processes below it.
            let table = if replicas.iter().any(|r| r.engine == Engine::Vllm) {
                vllm::ProcessTable::read()
            } else {
                vllm::ProcessTable::default()
            };
            replicas
                .iter()
                .map(|r| replicas::replica_resident_kib(r, &table))
                .sum()
        };
        let total: u64 = std::iter::once(std::process::id())
            .chain(logic.system.pids())
            .filter_map(replicas::resident_kib)
            .sum::<u64>()
            + replicas;
        peak.fetch_max(total, Ordering::Relaxed);
    }
}

/// Injects an emulator fault through a replica's control port.
async fn inject(control: SocketAddr, fault: &str) -> Result<(), RunError> {
    let body = bytes::Bytes::copy_from_slice(fault.as_bytes());
    match http::exchange(control, "POST", "/faults", &[], body, Duration::from_secs(5)).await {
        Ok(answer) if answer.status < 300 => Ok(()),
        Ok(answer) => Err(RunError::Fault(format!(
            "{control}: POST /faults answered {}",
            answer.status
        ))),
        Err(error) => Err(RunError::Fault(format!("{control}: POST /faults: {error}"))),
    }
}

/// A router's retries and moves, from its own counters (`GET /metrics` on its admin port); none when it
/// cannot be read.
async fn router_counts(router: &RouterAdmin) -> RouterCounts {
    let answer = http::exchange(
        router.addr,
        "GET",
        "/metrics",
        &[],
        bytes::Bytes::new(),
        Duration::from_secs(5),
    )
    .await;
    let Ok(answer) = answer else {
        return RouterCounts::default();
    };
    let text = String::from_utf8_lossy(&answer.body);
    let counter = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0)
    };
    RouterCounts {
        retried: counter("understudy_router_retries_total"),
        moved: counter("understudy_router_requests_moved_total"),
    }
}

/// A status line: elapsed, requests by outcome, primary, epoch, phase.
async fn show_progress(
    logic: Arc<Logic>,
    records: Arc<Mutex<Vec<RequestRecord>>>,
    start: Instant,
    duration: Duration,
    progress: Progress,
    mut stopped: watch::Receiver<bool>,
) {
    if progress == Progress::Quiet {
        return;
    }
    let mut ticks = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stopped.changed() => return,
        }
        let counts = report::count(&lock(&records), RouterCounts::default());
        let state = lock(&logic.state).clone();
        let phase = match &state.phase {
            Phase::Promoting(p) => format!("promoting to {} ({:?})", pool_name(p.to), p.step),
            other => format!("{other:?}").to_lowercase(),
        };
        let line = format!(
            "{:>5.1}s/{}s  ok {}  failed {}  shed {}  primary {}  epoch {}  {}",
            start.elapsed().as_secs_f64(),
            duration.as_secs(),
            counts.ok,
            counts.failed,
            counts.shed,
            pool_name(state.primary),
            state.epoch,
            phase
        );
        let mut err = std::io::stderr().lock();
        let _ = match progress {
            Progress::Terminal => write!(err, "\r\x1b[2K{line}"),
            _ => writeln!(err, "{line}"),
        };
        let _ = err.flush();
    }
}

/// When the policy predicts the first fault is acted on: the promotion starts on the round that
/// crosses its threshold (hard for refusals, soft for timeouts, each taking the probe timeout).
/// The first failing round is the first whose probe had not been answered when the fault struck:
/// it starts at most one interval after the fault, and at the earliest one probe's time before it,
/// which is below the timeout.
fn predicted_detection(checked: &Checked, kind: FaultKind) -> [f64; 2] {
    let policy = &checked.scenario.policy;
    let (interval, timeout) = (checked.interval, checked.timeout);
    let rounds = if kind.is_hard() {
        policy.hard_promote_after.min(policy.promote_after)
    } else {
        policy.promote_after
    };
    // A hung or slowed replica's probe takes its whole timeout to fail; the others fail at once.
    let probe = match kind {
        FaultKind::Hang | FaultKind::HangEngine | FaultKind::Slow | FaultKind::Partition => timeout,
        _ => Duration::ZERO,
    };
    let low = (interval * rounds.saturating_sub(1) + probe).saturating_sub(timeout);
    let high = interval * rounds + probe;
    [report::to_ms(low), report::to_ms(high)]
}

/// What held the failover logic back, each time it changed: a promotion blocked or a command
/// refused (with the reason), the lease's store lost and found.
fn held_back(events: &[(Duration, Event)]) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut last = None;
    for (at, event) in events {
        let line = match event {
            Event::PromotionBlocked { reason } => format!("promotion blocked: {reason:?}"),
            Event::CommandRefused { command, reason } => format!("{command:?} refused: {reason:?}"),
            Event::ControlPlaneUnreachable => "the lease's store is unreachable: control paused".to_owned(),
            Event::ControlPlaneRestored => "the lease's store is back".to_owned(),
            _ => continue,
        };
        if last.as_ref() != Some(&line) {
            lines.push(format!("{:.0} ms: {line}", report::to_ms(*at)));
            last = Some(line);
        }
    }
    lines
}

/// For each partition, how its pool's fences stopped, from what they answered the watch.
fn self_fences(
    faults: &[AppliedFault],
    standings: &[Standing],
    ttl: Duration,
    ended: Duration,
) -> Vec<SelfFence> {
    let partitions = faults.iter().filter(|f| f.fault == FaultKind::Partition.as_str());
    partitions
        .filter_map(|fault| {
            let pool = match fault.pool.as_str() {
                "a" => Pool::A,
                "b" => Pool::B,
                _ => return None,
            };
            let from = Duration::from_secs_f64(fault.at_ms / 1e3);
            let to = fault
                .ended_ms
                .map_or(ended, |ms| Duration::from_secs_f64(ms / 1e3));
            let mut fences: Vec<SocketAddr> = standings
                .iter()
                .filter(|s| s.pool == pool)
                .map(|s| s.fence)
                .collect();
            fences.sort();
            fences.dedup();
            let (mut serving, mut stopped, mut served_again) = (0, Some(Duration::ZERO), 0);
            for fence in fences {
                let mine: Vec<&Standing> = standings.iter().filter(|s| s.fence == fence).collect();
                let at_cut = mine.iter().rev().find(|s| s.at <= from);
                let Some(at_cut) = at_cut.filter(|s| s.standing.serves()) else {
                    continue;
                };
                serving += 1;
                let during = mine.iter().filter(|s| s.at > from && s.at <= to);
                let stop = during.clone().find(|s| !s.standing.serves());
                stopped = match (stopped, stop) {
                    (Some(latest), Some(stop)) => Some(latest.max(stop.at - from)),
                    _ => None,
                };
                if let Some(stop) = stop {
                    served_again += usize::from(
                        during
                            .filter(|s| s.at > stop.at)
                            .any(|s| s.standing.serves() && s.epoch <= at_cut.epoch),
                    );
                }
            }
            Some(SelfFence {
                pool: fault.pool.clone(),
                fault_at_ms: fault.at_ms,
                lasted_ms: report::to_ms(to.saturating_sub(from)),
                fences: serving,
                stopped_after_ms: stopped.filter(|_| serving > 0).map(report::to_ms),
                bound_ms: report::to_ms(ttl),
                served_again,
            })
        })
        .collect()
}

/// The run's report: what the clients saw, what the failover logic did, and the verdict on the
/// scenario's expectations.
fn build_report(
    checked: &Checked,
    logic: &Logic,
    records: &[RequestRecord],
    faults: Vec<AppliedFault>,
    routed_by: RouterCounts,
    ended: Duration,
    interrupted: bool,
) -> RunReport {
    let scenario = &checked.scenario;
    let journal = lock(&logic.journal);
    // The first fault that strikes replicas is the one detection, the gap and the stall are
    // counted from; a lost lease store strikes none.
    let first = faults.iter().find(|f| f.replicas > 0);
    let first_kind = scenario
        .faults
        .iter()
        .find(|f| f.fault != FaultKind::LostLease)
        .map(|f| f.fault);
    let fault_at = first.map(|f| Duration::from_secs_f64(f.at_ms / 1e3));
    let started = promotion_started(&journal.events, fault_at);
    let routed = first_routed(&journal.transitions);
    let requests = report::count(records, routed_by);
    let in_flight = failed_in_flight(records, fault_at);
    let ok_after_fault = fault_at.map(|at| {
        records
            .iter()
            .filter(|r| r.outcome == RequestOutcome::Ok && r.sent >= at)
            .count() as u64
    });
    let ttft_interactive = report::ttft(records, Some(Priority::Interactive), fault_at, routed, ended);
    let (mut passed, mut reasons) = judge(
        &scenario.expect,
        journal.transitions.len() as u32,
        &requests,
        (in_flight, ok_after_fault),
        &ttft_interactive,
    );
    if let Some(expected) = scenario.expect.load_proven {
        let proven = journal.load_proof.as_ref().and_then(|p| p.proven);
        let holds = proven == Some(expected);
        passed &= holds;
        let said = |p: Option<bool>| match p {
            Some(true) => "proven",
            Some(false) => "failed",
            None => "not run",
        };
        reasons.push(format!(
            "the standby's load proof {}, {} expected{}",
            said(proven),
            said(Some(expected)),
            if holds { "" } else { ": FAILED" }
        ));
    }
    let rollout = logic.rollout.as_ref().map(Rollout::run);
    if let (Some(expected), Some(run)) = (scenario.expect.rollout, &rollout) {
        let (holds, line) = judge_rollout(expected, run);
        passed &= holds;
        reasons.push(format!("{line}{}", if holds { "" } else { ": FAILED" }));
    }
    let self_fence = self_fences(&faults, &journal.standings, checked.grant.ttl, ended);
    for cut in &self_fence {
        if cut.served_again > 0 {
            passed = false;
            reasons.push(format!(
                "{} of {}'s fences served again at the epoch they had stopped at, still cut off",
                cut.served_again, cut.pool
            ));
        }
        if cut.fences > 0 && cut.stopped_after_ms.is_none() && cut.lasted_ms > cut.bound_ms {
            passed = false;
            reasons.push(format!(
                "{}'s fences served on through a partition longer than their grant",
                cut.pool
            ));
        }
    }
    let verdict = match (interrupted, passed) {
        (true, _) => Verdict::Interrupted,
        (false, true) => Verdict::Passed,
        (false, false) => Verdict::Failed,
    };
    RunReport {
        name: scenario.name.clone(),
        seed: 0,
        topology: match scenario.topology {
            Topology::ActivePassive => "active-passive",
            Topology::ActiveActive => "active-active",
        }
        .to_owned(),
        duration_ms: report::to_ms(ended),
        failed_before_reaching_a_replica: records
            .iter()
            .filter(|r| r.outcome == RequestOutcome::Failed && r.never_reached_a_replica)
            .count() as u64,
        failures: report::failures(records),
        shed_by_priority: report::shed_by_priority(records),
        failed_in_flight_at_fault: in_flight,
        requests,
        gap_ms: first
            .and_then(|f| report::gap(records, Duration::from_secs_f64(f.started_ms / 1e3)))
            .map(report::to_ms),
        detection_ms: fault_at
            .zip(started)
            .map(|(fault, start)| report::to_ms(start.saturating_sub(fault))),
        predicted_detection_ms: first_kind
            .filter(|_| scenario.topology == Topology::ActivePassive)
            .map(|kind| predicted_detection(checked, kind)),
        stall_ms: first
            .map(|f| {
                report::stall(
                    records,
                    Duration::from_secs_f64(f.started_ms / 1e3),
                    checked.duration,
                )
            })
            .map(report::to_ms),
        latency_ms: report::latency(records, fault_at, checked.duration),
        ttft_ms: report::ttft(records, None, fault_at, routed, ended),
        ttft_interactive_ms: ttft_interactive,
        held_back: held_back(&journal.events),
        parity: lock(&logic.parity).clone(),
        load_proof: journal.load_proof.clone(),
        rollout,
        faults,
        transitions: journal.transitions.clone(),
        routes: journal.routes.clone(),
        standby_shaped: journal.standby_shaped.clone(),
        grants: journal.grants.clone(),
        self_fence,
        fence_standings: journal
            .standings
            .iter()
            .map(|s| report::FenceStanding {
                at_ms: u64::try_from(s.at.as_millis()).unwrap_or(u64::MAX),
                pool: pool_name(s.pool).to_owned(),
                fence: s.fence.to_string(),
                standing: serde_json::to_value(s.standing)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                epoch: s.epoch.map(|e| e.0),
            })
            .collect(),
        cold_starts: lock(&logic.cold_starts).clone(),
        verdict,
        verdict_reasons: reasons,
        not_measured: vec![
            "a warm promotion times each replica's wake, not the stages inside it; a pilot light's \
             stages start at its process (no node, image or container-start stages here)"
                .to_owned(),
            "answers that are wrong but look fine are counted ok: the load does not check what it gets"
                .to_owned(),
        ]
        .into_iter()
        .chain(checked.rollout.is_some().then(|| {
            "a rollout replaces each replica in place and starts it at once: no pod scheduling, \
             image pull or cold start, and no surge replica beside it"
                .to_owned()
        }))
        .collect(),
        memory_peak_mib: None,
        scheduling_lag: lag::SchedulingLag::default(),
        records: Vec::new(),
    }
}

/// Whether `run` ended in the `expected` phase and kept its promise on the way: a stopped rollout
/// replaced none of the primary's replicas; one that ended up to date replaced the primary's only
/// after every replica of the standby, and only once the decision let the primary roll.
fn judge_rollout(expected: RolloutPhase, run: &RolloutRun) -> (bool, String) {
    let Some(last) = run.last_phase() else {
        return (
            false,
            format!("the rollout came to no phase, {expected:?} expected"),
        );
    };
    let primary = last.pool.as_str();
    let standby = if primary == pool_name(Pool::A) {
        pool_name(Pool::B)
    } else {
        pool_name(Pool::A)
    };
    let (on_primary, on_standby) = (run.replaced_in(primary), run.replaced_in(standby));
    let failed: Vec<&str> = run
        .replaced
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.replica.as_str())
        .collect();
    if !failed.is_empty() {
        return (
            false,
            format!("the rollout could not replace {}", failed.join(", ")),
        );
    }
    let mut line = format!(
        "the rollout ended {:?} ({expected:?} expected); {} of the standby's and {} of the primary's replicas replaced",
        last.phase,
        on_standby.len(),
        on_primary.len()
    );
    let mut holds = last.phase == expected;
    match expected {
        RolloutPhase::Stopped => holds &= on_primary.is_empty(),
        _ => {
            let let_go = run
                .phases
                .iter()
                .find(|p| p.phase == RolloutPhase::Rolling && p.pool == primary)
                .map(|p| p.at_ms);
            let standby_done = on_standby.iter().map(|r| r.at_ms + r.took_ms).fold(0.0, f64::max);
            let first_primary = on_primary.iter().map(|r| r.at_ms).fold(f64::INFINITY, f64::min);
            if let Some(let_go) = let_go {
                line.push_str(&format!(
                    "; the primary let go at {let_go:.0} ms, its first replica replaced at {first_primary:.0} ms, \
                     the standby's last ready at {standby_done:.0} ms"
                ));
            }
            holds &= !on_standby.is_empty()
                && !on_primary.is_empty()
                && let_go.is_some_and(|at| first_primary >= at && first_primary >= standby_done);
        }
    }
    (holds, line)
}

/// When the first promotion at or after the fault started.
fn promotion_started(events: &[(Duration, Event)], fault_at: Option<Duration>) -> Option<Duration> {
    events
        .iter()
        .find(|(at, e)| matches!(e, Event::PromotionStarted { .. }) && fault_at.is_some_and(|f| *at >= f))
        .map(|(at, _)| *at)
}

/// When the first promotion's route was pushed.
fn first_routed(transitions: &[Transition]) -> Option<Duration> {
    transitions.first().and_then(|t| {
        t.steps
            .iter()
            .find(|s| s.step == "Route")
            .map(|s| Duration::from_secs_f64(s.ended_ms / 1e3))
    })
}

/// How many of the requests that failed were sent before the fault: in flight when it struck.
fn failed_in_flight(records: &[RequestRecord], fault_at: Option<Duration>) -> u64 {
    fault_at.map_or(0, |at| {
        records
            .iter()
            .filter(|r| r.outcome == RequestOutcome::Failed && r.sent < at)
            .count() as u64
    })
}

/// Judges the scenario's expectations against what the run measured: whether every one held,
/// and a line for each.
fn judge(
    expect: &scenario::Expect,
    finished: u32,
    requests: &report::Requests,
    (in_flight, ok_after_fault): (u64, Option<u64>),
    ttft_interactive: &report::Ttft,
) -> (bool, Vec<String>) {
    let mut reasons = Vec::new();
    let mut passed = true;
    if let Some(expected) = expect.failovers {
        let holds = finished == expected;
        passed &= holds;
        reasons.push(format!(
            "{} promotion(s) finished, {expected} expected{}",
            finished,
            if holds { "" } else { ": FAILED" }
        ));
    }
    if let Some(most) = expect.max_failed_sent_after_fault {
        let after = requests.failed - in_flight;
        let holds = after <= most;
        passed &= holds;
        reasons.push(format!(
            "{after} request(s) sent after the fault failed, at most {most} allowed{}",
            if holds { "" } else { ": FAILED" }
        ));
    }
    if let Some(most) = expect.max_failed {
        let holds = requests.failed <= most;
        passed &= holds;
        reasons.push(format!(
            "{} request(s) failed, at most {most} allowed{}",
            requests.failed,
            if holds { "" } else { ": FAILED" }
        ));
    }
    if let Some(most) = expect.max_ok_sent_after_fault {
        let (holds, line) = match ok_after_fault {
            Some(ok) => (
                ok <= most,
                format!(
                    "{ok} request(s) sent after the fault succeeded, at most {most} expected of this baseline"
                ),
            ),
            None => (
                false,
                "no fault struck a replica, so nothing was sent after one".to_owned(),
            ),
        };
        passed &= holds;
        reasons.push(format!("{line}{}", if holds { "" } else { ": FAILED" }));
    }
    if let Some(least) = expect.min_failed {
        let holds = requests.failed >= least;
        passed &= holds;
        reasons.push(format!(
            "{} request(s) failed, at least {least} expected of this baseline{}",
            requests.failed,
            if holds { "" } else { ": FAILED" }
        ));
    }
    if let Some(ratio) = expect.interactive_storm_ttft_within {
        let (holds, line) = match (ttft_interactive.storm_p99, ttft_interactive.steady_p99) {
            (Some(storm), Some(steady)) => (
                storm <= ratio * steady,
                format!(
                    "interactive p99 time to first token in the storm {storm:.0} ms, {:.2}x its steady {steady:.0} ms, at most {ratio}x allowed",
                    storm / steady
                ),
            ),
            _ => (
                false,
                "no interactive request succeeded before the fault or in the storm, so the storm could not be judged"
                    .to_owned(),
            ),
        };
        passed &= holds;
        reasons.push(format!("{line}{}", if holds { "" } else { ": FAILED" }));
    }
    (passed, reasons)
}

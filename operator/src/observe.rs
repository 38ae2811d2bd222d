//! Generating probes of both pools of every FailoverPolicy the controller runs, turned into the
//! check observations its failover state machine consumes.
//!
//! The reconciler [`track`](ObservationSource::track)s each policy it runs;
//! [`ProbingObservations::run`], spawned beside the controller, probes both pools of every
//! tracked policy once per `spec.probe.interval` with the prober library, and keeps one
//! [`Observation::Check`] per pool and round until the next reconcile drains them. Each round
//! also compares the pools ([`crate::parity`]: an [`Observation::Parity`] and `status.parity`),
//! reads the routers' passive signals when it has routers, and the GPU agents' verdicts when it
//! has agents ([`crate::gpu_health`]: a pool whose replicas on healthy GPUs are too few fails
//! hard). A pool's replicas come from a [`ReplicaEndpoints`]: the pods of its workload
//! ([`KubeReplicas`]), or a fixed list ([`FixedReplicas`]) where there is no cluster.
//!
//! This module must never block the reconciler (tracking and draining take a short lock on a
//! map; probes run on their own tasks), never decide failover (the state machine does), and
//! never turn "the API server could not be asked" into a failed check: a pool whose pods cannot
//! be listed gets no check that round, while a pool with no running replica fails hard.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt, Shared, join, join_all, join3};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use understudy_core::Pool;
use understudy_core::failover::{CheckResult, Observation, PassiveSignal};
use understudy_core::quorum::Role;
use understudy_prober::outcome::ProbeOutcome;
use understudy_prober::parity::Fingerprint;
use understudy_prober::parity::flags::FlagPolicy;
use understudy_prober::parity::model::weight_bytes;
use understudy_prober::probe::{self, Endpoint, Expectation, ProbeReport, ProbeSpec};
use understudy_prober::report::PoolRound;
use understudy_prober::sleep::sleep_level;

use crate::crd::{
    ExpectMode, FailoverPolicy, GoldenAnswer, ModelFilesRecord, ParityStatus, RolloutMode, Tier,
};
use crate::gpu_health::{self, AgentsByNode, GpuAgents};
use crate::judge::{Judge, judge, probe_spec};
use crate::parity::{self, ServingConfig};
use crate::peers::{PolicyClusters, Routers};
use crate::policy::{self, ProbeTiming, pool_by_name};
use crate::ports::ReplicaEndpoints;
use crate::ports::{ObservationSource, ProbeFindings};
use crate::router_admin::{RouterToken, get_signals, policy_key};
use crate::standby::HostRoom;

pub use understudy_prober::probe::GOLDEN_PREFIX_CHARS;

/// The most observations kept for one policy between two reconciles; the oldest go first. A
/// reconciler that stopped draining must not grow the operator's memory without bound.
const MAX_PENDING: usize = 64;

/// The most a round is spread over by default, whatever the interval.
const DEFAULT_MAX_JITTER: Duration = Duration::from_secs(5);

/// The pool that holds the primary role as the policy's status last said; the home pool (A) for
/// a policy that has no status yet.
#[must_use]
pub fn primary_pool(policy: &FailoverPolicy) -> Pool {
    policy
        .status
        .as_ref()
        .and_then(|status| status.primary_pool.as_deref())
        .and_then(|name| pool_by_name(&policy.spec, name))
        .unwrap_or(Pool::A)
}

/// Whether the primary now serves another model than the one `golden` was recorded from. A model
/// that cannot be told, then or now, is not a change.
fn model_changed(golden: &GoldenAnswer, serving: Option<&str>) -> bool {
    matches!((golden.model.as_deref(), serving), (Some(then), Some(now)) if then != now)
}

/// What a round learned about the golden answer.
#[derive(Debug)]
struct GoldenUpdate {
    /// The golden answer the round found (`None`: there was none); the update applies only if
    /// it is still the one kept.
    replaces: Option<GoldenAnswer>,
    /// The golden answer to keep instead: `None` drops it.
    new: Option<GoldenAnswer>,
}

/// A pool's serving configuration as a round read it; `Err` says why there is none.
type Config = Result<ServingConfig, String>;

/// Whether the golden answer is recorded from the primary: `expect` in prefix mode with no value.
fn records_golden(spec: &crate::crd::FailoverPolicySpec) -> bool {
    spec.probe.expect.mode == ExpectMode::Prefix && spec.probe.expect.value.is_none()
}

/// Whether the primary's serving template is held until the standby has passed on it.
fn standby_first(spec: &crate::crd::FailoverPolicySpec) -> bool {
    spec.rollout == RolloutMode::StandbyFirst
}

/// Whether the standby is judged apart from the golden answer (non-empty only): in a
/// standby-first rollout, while it serves another model than the golden answer is recorded from
/// (`golden`, else the primary's `serving` model), which the primary is set to serve next. Its
/// answer on the new model is not the old one's; the golden answer is recorded again from the
/// primary once it has rolled.
fn judged_apart(
    spec: &crate::crd::FailoverPolicySpec,
    golden: Option<&GoldenAnswer>,
    serving: Option<&str>,
    standby: Option<&Config>,
) -> bool {
    let reference = golden.and_then(|g| g.model.as_deref()).or(serving);
    let standby = standby.and_then(|config| config.as_ref().ok()?.model());
    standby_first(spec)
        && records_golden(spec)
        && matches!((reference, standby.as_deref()), (Some(then), Some(now)) if then != now)
}

/// One tracked policy.
#[derive(Debug)]
struct Tracked {
    policy: Arc<FailoverPolicy>,
    timing: ProbeTiming,
    pending: VecDeque<Observation>,
    golden: Option<GoldenAnswer>,
    /// Whether the replicas took the last round's probe, or why not.
    probe_accepted: Option<Result<(), String>>,
    /// The last comparison of the pools.
    parity: Option<ParityStatus>,
    /// Each pool's model files as last read, by [`Pool::index`].
    model_files: [Option<ModelFilesRead>; 2],
    /// Each pool's replicas (`host:port`) that have passed a generating probe and still run, by
    /// [`Pool::index`]; `None` before the pool's first round.
    passed: [Option<BTreeSet<String>>; 2],
    /// Each pool's replicas that said they were asleep in its last round.
    asleep: [Vec<Endpoint>; 2],
    /// The level each of those sleeps at.
    asleep_levels: [Vec<Option<u8>>; 2],
    /// Host memory for each pool's level-1 sleepers, as its last round read the nodes.
    host_room: [HostRoom; 2],
    rounds: u64,
    next_round: Instant,
    in_flight: bool,
}

/// What one round found.
#[derive(Debug, Default)]
struct RoundResult {
    checks: Vec<Observation>,
    /// Each pool probed this round: its replicas, and each one's outcome.
    probed: Vec<(Pool, Vec<ProbeReport>)>,
    golden: Option<GoldenUpdate>,
    accepted: Option<Result<(), String>>,
    parity: Option<ParityStatus>,
    /// Each pool's model files read this round, by [`Pool::index`].
    model_files: [Option<ModelFilesRead>; 2],
    /// The level each of the standby's replicas that slept in the last round sleeps at.
    asleep_levels: Vec<(Pool, Vec<Option<u8>>)>,
    /// The standby's host memory for level-1 sleepers.
    host_room: Option<(Pool, HostRoom)>,
}

/// What a round needs, copied out of the map so that no lock is held while probing.
#[derive(Debug)]
struct RoundPlan {
    namespace: String,
    policy: Arc<FailoverPolicy>,
    timing: ProbeTiming,
    golden: Option<GoldenAnswer>,
    model_files: [Option<ModelFilesRead>; 2],
    /// Each pool's replicas that said they were asleep in the last round.
    asleep: [Vec<Endpoint>; 2],
    round: u64,
    seed: u64,
}

/// A pool's model files as a round read them, and the model its template named then. Model
/// files change only with a new model, so a pool whose files cannot be read (its node lost, its
/// agent down) is compared by its last reading while its template names the same model: a
/// standby that drifted stays drifted when the primary's node goes, which is when it matters.
///
/// An operator that restarts has each pool's last reading from `status.parity.modelFiles` by its
/// digest alone: a pool compared by its digest is compared with the other by theirs.
#[derive(Clone, Debug)]
struct ModelFilesRead {
    /// Its keys, `None` when only its digest is known.
    fingerprint: Option<Fingerprint>,
    /// Over the keys `allowDrift` does not let differ ([`parity::blocking_digest`]).
    digest: String,
    /// The depth it was read at (`cache`, `headers`, `full`): another depth's reading is not
    /// this one's.
    depth: String,
    model: String,
    read_at: String,
}

/// Each pool's model files as `policy`'s status last recorded them, by [`Pool::index`].
fn recorded_model_files(policy: &FailoverPolicy) -> [Option<ModelFilesRead>; 2] {
    let records = policy
        .status
        .as_ref()
        .and_then(|status| status.parity.as_ref())
        .map(|parity| parity.model_files.as_slice())
        .unwrap_or_default();
    [Pool::A, Pool::B].map(|pool| {
        let name = &policy.spec.pools.get(pool.index())?.name;
        let record = records.iter().find(|record| record.pool == *name)?;
        Some(ModelFilesRead {
            fingerprint: None,
            digest: record.digest.clone(),
            depth: record.depth.clone(),
            model: record.model.clone(),
            read_at: record.read_at.clone(),
        })
    })
}

/// The GPU agents as one round reads them, once, for all that uses them.
type RoundAgents<'a> = Shared<BoxFuture<'a, Option<Arc<AgentsByNode>>>>;

/// The most directories of one pool whose model files a round reads: one per node and model
/// directory its replicas run on.
const MAX_MODEL_PLACES: usize = 16;

/// The observation source of the running operator: generating probes of both pools of every
/// tracked policy, once per probe interval.
///
/// Golden answer: when `spec.probe.expect` is in prefix mode without a value, the first passing
/// answer of the pool that is primary then is recorded (its first [`GOLDEN_PREFIX_CHARS`]
/// characters) and every later answer of either pool must start with it. Until then answers are
/// judged non-empty. The controller writes it to `status.goldenAnswer` ([`Self::golden_answer`]),
/// and a policy tracked for the first time starts from the one its status holds, so a restarted
/// or newly elected operator judges by the recorded answer. A change of prompt or `maxTokens`
/// discards it, and so does a primary whose workload is rolled out to serve another model than
/// the one it was recorded from; it is then recorded again.
#[derive(Debug)]
pub struct ProbingObservations {
    replicas: Arc<dyn ReplicaEndpoints>,
    policies: Mutex<HashMap<ObjectRef<FailoverPolicy>, Tracked>>,
    /// When each replica (`host:port`) first answered a probe right, for the cold starts of new
    /// replicas; forgotten after [`FIRST_ANSWER_KEPT`].
    first_answers: Mutex<HashMap<String, Timestamp>>,
    /// The routers whose `/signals` are read every round, and their admin token.
    router_signals: Option<(Routers, RouterToken)>,
    /// The node agents whose GPU verdicts are read every round.
    gpu_agents: Option<GpuAgents>,
    /// Wakes [`Self::run`] when a policy is tracked for the first time or a round finishes.
    changed: Notify,
    max_jitter: Duration,
    /// Where a round that needs the state machine now names its policy, once
    /// [`Self::urgent_rounds`] was asked for.
    urgent: Mutex<Option<mpsc::UnboundedSender<ObjectRef<FailoverPolicy>>>>,
}

impl ProbingObservations {
    #[must_use]
    pub fn new(replicas: Arc<dyn ReplicaEndpoints>) -> Self {
        ProbingObservations {
            replicas,
            policies: Mutex::new(HashMap::new()),
            first_answers: Mutex::new(HashMap::new()),
            router_signals: None,
            gpu_agents: None,
            changed: Notify::new(),
            max_jitter: DEFAULT_MAX_JITTER,
            urgent: Mutex::new(None),
        }
    }

    /// The policies whose round just found what the state machine must act on without waiting
    /// for the policy's next reconcile: the primary not passing, a signal from the routers, or a
    /// policy that is suspect or promoting. The controller reconciles each
    /// at once ([`crate::controller::run`]); otherwise a failed round would wait up to a whole
    /// probe interval for the requeue, which runs at a phase of its own. A round of passes waits
    /// for it. A second call takes the stream from the first.
    pub fn urgent_rounds(&self) -> impl futures::Stream<Item = ObjectRef<FailoverPolicy>> + Send + 'static {
        let (send, receive) = mpsc::unbounded_channel();
        *self.urgent.lock().unwrap_or_else(PoisonError::into_inner) = Some(send);
        futures::stream::unfold(receive, |mut receive| async move {
            receive.recv().await.map(|policy| (policy, receive))
        })
    }

    /// Reads every node agent's GPU verdicts each round: a pool whose replicas on healthy GPUs
    /// are too few fails hard ([`crate::gpu_health`]).
    #[must_use]
    pub fn with_gpu_agents(mut self, agents: GpuAgents) -> Self {
        self.gpu_agents = Some(agents);
        self
    }

    /// Reads every router's `/signals` each round, beside the probes: what the data path saw of
    /// the primary becomes a passive observation ([`passive_signal`]).
    #[must_use]
    pub fn with_router_signals(mut self, routers: Routers, token: RouterToken) -> Self {
        self.router_signals = Some((routers, token));
        self
    }

    /// Spread each round over at most `max` (zero probes every replica at once). The spread is
    /// also kept under a quarter of the interval and under what the interval leaves after the
    /// timeout, so that a round ends before the next is due.
    #[must_use]
    pub fn with_max_jitter(mut self, max: Duration) -> Self {
        self.max_jitter = max;
        self
    }

    fn policies(&self) -> MutexGuard<'_, HashMap<ObjectRef<FailoverPolicy>, Tracked>> {
        // A poisoned map holds nothing half-written that matters more than probing on.
        self.policies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The policies tracked now.
    #[must_use]
    pub fn tracked(&self) -> Vec<ObjectRef<FailoverPolicy>> {
        self.policies().keys().cloned().collect()
    }

    /// Probes every tracked policy once per its interval, until dropped. Rounds run on their own
    /// tasks, one at a time per policy: a round still under way when the next is due is not
    /// doubled, the next one starts when it is due after that.
    pub async fn run(self: Arc<Self>) {
        let mut rounds = JoinSet::new();
        loop {
            while rounds.try_join_next().is_some() {}
            let now = Instant::now();
            let mut due = Vec::new();
            let mut wake_at: Option<Instant> = None;
            for (key, tracked) in self.policies().iter_mut() {
                if tracked.in_flight {
                    continue;
                }
                if tracked.next_round <= now {
                    tracked.in_flight = true;
                    tracked.next_round = now + tracked.timing.interval;
                    due.push(key.clone());
                }
                wake_at = Some(wake_at.map_or(tracked.next_round, |at| at.min(tracked.next_round)));
            }
            for key in due {
                let this = self.clone();
                rounds.spawn(async move {
                    this.probe_now(&key).await;
                });
            }
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => {}
                        () = self.changed.notified() => {}
                    }
                }
                None => self.changed.notified().await,
            }
        }
    }

    /// Probes both pools of `policy` once now and keeps the checks for [`ObservationSource::drain`];
    /// false when the policy is not tracked. [`Self::run`] calls this once per interval.
    pub async fn probe_now(&self, policy: &ObjectRef<FailoverPolicy>) -> bool {
        let Some(plan) = self.plan(policy) else {
            return false;
        };
        let RoundResult {
            mut checks,
            probed,
            golden: update,
            accepted,
            parity,
            model_files,
            asleep_levels,
            host_room,
        } = self.round(&plan).await;
        checks.extend(self.passive(&plan).await);
        let urgent = needs_acting_on(&plan.policy, &checks);
        {
            let mut policies = self.policies();
            if let Some(tracked) = policies.get_mut(policy) {
                tracked.in_flight = false;
                if accepted.is_some() {
                    tracked.probe_accepted = accepted;
                }
                if parity.is_some() || !tracked.policy.spec.parity.enabled {
                    tracked.parity = parity;
                }
                for (pool, levels) in asleep_levels {
                    tracked.asleep_levels[pool.index()] = levels;
                }
                if let Some((pool, room)) = host_room {
                    tracked.host_room[pool.index()] = room;
                }
                for (kept, read) in tracked.model_files.iter_mut().zip(model_files) {
                    if read.is_some() || tracked.policy.spec.parity.artifact_digest.is_none() {
                        *kept = read;
                    }
                }
                tracked.rounds = tracked.rounds.max(plan.round + 1);
                for (pool, reports) in probed {
                    let known = tracked.passed[pool.index()].get_or_insert_with(BTreeSet::new);
                    // A replica no longer running is routed no more.
                    let running: BTreeSet<String> = reports.iter().map(|r| r.endpoint.authority()).collect();
                    known.retain(|replica| running.contains(replica));
                    note_reports(known, &reports);
                    tracked.asleep[pool.index()] = reports
                        .into_iter()
                        .filter(|r| r.outcome == ProbeOutcome::Asleep)
                        .map(|r| r.endpoint)
                        .collect();
                }
                // A spec tracked while the round ran may have changed what the round judged by.
                if let Some(update) = update
                    && tracked.golden == update.replaces
                    && update
                        .new
                        .as_ref()
                        .is_none_or(|g| g.fits(&tracked.policy.spec.probe))
                {
                    match &update.new {
                        Some(golden) => {
                            tracing::info!(policy = %policy, golden = %golden.prefix, model = ?golden.model, "recorded the golden answer");
                        }
                        None => {
                            tracing::info!(policy = %policy, "the primary serves another model; recording the golden answer again");
                        }
                    }
                    tracked.golden = update.new;
                }
                for check in checks {
                    if tracked.pending.len() == MAX_PENDING {
                        tracked.pending.pop_front();
                    }
                    tracked.pending.push_back(check);
                }
            }
        }
        if urgent && let Some(urgent) = &*self.urgent.lock().unwrap_or_else(PoisonError::into_inner) {
            // A controller that stopped reading has stopped reconciling too.
            let _ = urgent.send(policy.clone());
        }
        self.changed.notify_one();
        true
    }

    fn plan(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<RoundPlan> {
        let policies = self.policies();
        let tracked = policies.get(policy)?;
        Some(RoundPlan {
            namespace: policy.namespace.clone().unwrap_or_default(),
            policy: tracked.policy.clone(),
            timing: tracked.timing,
            golden: tracked.golden.clone(),
            model_files: tracked.model_files.clone(),
            asleep: tracked.asleep.clone(),
            round: tracked.rounds,
            seed: stable_seed(policy),
        })
    }

    /// The golden answer to judge this round by, and the model the primary serves, when the
    /// policy records one. A model that cannot be read keeps the planned golden answer.
    /// The golden answer the round judges by: the one kept, unless the primary (whose serving
    /// configuration is `primary`) is set to serve another model than it was recorded from.
    fn current_golden(plan: &RoundPlan, primary: Option<&Config>) -> (Option<GoldenAnswer>, Option<String>) {
        if !records_golden(&plan.policy.spec) {
            return (plan.golden.clone(), None);
        }
        let serving = primary.and_then(|config| config.as_ref().ok()?.model());
        let golden = plan
            .golden
            .clone()
            .filter(|golden| !model_changed(golden, serving.as_deref()));
        (golden, serving)
    }

    /// Each pool's serving configuration, read once for the round and only where it is used: the
    /// primary's for its model when the golden answer is recorded from it, both for parity.
    async fn configs(&self, plan: &RoundPlan, primary: Pool) -> [Option<Config>; 2] {
        let spec = &plan.policy.spec;
        let read = |pool: Pool, needed: bool| async move {
            let pool_spec = spec.pools.get(pool.index()).filter(|_| needed)?;
            Some(
                match self.replicas.serving_config(&plan.namespace, pool_spec).await {
                    Ok(Some(config)) => Ok(config),
                    Ok(None) => Err("its workload is rolling out, or names no model to serve".to_owned()),
                    Err(error) => {
                        tracing::debug!(policy = %plan.policy.name_any(), pool = %pool_spec.name, %error, "could not read the pool's serving configuration");
                        Err(error.to_string())
                    }
                },
            )
        };
        let parity = spec.parity.enabled;
        let (p, s) = join(
            read(primary, parity || records_golden(spec)),
            read(primary.other(), parity || standby_first(spec)),
        )
        .await;
        [p, s]
    }

    /// One round over both pools: the checks, what it learned of the golden answer, and whether
    /// the replicas took the probe (`None` when no pool was probed).
    async fn round(&self, plan: &RoundPlan) -> RoundResult {
        let spec = &plan.policy.spec;
        let primary = primary_pool(&plan.policy);
        let standby = primary.other();
        let configs = self.configs(plan, primary).await;
        let (golden, serving_model) = Self::current_golden(plan, configs[0].as_ref());
        let standby_apart = judged_apart(
            spec,
            golden.as_ref(),
            serving_model.as_deref(),
            configs[1].as_ref(),
        );
        let judge = match judge(&spec.probe.expect, golden.as_ref()) {
            Ok(judge) => judge,
            Err(error) => {
                // Nothing can be judged: reporting either pool failed would be a guess.
                tracing::warn!(policy = %plan.policy.name_any(), %error, "spec.probe.expect.value is not a valid regular expression; not probing");
                return RoundResult::default();
            }
        };
        let (primary_endpoints, standby_endpoints) =
            join(self.resolve(plan, primary), self.resolve(plan, standby)).await;
        let compared = [primary_endpoints.clone(), standby_endpoints.clone()];
        let agents = self.read_agents(plan);
        let parity = self.parity(plan, primary, &compared, configs, agents.clone());
        let probing = async {
            match judge {
                Judge::Fixed(expect) => {
                    let probe = probe_spec(&spec.probe, &plan.timing, expect);
                    let apart = probe_spec(&spec.probe, &plan.timing, Expectation::NonEmpty);
                    let (p, s) = join(
                        self.probe_pool(plan, primary, primary_endpoints, &probe),
                        self.probe_pool(
                            plan,
                            standby,
                            standby_endpoints,
                            if standby_apart { &apart } else { &probe },
                        ),
                    )
                    .await;
                    (p, s, None)
                }
                Judge::RecordFromPrimary => {
                    let probe = probe_spec(&spec.probe, &plan.timing, Expectation::NonEmpty);
                    let p = self.probe_pool(plan, primary, primary_endpoints, &probe).await;
                    let golden = p.as_ref().and_then(|round| first_passing_answer(&round.reports));
                    let expect = match golden.as_deref() {
                        Some(text) if !standby_apart => Expectation::golden_prefix(text, GOLDEN_PREFIX_CHARS),
                        _ => Expectation::NonEmpty,
                    };
                    let probe = probe_spec(&spec.probe, &plan.timing, expect);
                    let s = self.probe_pool(plan, standby, standby_endpoints, &probe).await;
                    let recorded = golden.map(|text| GoldenAnswer {
                        prefix: text.chars().take(GOLDEN_PREFIX_CHARS).collect(),
                        prompt: spec.probe.prompt.clone(),
                        max_tokens: spec.probe.max_tokens,
                        pool: spec
                            .pools
                            .get(primary.index())
                            .map(|p| p.name.clone())
                            .unwrap_or_default(),
                        model: serving_model,
                        recorded_at: None,
                    });
                    // Recorded now, or the planned one dropped for another model even if none passed.
                    let update = (recorded.is_some() || plan.golden.is_some()).then(|| GoldenUpdate {
                        replaces: plan.golden.clone(),
                        new: recorded,
                    });
                    (p, s, update)
                }
            }
        };
        // The standby's sleepers' levels, for the objective: those the last round found asleep,
        // read beside this round's probes so that they delay no check.
        let levels = join_all(
            plan.asleep[standby.index()]
                .iter()
                .map(|endpoint| sleep_level(endpoint, plan.timing.timeout)),
        );
        let nodes = join3(
            self.on_failed_gpus(plan, primary, agents.clone()),
            self.host_room(plan, standby, agents),
            levels,
        );
        let ((primary_round, standby_round, golden), (parity, model_files), (gpu_failed, host_room, levels)) =
            join3(probing, parity, nodes).await;
        let mut rounds: Vec<PoolRound> = [primary_round, standby_round].into_iter().flatten().collect();
        rounds.sort_by_key(|round| round.pool.index());
        let mut rejected = None;
        let checks = rounds
            .iter()
            .filter_map(|round| {
                let result = round.verdict();
                tracing::debug!(
                    policy = %plan.policy.name_any(), pool = ?round.pool, replicas = round.reports.len(),
                    min_serving = round.min_serving, ?result, "probed"
                );
                let Some(result) = result else {
                    // The replicas refused the probe itself: no evidence about the pool.
                    let why = round.rejection().unwrap_or_default();
                    tracing::warn!(policy = %plan.policy.name_any(), pool = ?round.pool, %why, "the probe was rejected; no check this round");
                    rejected.get_or_insert(why);
                    return None;
                };
                Some(Observation::Check {
                    pool: round.pool,
                    result,
                })
            })
            .collect();
        let mut checks: Vec<Observation> = checks;
        for pool in gpu_failed {
            // Whatever its probes said: a replica on a failed GPU cannot be trusted to compute.
            checks.retain(|c| !matches!(c, Observation::Check { pool: p, .. } if *p == pool));
            checks.push(Observation::Check {
                pool,
                result: CheckResult::HardFail,
            });
        }
        checks.sort_by_key(|c| match c {
            Observation::Check { pool, .. } => pool.index(),
            _ => usize::MAX,
        });
        if let Some(holds) = parity.as_ref().and_then(parity::holds) {
            checks.push(Observation::Parity { holds });
        }
        let accepted = (!rounds.is_empty()).then(|| rejected.map_or(Ok(()), Err));
        let probed = rounds
            .into_iter()
            .map(|round| (round.pool, round.reports))
            .collect();
        RoundResult {
            checks,
            probed,
            golden,
            accepted,
            parity,
            model_files,
            asleep_levels: vec![(standby, levels)],
            host_room: Some((standby, host_room)),
        }
    }

    /// The pools compared ([`crate::parity`]): each one's pod template, what its first replica in
    /// address order reports and, when the policy asks, its model files; `None` with
    /// `spec.parity.enabled` off. With it, each pool's model files read this round, by
    /// [`Pool::index`].
    async fn parity(
        &self,
        plan: &RoundPlan,
        primary: Pool,
        endpoints: &[Option<Vec<Endpoint>>; 2],
        configs: [Option<Config>; 2],
        agents: RoundAgents<'_>,
    ) -> (Option<ParityStatus>, [Option<ModelFilesRead>; 2]) {
        let spec = &plan.policy.spec;
        if !spec.parity.enabled {
            return (None, [None, None]);
        }
        let flags = parity::flag_policy(&spec.parity);
        let models = configs.each_ref().map(|config| {
            config
                .as_ref()
                .and_then(|config| config.as_ref().ok())
                .and_then(ServingConfig::model)
        });
        let [primary_config, standby_config] = configs;
        let ((primary_side, standby_side), artifacts) = join(
            join(
                Self::parity_side(plan, primary, primary_config, endpoints[0].as_deref(), &flags),
                Self::parity_side(
                    plan,
                    primary.other(),
                    standby_config,
                    endpoints[1].as_deref(),
                    &flags,
                ),
            ),
            self.artifacts(plan, primary, agents),
        )
        .await;
        let now = Timestamp::from_second(Timestamp::now().as_second())
            .map_or_else(|_| String::new(), |t| t.to_string());
        let mut read: [Option<ModelFilesRead>; 2] = [None, None];
        let (Some(mut primary_side), Some(mut standby_side)) = (primary_side, standby_side) else {
            return (None, read);
        };
        if let Some(artifacts) = artifacts {
            // Each pool's files as read now, else as last read (by their keys, or by their
            // digest alone when a restarted operator has it from status) while its template
            // names the same model.
            // Only a settled reading is kept: one whose nodes agree, none of its files being
            // digested again.
            let depth = spec.parity.artifact_digest.map_or("", |d| d.as_str());
            let allowed = &spec.parity.allow_drift;
            let mut sides = Vec::with_capacity(2);
            for (role, (fingerprint, mut missing)) in artifacts.into_iter().enumerate() {
                let pool = if role == 0 { primary } else { primary.other() };
                let model = models[role].clone();
                if !fingerprint.0.is_empty() {
                    let digest = parity::blocking_digest(&fingerprint, allowed);
                    if let Some(model) = model.filter(|_| parity::settled(&fingerprint)) {
                        read[pool.index()] = Some(ModelFilesRead {
                            fingerprint: Some(fingerprint.clone()),
                            digest: digest.clone(),
                            depth: depth.to_owned(),
                            model,
                            read_at: now.clone(),
                        });
                    }
                    sides.push((Some(fingerprint), Some(digest), missing));
                    continue;
                }
                match (&plan.model_files[pool.index()], &model) {
                    (Some(last), Some(model)) if last.model == *model && last.depth == depth => {
                        let name = spec.pools.get(pool.index()).map_or("", |p| p.name.as_str());
                        missing.push(format!(
                            "{name}'s model files: compared as read at {}",
                            last.read_at
                        ));
                        sides.push((last.fingerprint.clone(), Some(last.digest.clone()), missing));
                    }
                    _ => sides.push((None, None, missing)),
                }
            }
            let by_keys = sides.iter().all(|(keys, _, _)| keys.is_some());
            for (side, (keys, digest, missing)) in
                [&mut primary_side, &mut standby_side].into_iter().zip(sides)
            {
                let fingerprint = match (by_keys, keys, digest) {
                    (true, Some(keys), _) => keys,
                    // A side known by its digest alone: the digests are what is compared.
                    (false, _, Some(digest)) => {
                        Fingerprint(BTreeMap::from([(format!("{}digest", parity::ARTIFACT), digest)]))
                    }
                    _ => Fingerprint::default(),
                };
                side.add_artifact((fingerprint, missing));
            }
        }
        let mut parity = parity::compare(primary_side, standby_side, &spec.parity.allow_drift, now);
        if spec.parity.artifact_digest.is_some() {
            parity.model_files = [Pool::A, Pool::B]
                .into_iter()
                .filter_map(|pool| {
                    let kept = read[pool.index()]
                        .as_ref()
                        .or(plan.model_files[pool.index()].as_ref())?;
                    Some(ModelFilesRecord {
                        pool: spec.pools.get(pool.index())?.name.clone(),
                        model: kept.model.clone(),
                        digest: kept.digest.clone(),
                        depth: kept.depth.clone(),
                        read_at: kept.read_at.clone(),
                    })
                })
                .collect();
        }
        (Some(parity), read)
    }

    /// Each pool's model files (the primary's first), read where they lie by the GPU agents of
    /// their nodes at the depth `spec.parity.artifactDigest` asks; `None` when it asks for none.
    async fn artifacts(
        &self,
        plan: &RoundPlan,
        primary: Pool,
        agents: RoundAgents<'_>,
    ) -> Option<[(Fingerprint, Vec<String>); 2]> {
        let depth = plan.policy.spec.parity.artifact_digest?.as_str();
        let agents = agents.await;
        let (a, b) = join(
            self.artifact(plan, primary, parity::Role::Primary, agents.as_deref(), depth),
            self.artifact(
                plan,
                primary.other(),
                parity::Role::Standby,
                agents.as_deref(),
                depth,
            ),
        )
        .await;
        Some([a, b])
    }

    /// `pool`'s model files read at `depth` on each node one of its replicas runs on (each
    /// directory once, [`MAX_MODEL_PLACES`] at most), merged by [`parity::artifact`].
    async fn artifact(
        &self,
        plan: &RoundPlan,
        pool: Pool,
        role: parity::Role,
        agents: Option<&AgentsByNode>,
        depth: &str,
    ) -> (Fingerprint, Vec<String>) {
        let Some(spec) = plan.policy.spec.pools.get(pool.index()) else {
            return (Fingerprint::default(), Vec::new());
        };
        let name = &spec.name;
        let not_read = |why: String| {
            (
                Fingerprint::default(),
                vec![format!("{name}'s model files: {why}")],
            )
        };
        let Some(agents) = agents else {
            return not_read("no GPU agents are read (the operator's --gpu-agent-selector)".to_owned());
        };
        let places = match self.replicas.model_places(&plan.namespace, spec).await {
            Ok(places) if places.is_empty() => return not_read("no replica of it is running".to_owned()),
            Ok(places) => places,
            Err(error) => return not_read(error.to_string()),
        };
        let mut seen = BTreeSet::new();
        let mut places: Vec<_> = places
            .into_iter()
            .filter(|place| seen.insert((place.node.clone(), place.path.clone())))
            .collect();
        let left_out = places.len().saturating_sub(MAX_MODEL_PLACES);
        places.truncate(MAX_MODEL_PLACES);
        let cluster = spec.cluster_name().map(str::to_owned);
        let readings = join_all(places.into_iter().map(|place| {
            let agent = agents.get(&(cluster.clone(), place.node.clone()));
            async move {
                let reading = match (place.path, agent) {
                    (Err(why), _) => Err(format!("pod {}: {why}", place.pod)),
                    (Ok(_), None) => Err("no GPU agent on it answered".to_owned()),
                    (Ok(path), Some(agent)) => gpu_health::read_model(&agent.host, agent.port, &path, depth)
                        .await
                        .map(|reading| reading.map(|r| r.fingerprint)),
                };
                parity::ArtifactReading {
                    node: place.node,
                    reading,
                }
            }
        }))
        .await;
        let (fingerprint, mut missing) = parity::artifact(name, role, readings);
        if left_out > 0 {
            missing.push(format!(
                "{name}'s model files on {left_out} more node(s): only {MAX_MODEL_PLACES} are read each round"
            ));
        }
        (fingerprint, missing)
    }

    /// The GPU agents of every cluster `plan`'s policy lives in, read once for the round (by
    /// [`Self::on_failed_gpus`], [`Self::artifacts`] and [`Self::host_room`]); `None` without
    /// agents. One that cannot be read says nothing of its node, and a warning says so.
    fn read_agents<'a>(&'a self, plan: &'a RoundPlan) -> RoundAgents<'a> {
        async move {
            let agents = self.gpu_agents.as_ref()?;
            let (by_node, unread) = agents
                .by_node(Some(PolicyClusters::of(&plan.namespace, &plan.policy)))
                .await;
            for why in &unread {
                tracing::warn!(policy = %plan.policy.name_any(), %why, "a GPU agent could not be read; its node counts as healthy and its model files are not read");
            }
            Some(Arc::new(by_node))
        }
        .boxed()
        .shared()
    }

    /// Host memory for `pool`'s level-1 sleepers ([`HostRoom`]): each replica's node and the size
    /// of its weight files (the model directory's sizes, read where it lies, nothing read of the
    /// files), and each node's available memory; empty without GPU agents or a level-1 warm tier.
    async fn host_room(&self, plan: &RoundPlan, pool: Pool, agents: RoundAgents<'_>) -> HostRoom {
        let mut room = HostRoom::default();
        let (true, Some(spec)) = (
            self.gpu_agents.is_some(),
            plan.policy.spec.pools.get(pool.index()),
        ) else {
            return room;
        };
        let level_one = spec
            .standby_groups()
            .iter()
            .any(|group| group.tier == Tier::Warm && group.sleep_level() == 1);
        if !level_one {
            return room;
        }
        let Some(by_node) = agents.await else {
            return room;
        };
        let places = match self.replicas.model_places(&plan.namespace, spec).await {
            Ok(places) => places,
            Err(error) => {
                tracing::debug!(policy = %plan.policy.name_any(), pool = %spec.name, %error, "could not find where the pool's replicas run");
                return room;
            }
        };
        let cluster = spec.cluster_name().map(str::to_owned);
        for ((in_cluster, node), agent) in by_node.iter() {
            if *in_cluster == cluster
                && let Some(memory) = agent.report.memory
            {
                room.available.insert(node.clone(), memory.available_bytes);
            }
        }
        let weights = join_all(places.iter().map(|place| {
            let agent = by_node.get(&(cluster.clone(), place.node.clone()));
            async move {
                let (Ok(path), Some(agent)) = (&place.path, agent) else {
                    return None;
                };
                let reading = gpu_health::read_model(&agent.host, agent.port, path, "cache").await;
                reading.ok().flatten().map(|r| weight_bytes(&r.fingerprint))
            }
        }))
        .await;
        for (place, weights) in places.into_iter().zip(weights) {
            if let Some(weights) = weights.filter(|w| *w > 0) {
                room.replicas.insert(place.endpoint, (place.node, weights));
            }
        }
        room
    }

    /// The pools whose replicas on healthy GPUs are fewer than they need, as the node agents
    /// report the GPUs ([`crate::gpu_health`]); none without agents.
    async fn on_failed_gpus(&self, plan: &RoundPlan, primary: Pool, agents: RoundAgents<'_>) -> Vec<Pool> {
        let Some(agents) = agents.await else {
            return Vec::new();
        };
        let failed = gpu_health::failed_pods(&agents);
        if failed.is_empty() {
            return Vec::new();
        }
        let mut pools = Vec::new();
        for pool in [primary, primary.other()] {
            let Some(spec) = plan.policy.spec.pools.get(pool.index()) else {
                continue;
            };
            let names = match self.replicas.replica_names(&plan.namespace, spec).await {
                Ok(names) => names,
                Err(error) => {
                    tracing::warn!(policy = %plan.policy.name_any(), pool = %spec.name, %error, "could not name the pool's replicas to match them to GPUs");
                    continue;
                }
            };
            let cluster = spec.cluster_name().map(str::to_owned);
            let on_failed: Vec<&String> = names
                .iter()
                .filter(|name| failed.contains(&(cluster.clone(), format!("{}/{name}", plan.namespace))))
                .collect();
            let needed = plan.policy.spec.standby_shapes()[pool.index()]
                .round_quorum(Role::of(pool == primary)) as usize;
            if !on_failed.is_empty() && names.len() - on_failed.len() < needed {
                tracing::warn!(
                    policy = %plan.policy.name_any(), pool = %spec.name, on_failed_gpus = ?on_failed, needed,
                    "replicas hold failed GPUs; the pool fails hard"
                );
                pools.push(pool);
            }
        }
        pools
    }

    async fn parity_side(
        plan: &RoundPlan,
        pool: Pool,
        config: Option<Config>,
        endpoints: Option<&[Endpoint]>,
        flags: &FlagPolicy,
    ) -> Option<parity::Side> {
        let spec = plan.policy.spec.pools.get(pool.index())?;
        let first = endpoints.and_then(|e| e.iter().min_by_key(|e| e.to_string()));
        Some(parity::side(&spec.name, config?, first, flags, plan.timing.timeout).await)
    }

    async fn resolve(&self, plan: &RoundPlan, pool: Pool) -> Option<Vec<Endpoint>> {
        let spec = plan.policy.spec.pools.get(pool.index())?;
        match self.replicas.resolve(&plan.namespace, spec).await {
            Ok(endpoints) => Some(endpoints),
            Err(error) => {
                tracing::warn!(policy = %plan.policy.name_any(), pool = %spec.name, %error, "could not find the pool's replicas; no check this round");
                None
            }
        }
    }

    async fn probe_pool(
        &self,
        plan: &RoundPlan,
        pool: Pool,
        endpoints: Option<Vec<Endpoint>>,
        probe: &ProbeSpec,
    ) -> Option<PoolRound> {
        let endpoints = endpoints?;
        let spec = &plan.policy.spec;
        let shape = spec
            .pools
            .get(pool.index())
            .map(|_| spec.standby_shapes()[pool.index()])?;
        let is_primary = pool == primary_pool(&plan.policy);
        let max_jitter = self
            .max_jitter
            .min(plan.timing.interval / 4)
            .min(plan.timing.interval.saturating_sub(plan.timing.timeout));
        let reports = probe::probe_round(&endpoints, probe, plan.seed, plan.round, max_jitter).await;
        self.note_first_answers(&reports);
        Some(PoolRound {
            pool,
            min_serving: shape.round_quorum(Role::of(is_primary)) as usize,
            reports,
        })
    }
}

impl ProbingObservations {
    /// What the routers that route the primary at the policy's epoch saw of it, as one passive
    /// observation; `None` without routers, or when they saw nothing wrong. A router that cannot
    /// be read, or routes another pool or epoch, says nothing.
    async fn passive(&self, plan: &RoundPlan) -> Option<Observation> {
        let (routers, token) = self.router_signals.as_ref()?;
        let primary = primary_pool(&plan.policy);
        let name = &plan.policy.spec.pools.get(primary.index())?.name;
        let epoch = plan.policy.status.as_ref().and_then(|s| s.epoch).unwrap_or(0);
        let key = policy_key(&plan.policy);
        let clusters = PolicyClusters::of(&plan.namespace, &plan.policy);
        let routers = match routers.resolve(Some(clusters)).await {
            Ok(routers) => routers,
            Err(why) => {
                tracing::debug!(%why, "no router's signals to read");
                return None;
            }
        };
        let reads = join_all(
            routers
                .iter()
                .map(|router| tokio::time::timeout(SIGNALS_TIMEOUT, get_signals(router, token))),
        )
        .await;
        let seen: Vec<Option<PassiveSignal>> = reads
            .into_iter()
            .filter_map(|read| read.ok()?.ok())
            .flatten()
            .filter(|routed| routed.policy == key && routed.pool == *name && routed.epoch == epoch)
            .map(|routed| routed.signal)
            .collect();
        passive_signal(&seen).map(|signal| Observation::Passive {
            pool: primary,
            signal,
        })
    }

    /// Keeps when each replica that passed first had its first token: the probe ended now, so
    /// its first token came the rest of its answer's time ago.
    fn note_first_answers(&self, reports: &[ProbeReport]) {
        let now = Timestamp::now();
        let mut first = self.first_answers.lock().unwrap_or_else(PoisonError::into_inner);
        first.retain(|_, at| now.duration_since(*at).unsigned_abs() < FIRST_ANSWER_KEPT);
        for report in reports {
            let ProbeOutcome::Ok { first_token, total } = report.outcome else {
                continue;
            };
            let rest = total.saturating_sub(first_token);
            let at = now.checked_sub(rest).unwrap_or(now);
            first.entry(report.endpoint.authority()).or_insert(at);
        }
    }
}

/// Whether a round's `checks` of `policy` need its state machine now rather than at its next
/// requeue: the primary did not pass, the routers saw something, or the policy is suspect (a pass
/// clears it) or promoting (the new primary's passes move the route). A stranded policy is
/// acted on through its failing primary; one that merely passes waits for the requeue.
fn needs_acting_on(policy: &FailoverPolicy, checks: &[Observation]) -> bool {
    let primary = primary_pool(policy);
    let state = policy.status.as_ref().and_then(|s| s.state.as_deref());
    matches!(state, Some("Suspect" | "Promoting"))
        || checks.iter().any(|check| match check {
            Observation::Check { pool, result } => *pool == primary && *result != CheckResult::Pass,
            Observation::Passive { .. } => true,
            Observation::Parity { .. } | Observation::LoadProof { .. } => false,
        })
}

/// Keeps what probes of a pool's replicas found in `known`, the replicas that serve: each that
/// passed joins it, and each that is asleep or refuses connections (its server is down or not up
/// yet) leaves it. Any other failure leaves it where it was: the routers eject a replica that
/// fails under them, and the pool's checks judge it.
fn note_reports(known: &mut BTreeSet<String>, reports: &[ProbeReport]) {
    for report in reports {
        match report.outcome {
            ProbeOutcome::Ok { .. } => {
                known.insert(report.endpoint.authority());
            }
            ProbeOutcome::Asleep | ProbeOutcome::Refused => {
                known.remove(&report.endpoint.authority());
            }
            _ => {}
        }
    }
}

/// The longest one router's `/signals` may take to answer.
const SIGNALS_TIMEOUT: Duration = Duration::from_secs(2);

/// The routers' signals about the primary, one per router that routes it, as one observation:
/// refused everywhere only when every one of them saw every endpoint refuse (strong evidence,
/// a hard failed check); any refusal or timeout short of that only makes the primary suspect.
#[must_use]
pub fn passive_signal(seen: &[Option<PassiveSignal>]) -> Option<PassiveSignal> {
    if !seen.is_empty() && seen.iter().all(|s| *s == Some(PassiveSignal::AllRefused)) {
        return Some(PassiveSignal::AllRefused);
    }
    seen.iter()
        .any(Option::is_some)
        .then_some(PassiveSignal::Timeouts)
}

/// How long a replica's first answer is remembered: longer than a cold start is read for.
const FIRST_ANSWER_KEPT: Duration = Duration::from_secs(2 * 60 * 60);

/// The text of the first replica that passed, if any did.
fn first_passing_answer(reports: &[ProbeReport]) -> Option<String> {
    reports
        .iter()
        .find(|r| matches!(r.outcome, ProbeOutcome::Ok { .. }) && !r.text.trim().is_empty())
        .map(|r| r.text.clone())
}

/// A jitter seed that is the same for a policy in every process (FNV-1a of namespace and name), so
/// that a schedule can be predicted from the policy alone.
fn stable_seed(policy: &ObjectRef<FailoverPolicy>) -> u64 {
    let namespace = policy.namespace.as_deref().unwrap_or_default();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in namespace.bytes().chain([b'/']).chain(policy.name.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

impl ProbeFindings for ProbingObservations {
    fn golden_answer(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<GoldenAnswer> {
        self.policies()
            .get(policy)
            .and_then(|tracked| tracked.golden.clone())
    }

    fn probe_accepted(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<Result<(), String>> {
        self.policies()
            .get(policy)
            .and_then(|tracked| tracked.probe_accepted.clone())
    }

    fn parity(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<ParityStatus> {
        self.policies()
            .get(policy)
            .and_then(|tracked| tracked.parity.clone())
    }

    fn passed(&self, policy: &ObjectRef<FailoverPolicy>, pool: Pool) -> Option<BTreeSet<String>> {
        self.policies()
            .get(policy)
            .and_then(|tracked| tracked.passed[pool.index()].clone())
    }

    fn asleep(&self, policy: &ObjectRef<FailoverPolicy>, pool: Pool) -> Vec<Endpoint> {
        self.policies()
            .get(policy)
            .map(|tracked| tracked.asleep[pool.index()].clone())
            .unwrap_or_default()
    }

    fn asleep_levels(&self, policy: &ObjectRef<FailoverPolicy>, pool: Pool) -> Vec<Option<u8>> {
        self.policies()
            .get(policy)
            .map(|tracked| tracked.asleep_levels[pool.index()].clone())
            .unwrap_or_default()
    }

    fn host_room(&self, policy: &ObjectRef<FailoverPolicy>, pool: Pool) -> HostRoom {
        self.policies()
            .get(policy)
            .map(|tracked| tracked.host_room[pool.index()].clone())
            .unwrap_or_default()
    }

    fn note_probed(&self, policy: &ObjectRef<FailoverPolicy>, pool: Pool, reports: &[ProbeReport]) {
        if let Some(tracked) = self.policies().get_mut(policy) {
            note_reports(
                tracked.passed[pool.index()].get_or_insert_with(BTreeSet::new),
                reports,
            );
        }
    }
}

impl ObservationSource for ProbingObservations {
    fn first_answered(&self, endpoint: &str) -> Option<Timestamp> {
        self.first_answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
            .copied()
    }

    fn drain(&self, policy: &ObjectRef<FailoverPolicy>) -> Vec<Observation> {
        self.policies()
            .get_mut(policy)
            .map(|tracked| tracked.pending.drain(..).collect())
            .unwrap_or_default()
    }

    /// Starts probing a policy seen for the first time at once; for one already tracked, the next
    /// round uses the new spec. A spec that does not validate is not probed.
    fn track(&self, policy: &FailoverPolicy) {
        let key = ObjectRef::from_obj(policy);
        let Ok(validated) = policy::validate(&policy.spec) else {
            self.forget(&key);
            return;
        };
        let mut policies = self.policies();
        match policies.get_mut(&key) {
            Some(tracked) => {
                if tracked
                    .golden
                    .as_ref()
                    .is_some_and(|g| !g.fits(&policy.spec.probe))
                {
                    tracked.golden = None;
                }
                tracked.policy = Arc::new(policy.clone());
                tracked.timing = validated.probe;
            }
            None => {
                policies.insert(
                    key,
                    Tracked {
                        policy: Arc::new(policy.clone()),
                        timing: validated.probe,
                        pending: VecDeque::new(),
                        // What an earlier operator recorded, while it still fits the probe.
                        golden: policy
                            .status
                            .as_ref()
                            .and_then(|status| status.golden_answer.clone())
                            .filter(|golden| golden.fits(&policy.spec.probe)),
                        probe_accepted: None,
                        parity: None,
                        model_files: recorded_model_files(policy),
                        asleep_levels: [Vec::new(), Vec::new()],
                        host_room: [HostRoom::default(), HostRoom::default()],
                        passed: [None, None],
                        asleep: [Vec::new(), Vec::new()],
                        rounds: 0,
                        next_round: Instant::now(),
                        in_flight: false,
                    },
                );
                drop(policies);
                self.changed.notify_one();
            }
        }
    }

    fn forget(&self, policy: &ObjectRef<FailoverPolicy>) {
        self.policies().remove(policy);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::replicas::FixedReplicas;
    use understudy_core::failover::CheckResult;

    fn policy(yaml_pools: &str) -> FailoverPolicy {
        let spec = serde_yaml::from_str(&format!(
            "pools:\n{yaml_pools}recoveryObjective: 5m\nprobe: {{interval: 10s, timeout: 5s}}\n"
        ))
        .unwrap_or_else(|e| panic!("fixture: {e}"));
        let mut policy = FailoverPolicy::new("llama", spec);
        policy.metadata.namespace = Some("serving".to_owned());
        policy
    }

    const HOT_POOLS: &str = "  - {name: east, workload: {kind: Deployment, name: a}, replicas: 4}\n  \
                             - {name: west, workload: {kind: Deployment, name: b}, replicas: 4}\n";

    /// One replica a pool.
    const ONE_EACH: &str = "  - {name: east, workload: {kind: Deployment, name: a}, replicas: 1}\n  \
                            - {name: west, workload: {kind: Deployment, name: b}, replicas: 1}\n";

    #[test]
    fn the_routers_say_refused_only_together_and_anything_less_is_suspicion() {
        use PassiveSignal::{AllRefused, Timeouts};
        assert_eq!(passive_signal(&[]), None);
        assert_eq!(passive_signal(&[None, None]), None);
        assert_eq!(
            passive_signal(&[Some(AllRefused), Some(AllRefused)]),
            Some(AllRefused)
        );
        assert_eq!(passive_signal(&[Some(AllRefused), None]), Some(Timeouts));
        assert_eq!(passive_signal(&[Some(Timeouts), None]), Some(Timeouts));
    }

    #[test]
    fn the_primary_is_read_from_status_and_is_the_home_pool_without_one() {
        let mut p = policy(HOT_POOLS);
        assert_eq!(primary_pool(&p), Pool::A);
        p.status = Some(crate::crd::FailoverPolicyStatus {
            primary_pool: Some("west".to_owned()),
            ..Default::default()
        });
        assert_eq!(primary_pool(&p), Pool::B);
    }

    #[tokio::test(start_paused = true)]
    async fn every_interval_a_pool_without_replicas_fails_hard_until_its_policy_is_forgotten() {
        let observations = Arc::new(ProbingObservations::new(Arc::new(FixedReplicas::default())));
        let p = policy(HOT_POOLS);
        let key = ObjectRef::from_obj(&p);
        observations.track(&p);
        let probing = tokio::spawn(observations.clone().run());
        // Rounds at 0s, 10s and 20s; the clock is paused and jumps as the loop sleeps.
        tokio::time::sleep(Duration::from_secs(25)).await;
        let hard = |pool| Observation::Check {
            pool,
            result: CheckResult::HardFail,
        };
        assert_eq!(observations.drain(&key), [hard(Pool::A), hard(Pool::B)].repeat(3));
        assert!(observations.drain(&key).is_empty(), "drained once");
        observations.forget(&key);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(observations.drain(&key).is_empty());
        assert!(observations.tracked().is_empty());
        probing.abort();
    }

    #[tokio::test]
    async fn a_round_the_primary_fails_asks_for_a_reconcile_now_and_one_of_passes_while_serving_does_not() {
        use futures::{FutureExt, StreamExt};
        let east = replica(PARIS).await;
        let west = replica(PARIS).await;
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![east])
            .with_pool("west", vec![west]);
        let observations = ProbingObservations::new(Arc::new(replicas)).with_max_jitter(Duration::ZERO);
        let urgent = observations.urgent_rounds();
        tokio::pin!(urgent);
        let serving = |mut p: FailoverPolicy, state: &str| {
            p.status = Some(crate::crd::FailoverPolicyStatus {
                state: Some(state.to_owned()),
                ..Default::default()
            });
            p
        };
        /// The policy the stream names now, if any.
        fn asked(
            urgent: &mut (impl futures::Stream<Item = ObjectRef<FailoverPolicy>> + Unpin),
        ) -> Option<ObjectRef<FailoverPolicy>> {
            urgent.next().now_or_never().flatten()
        }
        let p = serving(policy(ONE_EACH), "Serving");
        let key = ObjectRef::from_obj(&p);
        observations.track(&p);
        assert!(observations.probe_now(&key).await);
        assert_eq!(asked(&mut urgent), None, "both pools passed while serving");

        // Suspect (or promoting): every round counts.
        observations.track(&serving(policy(ONE_EACH), "Suspect"));
        assert!(observations.probe_now(&key).await);
        assert_eq!(asked(&mut urgent), Some(key.clone()));

        // Serving again, and the primary pool has no replica: a hard failure, acted on now.
        let failing = FixedReplicas::default().with_pool("west", vec![replica(PARIS).await]);
        let observations = ProbingObservations::new(Arc::new(failing)).with_max_jitter(Duration::ZERO);
        let urgent = observations.urgent_rounds();
        tokio::pin!(urgent);
        observations.track(&p);
        assert!(observations.probe_now(&key).await);
        assert_eq!(asked(&mut urgent), Some(key.clone()));
        assert_eq!(asked(&mut urgent), None, "once a round");
    }

    #[tokio::test]
    async fn a_new_primary_whose_pilot_light_grows_passes_with_the_share_its_route_moved_at() {
        // Seed 004's worked example, just promoted: west's four warm replicas answer, and its
        // four pilot-light replicas are still starting (their API answers 503).
        const SEED_004: &str = "  - {name: east, workload: {kind: Deployment, name: a}, replicas: 8}\n  \
             - {name: west, workload: {kind: Deployment, name: b}, replicas: 8, standby: \
             [{tier: warm, replicas: 4}, {tier: pilotLight, replicas: 4}]}\n";
        let mut west = Vec::new();
        for _ in 0..4 {
            west.push(replica(PARIS).await);
        }
        for _ in 0..4 {
            west.push(replica_with(503, "").await);
        }
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![replica(PARIS).await])
            .with_pool("west", west);
        let observations = ProbingObservations::new(Arc::new(replicas)).with_max_jitter(Duration::ZERO);
        let promoted = |fraction: Option<f64>| {
            let mut p = policy(SEED_004);
            p.spec.min_serving_fraction = fraction;
            p.status = Some(crate::crd::FailoverPolicyStatus {
                primary_pool: Some("west".to_owned()),
                ..Default::default()
            });
            p
        };
        let west_check = |checks: Vec<Observation>| {
            checks.into_iter().find_map(|check| match check {
                Observation::Check {
                    pool: Pool::B,
                    result,
                } => Some(result),
                _ => None,
            })
        };
        let half = promoted(Some(0.5));
        observations.track(&half);
        let checks = one_round(&observations, &half).await;
        assert_eq!(
            west_check(checks),
            Some(CheckResult::Pass),
            "routed at 4 of 8, judged at 4"
        );
        let majority = promoted(None);
        observations.track(&majority);
        let checks = one_round(&observations, &majority).await;
        assert_eq!(
            west_check(checks),
            Some(CheckResult::HardFail),
            "routed at 5 of 8, judged at 5"
        );
    }

    /// A pool whose replicas change between rounds, as pods come and go.
    #[derive(Debug, Default)]
    struct Changing(Mutex<Vec<Endpoint>>);

    impl ReplicaEndpoints for Changing {
        fn resolve<'a>(
            &'a self,
            _namespace: &'a str,
            _pool: &'a crate::crd::PoolSpec,
        ) -> futures::future::BoxFuture<'a, Result<Vec<Endpoint>, crate::ports::ResolveError>> {
            let endpoints = self.0.lock().unwrap().clone();
            Box::pin(async move { Ok(endpoints) })
        }
    }

    #[tokio::test]
    async fn the_replicas_that_passed_are_kept_while_they_run_and_joined_by_each_that_passes() {
        let (first, starting, second) = (
            replica(PARIS).await,
            replica_with(503, "").await,
            replica(PARIS).await,
        );
        let changing = Arc::new(Changing::default());
        let observations = ProbingObservations::new(changing.clone()).with_max_jitter(Duration::ZERO);
        let p = policy(ONE_EACH);
        let key = ObjectRef::from_obj(&p);
        observations.track(&p);
        assert_eq!(
            observations.passed(&key, Pool::A),
            None,
            "nothing known before a round"
        );
        assert!(observations.asleep(&key, Pool::A).is_empty());
        let set = |replicas: &[&Endpoint]| {
            *changing.0.lock().unwrap() = replicas.iter().map(|e| (*e).clone()).collect();
        };
        let passed = |replicas: &[&Endpoint]| -> Option<BTreeSet<String>> {
            Some(replicas.iter().map(|e| e.authority()).collect())
        };
        set(&[&first, &starting]);
        one_round(&observations, &p).await;
        assert_eq!(observations.passed(&key, Pool::A), passed(&[&first]));
        // The one still starting never answered; it is replaced by one that does.
        set(&[&first, &second]);
        one_round(&observations, &p).await;
        assert_eq!(observations.passed(&key, Pool::A), passed(&[&first, &second]));
        // The first is gone (its pod deleted): it is routed no more.
        set(&[&second]);
        one_round(&observations, &p).await;
        assert_eq!(observations.passed(&key, Pool::A), passed(&[&second]));
        // One that says it is asleep is named as asleep, for the keeper to wake, until it wakes.
        let sleeper = asleep_replica().await;
        set(&[&second, &sleeper]);
        one_round(&observations, &p).await;
        assert_eq!(observations.asleep(&key, Pool::A), std::slice::from_ref(&sleeper));
        assert_eq!(observations.passed(&key, Pool::A), passed(&[&second]));
        set(&[&second]);
        one_round(&observations, &p).await;
        assert!(observations.asleep(&key, Pool::A).is_empty());
        // A replica still listed whose server went down (connections refused) is forgotten too.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let down = Endpoint::new("127.0.0.1", listener.local_addr().unwrap().port());
        drop(listener);
        observations.note_probed(&key, Pool::A, &[probe::probe(&second, &probe_spec_of(&p)).await]);
        let mut known = observations.passed(&key, Pool::A).unwrap();
        known.insert(down.authority());
        let reports = [probe::probe(&down, &probe_spec_of(&p)).await];
        assert_eq!(reports[0].outcome, ProbeOutcome::Refused);
        note_reports(&mut known, &reports);
        assert_eq!(Some(known), passed(&[&second]));
    }

    /// The probe a round of `p` sends, taking any text.
    fn probe_spec_of(p: &FailoverPolicy) -> ProbeSpec {
        let timing = policy::validate(&p.spec).unwrap().probe;
        probe_spec(&p.spec.probe, &timing, Expectation::NonEmpty)
    }

    #[test]
    fn a_policy_that_does_not_validate_is_not_probed() {
        let observations = ProbingObservations::new(Arc::new(FixedReplicas::default()));
        let mut p = policy(HOT_POOLS);
        observations.track(&p);
        assert_eq!(observations.tracked().len(), 1);
        p.spec.probe.timeout = "20s".into();
        observations.track(&p);
        assert!(observations.tracked().is_empty());
    }

    /// A replica that is awake and answers every completion with `answer`.
    async fn replica(answer: &'static str) -> Endpoint {
        replica_with(200, answer).await
    }

    /// A replica that answers generation with `status` (and `answer` when that is 200).
    async fn replica_with(status: u16, answer: &'static str) -> Endpoint {
        serving(status, answer, false).await
    }

    /// A replica that says it is asleep (vLLM's sleep mode).
    async fn asleep_replica() -> Endpoint {
        serving(200, PARIS, true).await
    }

    async fn serving(status: u16, answer: &'static str, asleep: bool) -> Endpoint {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut raw = Vec::new();
                let mut buf = [0u8; 4096];
                while !raw.windows(4).any(|w| w == b"\r\n\r\n") {
                    let Ok(n @ 1..) = stream.read(&mut buf).await else {
                        break;
                    };
                    raw.extend_from_slice(&buf[..n]);
                }
                let (code, kind, body) = if raw.starts_with(b"GET /is_sleeping") {
                    (200, "application/json", format!(r#"{{"is_sleeping": {asleep}}}"#))
                } else if status != 200 {
                    let error = serde_json::json!({"error": {"message": "no such model", "code": status}});
                    (status, "application/json", error.to_string())
                } else {
                    let chunk = serde_json::json!({"choices": [{"text": answer}]});
                    (
                        200,
                        "text/event-stream",
                        format!("data: {chunk}\n\ndata: [DONE]\n\n"),
                    )
                };
                let reply = format!(
                    "HTTP/1.1 {code} X\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
            }
        });
        Endpoint::new("127.0.0.1", port)
    }

    fn golden(prefix: &str, model: Option<&str>) -> GoldenAnswer {
        let probe = crate::crd::ProbeSpec::default();
        GoldenAnswer {
            prefix: prefix.to_owned(),
            prompt: probe.prompt,
            max_tokens: probe.max_tokens,
            pool: "east".to_owned(),
            model: model.map(str::to_owned),
            recorded_at: Some("2026-11-30T08:00:00Z".to_owned()),
        }
    }

    fn with_golden(mut p: FailoverPolicy, golden: GoldenAnswer) -> FailoverPolicy {
        p.status = Some(crate::crd::FailoverPolicyStatus {
            golden_answer: Some(golden),
            ..Default::default()
        });
        p
    }

    const PARIS: &str = " Paris. It is also the largest city";
    const BERLIN: &str = " Berlin. It is also the largest city";

    async fn one_round(observations: &ProbingObservations, p: &FailoverPolicy) -> Vec<Observation> {
        let key = ObjectRef::from_obj(p);
        assert!(observations.probe_now(&key).await);
        observations.drain(&key)
    }

    #[tokio::test]
    async fn a_probe_the_replicas_reject_judges_no_pool_and_says_why() {
        let east = replica_with(404, PARIS).await;
        let west = replica(PARIS).await;
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![east.clone()])
            .with_pool("west", vec![west]);
        let observations = ProbingObservations::new(Arc::new(replicas)).with_max_jitter(Duration::ZERO);
        let p = with_golden(policy(ONE_EACH), golden(&PARIS[..GOLDEN_PREFIX_CHARS], None));
        let key = ObjectRef::from_obj(&p);
        assert_eq!(observations.probe_accepted(&key), None, "before any round");
        observations.track(&p);
        // East refused the probe itself: no check of east (a failed one would count toward a
        // failover), west is judged as usual, and the reason is kept for status.
        assert_eq!(
            one_round(&observations, &p).await,
            [Observation::Check {
                pool: Pool::B,
                result: CheckResult::Pass
            }]
        );
        let why = observations.probe_accepted(&key).unwrap().unwrap_err();
        assert!(why.contains(&format!("{east} answered 404")), "{why}");
    }

    #[tokio::test]
    async fn a_new_operator_judges_both_pools_by_the_golden_answer_in_status_not_by_the_primarys_answer_now()
    {
        let east = replica(BERLIN).await;
        let west = replica(PARIS).await;
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![east])
            .with_pool("west", vec![west]);
        let observations = ProbingObservations::new(Arc::new(replicas)).with_max_jitter(Duration::ZERO);
        let recorded = golden(&PARIS[..GOLDEN_PREFIX_CHARS], None);
        let p = with_golden(policy(ONE_EACH), recorded.clone());
        observations.track(&p);
        let check = |pool, result| Observation::Check { pool, result };
        assert_eq!(
            one_round(&observations, &p).await,
            [
                check(Pool::A, CheckResult::SoftFail),
                check(Pool::B, CheckResult::Pass)
            ],
            "the primary no longer gives the recorded answer; the standby still does"
        );
        assert_eq!(
            observations.golden_answer(&ObjectRef::from_obj(&p)),
            Some(recorded)
        );
    }

    #[tokio::test]
    async fn a_primary_set_to_serve_another_model_has_its_golden_answer_recorded_again() {
        let east = replica(PARIS).await;
        let west = replica(PARIS).await;
        let replicas = FixedReplicas::default()
            .with_pool("east", vec![east])
            .with_pool("west", vec![west]);
        replicas.set_model("east", "meta-llama/Llama-3.1-8B");
        let observations =
            ProbingObservations::new(Arc::new(replicas.clone())).with_max_jitter(Duration::ZERO);
        let p = with_golden(
            policy(ONE_EACH),
            golden(&BERLIN[..GOLDEN_PREFIX_CHARS], Some("meta-llama/Llama-2-7b")),
        );
        let key = ObjectRef::from_obj(&p);
        observations.track(&p);
        let pass = [
            Observation::Check {
                pool: Pool::A,
                result: CheckResult::Pass,
            },
            Observation::Check {
                pool: Pool::B,
                result: CheckResult::Pass,
            },
        ];
        assert_eq!(one_round(&observations, &p).await, pass);
        let relearned = observations.golden_answer(&key).expect("recorded again");
        assert_eq!(relearned.prefix, PARIS[..GOLDEN_PREFIX_CHARS]);
        assert_eq!(relearned.model.as_deref(), Some("meta-llama/Llama-3.1-8B"));
        assert_eq!(relearned.pool, "east");
        assert_eq!(relearned.recorded_at, None, "the status write stamps it");

        // A model that cannot be told is no reason to drop what was recorded.
        let unknown = FixedReplicas::default();
        let observations = ProbingObservations::new(Arc::new(unknown)).with_max_jitter(Duration::ZERO);
        let kept = golden(&BERLIN[..GOLDEN_PREFIX_CHARS], Some("meta-llama/Llama-2-7b"));
        let p = with_golden(policy(ONE_EACH), kept.clone());
        observations.track(&p);
        one_round(&observations, &p).await;
        assert_eq!(observations.golden_answer(&key), Some(kept));
    }

    #[test]
    fn a_golden_answer_is_dropped_when_the_prompt_max_tokens_or_expectation_change() {
        let observations = ProbingObservations::new(Arc::new(FixedReplicas::default()));
        let recorded = golden(" Paris", None);
        let p = with_golden(policy(ONE_EACH), recorded.clone());
        let key = ObjectRef::from_obj(&p);
        let changes: [fn(&mut FailoverPolicy); 3] = [
            |p| p.spec.probe.prompt = "The capital of Italy is".to_owned(),
            |p| p.spec.probe.max_tokens = 16,
            |p| p.spec.probe.expect.value = Some(" Paris".to_owned()),
        ];
        for change in changes {
            observations.forget(&key);
            observations.track(&p);
            assert_eq!(observations.golden_answer(&key), Some(recorded.clone()));
            let mut changed = p.clone();
            change(&mut changed);
            observations.track(&changed);
            assert_eq!(observations.golden_answer(&key), None, "{:?}", changed.spec.probe);
            // Nor is one recorded for another probe taken up by an operator starting afresh.
            observations.forget(&key);
            observations.track(&changed);
            assert_eq!(observations.golden_answer(&key), None);
        }
    }

    #[test]
    fn the_jitter_seed_depends_on_the_policy_alone() {
        let a = ObjectRef::<FailoverPolicy>::new("llama").within("serving");
        let b = ObjectRef::<FailoverPolicy>::new("llama").within("staging");
        assert_eq!(stable_seed(&a), stable_seed(&a.clone()));
        assert_ne!(stable_seed(&a), stable_seed(&b));
    }
}

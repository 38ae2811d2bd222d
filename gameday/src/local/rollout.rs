//! A standby-first rollout on this machine: a scenario's `rollout` sets a new version (serving
//! flags) on both pools' templates at its time, as a user sets a new image on both workloads, and
//! the operator's own decision ([`understudy_api::rollout::decide`]) says whether the primary is
//! held. Each pool's template is rolled the way a StatefulSet rolls its pods, one replica at a
//! time and in place ([`Replica::replace`]): the same port, so its fence and its link keep
//! pointing at it. The standby is never held; the primary rolls only while the decision lets its
//! hold go.
//!
//! Replaced replicas start at once (the emulator's `--emu-instant`): a rollout's cold starts are
//! not what this shows. The decision is taken between promotions only, as the operator's keeper
//! takes it, once a probing round has fed the machine.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::Instant;
use understudy_api::crd::{RolloutPhase, RolloutRecord};
use understudy_api::rollout::{PoolView, Standing, decide};
use understudy_core::Pool;
use understudy_core::failover::{ControlPlane, FailoverState, Phase};
use understudy_prober::parity::Fingerprint;
use understudy_prober::parity::flags::{FlagPolicy, flags_fingerprint};

use super::executor::pool_name;
use super::replicas::Launcher;
use super::scenario::CheckedRollout;
use super::{Logic, START_LIMIT, lock, report};

/// A scenario's rollout while it runs.
#[derive(Debug)]
pub(super) struct Rollout {
    plan: CheckedRollout,
    launcher: Launcher,
    model: String,
    /// Each pool's serving template, its flags after the model; the new version's from the
    /// rollout's time on.
    templates: Mutex<[Vec<String>; 2]>,
    set: AtomicBool,
    /// Whether each pool's template is held, as the decision last said.
    held: [AtomicBool; 2],
    /// Whether a task replaces each pool's replicas now.
    rolling: [AtomicBool; 2],
    /// The tasks that replace them, waited for when the run ends.
    tasks: Mutex<JoinSet<()>>,
    /// The run is ending: no replacement starts.
    ending: AtomicBool,
    /// The record the decision last wrote, as status holds it.
    record: Mutex<Option<RolloutRecord>>,
    run: Mutex<RolloutRun>,
}

/// What a rollout did, timed from the start of load.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RolloutRun {
    /// When the new version was set on both pools.
    pub set_at_ms: Option<f64>,
    pub args: Vec<String>,
    /// Each phase the decision came to, in order.
    pub phases: Vec<PhaseAt>,
    /// Each replica replaced, in order.
    pub replaced: Vec<Replaced>,
}

/// A phase the rollout came to.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseAt {
    pub at_ms: f64,
    pub phase: RolloutPhase,
    /// The pool it held or rolled: the primary then.
    pub pool: String,
    pub message: String,
}

/// One replica replaced at the new version.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Replaced {
    pub at_ms: f64,
    pub pool: String,
    pub replica: String,
    /// How long from SIGTERM to the new process ready.
    pub took_ms: f64,
    /// Why it could not be replaced, when it could not.
    pub error: Option<String>,
}

impl RolloutRun {
    /// The phase it ended in.
    #[must_use]
    pub fn last_phase(&self) -> Option<&PhaseAt> {
        self.phases.last()
    }

    /// The replicas of `pool` replaced.
    #[must_use]
    pub fn replaced_in(&self, pool: &str) -> Vec<&Replaced> {
        self.replaced
            .iter()
            .filter(|r| r.pool == pool && r.error.is_none())
            .collect()
    }

    /// The report's lines.
    #[must_use]
    pub fn lines(&self) -> Vec<String> {
        let Some(set_at) = self.set_at_ms else {
            return vec!["rollout: the new version was never set".to_owned()];
        };
        let mut timed: Vec<(f64, String)> = self
            .phases
            .iter()
            .map(|phase| {
                let line = format!("{:?} on {}: {}", phase.phase, phase.pool, phase.message);
                (phase.at_ms, line)
            })
            .collect();
        for replaced in &self.replaced {
            let outcome = replaced.error.as_ref().map_or_else(
                || format!("replaced in {:.0} ms", replaced.took_ms),
                |why| format!("not replaced: {why}"),
            );
            let line = format!("{} of pool {} {outcome}", replaced.replica, replaced.pool);
            timed.push((replaced.at_ms, line));
        }
        // Stable: a phase before the replacements it started.
        timed.sort_by(|a, b| a.0.total_cmp(&b.0));
        std::iter::once(format!(
            "rollout: {} set on both pools at {set_at:.0} ms",
            self.args.join(" ")
        ))
        .chain(
            timed
                .into_iter()
                .map(|(at, line)| format!("  {at:.0} ms: {line}")),
        )
        .collect()
    }
}

impl Rollout {
    /// The rollout `plan`, over pools serving `model` with `args` (`[a, b]`) now.
    pub(super) fn new(
        plan: CheckedRollout,
        launcher: Launcher,
        model: String,
        args: [Vec<String>; 2],
    ) -> Rollout {
        Rollout {
            plan,
            launcher,
            model,
            templates: Mutex::new(args),
            set: AtomicBool::new(false),
            held: [AtomicBool::new(false), AtomicBool::new(false)],
            rolling: [AtomicBool::new(false), AtomicBool::new(false)],
            tasks: Mutex::new(JoinSet::new()),
            ending: AtomicBool::new(false),
            record: Mutex::new(None),
            run: Mutex::new(RolloutRun::default()),
        }
    }

    /// What it did.
    pub(super) fn run(&self) -> RolloutRun {
        lock(&self.run).clone()
    }

    /// Starts no more replacements and waits for those under way (each bounded by the start
    /// limit), so that no replica started for the run outlives it.
    pub(super) async fn finish(&self) {
        self.ending.store(true, Ordering::SeqCst);
        let mut tasks = std::mem::take(&mut *lock(&self.tasks));
        while tasks.join_next().await.is_some() {}
    }

    /// The serving keys of a `vllm serve` of this model with `args`, as parity reads them.
    fn keys(&self, args: &[String]) -> Fingerprint {
        let mut argv = vec!["serve".to_owned(), self.model.clone()];
        argv.extend(args.iter().cloned());
        flags_fingerprint(&argv, &FlagPolicy::default())
    }

    /// `pool` as the decision reads a workload: its template, what its running replicas run,
    /// whether it has rolled out, and the addresses it is probed at.
    fn view(&self, logic: &Logic, pool: Pool) -> PoolView {
        let target = self.keys(&lock(&self.templates)[pool.index()]);
        let mut running: Vec<Fingerprint> = Vec::new();
        let mut on_target = true;
        for replica in lock(&logic.replicas)
            .iter()
            .filter(|r| r.pool == pool && r.running())
        {
            let keys = self.keys(&replica.args);
            on_target &= keys == target;
            if !running.contains(&keys) {
                running.push(keys);
            }
        }
        PoolView {
            name: pool_name(pool).to_owned(),
            template: Some(target),
            running,
            rolled_out: on_target && !self.rolling[pool.index()].load(Ordering::SeqCst),
            replicas: lock(&logic.pools)[pool.index()]
                .replicas
                .iter()
                .map(ToString::to_string)
                .collect(),
            held: self.held[pool.index()].load(Ordering::SeqCst),
        }
    }
}

/// After a probing round: sets the new version when its time has come, decides where the rollout
/// stands from the machine's `state` and the replicas that `passing` says passed, and starts
/// rolling each pool whose template may roll and whose replicas do not all run it.
pub(super) fn keep(
    logic: &Arc<Logic>,
    state: &FailoverState,
    passing: &[Vec<SocketAddr>; 2],
    start: Instant,
) {
    let Some(rollout) = &logic.rollout else {
        return;
    };
    let now = start.elapsed();
    if now >= rollout.plan.at && !rollout.set.swap(true, Ordering::SeqCst) {
        for template in lock(&rollout.templates).iter_mut() {
            template.extend(rollout.plan.args.iter().cloned());
        }
        let mut run = lock(&rollout.run);
        run.set_at_ms = Some(report::to_ms(now));
        run.args.clone_from(&rollout.plan.args);
    }
    // Between promotions only, as the operator's keeper: holds stay as they are meanwhile.
    if state.phase != Phase::Serving
        || state.pending_action().is_some()
        || state.control_plane != ControlPlane::Reachable
        || !state.lease_known
    {
        return;
    }
    let (primary, standby) = (state.primary, state.primary.other());
    let views = [Pool::A, Pool::B].map(|pool| rollout.view(logic, pool));
    let passed: BTreeSet<String> = passing[standby.index()].iter().map(ToString::to_string).collect();
    let since_epoch = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let previous = lock(&rollout.record).clone();
    let decision = decide(
        &Standing {
            primary: &views[primary.index()],
            standby: &views[standby.index()],
            standby_health: state.health[standby.index()],
            passed: &passed,
            ready_after: logic.config.standby_ready_after,
            stop_after: logic.config.promote_after,
            allowed: &[],
            load_proof: None,
            now: since_epoch,
        },
        previous.as_ref(),
    );
    rollout.held[primary.index()].store(decision.hold, Ordering::SeqCst);
    rollout.held[standby.index()].store(false, Ordering::SeqCst);
    if decision.moved {
        lock(&rollout.run).phases.push(PhaseAt {
            at_ms: report::to_ms(now),
            phase: decision.record.phase,
            pool: decision.record.pool.clone(),
            message: decision.record.message.clone(),
        });
    }
    *lock(&rollout.record) = Some(decision.record);
    for pool in [standby, primary] {
        let view = &views[pool.index()];
        let behind = view
            .running
            .iter()
            .any(|keys| Some(keys) != view.template.as_ref());
        if behind
            && !rollout.held[pool.index()].load(Ordering::SeqCst)
            && !rollout.ending.load(Ordering::SeqCst)
            && !rollout.rolling[pool.index()].swap(true, Ordering::SeqCst)
        {
            lock(&rollout.tasks).spawn(roll(Arc::clone(logic), pool, start));
        }
    }
}

/// Replaces `pool`'s running replicas that do not run its template, one at a time, while its
/// template is not held.
async fn roll(logic: Arc<Logic>, pool: Pool, start: Instant) {
    let Some(rollout) = &logic.rollout else {
        return;
    };
    while !rollout.held[pool.index()].load(Ordering::SeqCst) && !rollout.ending.load(Ordering::SeqCst) {
        let template = lock(&rollout.templates)[pool.index()].clone();
        let taken = {
            let mut replicas = lock(&logic.replicas);
            replicas
                .iter()
                .position(|r| r.pool == pool && r.running() && r.args != template)
                .map(|i| (i, replicas.remove(i)))
        };
        let Some((index, replica)) = taken else {
            break;
        };
        let name = replica.name.clone();
        let began = start.elapsed();
        let (launcher, model) = (rollout.launcher.clone(), rollout.model.clone());
        let replaced = tokio::task::spawn_blocking(move || {
            let mut replica = replica;
            let outcome = replica.replace(&launcher, &model, &template, START_LIMIT);
            (replica, outcome)
        })
        .await;
        let error = match replaced {
            Ok((replica, outcome)) => {
                let mut replicas = lock(&logic.replicas);
                let at = index.min(replicas.len());
                replicas.insert(at, replica);
                outcome.err().map(|e| e.to_string())
            }
            Err(panicked) => Some(format!("the task replacing it failed: {panicked}")),
        };
        let failed = error.is_some();
        lock(&rollout.run).replaced.push(Replaced {
            at_ms: report::to_ms(began),
            pool: pool_name(pool).to_owned(),
            replica: name,
            took_ms: report::to_ms(start.elapsed().saturating_sub(began)),
            error,
        });
        if failed {
            break;
        }
    }
    rollout.rolling[pool.index()].store(false, Ordering::SeqCst);
}

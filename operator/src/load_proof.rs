//! Load proofs of the standby (`spec.loadProof`): the primary's recorded traffic replayed against
//! the standby's replicas, through their fences with the operator's token, at a share of the
//! rate the routers recorded it at, and judged by the policy's thresholds.
//!
//! A proof runs for its whole `duration` (a minute by default), far longer than a reconcile may
//! wait, so it runs on a task of its own ([`LoadProofs::start`]); the reconcile after it ends
//! takes its record ([`LoadProofs::finished`]) into status and the state machine, where a failure
//! blocks promotion, and once status holds it ([`LoadProofs::settle`]) an Event and metrics say
//! what it showed. While one runs, the standby's keeper leaves the standby alone (it would put the
//! replicas woken for the proof back to sleep), and a promotion, a pause or a lost Lease stops it
//! ([`LoadProofs::cancel`]): a standby being promoted must not carry a replay beside the users it
//! is about to take.
//!
//! One proof at a time per policy. This module must never send a prompt a user wrote (the routers
//! keep shapes, not text), retry a replayed request, leave a replica it woke awake when the replay
//! ends, or put one back to sleep once stopped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::future::join_all;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::watch;
use understudy_core::Pool;
use understudy_core::load_proof::{ShapeSample, Verdict, judge, plan_samples};
use understudy_prober::probe::Endpoint;
use understudy_prober::replay::{ReplayLimits, replay};
use understudy_prober::sleep::{
    ReplicaWake, WakeTimeouts, is_sleeping, put_to_sleep, wake_replica_at_its_level,
};

use crate::crd::{FailoverPolicy, LoadProofRecord, PoolSpec};
use crate::peers::{PolicyClusters, Routers};
use crate::policy::LoadProof;
use crate::ports::ReplicaEndpoints;
use crate::router_admin::{RouterToken, get_shapes, policy_key};

/// How long the routers' samples may take to arrive, all of them together.
const SHAPES_TIMEOUT: Duration = Duration::from_secs(10);

/// How each replayed request is bounded: long enough for a slow first token under load to be
/// measured as slow rather than lost; a stream silent for 30 s has stalled.
const REPLAY_LIMITS: ReplayLimits = ReplayLimits {
    timeout: Duration::from_secs(120),
    stall_after: Duration::from_secs(30),
};

/// What a proof came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Proven,
    Failed,
    /// Nothing could be replayed: no traffic recorded, no replica running, no router reached.
    NotRun,
}

impl Outcome {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Proven => "Proven",
            Outcome::Failed => "Failed",
            Outcome::NotRun => "NotRun",
        }
    }
}

/// A finished proof of one pool.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub pool: Pool,
    pub outcome: Outcome,
    pub record: LoadProofRecord,
}

/// Everything one proof needs, owned, for its task.
#[derive(Clone, Debug)]
pub struct Job {
    pub policy: Arc<FailoverPolicy>,
    pub namespace: String,
    /// The standby, as the machine names it, and its spec.
    pub pool: Pool,
    pub pool_spec: PoolSpec,
    pub proof: LoadProof,
    pub replicas: Arc<dyn ReplicaEndpoints>,
    /// When it starts, since the Unix epoch.
    pub started_at: Duration,
}

#[derive(Debug)]
enum Slot {
    Running {
        /// Tells a task from the one that ran before it under the same policy.
        id: u64,
        pool: Pool,
        stop: watch::Sender<bool>,
    },
    Finished {
        id: u64,
        finished: Finished,
    },
}

/// The load proofs under way and finished, per policy, and the routers their samples come from.
#[derive(Debug)]
pub struct LoadProofs {
    routers: Routers,
    token: RouterToken,
    slots: Mutex<HashMap<ObjectRef<FailoverPolicy>, Slot>>,
    next_id: AtomicU64,
}

impl LoadProofs {
    #[must_use]
    pub fn new(routers: Routers, token: RouterToken) -> Arc<Self> {
        Arc::new(LoadProofs {
            routers,
            token,
            slots: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        })
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<ObjectRef<FailoverPolicy>, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The pool a proof under way for `policy` is proving.
    #[must_use]
    pub fn running(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<Pool> {
        match self.slots().get(policy) {
            Some(Slot::Running { pool, .. }) => Some(*pool),
            _ => None,
        }
    }

    /// Starts `job` on a task of its own unless a proof of the policy runs or waits to be taken.
    pub fn start(self: &Arc<Self>, job: Job) -> bool {
        let key = ObjectRef::from_obj(job.policy.as_ref());
        let mut slots = self.slots();
        if slots.contains_key(&key) {
            return false;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (stop, mut stopped) = watch::channel(false);
        let this = Arc::clone(self);
        let pool = job.pool;
        let task_key = key.clone();
        tokio::spawn(async move {
            tokio::select! {
                finished = this.prove(&job, &task_key, id) => {
                    let mut slots = this.slots();
                    // Only its own slot: a stopped proof's result is no one's.
                    if this.is_current(&slots, &task_key, id) {
                        slots.insert(task_key, Slot::Finished { id, finished });
                    }
                }
                // Stopped: what it woke stays awake. A promotion wants it so; otherwise the
                // standby's keeper puts the standby back into its shape between promotions.
                _ = stopped.wait_for(|stop| *stop) => {}
            }
        });
        slots.insert(key, Slot::Running { id, pool, stop });
        true
    }

    /// A proof of `policy` that finished and is not yet settled, with its id for [`Self::settle`].
    #[must_use]
    pub fn finished(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<(u64, Finished)> {
        match self.slots().get(policy) {
            Some(Slot::Finished { id, finished }) => Some((*id, finished.clone())),
            _ => None,
        }
    }

    /// Forgets the finished proof `id` once what it found is written down; a later one stays.
    pub fn settle(&self, policy: &ObjectRef<FailoverPolicy>, id: u64) {
        let mut slots = self.slots();
        if matches!(slots.get(policy), Some(Slot::Finished { id: done, .. }) if *done == id) {
            slots.remove(policy);
        }
    }

    /// Stops a proof of `policy` under way, and says which pool it was proving. What it woke
    /// stays awake: it puts nothing back to sleep once stopped (a sleep under way when a promotion
    /// wakes the same replica would leave the new primary asleep); the standby's keeper shapes
    /// the standby again between promotions.
    pub fn cancel(&self, policy: &ObjectRef<FailoverPolicy>) -> Option<Pool> {
        let mut slots = self.slots();
        if !matches!(slots.get(policy), Some(Slot::Running { .. })) {
            // Nothing under way; a finished proof stays to be taken in.
            return None;
        }
        match slots.remove(policy) {
            Some(Slot::Running { pool, stop, .. }) => {
                stop.send_replace(true);
                Some(pool)
            }
            _ => None,
        }
    }

    /// Drops a finished proof of `policy` not yet taken in: what it found is no longer about the
    /// standby (its pool was promoted).
    pub fn drop_finished(&self, policy: &ObjectRef<FailoverPolicy>) {
        let mut slots = self.slots();
        if matches!(slots.get(policy), Some(Slot::Finished { .. })) {
            slots.remove(policy);
        }
    }

    /// Forgets a deleted policy: a proof under way is stopped, a finished one dropped.
    pub fn forget(&self, policy: &ObjectRef<FailoverPolicy>) {
        self.cancel(policy);
        self.slots().remove(policy);
    }

    /// Whether proof `id` is still the one under way for `policy`.
    fn is_current(
        &self,
        slots: &HashMap<ObjectRef<FailoverPolicy>, Slot>,
        policy: &ObjectRef<FailoverPolicy>,
        id: u64,
    ) -> bool {
        matches!(slots.get(policy), Some(Slot::Running { id: running, .. }) if *running == id)
    }

    /// What the routers recorded of the policy's traffic, each router's sample.
    async fn samples(&self, job: &Job) -> Result<Vec<ShapeSample>, String> {
        let clusters = PolicyClusters::of(&job.namespace, &job.policy);
        let routers = self.routers.resolve(Some(clusters)).await?;
        let key = policy_key(&job.policy);
        // Each router bounded on its own: one that hangs costs its sample, not the others'.
        let read = join_all(routers.iter().map(|router| async {
            tokio::time::timeout(SHAPES_TIMEOUT, get_shapes(router, &self.token, &key))
                .await
                .unwrap_or_else(|_| Err(format!("no sample within {SHAPES_TIMEOUT:?}")))
        }))
        .await;
        let mut samples = Vec::new();
        let mut failed = Vec::new();
        for (router, answer) in routers.iter().zip(read) {
            match answer {
                Ok(sample) => samples.push(sample),
                Err(why) => failed.push(format!("{router}: {why}")),
            }
        }
        if samples.is_empty() {
            return Err(format!("no router answered: {}", failed.join("; ")));
        }
        Ok(samples)
    }

    /// One proof, start to end: the sample, the plan, the standby's replicas woken where they
    /// sleep, the replay, and the woken put back to sleep at their levels unless the proof
    /// (`policy`'s `id`) was stopped meanwhile.
    async fn prove(&self, job: &Job, policy: &ObjectRef<FailoverPolicy>, id: u64) -> Finished {
        let not_run = |detail: String| Finished {
            pool: job.pool,
            outcome: Outcome::NotRun,
            record: record(job, Outcome::NotRun, detail),
        };
        let samples = match self.samples(job).await {
            Ok(samples) => samples,
            Err(why) => return not_run(format!("the primary's traffic could not be read: {why}")),
        };
        let (recorded_rate, planned) = match plan_samples(&samples, job.proof.rate_share, job.proof.duration)
        {
            Ok(planned) => planned,
            Err(why) => return not_run(why.to_string()),
        };
        let endpoints = match job.replicas.resolve(&job.namespace, &job.pool_spec).await {
            Ok(endpoints) if !endpoints.is_empty() => endpoints,
            Ok(_) => {
                return not_run(format!(
                    "no replica of {} runs to replay against (a pilot light grows only on promotion)",
                    job.pool_spec.name
                ));
            }
            Err(error) => return not_run(format!("the standby's replicas cannot be found: {error}")),
        };
        let level = job.pool_spec.standby_shape().sleep_level;
        let (awake, woken, not_woken) = wake(&endpoints, level).await;
        if awake.is_empty() {
            return not_run(format!(
                "no replica of {} could be woken for the replay: {}",
                job.pool_spec.name,
                not_woken.join("; ")
            ));
        }
        let replayed = replay(&awake, &planned, None, REPLAY_LIMITS).await;
        // Stopped meanwhile (a promotion may be waking these very replicas): nothing goes back.
        let slept = if self.is_current(&self.slots(), policy, id) {
            put_back(&woken).await
        } else {
            Vec::new()
        };
        let verdict = judge(&replayed, &job.proof.thresholds);
        let (outcome, mut detail) = if verdict.replayer_behind() {
            let late = verdict.sent_late_p99.unwrap_or_default();
            (
                Outcome::NotRun,
                format!(
                    "the replayer fell {} ms behind its plan (p99): its figures measure the operator, not the standby",
                    late.as_millis()
                ),
            )
        } else if verdict.proven {
            (Outcome::Proven, "every threshold kept".to_owned())
        } else {
            (Outcome::Failed, verdict.broken.join("; "))
        };
        if !not_woken.is_empty() {
            detail.push_str(&format!(
                "; not woken, so not replayed against: {}",
                not_woken.join("; ")
            ));
        }
        let awake_again: Vec<String> = woken
            .iter()
            .zip(&slept)
            .filter_map(|((endpoint, _), slept)| slept.as_ref().err().map(|why| format!("{endpoint}: {why}")))
            .collect();
        if !awake_again.is_empty() {
            detail.push_str(&format!("; not asleep again: {}", awake_again.join("; ")));
        }
        let mut record = record(job, outcome, detail);
        fill(&mut record, &verdict);
        record.recorded_rate = Some(round2(recorded_rate));
        record.replicas = u32::try_from(awake.len()).unwrap_or(u32::MAX);
        record.woken = u32::try_from(woken.len()).unwrap_or(u32::MAX);
        Finished {
            pool: job.pool,
            outcome,
            record,
        }
    }
}

/// Puts `woken` back to sleep, each at the level it was woken from; what became of each.
async fn put_back(woken: &[(Endpoint, u8)]) -> Vec<Result<(), String>> {
    join_all(
        woken
            .iter()
            .map(|(endpoint, level)| put_to_sleep(endpoint, *level, WakeTimeouts::default())),
    )
    .await
}

/// Wakes the sleeping ones of `endpoints`: every replica awake now, those woken with the level
/// they slept at (to put them back at), and each that could not be woken, with why.
async fn wake(endpoints: &[Endpoint], level: u8) -> (Vec<Endpoint>, Vec<(Endpoint, u8)>, Vec<String>) {
    let timeouts = WakeTimeouts::default();
    let states = join_all(endpoints.iter().map(|e| is_sleeping(e, timeouts.query))).await;
    let mut asleep = Vec::new();
    let mut awake = Vec::new();
    for (endpoint, state) in endpoints.iter().zip(&states) {
        if matches!(state, Ok(Some(true))) {
            asleep.push(endpoint);
        } else {
            awake.push(endpoint.clone());
        }
    }
    let wakes = join_all(
        asleep
            .iter()
            .map(|endpoint| wake_replica_at_its_level(endpoint, level, timeouts)),
    )
    .await;
    let mut woken = Vec::new();
    let mut not_woken = Vec::new();
    for (endpoint, (outcome, level)) in asleep.into_iter().zip(wakes) {
        if outcome == ReplicaWake::Woken {
            awake.push(endpoint.clone());
            woken.push((endpoint.clone(), level));
        } else {
            not_woken.push(format!("{endpoint}: {outcome:?}"));
        }
    }
    (awake, woken, not_woken)
}

fn record(job: &Job, outcome: Outcome, detail: String) -> LoadProofRecord {
    LoadProofRecord::new(
        crate::reconciler::rfc3339(job.started_at),
        job.pool_spec.name.clone(),
        outcome.as_str(),
        detail,
    )
}

/// The verdict's figures into `record`: the rate is the one the requests were sent at.
fn fill(record: &mut LoadProofRecord, verdict: &Verdict) {
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    record.requests = u32::try_from(verdict.requests).unwrap_or(u32::MAX);
    record.errors = u32::try_from(verdict.errors).unwrap_or(u32::MAX);
    record.replayed_rate = verdict.sent_rate.map(round2);
    record.ttft_p99_ms = verdict.ttft_p99.map(millis);
    record.itl_p99_ms = verdict.itl_p99.map(millis);
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

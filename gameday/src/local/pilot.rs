//! The pilot light: standby replicas that do not run until a promotion grows them. Each is
//! started then as a real process with the emulator's modelled startup (weight load, compile,
//! graph capture, API start), and its cold start is timed stage by stage from its own log lines
//! by the prober's cold-start reader, as the operator times a pod's from `kubectl logs
//! --timestamps`. A warm replica's start is timed the same way, from its wake.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use serde::Serialize;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use understudy_core::Pool;
use understudy_prober::coldstart::ColdStartStage;
use understudy_prober::coldstart::vllm_log::{Mark, StartupLog};

use super::executor::PoolAddrs;
use super::replicas::{Launcher, Replica, Startup};
use super::system::System;
use super::{START_LIMIT, lock};

/// The stage a warm replica's start is: its wake calls.
pub const WAKE: &str = "wake";

/// What a pool's pilot light starts, when a promotion asks for it.
#[derive(Clone, Debug)]
pub struct PilotLight {
    pub pool: Pool,
    pub launcher: Launcher,
    pub model: String,
    pub args: Vec<String>,
}

/// A pilot light as it grows: each replica a promotion asks for starts in the background and joins
/// its pool, behind a fence of its own, once it reports ready, as a pod joins its workload's
/// endpoints. The promotion does not wait for it: its AwaitServing counts the replicas that pass,
/// and the route takes the rest as they pass.
#[derive(Debug)]
pub struct Growth {
    pub pilot: PilotLight,
    system: Arc<System>,
    pools: Arc<Mutex<[PoolAddrs; 2]>>,
    replicas: Arc<Mutex<Vec<Replica>>>,
    cold_starts: Arc<Mutex<Vec<ColdStart>>>,
    /// Replicas started and not yet ready (or failed).
    starting: Arc<AtomicU32>,
    /// Why each start that failed did.
    failures: Arc<Mutex<Vec<String>>>,
    /// When the first replica was started.
    began: Mutex<Option<tokio::time::Instant>>,
    /// Told each time a replica joins its pool.
    joined: Arc<Notify>,
    tasks: Mutex<JoinSet<()>>,
}

impl Growth {
    /// Grows `pilot` into `pools`, keeping each grown replica in `replicas` (which kills it when
    /// dropped) and its cold start in `cold_starts`; its fence is one of `system`'s.
    #[must_use]
    pub fn new(
        pilot: PilotLight,
        system: Arc<System>,
        pools: Arc<Mutex<[PoolAddrs; 2]>>,
        replicas: Arc<Mutex<Vec<Replica>>>,
        cold_starts: Arc<Mutex<Vec<ColdStart>>>,
    ) -> Growth {
        Growth {
            pilot,
            system,
            pools,
            replicas,
            cold_starts,
            starting: Arc::new(AtomicU32::new(0)),
            failures: Arc::new(Mutex::new(Vec::new())),
            began: Mutex::new(None),
            joined: Arc::new(Notify::new()),
            tasks: Mutex::new(JoinSet::new()),
        }
    }

    /// Replicas started and not ready yet.
    #[must_use]
    pub fn starting(&self) -> u32 {
        self.starting.load(Ordering::SeqCst)
    }

    /// Why the starts that failed did.
    #[must_use]
    pub fn failures(&self) -> Vec<String> {
        lock(&self.failures).clone()
    }

    /// When the first replica was started, once one was.
    #[must_use]
    pub fn began(&self) -> Option<tokio::time::Instant> {
        *lock(&self.began)
    }

    /// Returns once a replica has joined its pool since the last call returned.
    pub async fn joined(&self) {
        self.joined.notified().await;
    }

    /// Starts one replica named `name` in the background, with the emulator's modelled startup.
    pub fn start(&self, name: String) {
        lock(&self.began).get_or_insert_with(tokio::time::Instant::now);
        self.starting.fetch_add(1, Ordering::SeqCst);
        let pilot = self.pilot.clone();
        let (system, pools, replicas, cold_starts, starting, failures, joined) = (
            Arc::clone(&self.system),
            Arc::clone(&self.pools),
            Arc::clone(&self.replicas),
            Arc::clone(&self.cold_starts),
            Arc::clone(&self.starting),
            Arc::clone(&self.failures),
            Arc::clone(&self.joined),
        );
        lock(&self.tasks).spawn(async move {
            let pool = pilot.pool;
            let started = tokio::task::spawn_blocking(move || {
                Replica::start(
                    &pilot.launcher,
                    &name,
                    pilot.pool,
                    &pilot.model,
                    &pilot.args,
                    Startup::Modelled,
                    START_LIMIT,
                )
            })
            .await;
            let outcome = match started {
                Ok(Ok(mut replica)) => match system.front(pool, &mut replica).await {
                    Ok((link, fence)) => {
                        // The replica joins its pool and its fence together, as one.
                        let mut addrs = lock(&pools);
                        addrs[pool.index()].replicas.push(link);
                        addrs[pool.index()].fences.push(fence);
                        drop(addrs);
                        lock(&cold_starts).push(ColdStart::of(&replica, "pilot-light"));
                        lock(&replicas).push(replica);
                        Ok(())
                    }
                    // The replica is dropped here, and killed with it.
                    Err(error) => Err(error.to_string()),
                },
                Ok(Err(error)) => Err(error.to_string()),
                Err(error) => Err(format!("starting a replica: {error}")),
            };
            starting.fetch_sub(1, Ordering::SeqCst);
            match outcome {
                Ok(()) => joined.notify_one(),
                Err(why) => lock(&failures).push(why),
            }
        });
    }

    /// Waits for the starts still under way (each bounded by the start limit), so that no replica
    /// started for the run outlives it.
    pub async fn finish(&self) {
        let mut tasks = std::mem::take(&mut *lock(&self.tasks));
        while tasks.join_next().await.is_some() {}
    }
}

/// One stage of a cold start: the prober's stage names, and `wake` for a warm replica's wake
/// calls (weights back from host memory, or reloaded after a level-2 sleep).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageTime {
    pub stage: &'static str,
    /// `null` when no line told when it began or ended.
    pub ms: Option<f64>,
}

/// One replica's cold start, as the report shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ColdStart {
    pub replica: String,
    pub tier: &'static str,
    /// From the process's start; the stages before it (node, image, container start) have no
    /// local counterpart.
    pub stages: Vec<StageTime>,
    /// From the process's start (or the wake's) to its first passing generating probe.
    pub to_first_token_ms: Option<f64>,
    #[serde(skip)]
    began: Timestamp,
    #[serde(skip)]
    api_ready: Option<Timestamp>,
}

fn between(from: Option<Timestamp>, to: Option<Timestamp>) -> Option<Duration> {
    let span = to?.duration_since(from?);
    Duration::try_from(span).ok()
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| (d.as_secs_f64() * 1e6).round() / 1e3)
}

impl ColdStart {
    /// The stages `replica`'s startup log shows, up to its API's readiness.
    #[must_use]
    pub fn of(replica: &Replica, tier: &'static str) -> ColdStart {
        ColdStart::from_log(&replica.name, tier, replica.spawned, &replica.startup_log)
    }

    /// The stages a stamped startup log shows, for a process started at `spawned`. A local process
    /// runs once it is spawned, with no image to unpack and no container to create, so there is
    /// no container start to time: its engine start runs from the spawn, as a pod's runs from its
    /// container's `startedAt`.
    #[must_use]
    pub fn from_log(replica: &str, tier: &'static str, spawned: Timestamp, text: &str) -> ColdStart {
        let log = StartupLog::parse(text);
        let at = |mark: Option<Mark>| mark.and_then(|m| m.at);
        let (loading, loaded, engine, api) = (
            at(log.load_started),
            at(log.load_finished),
            at(log.engine_ready),
            at(log.api_ready),
        );
        let stages = [
            (ColdStartStage::EngineStart, between(Some(spawned), loading)),
            (ColdStartStage::WeightLoad, between(loading, loaded)),
            (ColdStartStage::Warmup, between(loaded, engine)),
            (ColdStartStage::Ready, between(engine, api)),
        ]
        .into_iter()
        .map(|(stage, d)| StageTime {
            stage: stage.as_str(),
            ms: ms(d),
        })
        .collect();
        ColdStart {
            replica: replica.to_owned(),
            tier,
            stages,
            to_first_token_ms: None,
            began: spawned,
            api_ready: api,
        }
    }

    /// A warm replica woken at `woken`, whose wake calls began at `began`.
    #[must_use]
    pub fn woken(replica: &str, began: Timestamp, woken: Timestamp) -> ColdStart {
        ColdStart {
            replica: replica.to_owned(),
            tier: "warm",
            stages: vec![StageTime {
                stage: WAKE,
                ms: ms(between(Some(began), Some(woken))),
            }],
            to_first_token_ms: None,
            began,
            api_ready: Some(woken),
        }
    }

    /// From the process's start to its API's readiness.
    #[must_use]
    pub fn to_ready(&self) -> Option<Duration> {
        between(Some(self.began), self.api_ready)
    }

    /// Records its first passing generating probe, at `at`.
    pub fn first_token(&mut self, at: Timestamp) {
        let first_token = ColdStartStage::FirstToken.as_str();
        if self.stages.iter().any(|s| s.stage == first_token) {
            return;
        }
        self.stages.push(StageTime {
            stage: first_token,
            ms: ms(between(self.api_ready, Some(at))),
        });
        self.to_first_token_ms = ms(between(Some(self.began), Some(at)));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn stages_are_timed_between_the_stamped_lines_and_a_missing_line_leaves_its_stage_unknown() {
        let spawned: Timestamp = "2026-12-01T10:00:00Z".parse().unwrap();
        let log = "\
2026-12-01T10:00:00.100Z INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.11.0
2026-12-01T10:00:00.200Z INFO 12-01 10:00:00 [gpu_model_runner.py:1] Starting to load model m...
2026-12-01T10:00:00.750Z INFO 12-01 10:00:00 [gpu_model_runner.py:2] Model loading took 1.1 GiB memory and 0.550000 seconds
2026-12-01T10:00:01.050Z INFO 12-01 10:00:01 [launcher.py:1] Application startup complete.
";
        let mut cold = ColdStart::from_log("b-1", "pilot-light", spawned, log);
        cold.first_token("2026-12-01T10:00:01.100Z".parse().unwrap());
        let got: Vec<(&str, Option<f64>)> = cold.stages.iter().map(|s| (s.stage, s.ms)).collect();
        // No `init engine` line: warmup and ready are unknown, never guessed.
        assert_eq!(
            got,
            [
                ("engine-start", Some(200.0)),
                ("weight-load", Some(550.0)),
                ("warmup", None),
                ("ready", None),
                ("first-token", Some(50.0))
            ]
        );
        assert_eq!(cold.to_first_token_ms, Some(1_100.0));
        assert_eq!(cold.to_ready(), Some(Duration::from_millis(1_050)));
    }
}

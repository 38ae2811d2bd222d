//! The pilot light: standby replicas that do not run until a promotion grows them. Each is
//! started then as a real process with the emulator's modelled startup (weight load, compile,
//! graph capture, API start), and its cold start is timed stage by stage from its own log lines
//! by the prober's cold-start reader, as the operator times a pod's from `kubectl logs
//! --timestamps`. A warm replica's start is timed the same way, from its wake.

use std::time::Duration;

use jiff::Timestamp;
use serde::Serialize;
use understudy_core::Pool;
use understudy_prober::coldstart::ColdStartStage;
use understudy_prober::coldstart::vllm_log::{Mark, StartupLog};

use super::replicas::{Launcher, Replica};

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
    /// From the process's start; the stages before it (node, image) have no local counterpart.
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

    /// The stages a stamped startup log shows, for a process started at `spawned`.
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
            (ColdStartStage::ContainerStart, between(Some(spawned), loading)),
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
        let got: Vec<Option<f64>> = cold.stages.iter().map(|s| s.ms).collect();
        // No `init engine` line: warmup and ready are unknown, never guessed.
        assert_eq!(got, [Some(200.0), Some(550.0), None, None, Some(50.0)]);
        assert_eq!(cold.to_first_token_ms, Some(1_100.0));
        assert_eq!(cold.to_ready(), Some(Duration::from_millis(1_050)));
    }
}

//! Faults the emulator can be told to have, and the live switchboard the server consults.
//!
//! A fault is written `KIND[:ARG][@OFFSET]`, in a flag (`--emu-fault crash@30s`) or in a POST to
//! the control port. The offset counts from process start, so a crash can land in the middle of
//! weight loading. [`FaultBoard`] holds what is in force: the request path reads it with one atomic
//! load per check. This module must never be reachable from the API port.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use super::Error;

/// How a half-failed replica fails generation while `/health` stays 200.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfFailure {
    /// Non-streaming generation answers 500; a stream sends one token, then an error event.
    Error,
    /// Generation stalls after the first token and never finishes.
    Stall,
}

/// What a drifted replica reports differently from its peers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Drift {
    pub version: Option<String>,
    pub weights_digest: Option<String>,
    pub max_model_len: Option<u32>,
}

/// One fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// The process exits at once with this code, as after a kill or a segfault.
    Crash {
        code: i32,
    },
    /// Connections are accepted and requests read, and nothing is ever answered.
    Hang,
    /// The engine stops while the API server runs on, as when vLLM's worker process is stopped
    /// (SIGSTOP): `/health`, `/v1/models`, `/tokenize` and `/metrics` answer, a stream gets its
    /// 200 head and no byte of body, a plain generation no answer at all. Cleared, everything
    /// carries on where it stopped.
    EngineHung,
    /// vLLM's `EngineDeadError`: `/health` 503, generation 500, exit at the next watchdog tick.
    EngineDead,
    HalfFailed(HalfFailure),
    /// Every prefill and decode takes this many times longer.
    Slow(f64),
    /// Generation returns fluent-looking text in the model's words that differs from its own: the
    /// same vocabulary from another seed, not the garbage of unloaded weights.
    WrongOutput,
    Drift(Drift),
    /// Every fault in force is lifted (a crash or engine death cannot be).
    Clear,
}

/// A fault and when it strikes (from process start; zero means at once).
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledFault {
    pub fault: Fault,
    pub at: Duration,
}

impl ScheduledFault {
    /// Parses `KIND[:ARG][@OFFSET]`, e.g. `crash@30s`, `slow:4@1.5s`, `drift:version=0.10.0`.
    pub fn parse(spec: &str) -> Result<ScheduledFault, Error> {
        let bad = |reason: &str| Error::Fault {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let spec_trimmed = spec.trim();
        let (body, at) = match spec_trimmed.rsplit_once('@') {
            Some((body, offset)) => (
                body,
                parse_offset(offset).ok_or_else(|| bad("bad offset; write 30s, 1.5s or 500ms"))?,
            ),
            None => (spec_trimmed, Duration::ZERO),
        };
        let (kind, arg) = match body.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (body, None),
        };
        let fault = match (kind, arg) {
            ("crash", None) => Fault::Crash { code: 1 },
            ("crash", Some(code)) => Fault::Crash {
                code: code.parse().map_err(|_| bad("exit code must be a number"))?,
            },
            ("hang", None) => Fault::Hang,
            ("engine-hung", None) => Fault::EngineHung,
            ("engine-dead", None) => Fault::EngineDead,
            ("half-failed", None | Some("error")) => Fault::HalfFailed(HalfFailure::Error),
            ("half-failed", Some("stall")) => Fault::HalfFailed(HalfFailure::Stall),
            ("slow", None) => Fault::Slow(10.0),
            ("slow", Some(x)) => match x.parse::<f64>() {
                Ok(m) if m > 0.0 && m.is_finite() => Fault::Slow(m),
                _ => return Err(bad("slow takes a positive multiplier, e.g. slow:4")),
            },
            ("wrong-output", None) => Fault::WrongOutput,
            ("drift", arg) => Fault::Drift(parse_drift(arg).map_err(|r| bad(&r))?),
            ("clear", None) => Fault::Clear,
            _ => {
                return Err(bad(
                    "unknown fault; one of crash[:CODE], hang, engine-hung, engine-dead, half-failed[:error|stall], \
                     slow[:X], wrong-output, drift[:version=V,weights-digest=D,max-model-len=N], clear",
                ));
            }
        };
        Ok(ScheduledFault { fault, at })
    }
}

fn parse_drift(arg: Option<&str>) -> Result<Drift, String> {
    let Some(arg) = arg else {
        return Ok(Drift {
            weights_digest: Some("drifted".to_string()),
            ..Drift::default()
        });
    };
    let mut drift = Drift::default();
    for part in arg.split(',') {
        match part.split_once('=') {
            Some(("version", v)) => drift.version = Some(v.to_string()),
            Some(("weights-digest", v)) => drift.weights_digest = Some(v.to_string()),
            Some(("max-model-len", v)) => {
                drift.max_model_len = Some(
                    v.parse()
                        .map_err(|_| format!("max-model-len `{v}` is not a number"))?,
                )
            }
            _ => {
                return Err(format!(
                    "drift takes version=, weights-digest= or max-model-len=, not `{part}`"
                ));
            }
        }
    }
    Ok(drift)
}

fn parse_offset(raw: &str) -> Option<Duration> {
    let (number, scale) = if let Some(ms) = raw.strip_suffix("ms") {
        (ms, 0.001)
    } else if let Some(s) = raw.strip_suffix('s') {
        (s, 1.0)
    } else if let Some(m) = raw.strip_suffix('m') {
        (m, 60.0)
    } else {
        (raw, 1.0)
    };
    let secs = number.parse::<f64>().ok()? * scale;
    (secs >= 0.0 && secs.is_finite()).then(|| Duration::from_secs_f64(secs))
}

const HALF_NONE: u8 = 0;
const HALF_ERROR: u8 = 1;
const HALF_STALL: u8 = 2;

/// The faults in force right now. Cheap to read on every request and every token.
#[derive(Debug)]
pub struct FaultBoard {
    hang: AtomicBool,
    engine_dead: AtomicBool,
    half_failed: AtomicU8,
    slow_bits: AtomicU64,
    wrong_output: AtomicBool,
    drift: Mutex<Drift>,
    /// Set once, to the exit code, when the process must end now.
    exit: watch::Sender<Option<i32>>,
    /// Bumped whenever something readers cache (the drift) changes.
    changes: watch::Sender<u64>,
}

impl Default for FaultBoard {
    fn default() -> Self {
        FaultBoard {
            hang: AtomicBool::new(false),
            engine_dead: AtomicBool::new(false),
            half_failed: AtomicU8::new(HALF_NONE),
            slow_bits: AtomicU64::new(1.0f64.to_bits()),
            wrong_output: AtomicBool::new(false),
            drift: Mutex::new(Drift::default()),
            exit: watch::channel(None).0,
            changes: watch::channel(0).0,
        }
    }
}

impl FaultBoard {
    /// Puts a fault in force now.
    pub fn apply(&self, fault: &Fault) {
        match fault {
            Fault::Crash { code } => {
                self.exit.send_replace(Some(*code));
            }
            Fault::Hang => self.hang.store(true, Ordering::SeqCst),
            // The engine's gate holds it (`Engine::apply_fault`): nothing to switch here.
            Fault::EngineHung => {}
            Fault::EngineDead => self.engine_dead.store(true, Ordering::SeqCst),
            Fault::HalfFailed(HalfFailure::Error) => self.half_failed.store(HALF_ERROR, Ordering::SeqCst),
            Fault::HalfFailed(HalfFailure::Stall) => self.half_failed.store(HALF_STALL, Ordering::SeqCst),
            Fault::Slow(m) => self.slow_bits.store(m.to_bits(), Ordering::SeqCst),
            Fault::WrongOutput => self.wrong_output.store(true, Ordering::SeqCst),
            Fault::Drift(d) => {
                let mut held = self.drift.lock().unwrap_or_else(|e| e.into_inner());
                if d.version.is_some() {
                    held.version.clone_from(&d.version);
                }
                if d.weights_digest.is_some() {
                    held.weights_digest.clone_from(&d.weights_digest);
                }
                if d.max_model_len.is_some() {
                    held.max_model_len = d.max_model_len;
                }
            }
            Fault::Clear => {
                self.hang.store(false, Ordering::SeqCst);
                self.half_failed.store(HALF_NONE, Ordering::SeqCst);
                self.slow_bits.store(1.0f64.to_bits(), Ordering::SeqCst);
                self.wrong_output.store(false, Ordering::SeqCst);
                *self.drift.lock().unwrap_or_else(|e| e.into_inner()) = Drift::default();
            }
        }
        self.changes.send_modify(|n| *n += 1);
    }

    pub fn hang(&self) -> bool {
        self.hang.load(Ordering::Relaxed)
    }

    pub fn engine_dead(&self) -> bool {
        self.engine_dead.load(Ordering::Relaxed)
    }

    pub fn half_failed(&self) -> Option<HalfFailure> {
        match self.half_failed.load(Ordering::Relaxed) {
            HALF_ERROR => Some(HalfFailure::Error),
            HALF_STALL => Some(HalfFailure::Stall),
            _ => None,
        }
    }

    pub fn slow(&self) -> f64 {
        f64::from_bits(self.slow_bits.load(Ordering::Relaxed))
    }

    pub fn wrong_output(&self) -> bool {
        self.wrong_output.load(Ordering::Relaxed)
    }

    pub fn drift(&self) -> Drift {
        self.drift.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Resolves with the exit code once a crash is in force.
    pub async fn crashed(&self) -> i32 {
        let mut rx = self.exit.subscribe();
        loop {
            if let Some(code) = *rx.borrow_and_update() {
                return code;
            }
            if rx.changed().await.is_err() {
                return futures::future::pending().await;
            }
        }
    }

    /// A receiver that sees a new value whenever a fault is applied.
    pub fn watch_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn fault_specs_read_kind_argument_and_offset() {
        let f = ScheduledFault::parse("crash@30s").unwrap();
        assert_eq!(
            (f.fault, f.at),
            (Fault::Crash { code: 1 }, Duration::from_secs(30))
        );
        let f = ScheduledFault::parse("slow:4@500ms").unwrap();
        assert_eq!((f.fault, f.at), (Fault::Slow(4.0), Duration::from_millis(500)));
        assert_eq!(
            ScheduledFault::parse("half-failed:stall").unwrap().fault,
            Fault::HalfFailed(HalfFailure::Stall)
        );
        assert_eq!(
            ScheduledFault::parse("drift:version=0.10.0,max-model-len=2048")
                .unwrap()
                .fault,
            Fault::Drift(Drift {
                version: Some("0.10.0".into()),
                weights_digest: None,
                max_model_len: Some(2048)
            })
        );
    }

    #[test]
    fn a_misspelt_fault_is_refused_with_the_list_of_kinds() {
        let err = ScheduledFault::parse("crsh@3s").unwrap_err().to_string();
        assert!(err.contains("hang"), "{err}");
        assert!(ScheduledFault::parse("slow:-1").is_err());
        assert!(ScheduledFault::parse("crash@soon").is_err());
    }

    #[test]
    fn clear_lifts_faults_but_not_engine_death() {
        let board = FaultBoard::default();
        board.apply(&Fault::Hang);
        board.apply(&Fault::Slow(3.0));
        board.apply(&Fault::EngineDead);
        board.apply(&Fault::Clear);
        assert!(!board.hang());
        assert_eq!(board.slow(), 1.0);
        assert!(board.engine_dead());
    }
}

//! The pools' replicas as real processes: one `vllm-emulator` each, on loopback ports it picks
//! and reports, or one real vLLM server from the tier ([`super::vllm`]) on a port picked for it;
//! killed with a real signal when a fault says so and always when the run ends.
//!
//! A [`Replica`] owns its child process and what it started (a vLLM server is three processes):
//! dropping it kills them all and reaps the child, so a run that stops early, by a failure,
//! leaves nothing behind; they stay in this process's group, so that a terminal's Ctrl-C reaches
//! them as it reaches the runner.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use understudy_core::Pool;

use super::scenario::Engine;
use super::vllm::{self, VllmTier};

/// How to start an emulator: the program and the arguments before `serve`. The runner re-runs
/// its own binary (`understudy-gameday emulator serve …`); tests start `vllm-emulator` itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launcher {
    pub program: PathBuf,
    pub prefix: Vec<String>,
}

/// Why a replica could not be started or signalled.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("starting {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("replica {name} did not report its ports and readiness within {limit:?}; its last lines: {tail}")]
    NotReady {
        name: String,
        limit: Duration,
        tail: String,
    },
    #[error("signalling replica {name}: {message}")]
    Signal { name: String, message: String },
    #[error("picking a port for replica {name}: {source}")]
    Port {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("replica {name} is real vLLM, which is not replaced here: only emulated replicas are")]
    NotEmulated { name: String },
    #[error("replica {name} is real vLLM, whose API server has no worker process to stop (yet, or any more)")]
    NoWorker { name: String },
}

/// How long a replica's startup stages take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Startup {
    /// No time at all: the pools that are up before the run.
    Instant,
    /// The emulator's modelled weight load, compile, graph capture and API start: a replica
    /// started during the run, whose cold start is timed.
    Modelled,
}

/// One running replica.
#[derive(Debug)]
pub struct Replica {
    pub name: String,
    pub pool: Pool,
    /// The OpenAI-compatible API, on loopback.
    pub api: SocketAddr,
    /// Where the failover logic reaches the API: a link the run can cut, once it has one.
    pub link: Option<SocketAddr>,
    /// What it runs.
    pub engine: Engine,
    /// Its serving flags: its `vllm serve` command line after the model.
    pub args: Vec<String>,
    /// The emulator's fault endpoint; none for a real vLLM server.
    pub control: Option<SocketAddr>,
    /// When the process was started.
    pub spawned: jiff::Timestamp,
    /// Its log up to readiness, each line stamped when it was read, as `kubectl logs
    /// --timestamps` stamps a container's: what the cold-start reader times stages from.
    pub startup_log: String,
    child: Child,
    stopped: bool,
}

/// What a replica's stdout has told so far.
#[derive(Debug, Default)]
struct Reported {
    api: Option<SocketAddr>,
    control: Option<SocketAddr>,
    ready: bool,
    tail: Vec<String>,
    log: String,
}

/// The address after `on http://` in a log line.
fn address_in(line: &str) -> Option<SocketAddr> {
    let (_, rest) = line.split_once("on http://")?;
    rest.split_whitespace().next()?.parse().ok()
}

impl Replica {
    /// Starts replica `name` of `pool` serving `model` with the emulator, and waits until it is
    /// ready.
    pub fn start(
        launcher: &Launcher,
        name: &str,
        pool: Pool,
        model: &str,
        extra: &[String],
        startup: Startup,
        limit: Duration,
    ) -> Result<Replica, ReplicaError> {
        Replica::start_on(launcher, (name, pool), model, extra, startup, 0, limit)
    }

    /// Replaces this emulated replica with one serving `model` with `extra`, on the same port,
    /// as a StatefulSet replaces a pod in place: SIGTERM, its requests in flight answered (within
    /// `limit`, else SIGKILL), then the new process, waited for until it is ready. Its fence and
    /// its link keep pointing at it.
    pub fn replace(
        &mut self,
        launcher: &Launcher,
        model: &str,
        extra: &[String],
        limit: Duration,
    ) -> Result<(), ReplicaError> {
        if self.engine != Engine::Emulated {
            return Err(ReplicaError::NotEmulated {
                name: self.name.clone(),
            });
        }
        self.stop_within(limit)?;
        let port = self.api.port();
        let mut replaced = Replica::start_on(
            launcher,
            (&self.name, self.pool),
            model,
            extra,
            Startup::Instant,
            port,
            limit,
        )?;
        replaced.link = self.link;
        std::mem::swap(self, &mut replaced);
        Ok(())
    }

    /// SIGTERM, and SIGKILL if it is still there after `limit`.
    fn stop_within(&mut self, limit: Duration) -> Result<(), ReplicaError> {
        if self.stopped {
            return Ok(());
        }
        self.signal("-TERM")?;
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                self.stopped = true;
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.crash()
    }

    fn start_on(
        launcher: &Launcher,
        (name, pool): (&str, Pool),
        model: &str,
        extra: &[String],
        startup: Startup,
        port: u16,
        limit: Duration,
    ) -> Result<Replica, ReplicaError> {
        let mut command = Command::new(&launcher.program);
        command
            .args(&launcher.prefix)
            .args(["serve", model, "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--emu-control-port", "0"])
            .args((startup == Startup::Instant).then_some("--emu-instant"))
            .args(extra)
            .env("VLLM_SERVER_DEV_MODE", "1");
        let (mut replica, reported) = Replica::spawn(
            command,
            &launcher.program,
            (name, pool, Engine::Emulated),
            None,
            limit,
        )?;
        replica.args = extra.to_vec();
        match reported.control {
            Some(control) => {
                replica.control = Some(control);
                Ok(replica)
            }
            None => Err(ReplicaError::NotReady {
                name: name.to_owned(),
                limit,
                tail: reported.tail.join(" | "),
            }),
        }
    }

    /// Starts replica `name` of `pool` as a real vLLM server of the tier's model, served as
    /// `model`, and waits until it is ready (about a minute on two idle cores).
    pub fn start_vllm(
        tier: &VllmTier,
        name: &str,
        pool: Pool,
        model: &str,
        extra: &[String],
        limit: Duration,
    ) -> Result<Replica, ReplicaError> {
        let port = vllm::free_port().map_err(|source| ReplicaError::Port {
            name: name.to_owned(),
            source,
        })?;
        let api = SocketAddr::from(([127, 0, 0, 1], port));
        let command = tier.command(model, port, true, extra);
        Replica::spawn(
            command,
            &tier.python,
            (name, pool, Engine::Vllm),
            Some(api),
            limit,
        )
        .map(|(mut replica, _)| {
            replica.args = extra.to_vec();
            replica
        })
    }

    /// Starts `command`, reading its output, and waits for `Application startup complete.` and,
    /// when `api` is not known beforehand, the line that tells the API's address.
    fn spawn(
        mut command: Command,
        program: &std::path::Path,
        (name, pool, engine): (&str, Pool, Engine),
        api: Option<SocketAddr>,
        limit: Duration,
    ) -> Result<(Replica, Reported), ReplicaError> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let spawned = jiff::Timestamp::now();
        let mut child = command.spawn().map_err(|source| ReplicaError::Spawn {
            program: program.display().to_string(),
            source,
        })?;
        let (lines, seen) = mpsc::channel();
        // Its lines after readiness (one access line per request) are read and dropped, so that
        // the replica never blocks on a full pipe.
        follow_output(&mut child, move |line| {
            let _ = lines.send(line);
        });
        let mut replica = Replica {
            name: name.to_owned(),
            pool,
            api: api.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
            link: None,
            engine,
            args: Vec::new(),
            control: None,
            spawned,
            startup_log: String::new(),
            child,
            stopped: false,
        };
        let reported = wait_until_ready(&seen, limit);
        match (api.or(reported.api), reported.ready) {
            (Some(api), true) => {
                replica.api = api;
                replica.startup_log = reported.log.clone();
                Ok((replica, reported))
            }
            _ => Err(ReplicaError::NotReady {
                name: name.to_owned(),
                limit,
                tail: reported.tail.join(" | "),
            }),
        }
    }

    /// Its process has not been killed (it may be hung).
    #[must_use]
    pub fn running(&self) -> bool {
        !self.stopped
    }

    /// The process id, while the process exists.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL to every process of the replica: it is gone at once, its port refuses.
    pub fn crash(&mut self) -> Result<(), ReplicaError> {
        self.stopped = true;
        let killed = self.signal("-KILL");
        let _ = self.child.wait();
        killed
    }

    /// SIGSTOP to every process of the replica: connections stay open, nothing answers.
    pub fn hang(&mut self) -> Result<(), ReplicaError> {
        self.signal("-STOP")
    }

    /// SIGCONT: a hung replica carries on where it stopped.
    pub fn resume(&mut self) -> Result<(), ReplicaError> {
        if self.stopped {
            // Crashed: there is nothing to continue.
            return Ok(());
        }
        self.signal("-CONT")
    }

    /// A real vLLM server's worker process, stopped (`-STOP`) or continued (`-CONT`): stopped,
    /// the API server answers `/health` and takes requests while no generation makes progress.
    pub fn signal_worker(&mut self, signal_name: &str) -> Result<(), ReplicaError> {
        if self.stopped {
            // Crashed: its worker went with it.
            return Ok(());
        }
        let worker = vllm::worker_of(self.child.id()).ok_or_else(|| ReplicaError::NoWorker {
            name: self.name.clone(),
        })?;
        signal(worker, signal_name).map_err(|message| ReplicaError::Signal {
            name: self.name.clone(),
            message,
        })
    }

    /// Every process of the replica.
    fn signal(&self, signal_name: &str) -> Result<(), ReplicaError> {
        vllm::signal_tree(self.child.id(), signal_name).map_err(|message| ReplicaError::Signal {
            name: self.name.clone(),
            message,
        })
    }
}

/// Reads `child`'s standard output and error on threads of their own, which end with it, and
/// hands `each` every line stamped with when it was read, as `kubectl logs --timestamps` stamps
/// a container's: what the cold-start reader times stages from.
pub fn follow_output(child: &mut Child, each: impl Fn(String) + Clone + Send + 'static) {
    for pipe in [
        child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
        child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let each = each.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                each(format!("{} {line}", jiff::Timestamp::now()));
            }
        });
    }
}

/// Sends `signal` (`-STOP`, `-TERM`, …) to `pid` through kill(1): the workspace forbids the
/// unsafe a direct kill(2) needs.
pub fn signal(pid: u32, signal: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill {signal} exited with {status}"))
    }
}

/// The resident memory of `replica` and, for a real vLLM server, the processes below it (its
/// engine core and worker, found in `table`), in KiB.
#[must_use]
pub fn replica_resident_kib(replica: &Replica, table: &vllm::ProcessTable) -> u64 {
    let pid = replica.pid();
    let below = match replica.engine {
        Engine::Emulated => Vec::new(),
        Engine::Vllm => table.below(pid),
    };
    std::iter::once(pid)
        .chain(below.into_iter().map(|(child, _)| child))
        .filter_map(resident_kib)
        .sum()
}

/// The resident memory of process `pid` in KiB, from `/proc`; `None` when it is gone or this
/// system has no `/proc`.
#[must_use]
pub fn resident_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn wait_until_ready(seen: &mpsc::Receiver<String>, limit: Duration) -> Reported {
    let deadline = std::time::Instant::now() + limit;
    let mut reported = Reported::default();
    while !reported.ready {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let Ok(stamped) = seen.recv_timeout(left) else {
            break;
        };
        reported.log.push_str(&stamped);
        reported.log.push('\n');
        let line = stamped
            .split_once(' ')
            .map_or(stamped.as_str(), |(_, rest)| rest)
            .to_owned();
        if line.contains("emulator API endpoint bound") {
            reported.api = address_in(&line);
        } else if line.contains("emulator control endpoint on") {
            reported.control = address_in(&line);
        } else if line.contains("Application startup complete") {
            reported.ready = true;
        }
        reported.tail.push(line);
        if reported.tail.len() > 5 {
            reported.tail.remove(0);
        }
    }
    reported
}

impl Drop for Replica {
    fn drop(&mut self) {
        if !self.stopped {
            // A stopped (SIGSTOP) process still dies of SIGKILL; a vLLM server's engine core
            // and worker go with it.
            let _ = vllm::signal_tree(self.child.id(), "-KILL");
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_address_is_read_from_the_emulators_log_line() {
        let line = "(APIServer pid=7) INFO 11-30 06:12:10 [startup.py:1] emulator API endpoint bound, \
                    refusing connections until ready, on http://127.0.0.1:38413";
        assert_eq!(address_in(line), Some(SocketAddr::from(([127, 0, 0, 1], 38413))));
        assert_eq!(address_in("no address here"), None);
    }
}

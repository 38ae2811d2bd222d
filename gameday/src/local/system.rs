//! The data path as processes of their own: two router gateways and a fence in front of every
//! replica, each started from the router's own command line, the fences reading the lease from
//! a file the failover logic moves by compare-and-set. Their files (the lease, the routers' admin
//! tokens) live in a folder of the run's own, removed with it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use understudy_core::Pool;

use super::executor::pool_name;
use super::lock;
use super::process::{Process, ProcessError};
use super::replicas::Launcher;
use super::scenario::Checked;

/// How often a fence reads the lease file.
const FENCE_POLL_MS: u64 = 100;

/// How long a router or fence may take to report its addresses.
const LISTEN_LIMIT: Duration = Duration::from_secs(20);

/// The run's folder: made for it, removed when it is dropped.
#[derive(Debug)]
pub struct RunDir(PathBuf);

impl RunDir {
    /// A new folder under the system's temporary directory.
    pub fn create(seed: u64) -> std::io::Result<RunDir> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "understudy-gameday-{}-{seed}-{stamp}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(RunDir(dir))
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One router gateway process's addresses and token.
#[derive(Clone, Debug)]
pub struct RouterAddrs {
    pub public: SocketAddr,
    pub admin: SocketAddr,
    pub token: String,
}

/// Starts the routers and fences, and keeps them (and kills them when dropped).
#[derive(Debug)]
pub struct System {
    launcher: Launcher,
    dir: RunDir,
    processes: Mutex<Vec<Process>>,
    /// How long a fence lets a generation run on once its pool lost the lease.
    drain: Duration,
}

impl System {
    #[must_use]
    pub fn new(launcher: Launcher, dir: RunDir) -> System {
        System {
            launcher,
            dir,
            processes: Mutex::new(Vec::new()),
            drain: Duration::from_secs(60),
        }
    }

    /// Its fences let a generation run on for `drain` once their pool lost the lease.
    #[must_use]
    pub fn with_drain(mut self, drain: Duration) -> System {
        self.drain = drain;
        self
    }

    /// The lease's file, which the fences read and the failover logic moves.
    #[must_use]
    pub fn lease_file(&self) -> PathBuf {
        self.dir.path().join("lease.json")
    }

    /// The process ids of every router and fence.
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        lock(&self.processes).iter().map(Process::pid).collect()
    }

    /// Kills every router and fence.
    pub fn stop(&self) {
        lock(&self.processes).clear();
    }

    async fn start(&self, name: String, args: Vec<String>, wanted: usize) -> Result<Process, ProcessError> {
        let launcher = self.launcher.clone();
        let started = tokio::task::spawn_blocking(move || {
            Process::start(&launcher, &name, &args, wanted, LISTEN_LIMIT)
        })
        .await;
        match started {
            Ok(result) => result,
            Err(join) => Err(ProcessError::Spawn {
                name: "a router or fence".to_owned(),
                source: std::io::Error::other(join.to_string()),
            }),
        }
    }

    /// A fence process in front of `upstream`, refusing work while `pool` does not hold the
    /// lease; its address.
    pub async fn fence(&self, pool: Pool, upstream: SocketAddr) -> Result<SocketAddr, ProcessError> {
        let name = format!("fence of {upstream}");
        let args = [
            "fence",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.to_string(),
            "--pool",
            pool_name(pool),
            "--lease-file",
            &self.lease_file().display().to_string(),
            "--lease-poll-ms",
            &FENCE_POLL_MS.to_string(),
            "--drain-ms",
            &self.drain.as_millis().to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let process = self.start(name.clone(), args, 1).await?;
        let addr = process.addr("fence").ok_or(ProcessError::NotListening {
            name,
            wanted: 1,
            limit: LISTEN_LIMIT,
            tail: "no fence line".to_owned(),
        })?;
        lock(&self.processes).push(process);
        Ok(addr)
    }

    /// Router gateway number `i`, with no route yet, set as the scenario's `router` says.
    pub async fn router(&self, i: usize, checked: &Checked) -> Result<RouterAddrs, ProcessError> {
        let name = format!("router {i}");
        let token = format!("local-game-day-{i}-{}", std::process::id());
        let token_file = self.dir.path().join(format!("router-{i}.token"));
        std::fs::write(&token_file, &token).map_err(|source| ProcessError::Spawn {
            name: name.clone(),
            source,
        })?;
        let mut args: Vec<String> = [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--admin-token-file",
            &token_file.display().to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend(gateway_flags(checked));
        let process = self.start(name.clone(), args, 2).await?;
        let (Some(public), Some(admin)) = (process.addr("gateway"), process.addr("admin")) else {
            return Err(ProcessError::NotListening {
                name,
                wanted: 2,
                limit: LISTEN_LIMIT,
                tail: format!("{:?}", process.listening),
            });
        };
        lock(&self.processes).push(process);
        Ok(RouterAddrs { public, admin, token })
    }
}

/// The gateway's flags for the scenario's `router`: its defaults, less what the scenario turns
/// off.
#[must_use]
pub fn gateway_flags(checked: &Checked) -> Vec<String> {
    let router = &checked.scenario.router;
    let mut flags = Vec::new();
    if !router.retries {
        flags.extend(["--retry-budget-percent", "0", "--retry-budget-floor", "0"].map(str::to_owned));
    }
    if !router.waiting_room {
        flags.extend(["--queue-bound", "0"].map(str::to_owned));
    }
    if let Some(out_for) = checked.eject_for {
        let ms = out_for.as_millis().to_string();
        flags.extend([
            "--ejection-base-ms".to_owned(),
            ms.clone(),
            "--ejection-max-ms".to_owned(),
            ms,
        ]);
    }
    flags
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::local::scenario::{DEFAULT, Scenario};

    #[test]
    fn the_gateway_is_told_only_what_the_scenario_turns_off() {
        let defaults = Scenario::parse(DEFAULT).unwrap();
        assert!(gateway_flags(&defaults).is_empty());
        let bare = DEFAULT.replace(
            "policy:",
            "router: {retries: false, waitingRoom: false, ejectFor: 60s}\npolicy:",
        );
        let flags = gateway_flags(&Scenario::parse(&bare).unwrap()).join(" ");
        assert_eq!(
            flags,
            "--retry-budget-percent 0 --retry-budget-floor 0 --queue-bound 0 \
             --ejection-base-ms 60000 --ejection-max-ms 60000"
        );
    }
}

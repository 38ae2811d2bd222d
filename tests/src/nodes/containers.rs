//! A container as a local process: which program stands in for its image, its command line
//! and environment as the pod gives them, and its output kept as the kubelet keeps a log.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, Pod, Secret};
use kube::{Api, Client, ResourceExt};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

/// The local programs that stand in for container images.
#[derive(Debug, Clone)]
pub struct Programs {
    /// Runs every image whose name contains `vllm` (but not `vllm-cpu`): `vllm-emulator`, a
    /// drop-in for `vllm serve`.
    pub vllm: PathBuf,
    /// Runs images whose name contains `vllm-cpu`, vLLM's CPU build: `tests/vllm/serve.sh`, the
    /// real vLLM of the tier `tests/vllm/install.sh` installs. None: such images fail to start.
    pub vllm_cpu: Option<PathBuf>,
    /// Runs understudy's images, each by its binary (`understudy-router`: the gateway and the
    /// fence; `understudy-operator`; `understudy-prober`). An image whose program is not given
    /// fails to start.
    pub understudy: BTreeMap<Binary, PathBuf>,
}

/// One of understudy's images, by the binary it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Binary {
    Router,
    Operator,
    Prober,
}

/// What an image is, here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Image {
    /// vLLM's OpenAI server, whose entrypoint is `vllm serve`.
    Vllm,
    /// vLLM's CPU build, run for real ([`Programs::vllm_cpu`]); its entrypoint is `vllm serve` too.
    VllmCpu,
    /// One of understudy's own images, whose entrypoint is its binary: `understudy-operator`,
    /// `understudy-prober`, or for any other, `understudy-router`.
    Understudy(Binary),
    /// Anything else (a pause container, say): it runs no process and never exits.
    Inert,
}

impl Image {
    #[must_use]
    pub fn of(image: &str) -> Image {
        if image.contains("vllm-cpu") {
            Image::VllmCpu
        } else if image.contains("vllm") {
            Image::Vllm
        } else if image.contains("understudy-operator") {
            Image::Understudy(Binary::Operator)
        } else if image.contains("understudy-prober") {
            Image::Understudy(Binary::Prober)
        } else if image.contains("understudy") {
            Image::Understudy(Binary::Router)
        } else {
            Image::Inert
        }
    }
}

/// `text` with the pod's address for every address (`0.0.0.0`) and for loopback (`127.0.0.1`):
/// here all pods share one network, so a pod's own loopback is its own address.
fn on_pod_address(text: &str, pod_ip: Ipv4Addr) -> String {
    let ip = pod_ip.to_string();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'scan: while !rest.is_empty() {
        for address in ["0.0.0.0", "127.0.0.1"] {
            let whole = |tail: &str| !tail.starts_with(|c: char| c.is_ascii_digit());
            let starts_a_word = !out.ends_with(|c: char| c.is_ascii_digit() || c == '.');
            if let Some(tail) = rest.strip_prefix(address)
                && whole(tail)
                && starts_a_word
            {
                out.push_str(&ip);
                rest = tail;
                continue 'scan;
            }
        }
        let mut chars = rest.chars();
        out.extend(chars.next());
        rest = chars.as_str();
    }
    out
}

/// Why a container could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no program stands in for image {0:?}: give --understudy")]
    NoProgram(String),
    #[error("{0}")]
    Env(String),
    #[error("starting {program}: {source}")]
    Spawn {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The argument vector the image's program gets: the pod's `command` and `args` with the
/// image's own executable (`vllm`, `understudy-router`) left out, and the pod's address where
/// the pod says every address or loopback ([`on_pod_address`]). vLLM listens on every address
/// unless told: it is given the pod's.
#[must_use]
pub fn argv(image: Image, container: &Container, pod_ip: Ipv4Addr) -> Vec<String> {
    let command = container.command.clone().unwrap_or_default();
    let mut words: Vec<String> = match image {
        Image::Vllm | Image::VllmCpu if command.is_empty() => vec!["serve".to_owned()],
        Image::Vllm | Image::VllmCpu | Image::Understudy(_) => command.into_iter().skip(1).collect(),
        Image::Inert => command,
    };
    words.extend(container.args.iter().flatten().cloned());
    let ip = pod_ip.to_string();
    let mut words: Vec<String> = words.iter().map(|w| on_pod_address(w, pod_ip)).collect();
    if matches!(image, Image::Vllm | Image::VllmCpu) {
        let given = words.iter().any(|w| w == "--host" || w.starts_with("--host="));
        if !given {
            words.extend(["--host".to_owned(), ip]);
        }
    }
    words
}

/// A value a container's environment takes from elsewhere.
async fn resolve_env(
    client: &Client,
    pod: &Pod,
    pod_ip: Ipv4Addr,
    var: &EnvVar,
) -> Result<String, StartError> {
    if let Some(value) = &var.value {
        return Ok(on_pod_address(value, pod_ip));
    }
    let Some(from) = &var.value_from else {
        return Ok(String::new());
    };
    let namespace = pod.namespace().unwrap_or_default();
    let missing = |what: String| StartError::Env(format!("env {}: {what}", var.name));
    if let Some(field) = &from.field_ref {
        let spec = pod.spec.as_ref();
        return match field.field_path.as_str() {
            "metadata.name" => Ok(pod.name_any()),
            "metadata.namespace" => Ok(namespace),
            "metadata.uid" => Ok(pod.uid().unwrap_or_default()),
            "spec.nodeName" => Ok(spec.and_then(|s| s.node_name.clone()).unwrap_or_default()),
            "spec.serviceAccountName" => Ok(spec
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".to_owned())),
            "status.podIP" => Ok(pod_ip.to_string()),
            "status.hostIP" => Ok("127.0.0.1".to_owned()),
            other => Err(missing(format!("fieldRef {other} is not emulated"))),
        };
    }
    if let Some(key) = &from.secret_key_ref {
        let secret = Api::<Secret>::namespaced(client.clone(), &namespace)
            .get(&key.name)
            .await
            .map_err(|e| missing(format!("secret {}: {e}", key.name)))?;
        let data = secret.data.unwrap_or_default();
        let bytes = data
            .get(&key.key)
            .ok_or_else(|| missing(format!("secret {} has no key {}", key.name, key.key)))?;
        return Ok(String::from_utf8_lossy(&bytes.0).into_owned());
    }
    if let Some(key) = &from.config_map_key_ref {
        let map = Api::<ConfigMap>::namespaced(client.clone(), &namespace)
            .get(&key.name)
            .await
            .map_err(|e| missing(format!("configmap {}: {e}", key.name)))?;
        return map
            .data
            .unwrap_or_default()
            .remove(&key.key)
            .ok_or_else(|| missing(format!("configmap {} has no key {}", key.name, key.key)));
    }
    Err(missing("its source is not emulated".to_owned()))
}

/// A container's environment, as the kubelet would set it.
pub async fn environment(
    client: &Client,
    pod: &Pod,
    pod_ip: Ipv4Addr,
    container: &Container,
) -> Result<BTreeMap<String, String>, StartError> {
    let mut env = BTreeMap::new();
    for var in container.env.iter().flatten() {
        env.insert(var.name.clone(), resolve_env(client, pod, pod_ip, var).await?);
    }
    Ok(env)
}

/// Where each of a container's volume mounts lies here, longest mount path first: a secret's,
/// config map's or emptyDir volume is a directory of the pod's own (`volumes/<name>`), the keys
/// of a secret or config map written into it as files (only its `items`, when it names them); a
/// hostPath volume is the host's own path. Other kinds are not emulated: their mounts are left
/// where the container asks.
pub async fn mounts(
    client: &Client,
    pod: &Pod,
    dir: &Path,
    container: &Container,
) -> Result<Vec<(String, PathBuf)>, StartError> {
    let namespace = pod.namespace().unwrap_or_default();
    let volumes = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    let mut mounts = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let missing = |what: String| StartError::Env(format!("volume {}: {what}", mount.name));
        let Some(volume) = volumes.iter().find(|v| v.name == mount.name) else {
            return Err(missing("not in the pod".to_owned()));
        };
        if let Some(host) = &volume.host_path {
            mounts.push((mount.mount_path.clone(), PathBuf::from(&host.path)));
            continue;
        }
        let local = dir.join("volumes").join(&volume.name);
        let io = |e: std::io::Error| missing(e.to_string());
        tokio::fs::create_dir_all(&local).await.map_err(io)?;
        let (data, items): (BTreeMap<String, Vec<u8>>, _) = if let Some(from) = &volume.secret {
            let name = from.secret_name.clone().unwrap_or_default();
            let secret = Api::<Secret>::namespaced(client.clone(), &namespace)
                .get(&name)
                .await
                .map_err(|e| missing(format!("secret {name}: {e}")))?;
            let data = secret.data.unwrap_or_default();
            (
                data.into_iter().map(|(k, v)| (k, v.0)).collect(),
                from.items.clone(),
            )
        } else if let Some(from) = &volume.config_map {
            let map = Api::<ConfigMap>::namespaced(client.clone(), &namespace)
                .get(&from.name)
                .await
                .map_err(|e| missing(format!("configmap {}: {e}", from.name)))?;
            let data = map.data.unwrap_or_default();
            (
                data.into_iter().map(|(k, v)| (k, v.into_bytes())).collect(),
                from.items.clone(),
            )
        } else if volume.empty_dir.is_some() {
            (BTreeMap::new(), None)
        } else {
            continue;
        };
        let files: Vec<(String, String)> = match items {
            Some(items) => items.into_iter().map(|i| (i.key, i.path)).collect(),
            None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
        };
        for (key, path) in files {
            let bytes = data.get(&key).ok_or_else(|| missing(format!("no key {key}")))?;
            tokio::fs::write(local.join(&path), bytes).await.map_err(io)?;
        }
        mounts.push((mount.mount_path.clone(), local));
    }
    mounts.sort_by_key(|(at, _)| std::cmp::Reverse(at.len()));
    Ok(mounts)
}

/// `word` with a mount's path at its start put where the mount lies here.
#[must_use]
pub fn on_mounts(word: &str, mounts: &[(String, PathBuf)]) -> String {
    for (at, local) in mounts {
        let at = at.trim_end_matches('/');
        if let Some(rest) = word.strip_prefix(at)
            && (rest.is_empty() || rest.starts_with('/'))
        {
            return format!("{}{rest}", local.display());
        }
    }
    word.to_owned()
}

/// One container's log, each line stamped with the time it was read, as the kubelet's CRI log
/// is; kept across the container's restarts, as `kubectl logs` shows the current one's.
#[derive(Debug)]
pub struct Log {
    pub path: PathBuf,
    file: Mutex<Option<tokio::fs::File>>,
}

impl Log {
    pub async fn create(path: PathBuf) -> std::io::Result<Arc<Log>> {
        let file = tokio::fs::File::create(&path).await?;
        Ok(Arc::new(Log {
            path,
            file: Mutex::new(Some(file)),
        }))
    }

    /// Starts the log afresh, for a new instance of the container.
    pub async fn restart(&self) -> std::io::Result<()> {
        *self.file.lock().await = Some(tokio::fs::File::create(&self.path).await?);
        Ok(())
    }

    async fn append(&self, line: &str) {
        let stamped = format!("{} {line}\n", Timestamp::now());
        if let Some(file) = self.file.lock().await.as_mut() {
            // A log that cannot be written loses lines, never the container.
            let _ = file.write_all(stamped.as_bytes()).await;
        }
    }

    /// Copies `from` into the log, line by line, until it ends.
    fn follow(self: &Arc<Self>, from: impl AsyncRead + Unpin + Send + 'static) {
        let log = self.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(from).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                log.append(&line).await;
            }
        });
    }
}

/// Starts `program` with `argv` and `env`, its output going to `log`, in a process group of its
/// own (a container's processes die together: [`kill_group`]). The process is killed if the
/// handle is dropped.
pub fn spawn(
    program: &Path,
    argv: &[String],
    env: &BTreeMap<String, String>,
    dir: &Path,
    log: &Arc<Log>,
) -> Result<Child, StartError> {
    let mut child = Command::new(program)
        .args(argv)
        .envs(env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0)
        .spawn()
        .map_err(|source| StartError::Spawn {
            program: program.to_owned(),
            source,
        })?;
    if let Some(out) = child.stdout.take() {
        log.follow(out);
    }
    if let Some(err) = child.stderr.take() {
        log.follow(err);
    }
    Ok(child)
}

/// SIGKILL to every process of the container whose first process is `pid` (its group): a real
/// vLLM server's engine core and worker die with its API server, as in a container's cgroup.
pub async fn kill_group(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .status()
        .await;
}

/// Kills the process group of a container's first process when dropped: `kill_on_drop` kills
/// the process alone, and the processes it started would outlive it.
#[derive(Debug)]
pub struct GroupGuard(pub u32);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0)])
            .status();
    }
}

/// Sends SIGTERM to `pid`, as the kubelet asks a container to stop. `unsafe` is forbidden in
/// this workspace, so the signal goes through kill(1).
pub async fn terminate(pid: u32) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn container(command: &[&str], args: &[&str]) -> Container {
        let words = |w: &[&str]| (!w.is_empty()).then(|| w.iter().map(|s| (*s).to_owned()).collect());
        Container {
            name: "c".to_owned(),
            command: words(command),
            args: words(args),
            ..Container::default()
        }
    }

    const IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 12);

    #[test]
    fn a_vllm_image_without_a_command_runs_serve_on_the_pods_address() {
        let argv = argv(
            Image::Vllm,
            &container(&[], &["meta-llama/Llama-3.1-8B", "--port", "8000"]),
            IP,
        );
        assert_eq!(
            argv,
            [
                "serve",
                "meta-llama/Llama-3.1-8B",
                "--port",
                "8000",
                "--host",
                "127.0.0.12"
            ]
        );
    }

    #[test]
    fn a_vllm_command_loses_its_executable_and_every_address_becomes_the_pods() {
        let c = container(&["vllm", "serve"], &["m", "--host", "0.0.0.0"]);
        assert_eq!(argv(Image::Vllm, &c, IP), ["serve", "m", "--host", "127.0.0.12"]);
    }

    #[test]
    fn an_understudy_image_runs_its_binarys_command_line_on_the_pods_addresses() {
        let c = container(
            &["understudy-router", "fence"],
            &["--listen", "0.0.0.0:8001", "--upstream", "127.0.0.1:8000"],
        );
        assert_eq!(
            argv(Image::Understudy(Binary::Router), &c, IP),
            [
                "fence",
                "--listen",
                "127.0.0.12:8001",
                "--upstream",
                "127.0.0.12:8000"
            ]
        );
        // The chart gives only `args`, for the image's entrypoint.
        let c = container(&[], &["agent", "--admin-addr", "0.0.0.0:9400"]);
        assert_eq!(
            argv(Image::Understudy(Binary::Prober), &c, IP),
            ["agent", "--admin-addr", "127.0.0.12:9400"]
        );
    }

    #[test]
    fn a_path_under_a_mount_is_where_the_mount_lies() {
        let mounts = vec![
            (
                "/var/run/understudy/token".to_owned(),
                PathBuf::from("/pods/p/volumes/token"),
            ),
            ("/var/run".to_owned(), PathBuf::from("/pods/p/volumes/run")),
        ];
        assert_eq!(
            on_mounts("/var/run/understudy/token/token", &mounts),
            "/pods/p/volumes/token/token"
        );
        assert_eq!(on_mounts("/var/run/x", &mounts), "/pods/p/volumes/run/x");
        assert_eq!(on_mounts("/var/running", &mounts), "/var/running");
        assert_eq!(on_mounts("--flag", &mounts), "--flag");
    }

    #[test]
    fn only_whole_addresses_become_the_pods() {
        let args = "0.0.0.0:1 127.0.0.1 127.0.0.12 10.127.0.0.1 http://127.0.0.1:8000/v1";
        assert_eq!(
            on_pod_address(args, IP),
            "127.0.0.12:1 127.0.0.12 127.0.0.12 10.127.0.0.1 http://127.0.0.12:8000/v1"
        );
    }

    #[test]
    fn images_are_told_apart_by_name() {
        assert_eq!(Image::of("vllm/vllm-openai:v0.11.0"), Image::Vllm);
        assert_eq!(
            Image::of("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"),
            Image::VllmCpu
        );
        assert_eq!(
            Image::of("ghcr.io/understudy-dev/understudy-router:0.1"),
            Image::Understudy(Binary::Router)
        );
        assert_eq!(
            Image::of("ghcr.io/understudy-dev/understudy-operator:0.1"),
            Image::Understudy(Binary::Operator)
        );
        assert_eq!(
            Image::of("understudy-prober:test"),
            Image::Understudy(Binary::Prober)
        );
        assert_eq!(Image::of("registry.k8s.io/pause:3.10"), Image::Inert);
    }
}

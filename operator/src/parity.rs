//! Parity between the pools as the operator sees it: each pool's fingerprint from its pod template
//! (the canonical `vllm serve` flags, the image, the `VLLM_*` environment) and from one of its
//! running replicas (vLLM's version, each served model's root and context length, the digests of
//! how it tokenizes a fixed text and a fixed chat), compared key by key into `status.parity`.
//!
//! What cannot be read is left out of the comparison on both sides, and said, never guessed: a
//! pool with no replica running (all pilot light) is compared by its template alone, a workload
//! that is rolling out by its replicas alone. With `spec.parity.artifactDigest`, the model's
//! files are compared too (`artifact.*` keys): each replica's model directory is found on its node
//! from its pod ([`model_host_path`]) and read there by the node's GPU agent
//! (`understudy_prober::model_cache`); the operator never reads weights itself. This module
//! compares; the state machine decides what drift means (`Observation::Parity`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use understudy_prober::parity::flags::{FlagPolicy, canonical_flags, flags_fingerprint, runs_vllm};
use understudy_prober::parity::runtime::runtime_fingerprint;
use understudy_prober::parity::{DriftReport, Fingerprint, allows};
use understudy_prober::probe::Endpoint;

use crate::crd::{ParitySpec, ParityStatus};
pub use crate::crd::{drift_line, drift_of};

/// `VLLM_*` variables that change how vLLM logs or which dev routes it serves, never an answer:
/// left out of the fingerprint.
const QUIET_ENV: [&str; 4] = [
    "VLLM_SERVER_DEV_MODE",
    "VLLM_LOGGING_LEVEL",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_PREFIX",
];

/// How a pool's vLLM is started, from its pod template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServingConfig {
    /// The serving container's command and arguments together.
    pub argv: Vec<String>,
    pub image: Option<String>,
    /// Its `VLLM_*` environment given as values (not from Secrets or fields), but for those that
    /// change only logging and dev routes.
    pub env: BTreeMap<String, String>,
}

fn argv_of(container: &Container) -> Vec<String> {
    container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .cloned()
        .collect()
}

impl ServingConfig {
    /// The model it serves: `vllm serve MODEL` or `--model MODEL`.
    #[must_use]
    pub fn model(&self) -> Option<String> {
        canonical_flags(&self.argv, &FlagPolicy::default()).remove("model")
    }

    /// The names clients ask for it by: the `--served-model-name` values (it takes one or more;
    /// the last time it is given counts, `--served_model_name` too, as vLLM reads it), or else
    /// the model itself, as vLLM answers `/v1/models`.
    #[must_use]
    pub fn served_models(&self) -> Vec<String> {
        let mut flags = canonical_flags(&self.argv, &FlagPolicy::default());
        match flags.remove("served-model-name") {
            Some(names) => names.split_whitespace().map(str::to_owned).collect(),
            None => flags.remove("model").into_iter().collect(),
        }
    }
}

/// The serving container of `template`: the first that runs vLLM ([`runs_vllm`]) and names a
/// model (`vllm serve MODEL` or `--model MODEL`); `None` when none does.
#[must_use]
pub fn serving_container(template: &PodTemplateSpec) -> Option<&Container> {
    let policy = FlagPolicy::default();
    template.spec.as_ref()?.containers.iter().find(|container| {
        let argv = argv_of(container);
        runs_vllm(&argv, container.image.as_deref()) && canonical_flags(&argv, &policy).contains_key("model")
    })
}

/// How the serving container of `template` ([`serving_container`]) starts vLLM.
#[must_use]
pub fn serving_config(template: &PodTemplateSpec) -> Option<ServingConfig> {
    let container = serving_container(template)?;
    let env = container
        .env
        .iter()
        .flatten()
        .filter(|var| var.name.starts_with("VLLM_") && !QUIET_ENV.contains(&var.name.as_str()))
        .filter_map(|var| Some((var.name.clone(), var.value.clone()?)))
        .collect();
    Some(ServingConfig {
        argv: argv_of(container),
        image: container.image.clone(),
        env,
    })
}

/// The flags parity leaves out: vLLM's own that never change answers, and the policy's
/// `ignoreFlags`.
#[must_use]
pub fn flag_policy(spec: &ParitySpec) -> FlagPolicy {
    let mut policy = FlagPolicy::default();
    for flag in &spec.ignore_flags {
        policy
            .ignore
            .insert(flag.trim_start_matches('-').replace('_', "-"));
    }
    policy
}

/// The directory on its node that a replica's vLLM loads its model from: the model's path, or
/// for a Hugging Face id its `models--ORG--NAME` folder in the hub cache, found as
/// `huggingface_hub` finds it (`--download-dir`, else `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`,
/// `HF_HOME/hub`, `XDG_CACHE_HOME/huggingface/hub`, `HOME/.cache/huggingface/hub`, root's home),
/// followed through the serving container's mounts to the hostPath volume it lies on. `Err` says
/// why it cannot be told (a variable set from a reference, a `subPathExpr`, a volume that is not
/// the node's own): only a node's own model cache can be read where it lies.
pub fn model_host_path(spec: &PodSpec) -> Result<String, String> {
    let template = PodTemplateSpec {
        metadata: None,
        spec: Some(spec.clone()),
    };
    let container = serving_container(&template).ok_or("no container serves a model with vLLM")?;
    let flags = canonical_flags(&argv_of(container), &FlagPolicy::default());
    let model = flags.get("model").ok_or("its vLLM names no model")?;
    let env = |name: &str| -> Result<Option<String>, String> {
        let Some(var) = container.env.iter().flatten().find(|var| var.name == name) else {
            return Ok(None);
        };
        var.value
            .clone()
            .map(Some)
            .ok_or_else(|| format!("{name} is set from a reference, which is not read here"))
    };
    let dir = if model.starts_with('/') {
        PathBuf::from(model)
    } else {
        let hub = match flags.get("download-dir") {
            Some(dir) => dir.clone(),
            None => hub_cache(&env)?,
        };
        Path::new(&hub).join(format!("models--{}", model.replace('/', "--")))
    };
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .filter(|mount| dir.starts_with(&mount.mount_path))
        .max_by_key(|mount| mount.mount_path.len())
        .ok_or_else(|| format!("its model directory {} is on no volume", dir.display()))?;
    if mount.sub_path_expr.is_some() {
        return Err(format!(
            "its model directory is on volume {} through a subPathExpr",
            mount.name
        ));
    }
    let host = spec
        .volumes
        .iter()
        .flatten()
        .find(|volume| volume.name == mount.name)
        .and_then(|volume| volume.host_path.as_ref())
        .ok_or_else(|| {
            format!(
                "its model directory {} is on volume {}, which is not a hostPath",
                dir.display(),
                mount.name
            )
        })?;
    let mut path = PathBuf::from(&host.path);
    for part in [mount.sub_path.as_deref().unwrap_or("")]
        .into_iter()
        .map(Path::new)
        .chain(dir.strip_prefix(&mount.mount_path).ok())
    {
        if !part.as_os_str().is_empty() {
            path.push(part);
        }
    }
    Ok(path.to_string_lossy().into_owned())
}

/// The Hugging Face hub cache as `huggingface_hub` finds it in an environment `env` reads.
fn hub_cache(env: &dyn Fn(&str) -> Result<Option<String>, String>) -> Result<String, String> {
    for name in ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"] {
        if let Some(cache) = env(name)? {
            return Ok(cache);
        }
    }
    if let Some(home) = env("HF_HOME")? {
        return Ok(format!("{home}/hub"));
    }
    let cache = match env("XDG_CACHE_HOME")? {
        Some(cache) => cache,
        None => format!("{}/.cache", env("HOME")?.unwrap_or_else(|| "/root".to_owned())),
    };
    Ok(format!("{cache}/huggingface/hub"))
}

/// Which reading a key comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    Template,
    Runtime,
    Artifact,
}

/// The prefix of the keys read from the model's files.
pub const ARTIFACT: &str = "artifact.";

fn source(key: &str) -> Source {
    if key.starts_with("flag.") || key.starts_with("env.") || key == "runtime.image" {
        Source::Template
    } else if key.starts_with(ARTIFACT) {
        Source::Artifact
    } else {
        Source::Runtime
    }
}

/// One node's reading of a pool's model files: its fingerprint, `None` while the node's agent
/// takes its first full digest, or why it could not be read.
#[derive(Clone, Debug)]
pub struct ArtifactReading {
    pub node: String,
    pub reading: Result<Option<Fingerprint>, String>,
}

/// Whose model files a reading is: the primary's are what the standby must match, so where its
/// nodes disagree the most of them say what it serves; the standby's must all match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Primary,
    Standby,
}

/// A pool's model files as its nodes read them, one value per key, and what was not read and
/// why. Where the nodes that read them disagree, the value names each node's (`node-1=…;
/// node-2=…`), which matches no other pool's and so is drift; but for the primary a value more
/// than half its nodes read is its value, and the disagreement is said: one node's corrupt copy
/// under a failing primary must not keep a sound standby from taking over.
#[must_use]
pub fn artifact(pool: &str, role: Role, readings: Vec<ArtifactReading>) -> (Fingerprint, Vec<String>) {
    let mut missing = Vec::new();
    let mut read = Vec::new();
    for ArtifactReading { node, reading } in readings {
        match reading {
            Ok(Some(fingerprint)) => read.push((node, fingerprint)),
            Ok(None) => missing.push(format!(
                "{pool}'s model files on node {node}: the first full digest is being taken"
            )),
            Err(why) => missing.push(format!("{pool}'s model files on node {node}: {why}")),
        }
    }
    let keys: BTreeSet<&String> = read.iter().flat_map(|(_, fp)| fp.0.keys()).collect();
    let mut merged = Fingerprint::default();
    for key in keys {
        let values: BTreeSet<Option<&str>> = read.iter().map(|(_, fp)| fp.get(key)).collect();
        if let [Some(value)] = values.iter().copied().collect::<Vec<_>>()[..] {
            merged.insert(format!("{ARTIFACT}{key}"), value);
            continue;
        }
        let each = read
            .iter()
            .map(|(node, fp)| format!("{node}={}", fp.get(key).unwrap_or("absent")))
            .collect::<Vec<_>>()
            .join(SPLIT);
        // A file most of the primary's nodes lack is one it does not have: absence is a vote.
        let held_by = |value: Option<&str>| read.iter().filter(|(_, fp)| fp.get(key) == value).count();
        let most = values.iter().find(|value| 2 * held_by(**value) > read.len());
        match (role, most) {
            (Role::Primary, Some(value)) => {
                missing.push(format!(
                    "{pool}'s nodes disagree on {key} ({each}): compared by most of them"
                ));
                if let Some(value) = value {
                    merged.insert(format!("{ARTIFACT}{key}"), *value);
                }
            }
            _ => merged.insert(format!("{ARTIFACT}{key}"), each),
        }
    }
    (merged, missing)
}

/// One pool's fingerprint, with the readings it has and why it lacks the others.
#[derive(Clone, Debug, Default)]
pub struct Side {
    pub fingerprint: Fingerprint,
    read: BTreeSet<Source>,
    pub missing: Vec<String>,
}

/// The keys a serving template is compared by: its canonical flags (`flag.*`), its `VLLM_*`
/// environment (`env.*`) and its image (`runtime.image`, the digest when it is pinned by one).
#[must_use]
pub fn template_keys(config: &ServingConfig, flags: &FlagPolicy) -> Fingerprint {
    let mut keys = flags_fingerprint(&config.argv, flags);
    for (name, value) in &config.env {
        keys.insert(format!("env.{name}"), value.clone());
    }
    if let Some(image) = &config.image {
        let digest = image.rsplit_once('@').map_or(image.as_str(), |(_, d)| d);
        keys.insert("runtime.image", digest);
    }
    keys
}

/// Reads `pool`'s side: its template's `config` (`Err` says why there is none) and what its
/// replica at `endpoint` reports within `timeout`.
pub async fn side(
    pool: &str,
    config: Result<ServingConfig, String>,
    endpoint: Option<&Endpoint>,
    flags: &FlagPolicy,
    timeout: Duration,
) -> Side {
    let mut side = Side::default();
    match config {
        Ok(config) => {
            side.fingerprint.extend(template_keys(&config, flags));
            side.read.insert(Source::Template);
        }
        Err(why) => side
            .missing
            .push(format!("{pool}'s serving flags and environment: {why}")),
    }
    match endpoint {
        None => side
            .missing
            .push(format!("{pool}'s runtime: no replica of it is running")),
        Some(endpoint) => match runtime_fingerprint(endpoint, None, timeout).await {
            Ok(runtime) => {
                side.fingerprint.extend(runtime);
                side.read.insert(Source::Runtime);
            }
            Err(error) => side.missing.push(format!("{pool}'s runtime: {error}")),
        },
    }
    side
}

/// Whether `fingerprint` (a pool's [`artifact`] keys) is a settled reading, fit to be kept as the
/// pool's: no node's file was answered as changed and being digested again, and its nodes agree.
#[must_use]
pub fn settled(fingerprint: &Fingerprint) -> bool {
    fingerprint
        .0
        .values()
        .all(|value| !value.starts_with(CHANGED) && !value.contains(SPLIT))
}

/// How the node agent answers a file that changed since its last full digest.
const CHANGED: &str = understudy_prober::model_cache::CHANGED;
/// What separates the nodes' values in a key they disagree on.
const SPLIT: &str = "; ";

/// The digest of `fingerprint`'s keys that `allowed` (the policy's `allowDrift`) does not let
/// differ: what a pool known by its digest alone is compared by.
#[must_use]
pub fn blocking_digest(fingerprint: &Fingerprint, allowed: &[String]) -> String {
    Fingerprint(
        fingerprint
            .0
            .iter()
            .filter(|(key, _)| !allowed.iter().any(|pattern| allows(pattern, key)))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect(),
    )
    .digest()
}

impl Side {
    /// Adds the model files' keys ([`artifact`]) and what of them was not read.
    pub fn add_artifact(&mut self, (fingerprint, missing): (Fingerprint, Vec<String>)) {
        if !fingerprint.0.is_empty() {
            self.read.insert(Source::Artifact);
        }
        self.fingerprint.extend(fingerprint);
        self.missing.extend(missing);
    }
}

/// The primary's and the standby's sides compared over what both read; `allowed` keys (the
/// policy's `allowDrift`) are reported apart and block nothing.
#[must_use]
pub fn compare(primary: Side, standby: Side, allowed: &[String], checked_at: String) -> ParityStatus {
    let both: BTreeSet<Source> = primary.read.intersection(&standby.read).copied().collect();
    let keep = |side: Side| {
        Fingerprint(
            side.fingerprint
                .0
                .into_iter()
                .filter(|(key, _)| both.contains(&source(key)))
                .collect(),
        )
    };
    let (mut not_compared, standby_missing) = (primary.missing.clone(), standby.missing.clone());
    not_compared.extend(standby_missing);
    let (primary, standby) = (keep(primary), keep(standby));
    let compared = primary.0.keys().chain(standby.0.keys()).collect::<BTreeSet<_>>();
    let artifact_keys = compared.iter().filter(|key| key.starts_with(ARTIFACT)).count();
    let compared = compared.len();
    let (blocking, allowed): (DriftReport, DriftReport) = primary.drift(&standby).split(allowed);
    ParityStatus {
        checked_at,
        compared: u32::try_from(compared).unwrap_or(u32::MAX),
        artifact_keys: u32::try_from(artifact_keys).unwrap_or(u32::MAX),
        drift: drift_of(blocking.differences),
        allowed: drift_of(allowed.differences),
        not_compared,
        model_files: Vec::new(),
    }
}

/// Whether `parity` says the standby may be promoted: `None` when nothing was compared.
#[must_use]
pub fn holds(parity: &ParityStatus) -> Option<bool> {
    (parity.compared > 0).then_some(parity.drift.is_empty())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn template(yaml: &str) -> PodTemplateSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn side_of(keys: &[(&str, &str)], read: &[Source]) -> Side {
        let mut side = Side::default();
        for (key, value) in keys {
            side.fingerprint.insert(*key, *value);
        }
        side.read = read.iter().copied().collect();
        side
    }

    #[test]
    fn the_served_model_names_are_the_flags_or_else_the_model() {
        let config = |argv: &str| ServingConfig {
            argv: argv.split(' ').map(str::to_owned).collect(),
            ..ServingConfig::default()
        };
        assert_eq!(
            config("vllm serve meta/llama --port 8000").served_models(),
            ["meta/llama"]
        );
        assert_eq!(
            config("vllm serve meta/llama --served-model-name llama chat --port 8000").served_models(),
            ["llama", "chat"]
        );
        assert_eq!(
            config("vllm serve --model meta/llama --served-model-name=llama").served_models(),
            ["llama"]
        );
        assert_eq!(
            config("vllm serve m --served_model_name a --served-model-name b").served_models(),
            ["b"],
            "the last one given, however it is spelt"
        );
    }

    #[test]
    fn the_serving_container_gives_its_flags_image_and_vllm_environment() {
        let config = serving_config(&template(
            r"
spec:
  containers:
    - {name: fence, image: understudy-router, args: [fence, --lease, chat-epoch]}
    - name: vllm
      image: vllm/vllm-openai@sha256:abc
      command: [vllm, serve]
      args: [meta-llama/Llama-3.1-70B-Instruct, --max-model-len, '8192']
      env:
        - {name: VLLM_USE_V1, value: '1'}
        - {name: VLLM_SERVER_DEV_MODE, value: '1'}
        - {name: HF_TOKEN, valueFrom: {secretKeyRef: {name: hf, key: token}}}
        - {name: POD_NAME, value: x}
",
        ))
        .unwrap();
        assert_eq!(config.image.as_deref(), Some("vllm/vllm-openai@sha256:abc"));
        assert_eq!(
            config.env,
            BTreeMap::from([("VLLM_USE_V1".to_owned(), "1".to_owned())])
        );
        assert_eq!(config.argv[0], "vllm");
    }

    #[test]
    fn only_what_both_sides_read_is_compared_and_allowed_keys_block_nothing() {
        let primary = side_of(
            &[
                ("flag.max-model-len", "8192"),
                ("env.VLLM_LOGGING_LEVEL", "INFO"),
                ("runtime.version", "0.11.0"),
            ],
            &[Source::Template, Source::Runtime],
        );
        let mut standby = side_of(
            &[
                ("flag.max-model-len", "4096"),
                ("env.VLLM_LOGGING_LEVEL", "DEBUG"),
            ],
            &[Source::Template],
        );
        standby
            .missing
            .push("west's runtime: no replica of it is running".to_owned());
        let parity = compare(primary, standby, &["env.*".to_owned()], "t".to_owned());
        assert_eq!(parity.compared, 2, "runtime.version is not compared: {parity:?}");
        assert_eq!(drift_line(&parity.drift), "flag.max-model-len (8192 ≠ 4096)");
        assert_eq!(parity.allowed[0].key, "env.VLLM_LOGGING_LEVEL");
        assert_eq!(
            parity.not_compared,
            ["west's runtime: no replica of it is running"]
        );
        assert_eq!(holds(&parity), Some(false));
    }

    #[test]
    fn nothing_read_on_one_side_compares_nothing_and_says_nothing_about_holding() {
        let primary = side_of(&[("flag.model", "m")], &[Source::Template]);
        let standby = side_of(&[("runtime.version", "0.11.0")], &[Source::Runtime]);
        let parity = compare(primary, standby, &[], "t".to_owned());
        assert_eq!(parity.compared, 0);
        assert_eq!(holds(&parity), None);
    }

    fn pod_spec(yaml: &str) -> PodSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn a_replicas_model_directory_is_found_on_the_hostpath_its_container_mounts() {
        let hub = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    command: [vllm, serve, meta-llama/Llama-3.1-8B]
    env: [{name: HF_HOME, value: /cache}]
    volumeMounts: [{name: models, mountPath: /cache}]
volumes: [{name: models, hostPath: {path: /var/lib/models}}]
",
        );
        assert_eq!(
            model_host_path(&hub).unwrap(),
            "/var/lib/models/hub/models--meta-llama--Llama-3.1-8B"
        );
        let path = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    args: [--model, /models/qwen, --download-dir, /elsewhere]
    volumeMounts:
      - {name: scratch, mountPath: /models/tmp}
      - {name: cache, mountPath: /models, subPath: team-a}
volumes:
  - {name: scratch, emptyDir: {}}
  - {name: cache, hostPath: {path: /mnt/nvme/models}}
",
        );
        assert_eq!(model_host_path(&path).unwrap(), "/mnt/nvme/models/team-a/qwen");
        let download_dir = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    command: [vllm, serve, org/m, --download-dir, /dl]
    volumeMounts: [{name: dl, mountPath: /dl}]
volumes: [{name: dl, hostPath: {path: /data}}]
",
        );
        assert_eq!(model_host_path(&download_dir).unwrap(), "/data/models--org--m");
        let pvc = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    command: [vllm, serve, org/m]
    volumeMounts: [{name: hf, mountPath: /root/.cache/huggingface}]
volumes: [{name: hf, persistentVolumeClaim: {claimName: models}}]
",
        );
        assert_eq!(
            model_host_path(&pvc).unwrap_err(),
            "its model directory /root/.cache/huggingface/hub/models--org--m is on volume hf, which is not a hostPath"
        );
        let xdg = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    command: [vllm, serve, org/m]
    env: [{name: XDG_CACHE_HOME, value: /xdg}]
    volumeMounts: [{name: c, mountPath: /xdg}]
volumes: [{name: c, hostPath: {path: /n}}]
",
        );
        assert_eq!(
            model_host_path(&xdg).unwrap(),
            "/n/huggingface/hub/models--org--m"
        );
        let referenced = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    command: [vllm, serve, org/m]
    env: [{name: HF_HOME, valueFrom: {configMapKeyRef: {name: c, key: home}}}]
",
        );
        assert_eq!(
            model_host_path(&referenced).unwrap_err(),
            "HF_HOME is set from a reference, which is not read here"
        );
        let expr = pod_spec(
            r"
containers:
  - name: vllm
    image: vllm/vllm-openai
    command: [vllm, serve, /models/m]
    volumeMounts: [{name: c, mountPath: /models, subPathExpr: $(POD)}]
volumes: [{name: c, hostPath: {path: /n}}]
",
        );
        assert!(model_host_path(&expr).unwrap_err().contains("subPathExpr"));
        let unmounted =
            pod_spec("containers: [{name: vllm, image: vllm/vllm-openai, command: [vllm, serve, org/m]}]");
        assert!(
            model_host_path(&unmounted)
                .unwrap_err()
                .contains("is on no volume")
        );
    }

    #[test]
    fn nodes_that_read_a_pools_model_files_differently_give_a_value_no_other_pool_matches() {
        let fingerprint = |digest: &str| {
            let mut fp = Fingerprint::default();
            fp.insert("model.file.w.sha256", digest);
            fp.insert("model.file.w.size", "16");
            fp
        };
        let reading = |node: &str, reading| ArtifactReading {
            node: node.to_owned(),
            reading,
        };
        let (agreed, missing) = artifact(
            "east",
            Role::Standby,
            vec![
                reading("n1", Ok(Some(fingerprint("aa")))),
                reading("n2", Ok(Some(fingerprint("aa")))),
                reading("n3", Ok(None)),
                reading("n4", Err("no GPU agent on it answered".to_owned())),
            ],
        );
        assert_eq!(agreed.get("artifact.model.file.w.sha256"), Some("aa"));
        assert_eq!(
            missing,
            [
                "east's model files on node n3: the first full digest is being taken",
                "east's model files on node n4: no GPU agent on it answered"
            ]
        );
        let split_readings = || {
            vec![
                reading("n1", Ok(Some(fingerprint("aa")))),
                reading("n2", Ok(Some(fingerprint("bb")))),
            ]
        };
        let (split, _) = artifact("west", Role::Standby, split_readings());
        assert_eq!(split.get("artifact.model.file.w.sha256"), Some("n1=aa; n2=bb"));
        assert_eq!(split.get("artifact.model.file.w.size"), Some("16"));

        let mut primary = Side::default();
        primary.add_artifact((agreed, Vec::new()));
        let mut standby = Side::default();
        standby.add_artifact((split, Vec::new()));
        let parity = compare(primary, standby, &[], "t".to_owned());
        assert_eq!(parity.artifact_keys, 2);
        assert_eq!(
            drift_line(&parity.drift),
            "artifact.model.file.w.sha256 (aa ≠ n1=aa; n2=bb)"
        );

        // A primary's node with another copy is outvoted, and said; an even split is not.
        let mut outvoted = split_readings();
        outvoted.push(reading("n3", Ok(Some(fingerprint("bb")))));
        let (primary, missing) = artifact("east", Role::Primary, outvoted);
        assert_eq!(primary.get("artifact.model.file.w.sha256"), Some("bb"));
        assert_eq!(
            missing,
            ["east's nodes disagree on model.file.w.sha256 (n1=aa; n2=bb; n3=bb): compared by most of them"]
        );
        let (even, _) = artifact("east", Role::Primary, split_readings());
        assert_eq!(even.get("artifact.model.file.w.sha256"), Some("n1=aa; n2=bb"));
    }

    #[test]
    fn the_policys_ignored_flags_are_left_out_however_they_are_written() {
        let policy = flag_policy(&ParitySpec {
            ignore_flags: vec!["--served_model_name".to_owned()],
            ..ParitySpec::default()
        });
        assert!(policy.ignore.contains("served-model-name"));
        assert!(policy.ignore.contains("port"));
    }
}

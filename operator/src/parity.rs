//! Parity between the pools as the operator sees it: each pool's fingerprint from its pod template
//! (the canonical `vllm serve` flags, the image, the `VLLM_*` environment) and from one of its
//! running replicas (vLLM's version, each served model's root and context length, the digests of
//! how it tokenizes a fixed text and a fixed chat), compared key by key into `status.parity`.
//!
//! What cannot be read is left out of the comparison on both sides, and said, never guessed: a
//! pool with no replica running (all pilot light) is compared by its template alone, a workload
//! that is rolling out by its replicas alone. The model's files are not read here; the prober
//! reads them where they are (`understudy-prober parity --model-dir`). This module compares; the
//! state machine decides what drift means (`Observation::Parity`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, PodTemplateSpec};
use understudy_prober::parity::flags::{FlagPolicy, canonical_flags, flags_fingerprint, runs_vllm};
use understudy_prober::parity::runtime::runtime_fingerprint;
use understudy_prober::parity::{Difference, DriftReport, Fingerprint};
use understudy_prober::probe::Endpoint;

use crate::crd::{ParityDrift, ParitySpec, ParityStatus};

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

/// Which reading a key comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    Template,
    Runtime,
}

fn source(key: &str) -> Source {
    if key.starts_with("flag.") || key.starts_with("env.") || key == "runtime.image" {
        Source::Template
    } else {
        Source::Runtime
    }
}

/// One pool's fingerprint, with the readings it has and why it lacks the others.
#[derive(Clone, Debug, Default)]
pub struct Side {
    pub fingerprint: Fingerprint,
    read: BTreeSet<Source>,
    pub missing: Vec<String>,
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
            side.fingerprint.extend(flags_fingerprint(&config.argv, flags));
            for (name, value) in config.env {
                side.fingerprint.insert(format!("env.{name}"), value);
            }
            if let Some(image) = config.image {
                let digest = image.rsplit_once('@').map_or(image.as_str(), |(_, d)| d);
                side.fingerprint.insert("runtime.image", digest);
            }
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

fn drift_of(differences: Vec<Difference>) -> Vec<ParityDrift> {
    differences
        .into_iter()
        .map(|d| ParityDrift {
            key: d.key,
            primary: d.left,
            standby: d.right,
        })
        .collect()
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
    let compared = primary
        .0
        .keys()
        .chain(standby.0.keys())
        .collect::<BTreeSet<_>>()
        .len();
    let (blocking, allowed): (DriftReport, DriftReport) = primary.drift(&standby).split(allowed);
    ParityStatus {
        checked_at,
        compared: u32::try_from(compared).unwrap_or(u32::MAX),
        drift: drift_of(blocking.differences),
        allowed: drift_of(allowed.differences),
        not_compared,
    }
}

/// Whether `parity` says the standby may be promoted: `None` when nothing was compared.
#[must_use]
pub fn holds(parity: &ParityStatus) -> Option<bool> {
    (parity.compared > 0).then_some(parity.drift.is_empty())
}

/// The drifted keys in one line: `flag.max-model-len (8192 ≠ 4096), …`.
#[must_use]
pub fn drift_line(drift: &[ParityDrift]) -> String {
    let side = |v: &Option<String>| v.clone().unwrap_or_else(|| "absent".to_owned());
    drift
        .iter()
        .map(|d| format!("{} ({} ≠ {})", d.key, side(&d.primary), side(&d.standby)))
        .collect::<Vec<_>>()
        .join(", ")
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

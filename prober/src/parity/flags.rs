//! `vllm serve` arguments in a canonical form, so that two pods with the same configuration
//! written differently agree, and two that differ are reported by flag.
//!
//! `--x=y` and `--x y` are the same, `--x_y` is `--x-y` (vLLM's parser accepts both), a bare
//! `--x` is `true` and `--no-x` is `false`, numbers compare by value (`0.90` is `0.9`), JSON
//! values by content, order is ignored, the last of a repeated flag wins (argparse's rule),
//! flags at their default are dropped, and flags that do not change answers (`--port`) are
//! ignored. This module parses; it must never guess a default it was not given.

use std::collections::{BTreeMap, BTreeSet};

use understudy_core::vllm::is_switch;

use super::Fingerprint;

/// Which flags to ignore and which values are defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagPolicy {
    /// Flag names (canonical, without `--`) that never count toward parity.
    pub ignore: BTreeSet<String>,
    /// Canonical values that are the same as leaving the flag out.
    pub defaults: BTreeMap<String, String>,
}

impl Default for FlagPolicy {
    fn default() -> Self {
        let ignore = [
            "host",
            "port",
            "api-key",
            "uvicorn-log-level",
            "disable-log-requests",
            "enable-log-requests",
            "disable-log-stats",
            "disable-uvicorn-access-log",
            "ssl-keyfile",
            "ssl-certfile",
            "root-path",
            "allowed-origins",
        ];
        // vLLM's own defaults for flags whose default does not depend on the hardware.
        let defaults = [
            ("tensor-parallel-size", "1"),
            ("pipeline-parallel-size", "1"),
            ("data-parallel-size", "1"),
            ("dtype", "auto"),
            ("gpu-memory-utilization", "0.9"),
            ("seed", "0"),
            ("trust-remote-code", "false"),
            ("enforce-eager", "false"),
            ("load-format", "auto"),
            ("kv-cache-dtype", "auto"),
            ("tokenizer-mode", "auto"),
            ("enable-sleep-mode", "false"),
            ("generation-config", "auto"),
        ];
        FlagPolicy {
            ignore: ignore.iter().map(|s| s.to_string()).collect(),
            defaults: defaults
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }
}

fn short_alias(flag: &str) -> Option<&'static str> {
    match flag {
        "-tp" => Some("tensor-parallel-size"),
        "-pp" => Some("pipeline-parallel-size"),
        "-dp" => Some("data-parallel-size"),
        "-q" => Some("quantization"),
        "-O" => Some("compilation-config"),
        _ => None,
    }
}

fn canonical_value(raw: &str) -> String {
    let trimmed = raw.trim();
    match trimmed {
        "True" | "true" => return "true".into(),
        "False" | "false" => return "false".into(),
        _ => {}
    }
    if (trimmed.starts_with('{') || trimmed.starts_with('['))
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(trimmed)
    {
        return v.to_string();
    }
    let numeric = !trimmed.is_empty()
        && trimmed
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'-' || b == b'e' || b == b'+');
    match trimmed.parse::<f64>() {
        Ok(n) if numeric && n.is_finite() => format!("{n}"),
        _ => trimmed.to_owned(),
    }
}

/// Whether a container running `argv` from `image` is a vLLM server: it runs `vllm serve` or the
/// OpenAI API server module, names `--model`, or runs a vLLM image (whose entrypoint is `vllm
/// serve`, so that its arguments start with the model). A sidecar's positional argument is not a
/// model.
#[must_use]
pub fn runs_vllm(argv: &[String], image: Option<&str>) -> bool {
    serve_arguments(argv).len() < argv.len()
        || argv.iter().any(|a| a == "--model" || a.starts_with("--model="))
        || image.is_some_and(|image| {
            let name = image.split(['@', ':']).next().unwrap_or(image);
            name.rsplit('/')
                .next()
                .is_some_and(|repo| repo.starts_with("vllm"))
        })
}

/// The arguments after `vllm serve` (or the API server module), or all of them.
fn serve_arguments(argv: &[String]) -> &[String] {
    if let Some(i) = argv.iter().position(|a| a == "serve")
        && i > 0
        && argv[i - 1].ends_with("vllm")
    {
        return &argv[i + 1..];
    }
    if let Some(i) = argv
        .iter()
        .position(|a| a == "vllm.entrypoints.openai.api_server")
    {
        return &argv[i + 1..];
    }
    argv
}

/// Canonical `flag name → value`, defaults dropped and ignorable flags left out.
pub fn canonical_flags(argv: &[String], policy: &FlagPolicy) -> BTreeMap<String, String> {
    let args = serve_arguments(argv);
    let mut flags: BTreeMap<String, String> = BTreeMap::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let (name, inline) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (n.replace('_', "-"), Some(v.to_owned())),
                None => (long.replace('_', "-"), None),
            }
        } else if let Some(alias) = short_alias(arg) {
            (alias.to_owned(), None)
        } else {
            // A positional argument: `vllm serve MODEL` is `--model MODEL`.
            flags.entry("model".into()).or_insert_with(|| arg.clone());
            continue;
        };
        let value = match inline {
            Some(v) => v,
            // A switch takes no value; an explicit boolean after one is read as its value, a model
            // name never is.
            None if is_switch(&name) => match args.get(i).map(String::as_str) {
                Some(b @ ("true" | "True" | "false" | "False")) => {
                    i += 1;
                    b.to_owned()
                }
                _ => "true".to_owned(),
            },
            None => {
                let start = i;
                while i < args.len() && !args[i].starts_with("--") && short_alias(&args[i]).is_none() {
                    i += 1;
                }
                if start == i {
                    "true".to_owned()
                } else {
                    args[start..i].join(" ")
                }
            }
        };
        let (name, value) = match name.strip_prefix("no-") {
            Some(positive) if value == "true" => (positive.to_owned(), "false".to_owned()),
            _ => (name, value),
        };
        flags.insert(name, canonical_value(&value));
    }
    flags.retain(|name, value| !policy.ignore.contains(name) && policy.defaults.get(name) != Some(value));
    flags
}

/// The flags as fingerprint entries `flag.<name>`.
pub fn flags_fingerprint(argv: &[String], policy: &FlagPolicy) -> Fingerprint {
    let mut fp = Fingerprint::default();
    for (name, value) in canonical_flags(argv, policy) {
        fp.insert(format!("flag.{name}"), value);
    }
    fp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn a_vllm_server_is_told_from_a_sidecar_by_its_command_flags_or_image() {
        assert!(runs_vllm(&words(&["vllm", "serve", "Qwen/Qwen3-0.6B"]), None));
        assert!(runs_vllm(
            &words(&["python3", "-m", "vllm.entrypoints.openai.api_server"]),
            None
        ));
        assert!(runs_vllm(&words(&["--model", "m"]), Some("registry/other:1")));
        assert!(runs_vllm(
            &words(&["Qwen/Qwen3-0.6B"]),
            Some("docker.io/vllm/vllm-openai:v0.11.0")
        ));
        assert!(runs_vllm(
            &words(&["Qwen/Qwen3-0.6B"]),
            Some("vllm/vllm-openai@sha256:abc")
        ));
        assert!(!runs_vllm(
            &words(&["fence", "--lease", "chat-epoch"]),
            Some("understudy/router:0.1")
        ));
        assert!(!runs_vllm(&words(&["fence"]), None));
    }

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    fn flags(s: &str) -> BTreeMap<String, String> {
        canonical_flags(&argv(s), &FlagPolicy::default())
    }

    #[test]
    fn equals_and_space_forms_order_underscores_and_number_spelling_agree() {
        let a = flags(
            "vllm serve Qwen/Qwen3-8B --max-model-len=8192 --gpu-memory-utilization 0.85 --enforce-eager",
        );
        let b = flags(
            "vllm serve --enforce-eager true --gpu_memory_utilization=0.850 --max-model-len 8192 --model Qwen/Qwen3-8B",
        );
        assert_eq!(a, b);
        assert_eq!(a.get("model").map(String::as_str), Some("Qwen/Qwen3-8B"));
        assert_eq!(a.get("gpu-memory-utilization").map(String::as_str), Some("0.85"));
    }

    #[test]
    fn a_switch_before_the_model_never_takes_the_model_as_its_value() {
        let before = flags_fingerprint(
            &argv("vllm serve --enforce-eager Qwen/Qwen3-8B"),
            &FlagPolicy::default(),
        );
        let after = flags_fingerprint(
            &argv("vllm serve Qwen/Qwen3-8B --enforce-eager"),
            &FlagPolicy::default(),
        );
        assert_eq!(before, after);
        let a = flags("vllm serve --trust-remote-code --no-enable-prefix-caching m --max-num-seqs 8");
        assert_eq!(a.get("model").map(String::as_str), Some("m"));
        assert_eq!(a.get("trust-remote-code").map(String::as_str), Some("true"));
        assert_eq!(a.get("enable-prefix-caching").map(String::as_str), Some("false"));
        assert_eq!(
            a,
            flags("vllm serve m --max-num-seqs 8 --no-enable-prefix-caching --trust-remote-code")
        );
    }

    #[test]
    fn defaults_and_ignorable_flags_drop_out_and_no_flags_are_false() {
        let a = flags(
            "vllm serve m --port 8000 --host 0.0.0.0 --tensor-parallel-size 1 --dtype auto --api-key s3cret",
        );
        assert_eq!(a, flags("vllm serve m"));
        assert!(!a.values().any(|v| v == "s3cret"), "the API key is never kept");
        let b = flags("vllm serve m --no-enable-prefix-caching -tp 2");
        assert_eq!(b.get("enable-prefix-caching").map(String::as_str), Some("false"));
        assert_eq!(b.get("tensor-parallel-size").map(String::as_str), Some("2"));
    }

    #[test]
    fn json_values_compare_by_content_and_the_last_repeat_wins() {
        let a = flags(
            r#"python3 -m vllm.entrypoints.openai.api_server --model m --compilation-config {"level":3,"cudagraph_mode":"FULL"}"#,
        );
        let b = flags(r#"vllm serve m -O {"cudagraph_mode":"FULL","level":3}"#);
        assert_eq!(a, b);
        assert_eq!(
            flags("vllm serve m --max-num-seqs 64 --max-num-seqs 128"),
            flags("vllm serve m --max-num-seqs 128")
        );
    }

    #[test]
    fn a_configured_ignore_list_is_honoured() {
        let mut policy = FlagPolicy::default();
        policy.ignore.insert("served-model-name".into());
        let a = canonical_flags(&argv("vllm serve m --served-model-name a"), &policy);
        let b = canonical_flags(&argv("vllm serve m --served-model-name b"), &policy);
        assert_eq!(a, b);
        assert_ne!(
            flags("vllm serve m --served-model-name a"),
            flags("vllm serve m --served-model-name b")
        );
    }
}

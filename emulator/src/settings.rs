//! The emulator's own settings: everything under `--emu-…`, or in the YAML file `--emu-config`.
//!
//! A key is the flag name without `--emu-` (`--emu-weights-gib 14` is `weights-gib: 14`); flags
//! override the file. Every duration is in seconds and every size in GiB, so a setting reads the
//! same in a flag, a file and the docs (`docs/emulator.md`). This module only types values; it must
//! never start timers or decide behaviour.

use std::path::Path;

use serde::Deserialize;

use super::Error;

/// What happens to a request that arrives while the engine sleeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AsleepRequests {
    /// Current vLLM: the request waits in the queue, unanswered, until `/wake_up`.
    Park,
    /// The behaviour proposed in vllm#45326: finish at once with `finish_reason: "abort"`.
    Abort,
}

/// The emulator's settings, with the defaults of a small model that starts in about a second.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct EmuSettings {
    /// Every startup stage takes no time (fast tests); the cost model is untouched.
    pub instant: bool,
    /// Prefill and decode take no time: only the emulator's own overhead remains (benchmarks).
    pub zero_cost: bool,
    /// What `/version` and the startup log report (0.32.0, the current line, by default); a
    /// version before 0.32 also prints 0.11's log lines ([`Dialect`](super::log::Dialect)).
    pub vllm_version: String,
    /// Model weights on the GPU, per tensor-parallel rank summed.
    pub weights_gib: f64,
    /// Disk or network to GPU: weight load at start and `reload_weights`.
    pub load_gib_per_s: f64,
    /// Host memory to GPU and back: level-1 sleep offload and wake.
    pub host_gib_per_s: f64,
    /// torch.compile at start (skipped with `--enforce-eager`).
    pub compile_s: f64,
    /// CUDA graph capture at start (skipped with `--enforce-eager`).
    pub cudagraph_s: f64,
    pub cudagraph_gib: f64,
    /// Memory profiling and KV-cache allocation inside engine init.
    pub profile_s: f64,
    /// From engine ready to the uvicorn ready line.
    pub api_startup_s: f64,
    /// Extra time the first generation takes after `/health` is already 200.
    pub deferred_warmup_s: f64,
    /// Re-allocating GPU memory on a level-2 wake (the weights stay garbage).
    pub wake_alloc_s: f64,
    /// The context length when `--max-model-len` is not given (the model's own).
    pub model_max_len: u32,
    /// KV-cache capacity in tokens, shared by every running request.
    pub kv_cache_tokens: u32,
    /// Prefill time per uncached prompt token.
    pub prefill_s_per_token: f64,
    /// Fixed cost of one prefill (scheduling, first forward pass).
    pub prefill_overhead_s: f64,
    /// Time between two output tokens of one request decoding alone.
    pub decode_s_per_token: f64,
    /// How much one more running request lengthens everyone's decode step (0.01 = 1 %).
    pub decode_batch_slowdown: f64,
    /// Multiplies every prefill and decode time (a `slow` fault multiplies again).
    pub latency_multiplier: f64,
    /// Part of the model's identity: a different digest gives different text.
    pub weights_digest: Option<String>,
    pub asleep_requests: AsleepRequests,
    /// vLLM's engine-death watchdog period; the process exits at the next tick after death.
    pub watchdog_s: f64,
    /// Where the control endpoint listens; none unless set. Never the API port.
    pub control_port: Option<u16>,
    pub control_host: String,
    /// Faults, each `KIND[:ARG][@OFFSET]`, e.g. `crash@30s`, `slow:4@10s`, `half-failed:stall`.
    pub fault: Vec<String>,
}

impl Default for EmuSettings {
    fn default() -> Self {
        EmuSettings {
            instant: false,
            zero_cost: false,
            vllm_version: "0.32.0".to_string(),
            weights_gib: 1.1,
            load_gib_per_s: 2.0,
            host_gib_per_s: 10.0,
            compile_s: 0.2,
            cudagraph_s: 0.15,
            cudagraph_gib: 0.31,
            profile_s: 0.1,
            api_startup_s: 0.05,
            deferred_warmup_s: 0.0,
            wake_alloc_s: 0.05,
            model_max_len: 32768,
            kv_cache_tokens: 131072,
            prefill_s_per_token: 0.00005,
            prefill_overhead_s: 0.002,
            decode_s_per_token: 0.008,
            decode_batch_slowdown: 0.01,
            latency_multiplier: 1.0,
            weights_digest: None,
            asleep_requests: AsleepRequests::Park,
            watchdog_s: 5.0,
            control_port: None,
            control_host: "127.0.0.1".to_string(),
            fault: Vec::new(),
        }
    }
}

/// Settings whose values are strings however they look.
const STRING_SETTINGS: &[&str] = &["vllm-version", "weights-digest", "control-host"];

impl EmuSettings {
    /// Types the `--emu-…` pairs over the YAML file named by `--emu-config`, if any.
    pub fn from_flags(pairs: &[(String, String)]) -> Result<EmuSettings, Error> {
        let mut map = serde_yaml::Mapping::new();
        if let Some((_, path)) = pairs.iter().rev().find(|(k, _)| k == "config") {
            let text = std::fs::read_to_string(Path::new(path)).map_err(|source| Error::ReadConfig {
                path: path.clone(),
                source,
            })?;
            match serde_yaml::from_str::<serde_yaml::Value>(&text)
                .map_err(|e| Error::Settings(format!("{path}: {e}")))?
            {
                serde_yaml::Value::Mapping(m) => map = m,
                serde_yaml::Value::Null => {}
                _ => return Err(Error::Settings(format!("{path}: expected a mapping of settings"))),
            }
        }
        let mut faults: Vec<serde_yaml::Value> = match map.remove("fault") {
            Some(serde_yaml::Value::Sequence(s)) => s,
            Some(one) => vec![one],
            None => Vec::new(),
        };
        for (key, raw) in pairs.iter().filter(|(k, _)| k != "config") {
            if key == "fault" {
                faults.push(serde_yaml::Value::String(raw.clone()));
                continue;
            }
            // Plain scalars typed as YAML types them (`2` a number, `true` a bool), except settings
            // that are strings even when they look like numbers (`--emu-vllm-version 0.11`).
            if STRING_SETTINGS.contains(&key.as_str()) {
                map.insert(
                    serde_yaml::Value::String(key.clone()),
                    serde_yaml::Value::String(raw.clone()),
                );
                continue;
            }
            let value = serde_yaml::from_str::<serde_yaml::Value>(raw)
                .ok()
                .filter(|v| !matches!(v, serde_yaml::Value::Mapping(_) | serde_yaml::Value::Sequence(_)))
                .unwrap_or_else(|| serde_yaml::Value::String(raw.clone()));
            map.insert(serde_yaml::Value::String(key.clone()), value);
        }
        map.insert("fault".into(), serde_yaml::Value::Sequence(faults));
        let settings: EmuSettings = serde_yaml::from_value(serde_yaml::Value::Mapping(map))
            .map_err(|e| Error::Settings(format!("--emu-…: {e}")))?;
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> Result<(), Error> {
        let positive = [
            ("load-gib-per-s", self.load_gib_per_s),
            ("host-gib-per-s", self.host_gib_per_s),
            ("latency-multiplier", self.latency_multiplier),
        ];
        for (name, value) in positive {
            if !(value > 0.0 && value.is_finite()) {
                return Err(Error::Settings(format!(
                    "--emu-{name} must be a positive number, not {value}"
                )));
            }
        }
        let durations = [
            ("weights-gib", self.weights_gib),
            ("compile-s", self.compile_s),
            ("cudagraph-s", self.cudagraph_s),
            ("profile-s", self.profile_s),
            ("api-startup-s", self.api_startup_s),
            ("deferred-warmup-s", self.deferred_warmup_s),
            ("wake-alloc-s", self.wake_alloc_s),
            ("prefill-s-per-token", self.prefill_s_per_token),
            ("prefill-overhead-s", self.prefill_overhead_s),
            ("decode-s-per-token", self.decode_s_per_token),
            ("decode-batch-slowdown", self.decode_batch_slowdown),
            ("watchdog-s", self.watchdog_s),
        ];
        for (name, value) in durations {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(Error::Settings(format!(
                    "--emu-{name} must be zero or more, not {value}"
                )));
            }
        }
        if self.kv_cache_tokens == 0 {
            return Err(Error::Settings(
                "--emu-kv-cache-tokens must be at least 1".to_string(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn flags_are_typed_and_faults_accumulate() {
        let s = EmuSettings::from_flags(&pairs(&[
            ("weights-gib", "14"),
            ("instant", "true"),
            ("fault", "crash@30s"),
            ("fault", "slow:2"),
            ("asleep-requests", "abort"),
            ("weights-digest", "123"),
        ]))
        .unwrap();
        assert_eq!(s.weights_gib, 14.0);
        assert!(s.instant);
        assert_eq!(s.fault, vec!["crash@30s".to_string(), "slow:2".to_string()]);
        assert_eq!(s.asleep_requests, AsleepRequests::Abort);
        assert_eq!(s.weights_digest.as_deref(), Some("123"));
    }

    #[test]
    fn an_unknown_emulator_setting_is_an_error_not_a_silent_default() {
        assert!(EmuSettings::from_flags(&pairs(&[("weigths-gib", "14")])).is_err());
        assert!(EmuSettings::from_flags(&pairs(&[("load-gib-per-s", "0")])).is_err());
    }

    #[test]
    fn a_yaml_file_is_read_and_flags_override_it() {
        let dir = std::env::temp_dir().join(format!("emu-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("emu.yaml");
        std::fs::write(&file, "weights-gib: 20\ncompile-s: 3\nfault: [hang@5s]\n").unwrap();
        let s = EmuSettings::from_flags(&pairs(&[
            ("config", file.to_str().unwrap()),
            ("compile-s", "1"),
            ("fault", "crash@9s"),
        ]))
        .unwrap();
        assert_eq!((s.weights_gib, s.compile_s), (20.0, 1.0));
        assert_eq!(s.fault, vec!["hang@5s".to_string(), "crash@9s".to_string()]);
    }
}

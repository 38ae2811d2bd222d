//! Parity fingerprints: a flat, sorted map from a named key (`model.commit`,
//! `model.file.model.safetensors.sha256`, `tokenizer.tokenizer.json.sha256`, `runtime.version`,
//! `flag.max-model-len`, …) to a value, and what differs between two of them. Flat keys make a
//! [`DriftReport`] name exactly what differs, with both values. Reading a replica's fingerprint is
//! the prober's; comparing two, and deciding from the comparison, is pure and lives here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Everything that must agree between two replicas, by key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fingerprint(pub BTreeMap<String, String>);

impl Fingerprint {
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.insert(key.into(), value.into());
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// One SHA-256 over every key and value, in key order: equal for equal fingerprints.
    #[must_use]
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        for (key, value) in &self.0 {
            hasher.update(key.as_bytes());
            hasher.update([0]);
            hasher.update(value.as_bytes());
            hasher.update([b'\n']);
        }
        hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Adds every entry of `other` (its keys win).
    pub fn extend(&mut self, other: Fingerprint) {
        self.0.extend(other.0);
    }

    /// What differs from `other`: each key present on either side with different values.
    pub fn drift(&self, other: &Fingerprint) -> DriftReport {
        let mut differences = Vec::new();
        let keys: std::collections::BTreeSet<&String> = self.0.keys().chain(other.0.keys()).collect();
        for key in keys {
            let (a, b) = (self.0.get(key), other.0.get(key));
            if a != b {
                differences.push(Difference {
                    key: key.clone(),
                    left: a.cloned(),
                    right: b.cloned(),
                });
            }
        }
        DriftReport { differences }
    }
}

/// One key whose values differ (`None`: absent on that side).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub key: String,
    pub left: Option<String>,
    pub right: Option<String>,
}

/// Every difference between two fingerprints, sorted by key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DriftReport {
    pub differences: Vec<Difference>,
}

impl DriftReport {
    /// Parity holds when nothing differs.
    pub fn holds(&self) -> bool {
        self.differences.is_empty()
    }

    pub fn keys(&self) -> Vec<&str> {
        self.differences.iter().map(|d| d.key.as_str()).collect()
    }

    /// This report split into the differences no pattern of `allowed` names, and those one does.
    /// A pattern is a key, or ends in `*` and names every key it begins.
    #[must_use]
    pub fn split(self, allowed: &[String]) -> (DriftReport, DriftReport) {
        let (allowed, blocking): (Vec<Difference>, Vec<Difference>) = self
            .differences
            .into_iter()
            .partition(|d| allowed.iter().any(|pattern| allows(pattern, &d.key)));
        (
            DriftReport {
                differences: blocking,
            },
            DriftReport { differences: allowed },
        )
    }

    /// One line per difference: `key: left ≠ right`.
    pub fn render(&self) -> String {
        if self.holds() {
            return "parity holds: no differences\n".to_owned();
        }
        let side = |v: &Option<String>| v.clone().unwrap_or_else(|| "(absent)".to_owned());
        self.differences
            .iter()
            .map(|d| format!("{}: {} ≠ {}\n", d.key, side(&d.left), side(&d.right)))
            .collect()
    }
}

/// Whether `pattern` names `key`: the same, or a prefix of it ending in `*`.
#[must_use]
pub fn allows(pattern: &str, key: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => key.starts_with(prefix),
        None => pattern == key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_keys_are_split_off_by_name_or_by_prefix() {
        let mut a = Fingerprint::default();
        a.insert("env.VLLM_LOGGING_LEVEL", "INFO");
        a.insert("env.VLLM_USE_V1", "1");
        a.insert("flag.max-model-len", "8192");
        let mut b = Fingerprint::default();
        b.insert("env.VLLM_LOGGING_LEVEL", "DEBUG");
        b.insert("flag.max-model-len", "4096");
        let (blocking, allowed) = a.drift(&b).split(&["env.*".to_owned()]);
        assert_eq!(blocking.keys(), ["flag.max-model-len"]);
        assert_eq!(allowed.keys(), ["env.VLLM_LOGGING_LEVEL", "env.VLLM_USE_V1"]);
        let (blocking, _) = a
            .drift(&b)
            .split(&["env.VLLM_USE_V1".to_owned(), "flag.max-model-len*".to_owned()]);
        assert_eq!(blocking.keys(), ["env.VLLM_LOGGING_LEVEL"]);
        assert!(!allows("env.VLLM", "env.VLLM_USE_V1"));
    }

    #[test]
    fn the_report_names_each_differing_key_with_both_values_and_absent_sides() {
        let mut a = Fingerprint::default();
        a.insert("runtime.version", "0.11.0");
        a.insert("flag.max-model-len", "8192");
        a.insert("flag.enforce-eager", "true");
        let mut b = a.clone();
        assert!(a.drift(&b).holds());
        b.insert("runtime.version", "0.10.2");
        b.0.remove("flag.enforce-eager");
        let report = a.drift(&b);
        assert_eq!(report.keys(), vec!["flag.enforce-eager", "runtime.version"]);
        assert_eq!(
            report.render(),
            "flag.enforce-eager: true ≠ (absent)\nruntime.version: 0.11.0 ≠ 0.10.2\n"
        );
    }
}

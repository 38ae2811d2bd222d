//! The chart's values agree with its schema, its README and its templates: every value in
//! `values.yaml` is in `values.schema.json` (and every schema property in `values.yaml`), every
//! value is in the README's table, and every value a template reads exists; and the dashboard
//! and the alerts query only metrics the binaries export. Rendering, `helm lint` and installing
//! the chart are the cluster tier's (`tests/cluster/e2e.sh`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/understudy")
}

/// The values' paths, walked beside the schema: a mapping whose schema names its properties is
/// walked into, anything else (a scalar, a list, a free-form map such as labels or resources) is
/// one value. Every path the walk meets must be in the schema; `nodes` gets every path, `values`
/// the ones that are values.
fn walk(values: &Yaml, schema: &Json, at: &str, nodes: &mut BTreeSet<String>, leaves: &mut BTreeSet<String>) {
    let properties = schema.get("properties").and_then(Json::as_object);
    let (Yaml::Mapping(map), Some(properties)) = (values, properties) else {
        leaves.insert(at.to_owned());
        return;
    };
    for (key, value) in map {
        let key = key.as_str().unwrap();
        let path = if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        };
        let node = properties
            .get(key)
            .unwrap_or_else(|| panic!("`{path}` is in values.yaml and not in values.schema.json"));
        nodes.insert(path.clone());
        walk(value, node, &path, nodes, leaves);
    }
    for key in properties.keys() {
        let path = if at.is_empty() {
            key.clone()
        } else {
            format!("{at}.{key}")
        };
        assert!(
            map.contains_key(key.as_str()),
            "`{path}` is in values.schema.json and not in values.yaml"
        );
    }
}

fn values() -> (BTreeSet<String>, BTreeSet<String>) {
    let chart = chart();
    let values: Yaml =
        serde_yaml::from_str(&std::fs::read_to_string(chart.join("values.yaml")).unwrap()).unwrap();
    let schema: Json =
        serde_json::from_str(&std::fs::read_to_string(chart.join("values.schema.json")).unwrap()).unwrap();
    let (mut nodes, mut leaves) = (BTreeSet::new(), BTreeSet::new());
    walk(&values, &schema, "", &mut nodes, &mut leaves);
    (nodes, leaves)
}

/// The dotted name that starts `text`.
fn dotted(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
        .unwrap_or(text.len());
    text[..end].trim_end_matches('.')
}

/// Every `.Values.a.b` a template reads, and every `$x.b` of a variable `$x := .Values.a`.
fn read_by(template: &str) -> BTreeSet<String> {
    let mut read = BTreeSet::new();
    let mut aliases = Vec::new();
    for (at, _) in template.match_indices(".Values.") {
        let path = dotted(&template[at + ".Values.".len()..]);
        read.insert(path.to_owned());
        let before = template[..at].trim_end_matches('$').trim_end();
        if let Some(assigned) = before.strip_suffix(":=") {
            let name = assigned.trim_end().rsplit(' ').next().unwrap_or_default();
            if name.starts_with('$') && name.len() > 1 {
                aliases.push((format!("{name}."), path.to_owned()));
            }
        }
    }
    for (alias, path) in aliases {
        for (at, _) in template.match_indices(&alias) {
            read.insert(format!("{path}.{}", dotted(&template[at + alias.len()..])));
        }
    }
    read
}

#[test]
fn every_value_is_in_the_schema_and_the_readme() {
    let (_, leaves) = values();
    let readme = std::fs::read_to_string(chart().join("README.md")).unwrap();
    let missing: Vec<&String> = leaves
        .iter()
        .filter(|path| !readme.contains(&format!("| `{path}` |")))
        .collect();
    assert!(missing.is_empty(), "not in the README's table: {missing:?}");
    // And the table names nothing that is not a value.
    let listed: BTreeSet<&str> = readme
        .lines()
        .filter_map(|line| line.strip_prefix("| `")?.split_once("` |").map(|(path, _)| path))
        .filter(|path| path.contains('.') && !path.starts_with("Understudy"))
        .collect();
    let unknown: Vec<&&str> = listed.iter().filter(|path| !leaves.contains(**path)).collect();
    assert!(
        unknown.is_empty(),
        "in the README's table and not a value: {unknown:?}"
    );
}

#[test]
fn every_value_a_template_reads_exists() {
    let (nodes, _) = values();
    let mut read = BTreeSet::new();
    for entry in std::fs::read_dir(chart().join("templates")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for value in read_by(&text) {
            read.insert((value, path.file_name().unwrap().to_string_lossy().into_owned()));
        }
    }
    assert!(read.len() > 40, "the scan found too little to trust: {read:?}");
    let unknown: Vec<_> = read.iter().filter(|(value, _)| !nodes.contains(value)).collect();
    assert!(
        unknown.is_empty(),
        "templates read values that do not exist: {unknown:?}"
    );
}

#[test]
fn the_template_scan_reads_dotted_values_and_the_variables_that_hold_them() {
    let read = read_by(
        "{{ .Values.router.port }}:{{- $rule := .Values.metrics.prometheusRule }}{{ $rule.parityDriftFor }}\
         {{ toYaml $.Values.agent.tolerations | nindent 8 }}",
    );
    let expected = [
        "agent.tolerations",
        "metrics.prometheusRule",
        "metrics.prometheusRule.parityDriftFor",
        "router.port",
    ];
    assert_eq!(read, expected.iter().map(ToString::to_string).collect());
}

/// The metric names `text` queries: `understudy_…` and `DCGM_…` words.
fn metrics_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for prefix in ["understudy_", "DCGM_"] {
        for (at, _) in text.match_indices(prefix) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            found.insert(rest[..end].to_owned());
        }
    }
    found
}

/// Whether a binary exports `metric`: its name, less a histogram's or counter's suffix and less
/// the registry's `understudy_` prefix, is written as a string in the binaries' sources.
fn exported(metric: &str, sources: &str) -> bool {
    let base = ["_bucket", "_sum", "_count", "_total"]
        .iter()
        .find_map(|suffix| metric.strip_suffix(suffix))
        .unwrap_or(metric);
    let unprefixed = base.strip_prefix("understudy_").unwrap_or(base);
    [metric, base, unprefixed]
        .iter()
        .any(|name| sources.contains(&format!("\"{name}\"")) || sources.contains(&format!("\"{name}{{")))
}

#[test]
fn the_dashboard_and_the_alerts_query_only_metrics_the_binaries_export() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut sources = String::new();
    for dir in ["operator/src", "router/src", "prober/src"] {
        let mut stack = vec![root.join(dir)];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    sources.push_str(&std::fs::read_to_string(&path).unwrap());
                }
            }
        }
    }
    let dashboard = std::fs::read_to_string(chart().join("dashboards/understudy.json")).unwrap();
    let parsed: Json = serde_json::from_str(&dashboard).unwrap();
    assert!(parsed["panels"].as_array().is_some_and(|p| p.len() >= 10));
    let alerts = std::fs::read_to_string(chart().join("templates/prometheusrule.yaml")).unwrap();
    let queried: BTreeSet<String> = metrics_in(&dashboard)
        .into_iter()
        .chain(metrics_in(&alerts))
        .collect();
    assert!(queried.len() > 10, "{queried:?}");
    let unknown: Vec<&String> = queried.iter().filter(|m| !exported(m, &sources)).collect();
    assert!(
        unknown.is_empty(),
        "queried and exported by no binary: {unknown:?}"
    );
}

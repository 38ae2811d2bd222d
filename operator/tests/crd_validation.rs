//! The FailoverPolicy and GameDay schemas, as `crdgen` prints them, admit every example and refuse
//! every nonsense object in `examples/invalid/` with the message its `# expect:` line names.
//!
//! Admission is emulated the way the apiserver does it: schema defaults first, then the structural
//! OpenAPI checks (`understudy_api::schema`, since kube-cel evaluates CEL rules only), then every
//! `x-kubernetes-validations` rule through `kube_cel`. Then the same files go through the Rust
//! side (`serde` and `policy::validate`), which must agree.

use std::{
    fs,
    path::{Path, PathBuf},
};

use kube::CustomResourceExt;
use serde_json::Value;
use understudy_operator::cron::CronSchedule;
use understudy_operator::gameday::RunConfig;
use understudy_operator::{
    crd::{FailoverPolicy, GameDay},
    policy,
};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The openAPIV3Schema of the generated CRD: exactly what `crdgen` prints.
fn schema() -> Value {
    schema_of(FailoverPolicy::crd())
}

fn schema_of(
    crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    let version = crd.spec.versions.first().expect("the CRD has a version");
    let schema = version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("a schema");
    serde_json::to_value(schema).expect("schema serializes")
}

/// Every `FailoverPolicy` manifest in `dir` (not recursive), with its text.
fn manifests(dir: &Path) -> Vec<(String, String, Value)> {
    manifests_of(dir, "FailoverPolicy")
}

/// Every manifest of `kind` in `dir` (not recursive), with its text.
fn manifests_of(dir: &Path, kind: &str) -> Vec<(String, String, Value)> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.extension().is_none_or(|ext| ext != "yaml") {
            continue;
        }
        let text = fs::read_to_string(&path).expect("readable");
        let object: Value =
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
        if object["kind"] == kind {
            let name = path
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            found.push((name, text, object));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

/// What the apiserver would say about `object`; empty when it would be admitted.
fn admission_errors(schema: &Value, object: &Value) -> Vec<String> {
    assert_eq!(object["apiVersion"], "understudy.dev/v1alpha1");
    assert!(
        object["metadata"]["name"].is_string(),
        "every manifest has metadata.name"
    );
    let defaulted = kube_cel::apply_defaults(schema, object);
    let mut errors = understudy_api::schema::check(schema, &defaulted);
    if let Err(failures) = kube_cel::Validator::new().validate(schema, &defaulted, None) {
        errors.extend(failures.iter().map(ToString::to_string));
    }
    errors
}

#[test]
fn every_example_is_admitted() {
    let schema = schema();
    let examples = manifests(&repo_root().join("examples"));
    let names: Vec<&str> = examples.iter().map(|(name, ..)| name.as_str()).collect();
    for expected in [
        "failoverpolicy-minimal.yaml",
        "failoverpolicy-70b-five-minutes.yaml",
    ] {
        assert!(
            names.contains(&expected),
            "examples/{expected} is missing; found {names:?}"
        );
    }
    for (name, _, object) in &examples {
        let errors = admission_errors(&schema, object);
        assert!(
            errors.is_empty(),
            "examples/{name} is refused:\n  {}",
            errors.join("\n  ")
        );
    }
}

#[test]
fn every_invalid_example_is_refused_with_the_message_it_expects() {
    let schema = schema();
    let invalid = manifests(&repo_root().join("examples/invalid"));
    assert!(
        invalid.len() >= 20,
        "expected the whole set of invalid examples, found {}",
        invalid.len()
    );
    for (name, text, object) in &invalid {
        let expected = text
            .lines()
            .next()
            .and_then(|line| line.strip_prefix("# expect: "))
            .unwrap_or_else(|| {
                panic!("examples/invalid/{name}: the first line must be `# expect: <message>`")
            });
        let errors = admission_errors(&schema, object);
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "examples/invalid/{name}: expected an error containing {expected:?}, got:\n  {}",
            if errors.is_empty() {
                "nothing: it was admitted".to_owned()
            } else {
                errors.join("\n  ")
            }
        );
    }
}

#[test]
fn the_brief_cases_of_nonsense_all_have_an_invalid_example() {
    let dir = repo_root().join("examples/invalid");
    for case in [
        "zero-interval",
        "negative-interval",
        "timeout-not-shorter-than-interval",
        "promote-after-below-suspect-after",
        "same-workload-twice",
        "unknown-tier",
        "automatic-failback-without-healthyFor",
        "tier-replicas-do-not-sum",
    ] {
        assert!(
            dir.join(format!("{case}.yaml")).is_file(),
            "examples/invalid/{case}.yaml is missing"
        );
    }
}

/// The operator reads every admitted object, and refuses (in Rust) every object the schema
/// refuses, so that a policy stored before a rule existed cannot slip through.
#[test]
fn the_operator_agrees_with_the_schema_on_every_example() {
    for (name, _, object) in manifests(&repo_root().join("examples")) {
        let policy: FailoverPolicy =
            serde_json::from_value(object).unwrap_or_else(|e| panic!("examples/{name}: {e}"));
        if let Err(e) = policy::validate(&policy.spec) {
            panic!("examples/{name} is admitted by the schema but refused by policy::validate: {e}");
        }
    }
    for (name, text, object) in manifests(&repo_root().join("examples/invalid")) {
        if text.lines().any(|line| line.starts_with("# rust-accepts: ")) {
            continue;
        }
        let refused = match serde_json::from_value::<FailoverPolicy>(object) {
            Err(_) => true,
            Ok(policy) => policy::validate(&policy.spec).is_err(),
        };
        assert!(
            refused,
            "examples/invalid/{name} is refused by the schema but accepted by policy::validate"
        );
    }
}

/// `kubectl get -o yaml` shows the schema's defaults; the operator fills in serde's. They must be
/// the same values, or the operator would run a policy other than the one users read.
#[test]
fn schema_defaults_and_serde_defaults_agree() {
    let schema = schema();
    for (name, _, object) in manifests(&repo_root().join("examples")) {
        let defaulted = kube_cel::apply_defaults(&schema, &object);
        let policy: FailoverPolicy =
            serde_json::from_value(object).unwrap_or_else(|e| panic!("examples/{name}: {e}"));
        let from_serde = serde_json::to_value(&policy.spec).expect("spec serializes");
        assert_eq!(
            from_serde, defaulted["spec"],
            "examples/{name}: serde and schema defaults differ"
        );
    }
}

#[test]
fn every_cel_rule_in_the_schema_compiles() {
    // Rules on optional fields run only when the field is set; compile them all regardless.
    let compiled = kube_cel::compile_schema(&schema());
    let errors: Vec<String> = compiled
        .compilation_errors()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        errors.is_empty(),
        "CEL rules that do not compile:\n  {}",
        errors.join("\n  ")
    );
}

#[test]
fn the_committed_crd_matches_the_generated_one() {
    let path = repo_root().join("crds/failoverpolicy.yaml");
    let committed = fs::read_to_string(&path).unwrap_or_default();
    let generated = serde_yaml::to_string(&FailoverPolicy::crd()).expect("CRD serializes");
    assert!(
        committed == generated,
        "crds/failoverpolicy.yaml is out of date; regenerate it with\n  \
         cargo run -q -p understudy-operator --bin crdgen > crds/failoverpolicy.yaml"
    );
}

#[test]
fn the_crd_has_the_names_columns_and_status_users_rely_on() {
    let crd = serde_json::to_value(FailoverPolicy::crd()).expect("CRD serializes");
    assert_eq!(crd["metadata"]["name"], "failoverpolicies.understudy.dev");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["shortNames"], serde_json::json!(["fpol"]));
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert!(
        version["subresources"]["status"].is_object(),
        "status is a subresource"
    );
    let columns: Vec<(String, String)> = version["additionalPrinterColumns"]
        .as_array()
        .expect("printer columns")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default().to_owned(),
                c["jsonPath"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let expected = [
        ("Primary", ".status.primaryPool"),
        ("Epoch", ".status.epoch"),
        ("State", ".status.state"),
        ("Age", ".metadata.creationTimestamp"),
    ];
    assert_eq!(columns, expected.map(|(n, p)| (n.to_owned(), p.to_owned())));
    let failover = &version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["failover"];
    assert_eq!(
        failover["x-kubernetes-preserve-unknown-fields"], true,
        "status.failover keeps any shape"
    );
}

/// The GameDay's `# expect:` line, or a panic naming the file.
fn expected_error<'a>(name: &str, text: &'a str) -> &'a str {
    text.lines()
        .next()
        .and_then(|line| line.strip_prefix("# expect: "))
        .unwrap_or_else(|| panic!("examples/invalid/{name}: the first line must be `# expect: <message>`"))
}

#[test]
fn every_gameday_example_is_admitted_and_read_by_the_operator() {
    let schema = schema_of(GameDay::crd());
    // In a folder of their own: `tests/example_policies.rs` reads every `examples/*.yaml` as a
    // FailoverPolicy.
    let examples = manifests_of(&repo_root().join("examples/gamedays"), "GameDay");
    let names: Vec<&str> = examples.iter().map(|(name, ..)| name.as_str()).collect();
    assert!(names.contains(&"weekly.yaml"), "found {names:?}");
    for (name, _, object) in &examples {
        let errors = admission_errors(&schema, object);
        assert!(
            errors.is_empty(),
            "examples/{name} is refused:\n  {}",
            errors.join("\n  ")
        );
        let defaulted = kube_cel::apply_defaults(&schema, object);
        let gameday: GameDay =
            serde_json::from_value(object.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            serde_json::to_value(&gameday.spec).expect("spec serializes"),
            defaulted["spec"],
            "examples/{name}: serde and schema defaults differ"
        );
        RunConfig::from_spec(&gameday.spec).unwrap_or_else(|e| panic!("examples/{name}: {e}"));
        if let Some(schedule) = &gameday.spec.schedule {
            CronSchedule::parse(schedule).unwrap_or_else(|e| panic!("examples/{name}: {e}"));
        }
    }
}

#[test]
fn every_invalid_gameday_example_is_refused_with_the_message_it_expects() {
    let schema = schema_of(GameDay::crd());
    let invalid = manifests_of(&repo_root().join("examples/invalid"), "GameDay");
    assert!(
        invalid.len() >= 8,
        "expected the GameDay invalid examples, found {}",
        invalid.len()
    );
    for (name, text, object) in &invalid {
        let expected = expected_error(name, text);
        let errors = admission_errors(&schema, object);
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "examples/invalid/{name}: expected an error containing {expected:?}, got:\n  {}",
            if errors.is_empty() {
                "nothing: it was admitted".to_owned()
            } else {
                errors.join("\n  ")
            }
        );
    }
}

/// What the schema cannot say (each cron field's range) the operator's parser does, so such a
/// game day is reported, never run at a time nobody meant.
#[test]
fn a_cron_schedule_the_schema_admits_can_still_be_refused_by_the_operator() {
    let schema = schema_of(GameDay::crd());
    let (_, _, mut object) = manifests_of(&repo_root().join("examples/gamedays"), "GameDay")
        .into_iter()
        .find(|(name, ..)| name == "weekly.yaml")
        .expect("the weekly example");
    object["spec"]["schedule"] = Value::from("61 10 * * TUE");
    assert!(admission_errors(&schema, &object).is_empty());
    let error = CronSchedule::parse("61 10 * * TUE").expect_err("minute 61 does not exist");
    assert!(
        error.to_string().contains("minute: 61 is outside 0-59"),
        "{error}"
    );
}

#[test]
fn every_cel_rule_in_the_gameday_schema_compiles() {
    let compiled = kube_cel::compile_schema(&schema_of(GameDay::crd()));
    let errors: Vec<String> = compiled
        .compilation_errors()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        errors.is_empty(),
        "CEL rules that do not compile:\n  {}",
        errors.join("\n  ")
    );
}

/// A transition rule: the apiserver checks it on update only, with the stored object as
/// `oldSelf`, so it is checked here with the weekly example as the stored one.
#[test]
fn a_gameday_policy_ref_cannot_change_once_created() {
    let schema = schema_of(GameDay::crd());
    let (_, _, stored) = manifests_of(&repo_root().join("examples/gamedays"), "GameDay")
        .into_iter()
        .find(|(name, ..)| name == "weekly.yaml")
        .expect("the weekly example");
    let stored = kube_cel::apply_defaults(&schema, &stored);
    let validator = kube_cel::Validator::new();
    let mut edited = stored.clone();
    edited["spec"]["maxRecovery"] = Value::from("10m");
    assert!(
        validator.validate(&schema, &edited, Some(&stored)).is_ok(),
        "other fields still change"
    );
    let mut moved = stored.clone();
    moved["spec"]["policyRef"]["name"] = Value::from("another-policy");
    assert!(
        validator.validate(&schema, &moved, None).is_ok(),
        "created so, it is fine"
    );
    let errors = validator
        .validate(&schema, &moved, Some(&stored))
        .expect_err("policyRef changed");
    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("policyRef cannot change; create another GameDay")),
        "{errors:?}"
    );
}

#[test]
fn the_committed_gameday_crd_matches_the_generated_one() {
    let generated = serde_yaml::to_string(&GameDay::crd()).expect("CRD serializes");
    for path in ["crds/gameday.yaml", "charts/understudy/crds/gameday.yaml"] {
        let committed = fs::read_to_string(repo_root().join(path)).unwrap_or_default();
        assert!(
            committed == generated,
            "{path} is out of date; regenerate it with\n  \
             cargo run -q -p understudy-operator --bin crdgen -- gameday > crds/gameday.yaml\n\
             and copy it to charts/understudy/crds/"
        );
    }
}

#[test]
fn the_gameday_crd_has_the_names_columns_and_status_users_rely_on() {
    let crd = serde_json::to_value(GameDay::crd()).expect("CRD serializes");
    assert_eq!(crd["metadata"]["name"], "gamedays.understudy.dev");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["shortNames"], serde_json::json!(["gd"]));
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert!(
        version["subresources"]["status"].is_object(),
        "status is a subresource"
    );
    let columns: Vec<(String, String)> = version["additionalPrinterColumns"]
        .as_array()
        .expect("printer columns")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default().to_owned(),
                c["jsonPath"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let expected = [
        ("Policy", ".spec.policyRef.name"),
        ("Schedule", ".spec.schedule"),
        ("Phase", ".status.phase"),
        ("Last Verdict", ".status.lastVerdict"),
        ("Next Run", ".status.nextRunAt"),
    ];
    assert_eq!(columns, expected.map(|(n, p)| (n.to_owned(), p.to_owned())));
}

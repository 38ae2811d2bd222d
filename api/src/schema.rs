//! Admission of a manifest offline, the way kube-apiserver admits it: the CRD's structural schema
//! (types, enums, bounds, required fields, and no field the schema does not name) checked with the
//! API server's own wording, so that `understudy-gameday simulate --policy` refuses `intervall` or
//! a field in the wrong place as `kubectl apply` would, rather than dropping it in silence.
//!
//! The CEL rules (`x-kubernetes-validations`) are not evaluated here: [`crate::policy::validate`]
//! repeats each of them in Rust, and the operator's tests run them through a CEL interpreter and a
//! real API server. Formats are not enforced, as the API server does not enforce `uint32` and
//! friends. Pure: no client, no I/O.

use kube::CustomResourceExt;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    // In the message only: as a `source` too, an error chain would print it twice.
    #[error("not YAML: {0}")]
    NotYaml(serde_yaml::Error),
    #[error("this is a {found}, not a {expected}")]
    WrongKind { expected: String, found: String },
    #[error("refused by the {kind} schema:\n  {}", .errors.join("\n  "))]
    Schema { kind: String, errors: Vec<String> },
    #[error("{0}")]
    Decode(serde_json::Error),
}

/// Reads a `K` manifest from YAML after checking it against `K`'s CRD schema, as the API server
/// would with strict field validation (`kubectl apply`'s default).
pub fn from_yaml<K: CustomResourceExt + DeserializeOwned>(text: &str) -> Result<K, ManifestError> {
    let object: Value = serde_yaml::from_str(text).map_err(ManifestError::NotYaml)?;
    let resource = K::api_resource();
    let expected = format!("{} {}", resource.api_version, resource.kind);
    let found = format!(
        "{} {}",
        object["apiVersion"].as_str().unwrap_or("<no apiVersion>"),
        object["kind"].as_str().unwrap_or("<no kind>")
    );
    if found != expected {
        return Err(ManifestError::WrongKind { expected, found });
    }
    let errors = check(&schema_of::<K>(), &object);
    if !errors.is_empty() {
        return Err(ManifestError::Schema {
            kind: resource.kind,
            errors,
        });
    }
    serde_json::from_value(object).map_err(ManifestError::Decode)
}

/// The openAPIV3Schema of `K`'s CRD (its first version), as `crdgen` prints it.
#[must_use]
pub fn schema_of<K: CustomResourceExt>() -> Value {
    let crd = K::crd();
    let schema = crd
        .spec
        .versions
        .first()
        .and_then(|version| version.schema.as_ref())
        .and_then(|schema| schema.open_api_v3_schema.as_ref());
    schema
        .and_then(|schema| serde_json::to_value(schema).ok())
        .unwrap_or(Value::Null)
}

/// The schema keywords [`check`] enforces.
pub const CHECKED: &[&str] = &[
    "type",
    "enum",
    "required",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "properties",
    "additionalProperties",
    "items",
    "nullable",
    "x-kubernetes-preserve-unknown-fields",
];

/// The keywords that constrain nothing [`check`] could check: documentation, defaults (a missing
/// field with a default is not missing), CEL rules, and formats the API server does not enforce.
pub const NOT_CHECKED: &[&str] = &[
    "description",
    "title",
    "default",
    "format",
    "x-kubernetes-validations",
];

/// What the API server's structural checks would say about the resource `object`; empty when
/// it would pass them. `apiVersion`, `kind` and `metadata` are the API server's own business.
#[must_use]
pub fn check(schema: &Value, object: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    check_at(schema, object, "", true, &mut errors);
    errors
}

fn check_at(schema: &Value, value: &Value, path: &str, resource_root: bool, errors: &mut Vec<String>) {
    let Some(schema) = schema.as_object() else {
        return;
    };
    let at = if path.is_empty() { "<root>" } else { path };

    if value.is_null() {
        if schema.get("nullable") != Some(&Value::Bool(true)) {
            let expected = schema.get("type").and_then(Value::as_str).unwrap_or("object");
            errors.push(format!(
                "{at}: Invalid value: \"null\": {at} in body must be of type {expected}: \"null\""
            ));
        }
        return;
    }
    if let Some(expected) = schema.get("type").and_then(Value::as_str) {
        let actual = type_of(value);
        let fits = actual == expected || (expected == "number" && actual == "integer");
        if !fits {
            errors.push(format!(
                "{at}: Invalid value: \"{actual}\": {at} in body must be of type {expected}: \"{actual}\""
            ));
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        let listed: Vec<String> = allowed.iter().map(Value::to_string).collect();
        errors.push(format!(
            "{at}: Unsupported value: {value}: supported values: {}",
            listed.join(", ")
        ));
    }
    if let Some(number) = value.as_f64() {
        if let Some(minimum) = schema.get("minimum").and_then(Value::as_f64)
            && number < minimum
        {
            errors.push(format!(
                "{at}: Invalid value: {value}: {at} in body should be greater than or equal to {minimum}"
            ));
        }
        if let Some(maximum) = schema.get("maximum").and_then(Value::as_f64)
            && number > maximum
        {
            errors.push(format!(
                "{at}: Invalid value: {value}: {at} in body should be less than or equal to {maximum}"
            ));
        }
    }
    if let Some(text) = value.as_str() {
        let len = text.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && len < min
        {
            errors.push(format!(
                "{at}: Invalid value: {value}: {at} in body should be at least {min} chars long"
            ));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && len > max
        {
            errors.push(format!("{at}: Too long: may not be more than {max} bytes"));
        }
    }
    if let Some(items) = value.as_array() {
        let len = items.len() as u64;
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
            && len < min
        {
            errors.push(format!(
                "{at}: Invalid value: {len}: {at} in body should have at least {min} items"
            ));
        }
        if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
            && len > max
        {
            errors.push(format!("{at}: Too many: {len}: must have at most {max} items"));
        }
        if let Some(item_schema) = schema.get("items") {
            for (index, item) in items.iter().enumerate() {
                check_at(item_schema, item, &format!("{path}[{index}]"), false, errors);
            }
        }
    }
    if let Some(fields) = value.as_object() {
        check_fields(schema, fields, path, resource_root, errors);
    }
}

fn check_fields(
    schema: &serde_json::Map<String, Value>,
    fields: &serde_json::Map<String, Value>,
    path: &str,
    resource_root: bool,
    errors: &mut Vec<String>,
) {
    let properties = schema.get("properties").and_then(Value::as_object);
    for required in schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        let defaulted = properties
            .and_then(|p| p.get(required))
            .is_some_and(|field| field.get("default").is_some());
        if !fields.contains_key(required) && !defaulted {
            errors.push(format!("{}: Required value", join(path, required)));
        }
    }
    let additional = schema.get("additionalProperties").filter(|a| a.is_object());
    let preserve = schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    for (key, field) in fields {
        let field_path = join(path, key);
        if let Some(field_schema) = properties.and_then(|p| p.get(key)) {
            check_at(field_schema, field, &field_path, false, errors);
        } else if let Some(value_schema) = additional {
            check_at(value_schema, field, &field_path, false, errors);
        } else if resource_root && ["apiVersion", "kind", "metadata"].contains(&key.as_str()) {
            // Validated by the API server itself, not by the CRD's schema.
        } else if !preserve {
            errors.push(format!("unknown field \"{field_path}\""));
        }
    }
}

fn type_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::crd::{FailoverPolicy, GameDay};

    const MINIMAL: &str = include_str!("../../examples/failoverpolicy-minimal.yaml");

    /// Every keyword of `schema`, at any depth.
    fn keywords(schema: &Value, found: &mut Vec<String>) {
        let Some(object) = schema.as_object() else { return };
        for (keyword, inner) in object {
            found.push(keyword.clone());
            match keyword.as_str() {
                "properties" => inner
                    .as_object()
                    .into_iter()
                    .flatten()
                    .for_each(|(_, s)| keywords(s, found)),
                "items" | "additionalProperties" => keywords(inner, found),
                _ => {}
            }
        }
    }

    #[test]
    fn every_keyword_of_the_crds_is_understood() {
        for schema in [schema_of::<FailoverPolicy>(), schema_of::<GameDay>()] {
            let mut found = Vec::new();
            keywords(&schema, &mut found);
            for keyword in found {
                assert!(
                    CHECKED.contains(&keyword.as_str()) || NOT_CHECKED.contains(&keyword.as_str()),
                    "the CRD uses {keyword:?}, which the checker does not understand; teach it"
                );
            }
        }
    }

    #[test]
    fn the_minimal_example_is_read() {
        let policy: FailoverPolicy = from_yaml(MINIMAL).unwrap();
        assert_eq!(policy.spec.pools.len(), 2);
    }

    #[test]
    fn an_unknown_or_misplaced_field_is_refused_with_its_path() {
        // The example ends in spec's fields, so whatever is appended is in spec.
        let valid = format!("{MINIMAL}  probe:\n    interval: 3s\n");
        assert!(from_yaml::<FailoverPolicy>(&valid).is_ok());
        let typo = format!("{MINIMAL}  probe:\n    intervall: 3s\n");
        let error = from_yaml::<FailoverPolicy>(&typo).unwrap_err().to_string();
        assert!(
            error.contains("unknown field \"spec.probe.intervall\""),
            "{error}"
        );
        // minDwell belongs in spec.trigger.
        let misplaced = format!("{MINIMAL}  minDwell: 10m\n");
        let error = from_yaml::<FailoverPolicy>(&misplaced).unwrap_err().to_string();
        assert!(error.contains("unknown field \"spec.minDwell\""), "{error}");
    }

    #[test]
    fn a_wrong_type_or_kind_is_refused() {
        let error = from_yaml::<FailoverPolicy>(&MINIMAL.replace("replicas: 2", "replicas: two"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("must be of type integer"), "{error}");
        let error = from_yaml::<GameDay>(MINIMAL).unwrap_err().to_string();
        assert!(error.contains("not a understudy.dev/v1alpha1 GameDay"), "{error}");
        assert!(matches!(
            from_yaml::<FailoverPolicy>("spec: [unclosed"),
            Err(ManifestError::NotYaml(_))
        ));
    }

    /// The checker must refuse what it claims to check; otherwise every "admitted" of the
    /// operator's CRD tests means nothing.
    #[test]
    fn the_structural_checker_refuses_what_the_apiserver_refuses() {
        let schema = serde_json::json!({
            "type": "object",
            "required": ["count"],
            "properties": {
                "count": {"type": "integer", "minimum": 1.0, "maximum": 3.0},
                "mode": {"type": "string", "enum": ["a", "b"], "maxLength": 1},
                "list": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "boolean"}},
                "map": {"type": "object", "additionalProperties": {"type": "number", "nullable": true}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
            },
        });
        let check = |object: Value| check(&schema, &object);
        assert!(
            check(serde_json::json!({"count": 2, "mode": "a", "list": [true], "map": {"x": 1.5, "y": null}, "free": {"any": [1]}}))
                .is_empty()
        );
        let cases = [
            (serde_json::json!({}), "count: Required value"),
            (
                serde_json::json!({"count": 0}),
                "count in body should be greater than or equal to 1",
            ),
            (
                serde_json::json!({"count": 4}),
                "count in body should be less than or equal to 3",
            ),
            (
                serde_json::json!({"count": 1.5}),
                "count in body must be of type integer",
            ),
            (
                serde_json::json!({"count": "1"}),
                "count in body must be of type integer",
            ),
            (
                serde_json::json!({"count": 1, "mode": "c"}),
                "mode: Unsupported value: \"c\"",
            ),
            (
                serde_json::json!({"count": 1, "list": []}),
                "list in body should have at least 1 items",
            ),
            (
                serde_json::json!({"count": 1, "list": [true, true, true]}),
                "list: Too many: 3: must have at most 2 items",
            ),
            (
                serde_json::json!({"count": 1, "list": ["yes"]}),
                "list[0] in body must be of type boolean",
            ),
            (
                serde_json::json!({"count": 1, "map": {"x": "1"}}),
                "map.x in body must be of type number",
            ),
            (
                serde_json::json!({"count": 1, "extra": true}),
                "unknown field \"extra\"",
            ),
            (
                serde_json::json!({"count": null}),
                "count in body must be of type integer",
            ),
        ];
        for (object, expected) in cases {
            let errors = check(object.clone());
            assert!(
                errors.iter().any(|e| e.contains(expected)),
                "{object}: expected {expected:?}, got {errors:?}"
            );
        }
    }
}

//! Every field of the FailoverPolicy and GameDay specs is read. A CRD field nothing reads is a
//! defect: the schema admits it, a user sets it, and nothing changes. So each field of the
//! generated CRDs (`crds/*.yaml`) is listed here with one test that fails if the field's value is
//! not read, and a field added to a spec without such a test fails this file.
//!
//! A field is a leaf of `spec` in the schema. The walk goes into an object that lists its
//! properties and into a list of such objects (`spec.pools[].name`), and stops at everything
//! else: a scalar, a list of scalars (`spec.parity.ignoreFlags`), a map or an object without
//! properties is one field. An object that lists properties is not a field itself; its fields are.
//!
//! A test proves a field is read when it sets the field to a value other than its default and
//! asserts something that follows from that value. A test that only refuses a bad value counts
//! only for a field whose whole purpose is to be checked, and a test of the cluster tier
//! (`tests/tests/cluster.rs`) does not count: without a cluster it checks nothing. A field with
//! no such test is in [`NOT_YET_PROVEN`], saying what reads it and which test is missing; it
//! moves to [`READ_BY`] when that test is written.
//!
//! This file checks that the schemas and the two lists name the same fields, each once, and that
//! every named test exists. It does not run them: `cargo test --workspace` does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

use serde_yaml::Value as Yaml;

/// Each CRD's kind and its generated manifest.
const CRDS: &[(&str, &str)] = &[
    ("FailoverPolicy", include_str!("../../crds/failoverpolicy.yaml")),
    ("GameDay", include_str!("../../crds/gameday.yaml")),
];

/// Each spec field, by CRD, with the test that proves it is read: `path/to/file.rs::test_name`.
#[rustfmt::skip]
const READ_BY: &[(&str, &[(&str, &str)])] = &[
    ("FailoverPolicy", &[
        ("spec.admission.initialConcurrency", "operator/src/route_push.rs::a_route_taken_by_every_router_is_done_and_carries_pool_endpoints_epoch_and_admission"),
        ("spec.admission.initialPrefillTokens", "api/src/route.rs::the_policys_initial_prefill_tokens_are_per_replica_and_start_the_routes_prefill_budget"),
        ("spec.admission.maxConcurrency", "operator/src/route_push.rs::a_route_taken_by_every_router_is_done_and_carries_pool_endpoints_epoch_and_admission"),
        ("spec.admission.priorityHeader", "router/tests/gateway.rs::the_policys_priority_header_and_shed_priorities_decide_who_is_refused_in_the_window"),
        ("spec.admission.shedPriorities", "router/tests/gateway.rs::the_policys_priority_header_and_shed_priorities_decide_who_is_refused_in_the_window"),
        ("spec.admission.window", "operator/src/route_push.rs::a_route_taken_by_every_router_is_done_and_carries_pool_endpoints_epoch_and_admission"),
        ("spec.coldStartEstimates.apiReady", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.containerStart", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.engineStart", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.firstToken", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.imagePull", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.node", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.wakeLevel1", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.wakeLevel2", "gameday/tests/plan_cli.rs::the_text_lists_every_single_tier_mix_and_names_the_cheapest"),
        ("spec.coldStartEstimates.warmup", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.coldStartEstimates.weightLoad", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.failback.healthyFor", "api/src/policy.rs::automatic_failback_counts_healthy_for_in_whole_probe_intervals_rounded_up"),
        ("spec.failback.mode", "api/src/policy.rs::automatic_failback_counts_healthy_for_in_whole_probe_intervals_rounded_up"),
        ("spec.grants.clockSkew", "tests/tests/operator_grants.rs::a_grant_carries_the_policys_time_to_live_renewal_period_and_clock_skew_and_names_the_other_pools_fences"),
        ("spec.grants.renewEvery", "tests/tests/operator_grants.rs::a_grant_carries_the_policys_time_to_live_renewal_period_and_clock_skew_and_names_the_other_pools_fences"),
        ("spec.grants.ttl", "tests/tests/operator_grants.rs::a_grant_carries_the_policys_time_to_live_renewal_period_and_clock_skew_and_names_the_other_pools_fences"),
        ("spec.loadProof.blocksPromotion", "operator/src/controller/prove_load.rs::a_failed_proof_blocks_promotion_unless_the_policy_says_it_must_not"),
        ("spec.loadProof.duration", "tests/tests/operator_load_proof.rs::a_standby_with_the_primarys_capacity_is_proven_and_one_with_a_fraction_fails_at_the_same_load"),
        ("spec.loadProof.every", "api/src/policy.rs::a_load_proof_takes_its_defaults_and_refuses_what_cannot_be_replayed"),
        ("spec.loadProof.itlP99", "tests/tests/operator_load_proof.rs::a_standby_with_the_primarys_capacity_is_proven_and_one_with_a_fraction_fails_at_the_same_load"),
        ("spec.loadProof.maxErrorRate", "api/src/policy.rs::a_load_proof_takes_its_defaults_and_refuses_what_cannot_be_replayed"),
        ("spec.loadProof.notBetween", "api/src/policy.rs::a_load_proof_takes_its_defaults_and_refuses_what_cannot_be_replayed"),
        ("spec.loadProof.rateShare", "tests/tests/operator_load_proof.rs::a_standby_with_the_primarys_capacity_is_proven_and_one_with_a_fraction_fails_at_the_same_load"),
        ("spec.loadProof.ttftP99", "tests/tests/operator_load_proof.rs::a_standby_with_the_primarys_capacity_is_proven_and_one_with_a_fraction_fails_at_the_same_load"),
        ("spec.minServingFraction", "operator/tests/emulated_tiers.rs::four_warm_and_four_pilot_light_route_at_half_capacity_when_the_warm_four_answer"),
        ("spec.parity.allowDrift", "tests/tests/operator_probing.rs::template_drift_names_each_flag_and_keys_the_policy_allows_block_nothing"),
        ("spec.parity.artifactDigest", "tests/tests/operator_probing.rs::a_standby_whose_weights_differ_on_its_node_drifts_by_key_and_is_not_promoted"),
        ("spec.parity.enabled", "operator/src/controller/status.rs::with_parity_disabled_a_drift_found_is_neither_shown_nor_held_against_the_standby"),
        ("spec.parity.ignoreFlags", "operator/src/parity.rs::the_policys_ignored_flags_are_left_out_however_they_are_written"),
        ("spec.paused", "operator/tests/controller_commands.rs::a_paused_policy_never_promotes_however_long_its_primary_fails_and_warns_once_why"),
        ("spec.pools[].cluster.kubeconfigSecret.key", "operator/tests/clusters_mock.rs::a_secret_missing_its_key_or_a_usable_kubeconfig_or_reaching_outside_itself_is_refused"),
        ("spec.pools[].cluster.kubeconfigSecret.name", "tests/tests/regions.rs::region_east_cut_off_from_the_management_cluster_stops_serving_before_west_serves"),
        ("spec.pools[].cluster.name", "tests/tests/regions.rs::a_lost_management_cluster_stops_no_traffic_in_either_region_and_promotes_nothing"),
        ("spec.pools[].name", "operator/src/controller/status.rs::a_new_policy_reports_its_home_pool_holding_the_lease_at_epoch_zero"),
        ("spec.pools[].port", "operator/tests/observe_mock.rs::a_pools_replicas_resolve_to_the_port_its_spec_names"),
        ("spec.pools[].replicas", "api/src/policy.rs::an_empty_standby_list_means_every_replica_hot"),
        ("spec.pools[].standby[].replicas", "operator/tests/emulated_tiers.rs::four_warm_and_four_pilot_light_route_at_half_capacity_when_the_warm_four_answer"),
        ("spec.pools[].standby[].reserveGpus", "operator/tests/controller_reserve.rs::the_standby_gets_a_gpu_reserve_shaped_like_its_workload_and_the_primary_gets_none"),
        ("spec.pools[].standby[].sleepLevel", "operator/tests/emulated_tiers.rs::a_warm_level_2_standby_is_woken_weights_first_reloaded_then_its_cache"),
        ("spec.pools[].standby[].tier", "operator/tests/emulated_tiers.rs::a_warm_level_1_standby_sleeps_after_its_probe_and_is_woken_after_the_fence"),
        ("spec.pools[].workload.kind", "operator/tests/observe_mock.rs::a_statefulset_selects_its_pods_with_match_expressions_as_well"),
        ("spec.pools[].workload.name", "operator/tests/observe_mock.rs::a_deployments_running_pods_with_an_ip_are_the_pools_endpoints"),
        ("spec.probe.budgets.firstToken", "operator/src/judge.rs::the_probe_is_timed_by_the_policys_timeout_and_budgets_and_stalls_after_the_first_token_budget"),
        ("spec.probe.budgets.total", "operator/src/judge.rs::the_probe_is_timed_by_the_policys_timeout_and_budgets_and_stalls_after_the_first_token_budget"),
        ("spec.probe.expect.mode", "operator/src/judge.rs::a_prefix_without_a_value_is_recorded_from_the_primary_and_then_used"),
        ("spec.probe.expect.value", "operator/src/judge.rs::a_prefix_without_a_value_is_recorded_from_the_primary_and_then_used"),
        ("spec.probe.interval", "operator/src/controller/mod.rs::a_failing_reconcile_waits_no_longer_than_a_successful_one_would"),
        ("spec.probe.maxTokens", "operator/src/observe.rs::a_golden_answer_is_dropped_when_the_prompt_max_tokens_or_expectation_change"),
        ("spec.probe.prompt", "operator/src/observe.rs::a_golden_answer_is_dropped_when_the_prompt_max_tokens_or_expectation_change"),
        ("spec.probe.timeout", "operator/src/judge.rs::the_probe_is_timed_by_the_policys_timeout_and_budgets_and_stalls_after_the_first_token_budget"),
        ("spec.recoveryObjective", "operator/src/controller/status.rs::objective_met_comes_from_the_estimates_for_the_standbys_tier_mix"),
        ("spec.rollout", "tests/tests/cluster.rs::a_standby_first_rollout_rolls_the_primary_only_after_the_standby_passed_and_never_to_a_version_broken_on_it"),
        ("spec.route.httpRoute.backends[].kind", "operator/tests/route_target_mock.rs::a_promotion_moves_the_httproutes_weights_and_waits_until_its_gateway_accepts_them"),
        ("spec.route.httpRoute.backends[].name", "operator/tests/route_target_mock.rs::a_promotion_moves_the_httproutes_weights_and_waits_until_its_gateway_accepts_them"),
        ("spec.route.httpRoute.backends[].pool", "operator/tests/route_target_mock.rs::a_promotion_moves_the_httproutes_weights_and_waits_until_its_gateway_accepts_them"),
        ("spec.route.httpRoute.name", "operator/tests/route_target_mock.rs::a_promotion_moves_the_httproutes_weights_and_waits_until_its_gateway_accepts_them"),
        ("spec.route.service.name", "operator/tests/route_target_mock.rs::a_promotion_moves_the_services_selector_to_the_new_primarys_pods"),
        ("spec.standbyProof.every", "api/src/policy.rs::a_standby_proof_runs_every_so_often_outside_its_windows"),
        ("spec.standbyProof.notBetween", "api/src/policy.rs::a_standby_proof_runs_every_so_often_outside_its_windows"),
        ("spec.stream.contract", "operator/src/route_push.rs::a_route_taken_by_every_router_is_done_and_carries_pool_endpoints_epoch_and_admission"),
        ("spec.stream.drainFor", "operator/tests/emulated_tiers.rs::after_a_planned_move_the_old_primary_drains_its_streams_before_it_sleeps"),
        ("spec.trigger.hardFailure.promoteAfter", "api/src/policy.rs::trigger_counts_and_pause_reach_the_state_machine"),
        ("spec.trigger.minDwell", "api/src/policy.rs::trigger_counts_and_pause_reach_the_state_machine"),
        ("spec.trigger.promoteAfter", "api/src/policy.rs::trigger_counts_and_pause_reach_the_state_machine"),
        ("spec.trigger.standbyReadyAfter", "api/src/policy.rs::trigger_counts_and_pause_reach_the_state_machine"),
        ("spec.trigger.suspectAfter", "api/src/policy.rs::trigger_counts_and_pause_reach_the_state_machine"),
    ]),
    ("GameDay", &[
        ("spec.concurrencyPolicy", "operator/tests/gameday_mock.rs::with_concurrency_policy_allow_a_run_due_during_another_waits_and_starts_when_it_ends"),
        ("spec.failback.after", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.failback.mode", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.fault", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.historyLimit", "operator/tests/gameday_mock.rs::a_finished_run_is_filed_newest_first_and_runs_beyond_the_history_limit_are_dropped"),
        ("spec.maxRecovery", "operator/tests/gameday_mock.rs::a_promotion_not_done_by_max_recovery_is_recorded_failed"),
        ("spec.policyRef.name", "operator/tests/gameday_mock.rs::a_scheduled_run_on_a_steady_policy_records_then_gives_the_failover_command"),
        ("spec.schedule", "operator/tests/gameday_mock.rs::a_scheduled_run_on_a_steady_policy_records_then_gives_the_failover_command"),
        ("spec.steadyState.readyFor", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.stopConditions.maxErrorRate", "operator/tests/gameday_mock.rs::a_run_records_what_the_routers_counted_since_the_fault_and_stops_when_the_clients_fail"),
        ("spec.stopConditions.maxTtftP99", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.stopConditions.minRequests", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.stopConditions.window", "operator/src/gameday/tests.rs::the_run_config_takes_the_fault_failback_ready_for_and_stop_conditions_from_the_spec"),
        ("spec.timeZone", "operator/tests/gameday_mock.rs::a_schedule_in_a_time_zone_is_read_there_and_an_unknown_zone_is_said"),
    ]),
];

/// Spec fields that something reads but no test proves it yet, by CRD: what reads each, and
/// which test is missing.
#[rustfmt::skip]
const NOT_YET_PROVEN: &[(&str, &[(&str, &str)])] = &[
    ("FailoverPolicy", &[]),
    ("GameDay", &[]),
];

/// The fields under the schema `node` at `at`, into `found`: see the module doc for the rule.
fn walk(node: &Yaml, at: &str, found: &mut BTreeSet<String>) {
    for combinator in ["allOf", "anyOf", "oneOf", "not"] {
        assert!(
            node.get(combinator).is_none(),
            "{at}: the walk does not read `{combinator}`; teach it before its fields go unlisted"
        );
    }
    let properties = node
        .get("properties")
        .and_then(Yaml::as_mapping)
        .filter(|properties| !properties.is_empty());
    let items = node
        .get("items")
        .filter(|items| items.get("properties").is_some());
    if let Some(properties) = properties {
        for (name, property) in properties {
            walk(property, &format!("{at}.{}", name.as_str().unwrap()), found);
        }
    } else if let Some(items) = items {
        walk(items, &format!("{at}[]"), found);
    } else {
        found.insert(at.to_owned());
    }
}

/// The spec fields of a CRD manifest, over all its versions.
fn spec_fields(kind: &str, manifest: &str) -> BTreeSet<String> {
    let crd: Yaml = serde_yaml::from_str(manifest).unwrap();
    assert_eq!(crd["spec"]["names"]["kind"].as_str(), Some(kind));
    let versions = crd["spec"]["versions"].as_sequence().expect("spec.versions");
    let mut found = BTreeSet::new();
    for version in versions {
        let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert!(spec.is_mapping(), "{kind} has no spec schema");
        walk(spec, "spec", &mut found);
    }
    found
}

type Entries = &'static [(&'static str, &'static str)];

/// `kind`'s entries in `table`.
fn of(table: &[(&str, Entries)], kind: &str) -> Entries {
    table
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(&[], |(_, entries)| *entries)
}

/// The paths of `entries`, which must be sorted and each named once.
fn paths(entries: Entries, list: &str, kind: &str) -> BTreeSet<&'static str> {
    let listed: Vec<&str> = entries.iter().map(|(path, _)| *path).collect();
    let mut sorted = listed.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(
        listed, sorted,
        "{list}'s {kind} fields must be sorted by path, each once"
    );
    listed.into_iter().collect()
}

#[test]
fn every_spec_field_has_a_test_that_reads_it_or_says_why_not_yet() {
    let kinds: Vec<&str> = CRDS.iter().map(|(kind, _)| *kind).collect();
    for table in [READ_BY, NOT_YET_PROVEN] {
        for (kind, _) in table {
            assert!(kinds.contains(kind), "no CRD {kind} in CRDS");
        }
    }
    for (kind, manifest) in CRDS {
        let schema = spec_fields(kind, manifest);
        let read = paths(of(READ_BY, kind), "READ_BY", kind);
        let unproven = paths(of(NOT_YET_PROVEN, kind), "NOT_YET_PROVEN", kind);
        let both: Vec<&&str> = read.intersection(&unproven).collect();
        assert!(
            both.is_empty(),
            "{kind} fields both in READ_BY and NOT_YET_PROVEN: {both:?}"
        );
        let listed: BTreeSet<&str> = read.union(&unproven).copied().collect();
        let missing: Vec<&String> = schema.iter().filter(|f| !listed.contains(f.as_str())).collect();
        let stale: Vec<&&str> = listed.iter().filter(|f| !schema.contains(**f)).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "{kind}'s spec fields and the lists disagree.\n\
             In the schema, in neither READ_BY nor NOT_YET_PROVEN (name the test that proves each \
             is read): {missing:?}\n\
             Listed, not in the schema (take them out): {stale:?}"
        );
    }
}

#[test]
fn every_test_named_as_proof_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut absent = Vec::new();
    for (_, entries) in READ_BY {
        for (field, test) in *entries {
            let (file, name) = test
                .split_once("::")
                .unwrap_or_else(|| panic!("{field}: {test:?} is not `path/to/file.rs::test_name`"));
            let Ok(text) = std::fs::read_to_string(root.join(file)) else {
                absent.push(format!("{field}: no file {file}"));
                continue;
            };
            if !is_a_test(&text, name) {
                absent.push(format!("{field}: no test `fn {name}(` in {file}"));
            }
        }
    }
    assert!(absent.is_empty(), "{}", absent.join("\n"));
}

/// Whether `text` holds `fn name(` under a test attribute (`#[test]`, `#[tokio::test]`…).
fn is_a_test(text: &str, name: &str) -> bool {
    let signature = format!("fn {name}(");
    text.match_indices(&signature).any(|(at, _)| {
        let line_start = text[..at].rfind('\n').map_or(0, |newline| newline + 1);
        text[..line_start]
            .lines()
            .rev()
            .take_while(|line| {
                let line = line.trim_start();
                line.starts_with("#[") || line.starts_with("//")
            })
            .any(|line| line.trim_start().starts_with("#[") && line.contains("test"))
    })
}

#[test]
fn the_walk_goes_into_objects_and_lists_of_objects_and_stops_at_everything_else() {
    let schema: Yaml = serde_yaml::from_str(
        "
properties:
  paused: {type: boolean}
  flags: {type: array, items: {type: string}}
  labels: {type: object, additionalProperties: {type: string}}
  free: {type: object}
  pools:
    type: array
    items:
      properties:
        name: {type: string}
        workload: {properties: {kind: {type: string}}}
",
    )
    .unwrap();
    let mut found = BTreeSet::new();
    walk(&schema, "spec", &mut found);
    let expected = [
        "spec.flags",
        "spec.free",
        "spec.labels",
        "spec.paused",
        "spec.pools[].name",
        "spec.pools[].workload.kind",
    ];
    assert_eq!(found, expected.into_iter().map(str::to_owned).collect());
}

#[test]
fn a_test_is_found_under_its_attribute_and_a_helper_of_the_same_name_is_not() {
    let text = "
/// What it does.
#[tokio::test(start_paused = true)]
async fn waits_a_round() {
}

fn a_helper() {
}

#[test]
#[ignore = \"needs a cluster\"]
fn a_long_name_on_its_own_line()
{
}
";
    assert!(is_a_test(text, "waits_a_round"));
    assert!(is_a_test(text, "a_long_name_on_its_own_line"));
    assert!(!is_a_test(text, "a_helper"));
    assert!(!is_a_test(text, "waits"));
}

//! Route targets other than understudy's routers (`spec.route`): a Gateway API HTTPRoute whose
//! backendRefs' weights move between the pools, or a Service whose selector moves. A promotion's
//! Route step writes the object, recording the epoch in [`EPOCH_ANNOTATION`]; for an HTTPRoute it
//! is done only once every gateway in its `parentRefs` has accepted it at the generation written
//! and resolved its backends (past the promotion's deadline, once it is written). What a
//! gateway's data plane still sends to the old pool after that, its fences refuse: the epoch is
//! enforced at the pools, not here.
//!
//! The admission step has nothing to open without understudy's routers and is handed off,
//! saying so. Every other step, and everything of a policy whose route goes to the routers, goes
//! to the executor this one wraps. Between promotions the target is kept pointing at the primary.
//!
//! Writes are made at the `resourceVersion` read (optimistic concurrency): an HTTPRoute is
//! replaced with only its weights and the annotation changed, a Service merge-patched with only
//! its selector and the annotation, so whoever owns the rest keeps it. A target whose
//! annotation names a later epoch is left alone: a newer promotion moved it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::Value;
use understudy_api::FIELD_MANAGER;
use understudy_core::Epoch;
use understudy_core::failover::Step;

use crate::crd::{EPOCH_ANNOTATION, FailoverPolicy, HttpRouteTarget, PoolBackend, PoolSpec, WorkloadKind};
use crate::ports::{RouteSyncReport, RouteSyncRequest, StepExecutor, StepReport, StepRequest};
use crate::workload::Workload;

/// Who carries a route to a Gateway API route or a Service.
pub const CARRIED_BY: &str = "route-target";

/// The route and admission steps of policies with `spec.route`, against the operator's own
/// API server; everything else to `inner`.
pub struct RouteTargets {
    inner: Arc<dyn StepExecutor>,
    client: kube::Client,
}

impl fmt::Debug for RouteTargets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteTargets")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// Where pointing a target at a pool got to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pointed {
    /// It sends to the pool, and whatever serves it has taken that.
    Taken,
    /// It sends to the pool, but is not taken yet: why.
    Written(String),
    /// It was not written this time (a conflict): why; tried again.
    Retry(String),
}

impl RouteTargets {
    /// Wraps `inner`, writing route targets with `client` (the operator's own cluster).
    #[must_use]
    pub fn new(inner: Arc<dyn StepExecutor>, client: kube::Client) -> Self {
        RouteTargets { inner, client }
    }

    /// Points `policy`'s target at `pool` at `epoch`; `Err` for what somebody must mend.
    async fn point(&self, policy: &FailoverPolicy, pool: &PoolSpec, epoch: Epoch) -> Result<Pointed, String> {
        let namespace = policy.namespace().unwrap_or_default();
        let Some(route) = &policy.spec.route else {
            return Ok(Pointed::Taken);
        };
        if let Some(http_route) = &route.http_route {
            return self
                .point_http_route(&namespace, http_route, &pool.name, epoch)
                .await;
        }
        if let Some(service) = &route.service {
            let labels = self.pod_labels(&namespace, pool).await?;
            return self
                .point_service(&namespace, &service.name, &labels, epoch)
                .await;
        }
        Ok(Pointed::Taken)
    }

    async fn point_http_route(
        &self,
        namespace: &str,
        target: &HttpRouteTarget,
        pool: &str,
        epoch: Epoch,
    ) -> Result<Pointed, String> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &http_route_resource());
        let name = &target.name;
        let Some(mut route) = api
            .get_opt(name)
            .await
            .map_err(|e| format!("HTTPRoute {name}: {e}"))?
        else {
            return Err(format!("HTTPRoute {name} does not exist in {namespace}"));
        };
        not_moved_since(name, &route.metadata, epoch)?;
        let spec = weighted(&route.data, namespace, &target.backends, pool)?;
        if spec.is_some() || epoch_of(&route.metadata) != Some(epoch) {
            if let Some(spec) = spec {
                route.data["spec"] = spec;
            }
            route
                .annotations_mut()
                .insert(EPOCH_ANNOTATION.to_owned(), epoch.0.to_string());
            let params = PostParams {
                field_manager: Some(FIELD_MANAGER.to_owned()),
                ..PostParams::default()
            };
            match api.replace(name, &params, &route).await {
                Ok(_) => {}
                // Written meanwhile by another: read again next time.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    return Ok(Pointed::Retry(format!(
                        "HTTPRoute {name} changed while it was written; trying again"
                    )));
                }
                Err(e) => return Err(format!("HTTPRoute {name}: {e}")),
            }
        }
        let current = api
            .get(name)
            .await
            .map_err(|e| format!("HTTPRoute {name}: {e}"))?;
        // Another writer may have put it back since.
        if weighted(&current.data, namespace, &target.backends, pool)?.is_some() {
            return Ok(Pointed::Retry(format!(
                "HTTPRoute {name} was changed back by another writer; written again next time"
            )));
        }
        let generation = current.metadata.generation.unwrap_or_default();
        Ok(match accepted(&current.data, namespace, generation) {
            Ok(()) => Pointed::Taken,
            Err(why) => Pointed::Written(format!("HTTPRoute {name} sends to {pool}; {why}")),
        })
    }

    /// Sets Service `name`'s selector to `labels` (the keys it had that `labels` lacks are
    /// removed) with a merge patch at the version read, as the typed Service would drop what
    /// this client's API version does not know.
    async fn point_service(
        &self,
        namespace: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        epoch: Epoch,
    ) -> Result<Pointed, String> {
        let api: Api<Service> = Api::namespaced(self.client.clone(), namespace);
        let Some(service) = api
            .get_opt(name)
            .await
            .map_err(|e| format!("Service {name}: {e}"))?
        else {
            return Err(format!("Service {name} does not exist in {namespace}"));
        };
        not_moved_since(name, &service.metadata, epoch)?;
        let had = service
            .spec
            .as_ref()
            .and_then(|s| s.selector.clone())
            .unwrap_or_default();
        if had == *labels && epoch_of(&service.metadata) == Some(epoch) {
            return Ok(Pointed::Taken);
        }
        let mut selector: serde_json::Map<String, Value> = had
            .keys()
            .filter(|key| !labels.contains_key(*key))
            .map(|key| (key.clone(), Value::Null))
            .collect();
        selector.extend(labels.iter().map(|(k, v)| (k.clone(), Value::from(v.clone()))));
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": service.metadata.resource_version,
                "annotations": {EPOCH_ANNOTATION: epoch.0.to_string()},
            },
            "spec": {"selector": selector},
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        match api.patch(name, &params, &Patch::Merge(&patch)).await {
            Ok(_) => Ok(Pointed::Taken),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(Pointed::Retry(format!(
                "Service {name} changed while it was written; trying again"
            ))),
            Err(e) => Err(format!("Service {name}: {e}")),
        }
    }

    /// The labels `pool`'s workload selects its serving pods by.
    async fn pod_labels(&self, namespace: &str, pool: &PoolSpec) -> Result<BTreeMap<String, String>, String> {
        let workload = Workload::new(self.client.clone(), namespace, &pool.workload)
            .get()
            .await
            .map_err(|e| format!("the workload of {}: {e}", pool.name))?;
        pod_labels(&pool.workload.kind, &pool.workload.name, &workload.data)
            .ok_or_else(|| format!("the workload of {} selects its pods by no matchLabels", pool.name))
    }

    async fn route(&self, request: StepRequest<'_>) -> StepReport {
        let sends = format!(
            "{} sends to {} at epoch {}",
            target_name(request.policy),
            request.pool.name,
            request.epoch
        );
        match self.point(request.policy, request.pool, request.epoch).await {
            Ok(Pointed::Taken) => StepReport::Done {
                carried_by: CARRIED_BY,
                note: Some(sends),
            },
            // Past the deadline a written route is enough, as a route some routers hold is.
            Ok(Pointed::Written(why)) if request.overdue.is_some() => StepReport::Done {
                carried_by: CARRIED_BY,
                note: Some(format!(
                    "{sends}; past the promotion's deadline, not taken yet: {why}"
                )),
            },
            Ok(Pointed::Written(reason) | Pointed::Retry(reason)) => StepReport::NotYet { reason },
            Err(note) => StepReport::Refused {
                carried_by: CARRIED_BY,
                reason: "RouteTargetRefused",
                note,
            },
        }
    }
}

impl StepExecutor for RouteTargets {
    fn carry_out<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, StepReport> {
        if request.policy.spec.route.is_none() {
            return self.inner.carry_out(request);
        }
        match request.step {
            Step::Route => Box::pin(self.route(request)),
            Step::OpenAdmission => Box::pin(async move {
                StepReport::HandedOff {
                    carried_by: CARRIED_BY,
                    note: format!(
                        "no admission window: {} takes all traffic at once (admission control is understudy's router's)",
                        request.pool.name
                    ),
                }
            }),
            _ => self.inner.carry_out(request),
        }
    }

    fn keep_route<'a>(&'a self, request: RouteSyncRequest<'a>) -> BoxFuture<'a, RouteSyncReport> {
        if request.policy.spec.route.is_none() {
            return self.inner.keep_route(request);
        }
        Box::pin(async move {
            match self.point(request.policy, request.pool, request.epoch).await {
                Ok(Pointed::Taken) => {}
                Ok(Pointed::Written(waiting) | Pointed::Retry(waiting)) => {
                    tracing::debug!(%waiting, "the route target is not in place yet");
                }
                Err(error) => tracing::warn!(%error, "the route target cannot be kept in place"),
            }
            RouteSyncReport::default()
        })
    }
}

fn target_name(policy: &FailoverPolicy) -> String {
    match &policy.spec.route {
        Some(route) => match (&route.http_route, &route.service) {
            (Some(http_route), _) => format!("HTTPRoute {}", http_route.name),
            (_, Some(service)) => format!("Service {}", service.name),
            _ => "the route target".to_owned(),
        },
        None => "the routers".to_owned(),
    }
}

/// Gateway API's HTTPRoute, `gateway.networking.k8s.io/v1`.
#[must_use]
pub fn http_route_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
        "httproutes",
    )
}

/// The epoch an object's annotation says it was moved at.
fn epoch_of(metadata: &ObjectMeta) -> Option<Epoch> {
    metadata
        .annotations
        .as_ref()?
        .get(EPOCH_ANNOTATION)?
        .parse()
        .ok()
        .map(Epoch)
}

/// A target moved at a later epoch than `epoch` was moved by a newer operator's promotion: this
/// one must not move it back.
fn not_moved_since(name: &str, metadata: &ObjectMeta, epoch: Epoch) -> Result<(), String> {
    match epoch_of(metadata) {
        Some(later) if later > epoch => Err(format!(
            "{name} was moved at epoch {}, after epoch {}: left as it is",
            later.0, epoch.0
        )),
        _ => Ok(()),
    }
}

/// Whether `reference` (one of an HTTPRoute's `backendRefs`) names `backend`: the same kind and
/// group (a Service by default), the same name, and the route's own namespace.
fn names(reference: &Value, backend: &PoolBackend, namespace: &str) -> bool {
    let text = |key: &str| reference.get(key).and_then(Value::as_str);
    text("kind").unwrap_or("Service") == backend.kind.as_str()
        && text("group").unwrap_or("") == backend.kind.group()
        && text("name") == Some(backend.name.as_str())
        && text("namespace").unwrap_or(namespace) == namespace
}

/// A backendRef's weight: 1 when it names none.
fn weight(reference: &Value) -> u64 {
    reference.get("weight").and_then(Value::as_u64).unwrap_or(1)
}

/// The spec of an HTTPRoute (`route`, its fields but `metadata`, in `namespace`) with every
/// rule that sends to a pool sending to `primary`: its backendRef keeps its weight when it has
/// one, else takes the largest the pools' refs of that rule had (1 when none had any), and the
/// other pool's refs get 0. Refs to anything else keep their weights. `None` when it already is
/// so; `Err` when a rule sends to the other pool and not to the primary's backend, or no rule
/// sends to it at all.
pub fn weighted(
    route: &Value,
    namespace: &str,
    backends: &[PoolBackend],
    primary: &str,
) -> Result<Option<Value>, String> {
    let primary_backend = backends
        .iter()
        .find(|b| b.pool == primary)
        .ok_or_else(|| format!("no backend is named for {primary}"))?;
    let mut spec = route.get("spec").cloned().unwrap_or(Value::Null);
    let mut changed = false;
    let mut to_primary = false;
    let rules = spec
        .get_mut("rules")
        .and_then(Value::as_array_mut)
        .ok_or("the HTTPRoute has no rules")?;
    for (index, rule) in rules.iter_mut().enumerate() {
        let Some(references) = rule.get_mut("backendRefs").and_then(Value::as_array_mut) else {
            continue;
        };
        let of_pools: Vec<usize> = (0..references.len())
            .filter(|&i| backends.iter().any(|b| names(&references[i], b, namespace)))
            .collect();
        if of_pools.is_empty() {
            continue;
        }
        let share = of_pools
            .iter()
            .map(|&i| weight(&references[i]))
            .max()
            .unwrap_or(1)
            .max(1);
        let mut sends = false;
        for &i in &of_pools {
            let reference = &mut references[i];
            let want = if names(reference, primary_backend, namespace) {
                sends = true;
                match weight(reference) {
                    0 => share,
                    kept => kept,
                }
            } else {
                0
            };
            if weight(reference) != want {
                reference["weight"] = Value::from(want);
                changed = true;
            }
        }
        if !sends {
            return Err(format!(
                "rule {index} of the HTTPRoute sends to a pool but not to {primary}'s backend ({} {})",
                primary_backend.kind.as_str(),
                primary_backend.name
            ));
        }
        to_primary = true;
    }
    if !to_primary {
        return Err(format!(
            "no rule of the HTTPRoute sends to {primary}'s backend ({} {})",
            primary_backend.kind.as_str(),
            primary_backend.name
        ));
    }
    Ok(changed.then_some(spec))
}

/// Whether every gateway the HTTPRoute (`route`, its fields but `metadata`, in `namespace`)
/// names in `spec.parentRefs` has accepted it at `generation` or later and resolved its
/// backends: `Err` says which has not. Status entries of gateways it no longer names are not
/// read.
pub fn accepted(route: &Value, namespace: &str, generation: i64) -> Result<(), String> {
    let parents = route
        .pointer("/spec/parentRefs")
        .and_then(Value::as_array)
        .filter(|parents| !parents.is_empty())
        .ok_or("it names no parent gateway")?;
    let statuses = route
        .pointer("/status/parents")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let key = |reference: &Value| {
        let text = |field: &str| reference.get(field).and_then(Value::as_str).map(str::to_owned);
        (
            text("name"),
            text("namespace").unwrap_or_else(|| namespace.to_owned()),
            text("sectionName"),
        )
    };
    for parent in parents {
        let wanted = key(parent);
        let gateway = wanted.0.clone().unwrap_or_default();
        let status = statuses
            .iter()
            .find(|s| s.get("parentRef").is_some_and(|r| key(r) == wanted))
            .ok_or_else(|| format!("gateway {gateway} has not said whether it accepts it"))?;
        let condition = |kind: &str| {
            status
                .get("conditions")
                .and_then(Value::as_array)
                .and_then(|conditions| {
                    conditions
                        .iter()
                        .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
                })
        };
        let reason = |c: &Value| {
            c.get("reason")
                .and_then(Value::as_str)
                .unwrap_or("no reason")
                .to_owned()
        };
        let accepted = condition("Accepted")
            .ok_or_else(|| format!("gateway {gateway} has not said whether it accepts it"))?;
        let seen = accepted
            .get("observedGeneration")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if seen < generation {
            return Err(format!(
                "gateway {gateway} has seen generation {seen} of it, not {generation} yet"
            ));
        }
        if accepted.get("status").and_then(Value::as_str) != Some("True") {
            return Err(format!(
                "gateway {gateway} does not accept it: {}",
                reason(accepted)
            ));
        }
        if let Some(resolved) = condition("ResolvedRefs")
            && resolved.get("status").and_then(Value::as_str) == Some("False")
        {
            return Err(format!(
                "gateway {gateway} cannot resolve its backends: {}",
                reason(resolved)
            ));
        }
    }
    Ok(())
}

/// The labels a workload selects its serving pods by: a Deployment's or a StatefulSet's
/// `matchLabels` (`None` with `matchExpressions`, which a Service selector cannot say), or the
/// labels a LeaderWorkerSet puts on its leaders.
#[must_use]
pub fn pod_labels(kind: &WorkloadKind, name: &str, workload: &Value) -> Option<BTreeMap<String, String>> {
    if *kind == WorkloadKind::LeaderWorkerSet {
        // Its leaders serve; its workers do not.
        return Some(BTreeMap::from([
            ("leaderworkerset.sigs.k8s.io/name".to_owned(), name.to_owned()),
            (
                "leaderworkerset.sigs.k8s.io/worker-index".to_owned(),
                "0".to_owned(),
            ),
        ]));
    }
    let selector = workload.pointer("/spec/selector")?;
    if selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .is_some_and(|e| !e.is_empty())
    {
        return None;
    }
    let labels: BTreeMap<String, String> =
        serde_json::from_value(selector.get("matchLabels")?.clone()).ok()?;
    (!labels.is_empty()).then_some(labels)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;
    use crate::crd::BackendKind;

    fn backends() -> Vec<PoolBackend> {
        vec![
            PoolBackend {
                pool: "east".to_owned(),
                kind: BackendKind::Service,
                name: "chat-east".to_owned(),
            },
            PoolBackend {
                pool: "west".to_owned(),
                kind: BackendKind::InferencePool,
                name: "chat-west".to_owned(),
            },
        ]
    }

    /// An HTTPRoute's fields but its metadata, as a `DynamicObject` holds them, in `llm`.
    fn route() -> Value {
        json!({
            "spec": {
                "parentRefs": [{"name": "gateway"}, {"name": "edge", "namespace": "infra", "sectionName": "web"}],
                "rules": [
                    {"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                     "backendRefs": [
                        {"name": "chat-east", "namespace": "llm", "port": 8000},
                        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat-west", "weight": 0},
                        {"name": "mirror", "port": 8000, "weight": 5}
                     ]},
                    {"backendRefs": [{"name": "chat-east", "namespace": "other", "port": 8000}]}
                ]
            }
        })
    }

    #[test]
    fn a_promotion_moves_the_weight_to_the_new_primarys_backend_and_leaves_other_refs_alone() {
        let spec = weighted(&route(), "llm", &backends(), "west").unwrap().unwrap();
        let refs = &spec["rules"][0]["backendRefs"];
        assert_eq!(
            refs[0]["weight"], 0,
            "the old primary's Service, named in the route's own namespace"
        );
        assert_eq!(
            refs[1]["weight"], 1,
            "the new primary's InferencePool, at the old one's weight"
        );
        assert_eq!(refs[2]["weight"], 5, "a backend of no pool");
        assert!(
            spec["rules"][1]["backendRefs"][0].get("weight").is_none(),
            "a Service of that name in another namespace is not the pool's"
        );
        assert_eq!(spec["parentRefs"], route()["spec"]["parentRefs"]);
        // Already so: nothing to write.
        let mut moved = route();
        moved["spec"] = spec;
        assert_eq!(weighted(&moved, "llm", &backends(), "west").unwrap(), None);
        // The home pool: an absent weight counts as 1, and is kept.
        assert!(weighted(&route(), "llm", &backends(), "east").unwrap().is_none());
    }

    #[test]
    fn a_weight_the_pools_had_moves_with_the_primary_role() {
        let mut route = route();
        route["spec"]["rules"][0]["backendRefs"][0]["weight"] = json!(100);
        let spec = weighted(&route, "llm", &backends(), "west").unwrap().unwrap();
        let refs = &spec["rules"][0]["backendRefs"];
        assert_eq!(
            (refs[0]["weight"].clone(), refs[1]["weight"].clone()),
            (json!(0), json!(100))
        );
        assert_eq!(refs[2]["weight"], 5, "a backend of no pool keeps its weight");
    }

    #[test]
    fn a_rule_that_sends_to_the_old_pool_but_not_the_new_one_is_an_error_that_names_its_backend() {
        let mut route = route();
        route["spec"]["rules"][0]["backendRefs"]
            .as_array_mut()
            .unwrap()
            .remove(1);
        let error = weighted(&route, "llm", &backends(), "west").unwrap_err();
        assert!(
            error.contains("rule 0") && error.contains("InferencePool chat-west"),
            "{error}"
        );
        assert!(weighted(&json!({"spec": {}}), "llm", &backends(), "east").is_err());
        let elsewhere = json!({"spec": {"rules": [{"backendRefs": [{"name": "mirror"}]}]}});
        assert!(
            weighted(&elsewhere, "llm", &backends(), "east")
                .unwrap_err()
                .contains("no rule")
        );
    }

    #[test]
    fn a_route_is_taken_once_every_gateway_it_names_accepted_the_generation_written() {
        let mut route = route();
        assert!(accepted(&route, "llm", 4).unwrap_err().contains("has not said"));
        let parent = |reference: Value, generation: i64, status: &str| {
            json!({"parentRef": reference, "controllerName": "traefik.io/gateway-controller",
                   "conditions": [{"type": "Accepted", "status": status, "observedGeneration": generation, "reason": "Accepted"}]})
        };
        let gateway = json!({"name": "gateway"});
        let edge = json!({"name": "edge", "namespace": "infra", "sectionName": "web"});
        route["status"] = json!({"parents": [parent(gateway.clone(), 4, "True")]});
        assert!(
            accepted(&route, "llm", 4)
                .unwrap_err()
                .contains("gateway edge has not said")
        );
        route["status"] =
            json!({"parents": [parent(gateway.clone(), 4, "True"), parent(edge.clone(), 3, "True")]});
        let why = accepted(&route, "llm", 4).unwrap_err();
        assert!(why.contains("generation 3 of it, not 4"), "{why}");
        route["status"] =
            json!({"parents": [parent(gateway.clone(), 4, "True"), parent(edge.clone(), 5, "False")]});
        assert!(
            accepted(&route, "llm", 4)
                .unwrap_err()
                .contains("does not accept it")
        );
        // A gateway it no longer names is not waited for.
        let gone = parent(json!({"name": "old"}), 1, "False");
        route["status"] =
            json!({"parents": [parent(gateway.clone(), 4, "True"), parent(edge.clone(), 5, "True"), gone]});
        assert_eq!(accepted(&route, "llm", 4), Ok(()));
        let mut unresolved = parent(edge, 5, "True");
        unresolved["conditions"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "ResolvedRefs", "status": "False", "reason": "BackendNotFound"}));
        route["status"] = json!({"parents": [parent(gateway, 4, "True"), unresolved]});
        assert!(
            accepted(&route, "llm", 4)
                .unwrap_err()
                .contains("BackendNotFound")
        );
    }

    #[test]
    fn a_service_selects_the_serving_pods_its_pools_workload_selects() {
        let deployment = json!({"spec": {"selector": {"matchLabels": {"app": "chat-east"}}}});
        assert_eq!(
            pod_labels(&WorkloadKind::Deployment, "chat-east", &deployment),
            Some(BTreeMap::from([("app".to_owned(), "chat-east".to_owned())]))
        );
        let expressions = json!({"spec": {"selector": {"matchLabels": {"app": "x"},
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]}}});
        assert_eq!(pod_labels(&WorkloadKind::StatefulSet, "x", &expressions), None);
        let leaders = pod_labels(&WorkloadKind::LeaderWorkerSet, "big", &json!({})).unwrap();
        assert_eq!(
            leaders.get("leaderworkerset.sigs.k8s.io/name"),
            Some(&"big".to_owned())
        );
        assert_eq!(
            leaders.get("leaderworkerset.sigs.k8s.io/worker-index"),
            Some(&"0".to_owned())
        );
    }

    #[test]
    fn a_target_moved_at_a_later_epoch_is_left_as_it_is() {
        let mut metadata = ObjectMeta::default();
        assert!(not_moved_since("chat", &metadata, Epoch(1)).is_ok());
        metadata.annotations = Some(BTreeMap::from([(EPOCH_ANNOTATION.to_owned(), "2".to_owned())]));
        assert!(not_moved_since("chat", &metadata, Epoch(2)).is_ok());
        assert!(
            not_moved_since("chat", &metadata, Epoch(1))
                .unwrap_err()
                .contains("epoch 2")
        );
    }
}

//! Route targets other than understudy's routers (`spec.route`): a Gateway API HTTPRoute whose
//! backendRefs' weights move between the pools, or a Service whose selector moves. A promotion's
//! Route step writes the object, recording the epoch in [`EPOCH_ANNOTATION`]; for an HTTPRoute it
//! is done only once every parent in `status.parents` has accepted it at the generation written.
//! What a gateway's data plane still sends to the old pool after that, its fences refuse: the
//! epoch is enforced at the pools, not here.
//!
//! The admission step has nothing to open without understudy's routers and says so. Every other
//! step, and everything of a policy whose route goes to the routers, goes to the executor this
//! one wraps. Between promotions the target is kept pointing at the primary.
//!
//! Writes replace the object at the `resourceVersion` read (optimistic concurrency), changing
//! only the weights, the selector and the annotation: whoever owns the rest of it keeps it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
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

impl RouteTargets {
    /// Wraps `inner`, writing route targets with `client` (the operator's own cluster).
    #[must_use]
    pub fn new(inner: Arc<dyn StepExecutor>, client: kube::Client) -> Self {
        RouteTargets { inner, client }
    }

    /// Points `policy`'s target at `pool` at `epoch`: `Ok(None)` when it is written and taken,
    /// `Ok(Some(why))` while it waits, `Err` for what somebody must mend.
    async fn point(
        &self,
        policy: &FailoverPolicy,
        pool: &PoolSpec,
        epoch: Epoch,
    ) -> Result<Option<String>, String> {
        let namespace = policy.namespace().unwrap_or_default();
        let Some(route) = &policy.spec.route else {
            return Ok(None);
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
        Ok(None)
    }

    async fn point_http_route(
        &self,
        namespace: &str,
        target: &HttpRouteTarget,
        pool: &str,
        epoch: Epoch,
    ) -> Result<Option<String>, String> {
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
        let spec = weighted(&route.data, &target.backends, pool)?;
        let mut generation = route.metadata.generation;
        if spec.is_some() || epoch_of(&route) != Some(epoch) {
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
                Ok(written) => generation = written.metadata.generation,
                // Written meanwhile by another: read again next time.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    return Ok(Some(format!(
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
        Ok(accepted(&current.data, generation.unwrap_or_default())
            .err()
            .map(|why| format!("HTTPRoute {name} sends to {pool}; {why}")))
    }

    async fn point_service(
        &self,
        namespace: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        epoch: Epoch,
    ) -> Result<Option<String>, String> {
        let api: Api<Service> = Api::namespaced(self.client.clone(), namespace);
        let Some(mut service) = api
            .get_opt(name)
            .await
            .map_err(|e| format!("Service {name}: {e}"))?
        else {
            return Err(format!("Service {name} does not exist in {namespace}"));
        };
        let epoch_text = epoch.0.to_string();
        let selects = service.spec.as_ref().and_then(|s| s.selector.as_ref()) == Some(labels);
        if selects && service.annotations().get(EPOCH_ANNOTATION) == Some(&epoch_text) {
            return Ok(None);
        }
        service.spec.get_or_insert_with(Default::default).selector = Some(labels.clone());
        service
            .annotations_mut()
            .insert(EPOCH_ANNOTATION.to_owned(), epoch_text);
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        match api.replace(name, &params, &service).await {
            Ok(_) => Ok(None),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(Some(format!(
                "Service {name} changed while it was written; trying again"
            ))),
            Err(e) => Err(format!("Service {name}: {e}")),
        }
    }

    /// The labels `pool`'s workload selects its pods by.
    async fn pod_labels(&self, namespace: &str, pool: &PoolSpec) -> Result<BTreeMap<String, String>, String> {
        let workload = Workload::new(self.client.clone(), namespace, &pool.workload)
            .get()
            .await
            .map_err(|e| format!("the workload of {}: {e}", pool.name))?;
        pod_labels(&pool.workload.kind, &pool.workload.name, &workload.data)
            .ok_or_else(|| format!("the workload of {} selects its pods by no matchLabels", pool.name))
    }

    async fn route(&self, request: StepRequest<'_>) -> StepReport {
        match self.point(request.policy, request.pool, request.epoch).await {
            Ok(None) => StepReport::Done {
                carried_by: CARRIED_BY,
                note: Some(format!(
                    "{} sends to {} at epoch {}",
                    target_name(request.policy),
                    request.pool.name,
                    request.epoch
                )),
            },
            Ok(Some(reason)) => StepReport::NotYet { reason },
            Err(reason) => StepReport::NotYet { reason },
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
                StepReport::Done {
                    carried_by: CARRIED_BY,
                    note: Some(format!(
                        "no admission window: {} takes all traffic at once (admission control is understudy's router's)",
                        request.pool.name
                    )),
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
                Ok(None) => {}
                Ok(Some(waiting)) => tracing::debug!(%waiting, "the route target is not in place yet"),
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
fn epoch_of(object: &DynamicObject) -> Option<Epoch> {
    object
        .annotations()
        .get(EPOCH_ANNOTATION)?
        .parse()
        .ok()
        .map(Epoch)
}

/// Whether `reference` (one of an HTTPRoute's `backendRefs`) names `backend`: the same kind and
/// group (a Service by default), the same name, and no other namespace.
fn names(reference: &Value, backend: &PoolBackend, namespace: Option<&str>) -> bool {
    let text = |key: &str| reference.get(key).and_then(Value::as_str);
    text("kind").unwrap_or("Service") == backend.kind.as_str()
        && text("group").unwrap_or("") == backend.kind.group()
        && text("name") == Some(backend.name.as_str())
        && text("namespace").is_none_or(|ns| Some(ns) == namespace)
}

/// The spec of HTTPRoute `route` with every backendRef of the pools' `backends` weighted for
/// `primary`: 1 for its backend, 0 for the other pool's; `None` when it already is. Refs to
/// anything else keep their weights. `Err` when no rule sends to the primary's backend.
pub fn weighted(route: &Value, backends: &[PoolBackend], primary: &str) -> Result<Option<Value>, String> {
    let namespace = route.pointer("/metadata/namespace").and_then(Value::as_str);
    let mut spec = route.get("spec").cloned().unwrap_or(Value::Null);
    let mut changed = false;
    let mut to_primary = false;
    let rules = spec
        .get_mut("rules")
        .and_then(Value::as_array_mut)
        .ok_or("the HTTPRoute has no rules")?;
    for rule in rules {
        let Some(references) = rule.get_mut("backendRefs").and_then(Value::as_array_mut) else {
            continue;
        };
        for reference in references {
            let Some(backend) = backends.iter().find(|b| names(reference, b, namespace)) else {
                continue;
            };
            let weight = u64::from(backend.pool == primary);
            to_primary |= backend.pool == primary;
            // An absent weight is 1.
            let now = reference.get("weight").and_then(Value::as_u64).unwrap_or(1);
            if now != weight {
                reference["weight"] = Value::from(weight);
                changed = true;
            }
        }
    }
    if !to_primary {
        let backend = backends.iter().find(|b| b.pool == primary).map_or_else(
            || "none".to_owned(),
            |b| format!("{} {}", b.kind.as_str(), b.name),
        );
        return Err(format!(
            "no rule of the HTTPRoute sends to {primary}'s backend ({backend})"
        ));
    }
    Ok(changed.then_some(spec))
}

/// Whether every gateway that parents HTTPRoute `route` has accepted it at `generation` or later:
/// `Err` says which has not, or that none has said anything yet.
pub fn accepted(route: &Value, generation: i64) -> Result<(), String> {
    let parents = route
        .pointer("/status/parents")
        .and_then(Value::as_array)
        .filter(|parents| !parents.is_empty())
        .ok_or("no gateway has accepted it yet (status.parents is empty)")?;
    for parent in parents {
        let who = parent
            .get("controllerName")
            .and_then(Value::as_str)
            .unwrap_or("a gateway");
        let condition = parent
            .get("conditions")
            .and_then(Value::as_array)
            .and_then(|conditions| {
                conditions
                    .iter()
                    .find(|c| c.get("type").and_then(Value::as_str) == Some("Accepted"))
            })
            .ok_or_else(|| format!("{who} has not said whether it accepts it"))?;
        let seen = condition
            .get("observedGeneration")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if seen < generation {
            return Err(format!(
                "{who} has seen generation {seen} of it, not {generation} yet"
            ));
        }
        if condition.get("status").and_then(Value::as_str) != Some("True") {
            let reason = condition
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or("no reason");
            return Err(format!("{who} does not accept it: {reason}"));
        }
    }
    Ok(())
}

/// The labels a workload selects its pods by: a Deployment's or a StatefulSet's `matchLabels`
/// (`None` with `matchExpressions`, which a Service selector cannot say), or the name label a
/// LeaderWorkerSet puts on its pods.
#[must_use]
pub fn pod_labels(kind: &WorkloadKind, name: &str, workload: &Value) -> Option<BTreeMap<String, String>> {
    if *kind == WorkloadKind::LeaderWorkerSet {
        return Some(BTreeMap::from([(
            "leaderworkerset.sigs.k8s.io/name".to_owned(),
            name.to_owned(),
        )]));
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

    fn route() -> Value {
        json!({
            "metadata": {"name": "chat", "namespace": "llm", "generation": 3},
            "spec": {
                "parentRefs": [{"name": "gateway"}],
                "rules": [
                    {"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                     "backendRefs": [
                        {"name": "chat-east", "port": 8000},
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
        let spec = weighted(&route(), &backends(), "west").unwrap().unwrap();
        let refs = &spec["rules"][0]["backendRefs"];
        assert_eq!(refs[0]["weight"], 0, "the old primary's Service");
        assert_eq!(refs[1]["weight"], 1, "the new primary's InferencePool");
        assert_eq!(refs[2]["weight"], 5, "a backend of no pool");
        assert!(
            spec["rules"][1]["backendRefs"][0].get("weight").is_none(),
            "a Service of that name in another namespace is not the pool's"
        );
        assert_eq!(spec["parentRefs"], route()["spec"]["parentRefs"]);
        // Already so: nothing to write.
        let mut moved = route();
        moved["spec"] = spec;
        assert_eq!(weighted(&moved, &backends(), "west").unwrap(), None);
        // The home pool back: an absent weight counts as 1.
        assert!(weighted(&route(), &backends(), "east").unwrap().is_none());
    }

    #[test]
    fn a_route_that_never_sends_to_the_primary_is_an_error_that_names_its_backend() {
        let mut route = route();
        route["spec"]["rules"][0]["backendRefs"]
            .as_array_mut()
            .unwrap()
            .remove(1);
        let error = weighted(&route, &backends(), "west").unwrap_err();
        assert!(error.contains("InferencePool chat-west"), "{error}");
        assert!(weighted(&json!({"spec": {}}), &backends(), "east").is_err());
    }

    #[test]
    fn a_route_is_taken_once_every_parent_accepted_the_generation_written() {
        let mut route = route();
        assert!(
            accepted(&route, 4)
                .unwrap_err()
                .contains("status.parents is empty")
        );
        let parent = |generation: i64, status: &str| {
            json!({"parentRef": {"name": "gateway"}, "controllerName": "traefik.io/gateway-controller",
                   "conditions": [{"type": "Accepted", "status": status, "observedGeneration": generation, "reason": "Accepted"}]})
        };
        route["status"] = json!({"parents": [parent(4, "True"), parent(3, "True")]});
        let why = accepted(&route, 4).unwrap_err();
        assert!(why.contains("generation 3 of it, not 4"), "{why}");
        route["status"] = json!({"parents": [parent(4, "True"), parent(5, "False")]});
        assert!(accepted(&route, 4).unwrap_err().contains("does not accept it"));
        route["status"] = json!({"parents": [parent(4, "True"), parent(5, "True")]});
        assert_eq!(accepted(&route, 4), Ok(()));
    }

    #[test]
    fn a_service_selects_the_pods_its_pools_workload_selects() {
        let deployment = json!({"spec": {"selector": {"matchLabels": {"app": "chat-east"}}}});
        assert_eq!(
            pod_labels(&WorkloadKind::Deployment, "chat-east", &deployment),
            Some(BTreeMap::from([("app".to_owned(), "chat-east".to_owned())]))
        );
        let expressions = json!({"spec": {"selector": {"matchLabels": {"app": "x"},
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]}}});
        assert_eq!(pod_labels(&WorkloadKind::StatefulSet, "x", &expressions), None);
        assert_eq!(
            pod_labels(&WorkloadKind::LeaderWorkerSet, "big", &json!({}))
                .unwrap()
                .get("leaderworkerset.sigs.k8s.io/name"),
            Some(&"big".to_owned())
        );
    }
}

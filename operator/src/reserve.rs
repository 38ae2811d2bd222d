//! GPU reserves: placeholder pods that hold the GPUs of the standby's pilot-light replicas, so
//! that a promotion does not wait for capacity. This is the cluster overprovisioner ("balloon
//! pods") pattern: a Deployment of pause containers that request what one replica requests, at a
//! negative priority that never preempts anything. When the pilot-light replicas are scaled up,
//! the scheduler preempts the placeholders and the replicas take their place.
//!
//! Pure: this module decides which pool's GPUs are held, how many replicas' worth, and what the
//! reserve Deployment looks like. The controller reads the workload and applies the result. It
//! must never reserve for the primary: the pool that holds the epoch Lease serves with its own
//! replicas, and placeholders beside them would only hold GPUs nobody is waiting for. (The
//! controller keeps the reserve of a pool that just became primary until its replicas are ready,
//! so the GPUs its placeholders free go to them; it never applies one for the primary.)

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements,
    SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use understudy_core::Pool;

use crate::crd::{FailoverPolicy, FailoverPolicySpec, Tier, WorkloadKind};

/// The placeholders' image: a pause container does nothing and costs next to nothing.
pub const DEFAULT_PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";

/// The PriorityClass the chart installs for placeholders: negative, `preemptionPolicy: Never`.
pub const DEFAULT_PRIORITY_CLASS: &str = "understudy-gpu-reserve";

/// `app.kubernetes.io/component` of every reserve Deployment and its pods.
pub const COMPONENT: &str = "gpu-reserve";

/// The label naming the policy a reserve belongs to.
pub const POLICY_LABEL: &str = "understudy.dev/policy";

/// The label naming the pool whose GPUs a reserve holds.
pub const POOL_LABEL: &str = "understudy.dev/pool";

/// Resources whose requests may be below their limits, so a placeholder asks for them as
/// requests only. Every other resource (GPUs, hugepages) needs a limit equal to its request.
const OVERCOMMITTABLE: [&str; 3] = ["cpu", "memory", "ephemeral-storage"];

/// How placeholders are run; the operator's command line sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReserveConfig {
    pub image: String,
    pub priority_class: String,
}

impl Default for ReserveConfig {
    fn default() -> Self {
        ReserveConfig {
            image: DEFAULT_PAUSE_IMAGE.to_owned(),
            priority_class: DEFAULT_PRIORITY_CLASS.to_owned(),
        }
    }
}

/// Whose GPUs to hold, and how many replicas' worth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservePlan {
    /// The standby pool.
    pub pool: Pool,
    pub pool_name: String,
    /// The reserve Deployment's name.
    pub deployment: String,
    /// The replicas of the standby's pilot-light groups with `reserveGpus: true`; the controller
    /// lowers it to those not running ([`waiting_reserved`]).
    pub replicas: u32,
}

/// Why a reserve Deployment could not be built from the workload.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReserveError {
    /// The workload has no pod template where its kind keeps one.
    #[error("{kind:?} {name} has no pod template at {path}")]
    NoTemplate {
        kind: WorkloadKind,
        name: String,
        path: &'static str,
    },
    /// The pod template does not read as one.
    #[error("the pod template of {name} cannot be read: {reason}")]
    Template { name: String, reason: String },
    /// Two containers ask for a resource in a form that cannot be added up.
    #[error("cannot add up {resource} across the containers of {name}: {value:?} is not a quantity")]
    Quantity {
        name: String,
        resource: String,
        value: String,
    },
    /// The policy's name cannot be a label value (at most 63 characters).
    #[error("a GPU reserve labels its pods with the policy's name, which must be at most 63 characters")]
    PolicyNameTooLong,
    /// The policy lacks the metadata an owner reference needs.
    #[error("the policy has no {0}")]
    MissingObjectKey(&'static str),
}

/// The name of the reserve Deployment of `pool` under `policy`.
#[must_use]
pub fn reserve_name(policy: &str, pool: &str) -> String {
    format!("{policy}-{pool}-reserve")
}

/// The reserve the policy wants while `primary` holds the epoch Lease: the other pool's
/// pilot-light groups with `reserveGpus: true`, or nothing when it has none.
#[must_use]
pub fn reserve_plan(policy: &str, spec: &FailoverPolicySpec, primary: Pool) -> Option<ReservePlan> {
    let standby = primary.other();
    let pool = spec.pools.get(standby.index())?;
    let replicas: u32 = pool
        .standby_groups()
        .iter()
        .filter(|group| group.tier == Tier::PilotLight && group.reserve_gpus())
        .map(|group| group.replicas)
        .sum();
    (replicas > 0).then(|| ReservePlan {
        pool: standby,
        pool_name: pool.name.clone(),
        deployment: reserve_name(policy, &pool.name),
        replicas,
    })
}

/// How many of `reserved` pilot-light replicas wait without running, when the pool's workload
/// runs `running` of its `total` replicas: the running ones hold their GPUs already. A pool scales
/// up as a whole, so the replicas beyond `running` are the pilot light, reserved ones counted
/// first.
#[must_use]
pub fn waiting_reserved(reserved: u32, total: u32, running: u32) -> u32 {
    reserved.min(total.saturating_sub(running))
}

/// What one replica of a workload runs: its pod template, and how many pods make one replica.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadShape {
    pub template: PodTemplateSpec,
    /// 1 for a Deployment or StatefulSet; a LeaderWorkerSet's group size.
    pub pods_per_replica: u32,
}

/// Reads a workload object (as the API server returns it) into its shape.
///
/// A LeaderWorkerSet replica is a group of `size` pods; each is shaped like the worker template,
/// which in multi-node vLLM asks for the same GPUs as the leader. Placing the group's pods within
/// one topology domain, as LeaderWorkerSet's exclusive placement does, is not reproduced: the
/// placeholders hold the GPU count on matching nodes, not a rack.
pub fn workload_shape(
    kind: WorkloadKind,
    name: &str,
    object: &serde_json::Value,
) -> Result<WorkloadShape, ReserveError> {
    let (path, pods_per_replica) = match kind {
        WorkloadKind::Deployment | WorkloadKind::StatefulSet => ("/spec/template", 1),
        WorkloadKind::LeaderWorkerSet => {
            let size = object
                .pointer("/spec/leaderWorkerTemplate/size")
                .and_then(serde_json::Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(1);
            ("/spec/leaderWorkerTemplate/workerTemplate", size.max(1))
        }
    };
    let template = object
        .pointer(path)
        .filter(|t| !t.is_null())
        .ok_or_else(|| ReserveError::NoTemplate {
            kind,
            name: name.to_owned(),
            path,
        })?;
    let template: PodTemplateSpec =
        serde_json::from_value(template.clone()).map_err(|e| ReserveError::Template {
            name: name.to_owned(),
            reason: e.to_string(),
        })?;
    Ok(WorkloadShape {
        template,
        pods_per_replica,
    })
}

/// The labels of a reserve Deployment and its pods; all but `managed-by` select them.
#[must_use]
pub fn reserve_labels(policy: &str, pool: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "understudy".to_owned()),
        ("app.kubernetes.io/component".to_owned(), COMPONENT.to_owned()),
        (POLICY_LABEL.to_owned(), policy.to_owned()),
        (POOL_LABEL.to_owned(), pool.to_owned()),
    ])
}

/// The label selector that finds every reserve of `policy`, whichever pool it holds.
#[must_use]
pub fn reserve_selector(policy: &str) -> String {
    format!("app.kubernetes.io/component={COMPONENT},{POLICY_LABEL}={policy}")
}

/// Whether `meta` is a reserve of the policy whose uid is `policy_uid`: labelled as a reserve and
/// owned by that policy. Anything else of the same name or labels is somebody else's, never
/// applied over or deleted.
#[must_use]
pub fn is_reserve_of(meta: &ObjectMeta, policy_uid: &str) -> bool {
    let labelled = meta
        .labels
        .as_ref()
        .and_then(|labels| labels.get("app.kubernetes.io/component"))
        .is_some_and(|component| component == COMPONENT);
    let owned = meta
        .owner_references
        .iter()
        .flatten()
        .any(|owner| owner.uid == policy_uid);
    labelled && owned
}

/// The reserve Deployment for `plan`, shaped like one pod of `shape`: one placeholder per pod
/// the reserved replicas will run, each requesting what that pod requests (GPUs and every other
/// extended resource, cpu, memory), placed by the template's node selector, affinity,
/// tolerations and runtime class. Owned by the policy, so that deleting the policy deletes it.
pub fn reserve_deployment(
    policy: &FailoverPolicy,
    plan: &ReservePlan,
    shape: &WorkloadShape,
    config: &ReserveConfig,
) -> Result<Deployment, ReserveError> {
    let policy_name = policy.name_any();
    if policy_name.len() > 63 {
        return Err(ReserveError::PolicyNameTooLong);
    }
    let owner = OwnerReference {
        api_version: FailoverPolicy::api_version(&()).into_owned(),
        kind: FailoverPolicy::kind(&()).into_owned(),
        name: policy_name.clone(),
        uid: policy.uid().ok_or(ReserveError::MissingObjectKey("uid"))?,
        controller: Some(true),
        // Blocking the owner's deletion would need update on failoverpolicies/finalizers.
        block_owner_deletion: None,
    };
    let pod = shape.template.spec.clone().unwrap_or_default();
    let resources = pod_requests(&pod).map_err(|(resource, value)| ReserveError::Quantity {
        name: policy_name.clone(),
        resource,
        value,
    })?;
    let limits: BTreeMap<String, Quantity> = resources
        .iter()
        .filter(|(name, _)| !OVERCOMMITTABLE.contains(&name.as_str()))
        .map(|(name, quantity)| (name.clone(), quantity.clone()))
        .collect();
    let labels = reserve_labels(&policy_name, &plan.pool_name);
    let mut object_labels = labels.clone();
    object_labels.insert(
        "app.kubernetes.io/managed-by".to_owned(),
        understudy_api::FIELD_MANAGER.to_owned(),
    );
    let container = Container {
        name: "reserve".to_owned(),
        image: Some(config.image.clone()),
        resources: Some(ResourceRequirements {
            requests: (!resources.is_empty()).then_some(resources),
            limits: (!limits.is_empty()).then_some(limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            // The pause image's own user; stated so that runAsNonRoot can be checked.
            run_as_user: Some(65535),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    let spec = PodSpec {
        containers: vec![container],
        priority_class_name: Some(config.priority_class.clone()),
        // A preempted placeholder holds nothing worth a grace period.
        termination_grace_period_seconds: Some(0),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        // Pod Security "restricted" asks for a seccomp profile besides the container's settings.
        security_context: Some(PodSecurityContext {
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        node_selector: pod.node_selector,
        affinity: pod.affinity,
        tolerations: pod.tolerations,
        runtime_class_name: pod.runtime_class_name,
        ..PodSpec::default()
    };
    let replicas = plan.replicas.saturating_mul(shape.pods_per_replica);
    Ok(Deployment {
        metadata: ObjectMeta {
            name: Some(plan.deployment.clone()),
            namespace: policy.namespace(),
            labels: Some(object_labels),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(i32::try_from(replicas).unwrap_or(i32::MAX)),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            // A rolling update would surge placeholders that wait for GPUs the old ones hold.
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".to_owned()),
                ..DeploymentStrategy::default()
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(spec),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    })
}

/// What the scheduler reserves for one pod of `pod`, resource by resource, as Kubernetes works
/// out a pod's effective request: the sum over its containers and sidecars (init containers that
/// keep running), or, where that is more, what a one-shot init container asks for together with
/// the sidecars declared before it, which already run beside it. A container's request defaults
/// to its limit, as the API server defaults it. A quantity asked for by one container only is
/// kept as written.
fn pod_requests(pod: &PodSpec) -> Result<BTreeMap<String, Quantity>, (String, String)> {
    fn requested(container: &Container) -> BTreeMap<String, Quantity> {
        let Some(resources) = &container.resources else {
            return BTreeMap::new();
        };
        let mut asked = resources.limits.clone().unwrap_or_default();
        asked.extend(resources.requests.clone().unwrap_or_default());
        asked
    }
    /// Adds up quantities of one resource; one alone is kept as written.
    fn sum(name: &str, quantities: &[Quantity]) -> Result<(Quantity, u128), (String, String)> {
        let mut milli: u128 = 0;
        for q in quantities {
            let value = milli_value(&q.0).ok_or_else(|| (name.to_owned(), q.0.clone()))?;
            milli = milli
                .checked_add(value)
                .ok_or_else(|| (name.to_owned(), q.0.clone()))?;
        }
        match quantities {
            [only] => Ok((only.clone(), milli)),
            _ => Ok((Quantity(milli_quantity(milli)), milli)),
        }
    }
    let init = pod.init_containers.as_deref().unwrap_or_default();
    let is_sidecar = |c: &Container| c.restart_policy.as_deref() == Some("Always");
    let mut steady: BTreeMap<String, Vec<Quantity>> = BTreeMap::new();
    for container in pod.containers.iter().chain(init.iter().filter(|c| is_sidecar(c))) {
        for (name, quantity) in requested(container) {
            steady.entry(name).or_default().push(quantity);
        }
    }
    let mut total: BTreeMap<String, (Quantity, u128)> = BTreeMap::new();
    for (name, quantities) in steady {
        let summed = sum(&name, &quantities)?;
        total.insert(name, summed);
    }
    // The sidecars declared so far, in order: each one-shot init container runs beside them.
    let mut sidecars_before: BTreeMap<String, Vec<Quantity>> = BTreeMap::new();
    for container in init {
        if is_sidecar(container) {
            for (name, quantity) in requested(container) {
                sidecars_before.entry(name).or_default().push(quantity);
            }
            continue;
        }
        for (name, quantity) in requested(container) {
            let mut together = sidecars_before.get(&name).cloned().unwrap_or_default();
            together.push(quantity);
            let candidate = sum(&name, &together)?;
            if total.get(&name).is_none_or(|(_, current)| candidate.1 > *current) {
                total.insert(name, candidate);
            }
        }
    }
    Ok(total
        .into_iter()
        .map(|(name, (quantity, _))| (name, quantity))
        .collect())
}

/// A Kubernetes quantity in thousandths of its unit, rounded up as the API server rounds a
/// request: `500m` is 500, `2` is 2000, `1Gi` is 1073741824000. `None` for anything else.
fn milli_value(text: &str) -> Option<u128> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let number = number.strip_prefix('+').unwrap_or(number);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    let digits = format!("{whole}{fraction}");
    let mantissa: u128 = digits.parse().ok()?;
    let decimals = u32::try_from(fraction.len()).ok()?;
    // value = mantissa / 10^decimals * numerator / denominator, in thousandths.
    let (numerator, denominator): (u128, u128) = match suffix {
        "n" => (1, 1_000_000),
        "u" => (1, 1_000),
        "m" => (1, 1),
        "" => (1_000, 1),
        "k" => (1_000_000, 1),
        "M" => (1_000_000_000, 1),
        "G" => (1_000_000_000_000, 1),
        "T" => (1_000_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000_000, 1),
        "Ki" => (1_000 << 10, 1),
        "Mi" => (1_000 << 20, 1),
        "Gi" => (1_000 << 30, 1),
        "Ti" => (1_000 << 40, 1),
        "Pi" => (1_000 << 50, 1),
        "Ei" => (1_000 << 60, 1),
        exponent => {
            let power = exponent.strip_prefix(['e', 'E'])?;
            let power: u32 = power.strip_prefix('+').unwrap_or(power).parse().ok()?;
            (1_000u128.checked_mul(10u128.checked_pow(power)?)?, 1)
        }
    };
    let scaled = mantissa.checked_mul(numerator)?;
    let divisor = 10u128.checked_pow(decimals)?.checked_mul(denominator)?;
    Some(scaled.div_ceil(divisor))
}

/// Thousandths written back as a quantity: whole units where they are whole, else `m`.
fn milli_quantity(milli: u128) -> String {
    if milli.is_multiple_of(1000) {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn policy(yaml_pools: &str) -> FailoverPolicy {
        let text = format!(
            "apiVersion: understudy.dev/v1alpha1\nkind: FailoverPolicy\nmetadata:\n  name: llama\n  \
             namespace: serving\n  uid: 0d5e8c42\nspec:\n  recoveryObjective: 5m\n  pools:\n{yaml_pools}"
        );
        serde_yaml::from_str(&text).unwrap()
    }

    /// East has no reserve; west keeps two replicas hot and reserves GPUs for three pilot-light
    /// ones, in two groups.
    fn two_pools() -> FailoverPolicy {
        policy(
            "  - {name: us-east, workload: {kind: Deployment, name: vllm-east}, replicas: 4}
  - name: us-west
    workload: {kind: Deployment, name: vllm-west}
    replicas: 6
    standby:
      - {tier: hot, replicas: 2}
      - {tier: pilotLight, replicas: 2, reserveGpus: true}
      - {tier: pilotLight, replicas: 1, reserveGpus: true}
      - {tier: pilotLight, replicas: 1}
",
        )
    }

    fn vllm_deployment() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "vllm-west", "namespace": "serving"},
            "spec": {"replicas": 2, "template": {
                "metadata": {"labels": {"app": "vllm-west"}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-west-2a"]}
                        ]}]
                    }}},
                    "runtimeClassName": "nvidia",
                    "priorityClassName": "serving-critical",
                    "serviceAccountName": "vllm",
                    "initContainers": [
                        {"name": "fetch-weights", "image": "fetch", "resources": {"requests": {"cpu": "8", "memory": "4Gi"}}},
                        {"name": "fence", "image": "fence", "restartPolicy": "Always",
                         "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
                    ],
                    "containers": [{
                        "name": "vllm", "image": "vllm/vllm-openai",
                        "resources": {
                            "requests": {"cpu": "6", "memory": "96Gi"},
                            "limits": {"nvidia.com/gpu": "2", "memory": "96Gi"}
                        }
                    }]
                }
            }}
        })
    }

    #[test]
    fn only_reserved_replicas_that_are_not_running_are_held() {
        // Six replicas, two hot, three reserved pilot light, one unreserved.
        assert_eq!(waiting_reserved(3, 6, 2), 3, "a standby as configured");
        assert_eq!(waiting_reserved(3, 6, 4), 2, "two of the pilot light run already");
        assert_eq!(waiting_reserved(3, 6, 6), 0, "an old primary runs them all");
        assert_eq!(waiting_reserved(3, 6, 9), 0, "scaled beyond the spec by hand");
    }

    #[test]
    fn the_reserve_is_for_the_standby_and_counts_its_reserved_pilot_light_replicas() {
        let policy = two_pools();
        let plan = reserve_plan("llama", &policy.spec, Pool::A).unwrap();
        assert_eq!(plan.pool, Pool::B);
        assert_eq!(plan.pool_name, "us-west");
        assert_eq!(plan.deployment, "llama-us-west-reserve");
        assert_eq!(
            plan.replicas, 3,
            "two groups reserve, the third pilot-light group does not"
        );
    }

    #[test]
    fn a_primary_or_a_standby_without_reserved_groups_gets_no_reserve() {
        let policy = two_pools();
        // us-west primary: us-east is the standby, and it reserves nothing.
        assert_eq!(reserve_plan("llama", &policy.spec, Pool::B), None);
        let all_hot = policy_without_reserve();
        assert_eq!(reserve_plan("llama", &all_hot.spec, Pool::A), None);
    }

    fn policy_without_reserve() -> FailoverPolicy {
        policy(
            "  - {name: us-east, workload: {kind: Deployment, name: vllm-east}, replicas: 4}
  - name: us-west
    workload: {kind: Deployment, name: vllm-west}
    replicas: 4
    standby:
      - {tier: warm, replicas: 2}
      - {tier: pilotLight, replicas: 2, reserveGpus: false}
",
        )
    }

    fn built() -> Deployment {
        let policy = two_pools();
        let plan = reserve_plan("llama", &policy.spec, Pool::A).unwrap();
        let shape = workload_shape(WorkloadKind::Deployment, "vllm-west", &vllm_deployment()).unwrap();
        reserve_deployment(&policy, &plan, &shape, &ReserveConfig::default()).unwrap()
    }

    #[test]
    fn placeholders_request_what_one_replica_requests_and_sit_where_it_would() {
        let deployment = built();
        let spec = deployment.spec.unwrap();
        assert_eq!(spec.replicas, Some(3));
        let pod = spec.template.spec.unwrap();
        let container = &pod.containers[0];
        assert_eq!(container.image.as_deref(), Some(DEFAULT_PAUSE_IMAGE));
        let resources = container.resources.clone().unwrap();
        let requests = resources.requests.unwrap();
        // The GPUs as written; memory summed with the fence sidecar; cpu from the one-shot init
        // container, whose 8 cpus are more than the 6.1 the containers and sidecar ask for, and
        // the scheduler reserves the larger.
        assert_eq!(requests["nvidia.com/gpu"], Quantity("2".into()));
        assert_eq!(requests["cpu"], Quantity("8".into()));
        assert_eq!(requests["memory"], Quantity("103146323968".into()), "96Gi + 64Mi");
        let limits = resources.limits.unwrap();
        assert_eq!(limits.keys().collect::<Vec<_>>(), ["nvidia.com/gpu"]);
        assert_eq!(limits["nvidia.com/gpu"], Quantity("2".into()));
        assert_eq!(
            pod.node_selector.unwrap()["nvidia.com/gpu.product"],
            "NVIDIA-H100-80GB-HBM3"
        );
        let tolerations = pod.tolerations.unwrap();
        assert_eq!(tolerations[0].key.as_deref(), Some("nvidia.com/gpu"));
        assert!(pod.affinity.unwrap().node_affinity.is_some());
        assert_eq!(pod.runtime_class_name.as_deref(), Some("nvidia"));
        // The workload's priority and identity are not the placeholders'.
        assert_eq!(pod.priority_class_name.as_deref(), Some(DEFAULT_PRIORITY_CLASS));
        assert_eq!(pod.service_account_name, None);
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.init_containers, None);
    }

    #[test]
    fn the_reserve_is_owned_by_the_policy_and_labelled_as_a_reserve() {
        let deployment = built();
        let meta = &deployment.metadata;
        assert_eq!(meta.name.as_deref(), Some("llama-us-west-reserve"));
        assert_eq!(meta.namespace.as_deref(), Some("serving"));
        let owner = &meta.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("FailoverPolicy", "llama", "0d5e8c42")
        );
        assert_eq!(owner.controller, Some(true));
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(labels["app.kubernetes.io/component"], COMPONENT);
        assert_eq!(labels[POLICY_LABEL], "llama");
        assert_eq!(labels[POOL_LABEL], "us-west");
        let spec = deployment.spec.unwrap();
        let selector = spec.selector.match_labels.unwrap();
        let pod_labels = spec.template.metadata.unwrap().labels.unwrap();
        assert!(selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)));
        assert!(
            !selector.contains_key("app"),
            "must never select the workload's own pods"
        );
    }

    #[test]
    fn a_leader_worker_set_reserves_a_placeholder_per_pod_of_each_group() {
        let policy = two_pools();
        let plan = reserve_plan("llama", &policy.spec, Pool::A).unwrap();
        let lws = serde_json::json!({
            "spec": {"replicas": 2, "leaderWorkerTemplate": {"size": 4, "workerTemplate": {
                "spec": {"containers": [{"name": "vllm", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}
            }}}
        });
        let shape = workload_shape(WorkloadKind::LeaderWorkerSet, "lws", &lws).unwrap();
        assert_eq!(shape.pods_per_replica, 4);
        let deployment = reserve_deployment(&policy, &plan, &shape, &ReserveConfig::default()).unwrap();
        let spec = deployment.spec.unwrap();
        assert_eq!(spec.replicas, Some(12), "three replicas of four pods");
        let container = &spec.template.spec.unwrap().containers[0];
        let requests = container.resources.clone().unwrap().requests.unwrap();
        assert_eq!(requests["nvidia.com/gpu"], Quantity("8".into()));
    }

    #[test]
    fn a_workload_without_a_template_is_an_error_naming_where_it_looked() {
        let error = workload_shape(
            WorkloadKind::StatefulSet,
            "vllm",
            &serde_json::json!({"spec": {}}),
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "StatefulSet vllm has no pod template at /spec/template"
        );
    }

    #[test]
    fn image_and_priority_class_come_from_the_configuration() {
        let policy = two_pools();
        let plan = reserve_plan("llama", &policy.spec, Pool::A).unwrap();
        let shape = workload_shape(WorkloadKind::Deployment, "vllm-west", &vllm_deployment()).unwrap();
        let config = ReserveConfig {
            image: "mirror.example/pause:3.10".into(),
            priority_class: "gpu-balloon".into(),
        };
        let pod = reserve_deployment(&policy, &plan, &shape, &config)
            .unwrap()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        assert_eq!(
            pod.containers[0].image.as_deref(),
            Some("mirror.example/pause:3.10")
        );
        assert_eq!(pod.priority_class_name.as_deref(), Some("gpu-balloon"));
    }

    #[test]
    fn placeholders_pass_pod_security_restricted() {
        let pod = built().spec.unwrap().template.spec.unwrap();
        let seccomp = pod.security_context.unwrap().seccomp_profile.unwrap();
        assert_eq!(seccomp.type_, "RuntimeDefault");
        let container = pod.containers[0].security_context.clone().unwrap();
        assert_eq!(container.run_as_non_root, Some(true));
        assert_eq!(container.allow_privilege_escalation, Some(false));
        assert_eq!(container.capabilities.unwrap().drop, Some(vec!["ALL".to_owned()]));
    }

    #[test]
    fn a_one_shot_init_container_counts_with_the_sidecars_declared_before_it() {
        let pod: PodSpec = serde_json::from_value(serde_json::json!({
            "initContainers": [
                {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "2"}}},
                {"name": "fetch-weights", "resources": {"requests": {"cpu": "8", "memory": "1Gi"}}},
                {"name": "late", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m"}}}
            ],
            "containers": [{"name": "vllm", "resources": {"requests": {"cpu": "6", "memory": "4Gi"}}}]
        }))
        .unwrap();
        let requests = pod_requests(&pod).unwrap();
        // The steady pod asks 8.5 cpus; fetch-weights runs beside the proxy declared before it,
        // 10, but not beside the sidecar declared after it.
        assert_eq!(requests["cpu"], Quantity("10".into()));
        assert_eq!(requests["memory"], Quantity("4Gi".into()));
    }

    #[test]
    fn a_reserve_is_recognised_by_its_label_and_its_owner() {
        let deployment = built();
        assert!(is_reserve_of(&deployment.metadata, "0d5e8c42"));
        assert!(
            !is_reserve_of(&deployment.metadata, "another-policy-uid"),
            "a policy of the same name created again owns its own"
        );
        let mut unlabelled = deployment.metadata.clone();
        unlabelled.labels = None;
        assert!(!is_reserve_of(&unlabelled, "0d5e8c42"));
        assert_eq!(
            reserve_selector("llama"),
            "app.kubernetes.io/component=gpu-reserve,understudy.dev/policy=llama"
        );
    }

    #[test]
    fn quantities_read_as_the_api_server_reads_them() {
        assert_eq!(milli_value("500m"), Some(500));
        assert_eq!(milli_value("2"), Some(2000));
        assert_eq!(milli_value("1.5"), Some(1500));
        assert_eq!(milli_value("1Gi"), Some(1_073_741_824_000));
        assert_eq!(milli_value("1k"), Some(1_000_000));
        assert_eq!(milli_value("2e3"), Some(2_000_000));
        assert_eq!(milli_value("0.5Mi"), Some(524_288_000));
        assert_eq!(milli_value("1n"), Some(1), "rounded up");
        assert_eq!(milli_value("lots"), None);
        assert_eq!(milli_value("1Qi"), None);
        assert_eq!(milli_quantity(8_100), "8100m");
        assert_eq!(milli_quantity(8_000), "8");
    }
}

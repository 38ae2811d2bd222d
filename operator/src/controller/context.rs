//! What every reconcile of a FailoverPolicy shares: the clients, the ports it consumes, the
//! clock, the write timeout, and the backoff counts of its error policy.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kube::Client;
use kube::runtime::reflector::ObjectRef;
use understudy_core::Pool;
use understudy_prober::probe::{Endpoint, Expectation, ProbeReport};

use crate::clusters::Clusters;
use crate::crd::FailoverPolicy;
use crate::grants::Grantor;
use crate::judge::fixed_expectation;
use crate::load_proof::LoadProofs;
use crate::metrics::Metrics;
use crate::ports::ReplicaEndpoints;
use crate::ports::{HandOffToComponents, NoObservations, ObservationSource, ProbeFindings, StepExecutor};
use crate::reconciler::{Shell, WithShell};
use crate::reserve::ReserveConfig;
use crate::standby::HostRoom;

/// The finalizer the controller puts on every FailoverPolicy it runs.
pub const FINALIZER: &str = "understudy.dev/cleanup";

/// How soon a policy is looked at again while a promotion is under way.
pub(super) const PROMOTING_REQUEUE: Duration = Duration::from_secs(2);

/// What every reconcile shares.
pub struct Context {
    /// The client, the Event recorder, the clock, the write timeout and the watchdog.
    pub shell: Shell,
    pub metrics: Arc<Metrics>,
    pub observations: Arc<dyn ObservationSource>,
    /// Without one, a golden answer in status is kept while it fits the probe.
    pub findings: Option<Arc<dyn ProbeFindings>>,
    pub steps: Arc<dyn StepExecutor>,
    /// How GPU reserves' placeholder pods run.
    pub reserve: ReserveConfig,
    /// How the pools' replicas are reached by the reconciles themselves: to keep the standby in
    /// its shape between promotions ([`crate::standby`]) and to count the promoted pool's
    /// replicas that pass the generating probe. Without it the standby is left as it runs and
    /// serving is counted by ready pods.
    pub replicas: Option<Arc<dyn ReplicaEndpoints>>,
    /// Grants the fences their right to serve; without it the fences read the Lease themselves.
    pub grants: Option<Arc<Grantor>>,
    /// The clusters the pools live in: the shell's client's, or the ones they name.
    pub clusters: Arc<Clusters>,
    /// Runs the standby's load proofs (`spec.loadProof`); without it (no routers to read the
    /// primary's traffic from, or no replicas reached) none runs.
    pub load_proofs: Option<Arc<LoadProofs>>,
    /// Consecutive failures per policy, for the error policy's backoff.
    failures: Mutex<HashMap<(String, String), u32>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("observations", &self.observations)
            .field("findings", &self.findings)
            .field("shell", &self.shell)
            .field("steps", &self.steps)
            .field("reserve", &self.reserve)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context that observes nothing, hands steps to their components, and reads the wall clock.
    #[must_use]
    pub fn new(client: Client, metrics: Arc<Metrics>, instance: Option<String>) -> Self {
        Context {
            clusters: Arc::new(Clusters::new(client.clone())),
            shell: Shell::new(client, instance, "Reconcile"),
            metrics,
            observations: Arc::new(NoObservations),
            findings: None,
            steps: Arc::new(HandOffToComponents),
            reserve: ReserveConfig::default(),
            replicas: None,
            grants: None,
            load_proofs: None,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Reaches the pools' replicas through `replicas`: the standby is kept in its shape between
    /// promotions, and a promoted pool serves when enough replicas pass the generating probe.
    #[must_use]
    pub fn with_replicas(mut self, replicas: Arc<dyn ReplicaEndpoints>) -> Self {
        self.replicas = Some(replicas);
        self
    }

    /// Replays the primary's recorded traffic against the standby when its `spec.loadProof` says.
    #[must_use]
    pub fn with_load_proofs(mut self, load_proofs: Arc<LoadProofs>) -> Self {
        self.load_proofs = Some(load_proofs);
        self
    }

    /// What a replica's answer must be: the policy's expectation, or the golden answer recorded
    /// from the primary; `None` while neither is known.
    pub(crate) fn expectation(&self, policy: &FailoverPolicy) -> Option<Expectation> {
        let golden = match &self.findings {
            Some(source) => source.golden_answer(&ObjectRef::from_obj(policy)),
            None => policy.status.as_ref().and_then(|s| s.golden_answer.clone()),
        };
        fixed_expectation(&policy.spec.probe.expect, golden.as_ref())
    }

    /// The replicas of `policy`'s `pool` known to pass the generating probe, as the probing
    /// rounds found them; `None` while nothing is known.
    pub(crate) fn passed(&self, policy: &FailoverPolicy, pool: Pool) -> Option<BTreeSet<String>> {
        self.findings.as_ref()?.passed(&ObjectRef::from_obj(policy), pool)
    }

    /// Host memory for `policy`'s `pool`'s level-1 sleepers, as the probing rounds' last read the
    /// nodes.
    pub(crate) fn host_room(&self, policy: &FailoverPolicy, pool: Pool) -> HostRoom {
        self.findings
            .as_ref()
            .map(|findings| findings.host_room(&ObjectRef::from_obj(policy), pool))
            .unwrap_or_default()
    }

    /// The level each replica of `policy`'s `pool` that sleeps sleeps at, as the probing rounds'
    /// last read them.
    pub(crate) fn asleep_levels(&self, policy: &FailoverPolicy, pool: Pool) -> Vec<Option<u8>> {
        self.findings
            .as_ref()
            .map(|findings| findings.asleep_levels(&ObjectRef::from_obj(policy), pool))
            .unwrap_or_default()
    }

    /// `policy`'s `pool`'s replicas that said they were asleep in the probing rounds' last.
    pub(crate) fn asleep(&self, policy: &FailoverPolicy, pool: Pool) -> Vec<Endpoint> {
        self.findings
            .as_ref()
            .map(|findings| findings.asleep(&ObjectRef::from_obj(policy), pool))
            .unwrap_or_default()
    }

    /// Keeps what probes of `policy`'s `pool` made outside a round found, for [`Self::passed`].
    pub(crate) fn note_probed(&self, policy: &FailoverPolicy, pool: Pool, reports: &[ProbeReport]) {
        if let Some(findings) = &self.findings {
            findings.note_probed(&ObjectRef::from_obj(policy), pool, reports);
        }
    }

    /// Reaches pools in other clusters through `clusters` (whose own cluster is the shell's).
    #[must_use]
    pub fn with_clusters(mut self, clusters: Arc<Clusters>) -> Self {
        self.clusters = clusters;
        self
    }

    /// Grants the fences of every policy it runs through `grants`.
    #[must_use]
    pub fn with_grants(mut self, grants: Arc<Grantor>) -> Self {
        self.grants = Some(grants);
        self
    }

    #[must_use]
    pub fn with_observations(mut self, observations: Arc<dyn ObservationSource>) -> Self {
        self.observations = observations;
        self
    }

    #[must_use]
    pub fn with_findings(mut self, findings: Arc<dyn ProbeFindings>) -> Self {
        self.findings = Some(findings);
        self
    }

    #[must_use]
    pub fn with_steps(mut self, steps: Arc<dyn StepExecutor>) -> Self {
        self.steps = steps;
        self
    }

    #[must_use]
    pub fn with_reserve(mut self, reserve: ReserveConfig) -> Self {
        self.reserve = reserve;
        self
    }

    pub(super) fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), u32>> {
        // A poisoned map only loses backoff counts; carry on with it.
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl WithShell for Context {
    fn shell_mut(&mut self) -> &mut Shell {
        &mut self.shell
    }
}

//! What every GameDay reconcile shares: the clients, the routers and tokens a run uses, the clock,
//! the write timeout, and how soon a game day is looked at again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use understudy_prober::probe::Bearer;

use crate::clusters::Clusters;
use crate::gameday::load;
use crate::peers::Routers;
use crate::reconciler::{Shell, WithShell};
use crate::router_admin::RouterToken;

/// How soon a game day with a run under way is looked at again.
pub const ACTIVE_REQUEUE: Duration = Duration::from_secs(5);

/// The longest an idle game day waits before it is looked at again.
pub(super) const IDLE_REQUEUE: Duration = Duration::from_secs(3600);

/// How late a scheduled run may start, like a CronJob's `startingDeadlineSeconds`: a run missed
/// by more (the operator was down) is skipped, so that nobody's failover lands at an hour that
/// was never scheduled.
pub const STARTING_DEADLINE: Duration = Duration::from_secs(600);

/// What every GameDay reconcile shares.
pub struct Context {
    /// The client, the Event recorder, the clock, the write timeout and the watchdog.
    pub shell: Shell,
    /// The routers whose counters are a run's record of loss and its stop conditions' evidence,
    /// and their admin token; without them a run records no loss and stops on nothing it sees.
    pub routers: Option<(Routers, RouterToken)>,
    /// The fences' control token, which sets and takes away the faults they play (`hang`,
    /// `halfFailed`); without it the fences refuse them.
    pub replica_token: Option<Bearer>,
    /// The clusters the pools live in, where their faults are injected.
    pub clusters: Arc<Clusters>,
    /// Each run's samples of the routers' counters within its stop conditions' window, oldest
    /// first, by `namespace/gameday/run`. Lost on a restart: the window starts again.
    samples: Mutex<HashMap<String, VecDeque<(Duration, load::Counters)>>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("shell", &self.shell)
            .finish_non_exhaustive()
    }
}

impl Context {
    #[must_use]
    pub fn new(client: Client, instance: Option<String>) -> Self {
        Context {
            clusters: Arc::new(Clusters::new(client.clone())),
            shell: Shell::new(client, instance, "GameDay"),
            routers: None,
            replica_token: None,
            samples: Mutex::new(HashMap::new()),
        }
    }

    /// Injects faults into pools in other clusters through `clusters`.
    #[must_use]
    pub fn with_clusters(mut self, clusters: Arc<Clusters>) -> Self {
        self.clusters = clusters;
        self
    }

    /// Sets and takes away the fences' faults with `token`.
    #[must_use]
    pub fn with_replica_token(mut self, token: Option<Bearer>) -> Self {
        self.replica_token = token;
        self
    }

    /// Reads `routers`' counters during a run, for its record of loss and its stop conditions.
    #[must_use]
    pub fn with_routers(mut self, routers: Routers, token: RouterToken) -> Self {
        self.routers = Some((routers, token));
        self
    }

    pub(super) fn samples(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<(Duration, load::Counters)>>> {
        self.samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl WithShell for Context {
    fn shell_mut(&mut self) -> &mut Shell {
        &mut self.shell
    }
}

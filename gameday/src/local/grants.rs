//! The run's grantor, doing what the operator does for its fences: every renewal period it reads
//! the lease as the failover logic reaches it and pushes a grant round ([`grant_round`]) to every
//! fence through the run's links, with the operator's token. A lease it cannot read (`lost-lease`)
//! means no renewals, and the fences go on under their failsafe; a pool cut off (`partition`)
//! hears nothing, and its fences stop when their grants run out. The Fence step runs a round at
//! once, so that the old primary is fenced when the lease moves, and the Route step waits until
//! the new primary's fences serve.
//!
//! What this module must never do: grant an epoch the lease does not hold, or count a fence that
//! did not answer as fenced.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use understudy_api::grant::{
    FenceAddr, GRANT_PATH, GrantAnswer, GrantRound, GrantTiming, PoolFences, grant_round,
};
use understudy_api::lease::EpochLease;
use understudy_core::Pool;

use super::executor::{LOCAL_POLICY, LogicLease, PoolAddrs, pool_name};
use super::http::exchange;
use super::lock;

/// The run's grantor.
#[derive(Debug)]
pub struct Granter {
    pub timing: GrantTiming,
    token: String,
    last: Mutex<Option<GrantRound>>,
}

impl Granter {
    #[must_use]
    pub fn new(timing: GrantTiming, token: &str) -> Granter {
        Granter {
            timing,
            token: token.to_owned(),
            last: Mutex::new(None),
        }
    }

    /// The last round pushed.
    #[must_use]
    pub fn last(&self) -> Option<GrantRound> {
        lock(&self.last).clone()
    }

    /// Reads the lease and pushes one round to every fence of `pools`; why not, when the lease
    /// cannot be read.
    pub async fn round(
        &self,
        lease: &LogicLease,
        pools: &Mutex<[PoolAddrs; 2]>,
    ) -> Result<GrantRound, String> {
        // Issued before the lease is read: a grant never outlasts the moment it was decided at.
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let record = match lease.read().await {
            Ok(Some(record)) => record,
            Ok(None) => return Err("the lease does not exist".to_owned()),
            Err(e) => return Err(format!("the lease cannot be read: {e}")),
        };
        let fences = {
            let pools = lock(pools);
            [Pool::A, Pool::B].map(|pool| PoolFences {
                pool: pool_name(pool).to_owned(),
                fences: pools[pool.index()]
                    .fences
                    .iter()
                    .map(|f| FenceAddr {
                        grantor: f.grantor.to_string(),
                        peer: f.peer.to_string(),
                    })
                    .collect(),
                // The run started every fence it has.
                complete: true,
            })
        };
        let bearer = format!("Bearer {}", self.token);
        let within = self.timing.push_timeout;
        let push = |fence: String, grant| {
            let bearer = bearer.clone();
            async move { push(&fence, &bearer, &grant, within).await }
        };
        let round = grant_round(
            &self.timing,
            LOCAL_POLICY,
            (record.epoch, &record.holder),
            &fences,
            wall,
            push,
        )
        .await;
        *lock(&self.last) = Some(round.clone());
        Ok(round)
    }
}

async fn push(
    fence: &str,
    bearer: &str,
    grant: &understudy_api::grant::Grant,
    within: Duration,
) -> GrantAnswer {
    let Ok(addr) = fence.parse() else {
        return GrantAnswer::Failed(format!("{fence}: not an address"));
    };
    let body = Bytes::from(serde_json::to_vec(grant).unwrap_or_default());
    match exchange(
        addr,
        "PUT",
        GRANT_PATH,
        &[("authorization", bearer)],
        body,
        within,
    )
    .await
    {
        Ok(answer) => GrantAnswer::read(answer.status, &answer.body),
        Err(e) => GrantAnswer::Failed(format!("{fence}: {e}")),
    }
}

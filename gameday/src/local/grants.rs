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
    FenceAddr, GRANT_PATH, GrantAnswer, GrantRound, GrantStanding, GrantTiming, PoolFences, grant_round,
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
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
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

/// One line for a round: each pool's fences by standing.
#[must_use]
pub fn summary(round: &GrantRound) -> String {
    let mut parts = Vec::new();
    for pool in ["a", "b"] {
        let mut counts: Vec<(GrantStanding, usize)> = Vec::new();
        let mut unanswered = 0;
        for answer in round.answers.iter().filter(|a| a.pool == pool) {
            match answer.answer.view() {
                Some(view) => match counts.iter_mut().find(|(s, _)| *s == view.standing) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((view.standing, 1)),
                },
                None => unanswered += 1,
            }
        }
        let mut said: Vec<String> = counts
            .iter()
            .map(|(standing, n)| format!("{n} {}", standing_name(*standing)))
            .collect();
        if unanswered > 0 {
            said.push(format!("{unanswered} unreachable"));
        }
        if !said.is_empty() {
            parts.push(format!("{pool}: {}", said.join(", ")));
        }
    }
    format!(
        "epoch {} held by {}{}; {}",
        round.epoch,
        round.holder,
        if round.prior_revoked {
            ""
        } else {
            " (the old holder not revoked)"
        },
        parts.join("; ")
    )
}

/// A standing as people read it.
#[must_use]
pub fn standing_name(standing: GrantStanding) -> &'static str {
    match standing {
        GrantStanding::None => "without a grant",
        GrantStanding::Fenced => "fenced",
        GrantStanding::Waiting => "waiting out the old holder",
        GrantStanding::Serving => "serving",
        GrantStanding::Failsafe => "serving on the failsafe",
        GrantStanding::Expired => "expired",
    }
}

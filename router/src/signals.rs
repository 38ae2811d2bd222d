//! Passive signals: what the data path has seen of a pool, turned into the observation the
//! failover state machine takes beside its active probes. Every endpoint refusing or resetting is
//! strong evidence ([`PassiveSignal::AllRefused`]); timeouts are weak ([`PassiveSignal::Timeouts`]).
//!
//! Pure functions of endpoint snapshots. This module must never eject, route or block anything.

use serde::Serialize;
use understudy_core::Epoch;
use understudy_core::failover::PassiveSignal;

use crate::endpoint::{EndpointSnapshot, Outcome};

/// What `GET /signals` answers for the routed pool.
#[derive(Clone, Debug, Serialize)]
pub struct PoolSignals {
    /// The policy whose route it is (empty for the unnamed one).
    pub policy: String,
    /// The pool's name.
    pub pool: String,
    /// The epoch it is routed under.
    pub epoch: Epoch,
    /// The observation for the state machine, if any.
    pub signal: Option<PassiveSignal>,
    /// The per-endpoint counters it was derived from.
    pub endpoints: Vec<EndpointSnapshot>,
}

/// The pool's signal from its endpoints' last outcomes. Pure.
#[must_use]
pub fn pool_signal(endpoints: &[EndpointSnapshot]) -> Option<PassiveSignal> {
    let refused = |e: &EndpointSnapshot| matches!(e.last, Some(Outcome::Refused | Outcome::Reset));
    if !endpoints.is_empty() && endpoints.iter().all(refused) {
        return Some(PassiveSignal::AllRefused);
    }
    endpoints
        .iter()
        .any(|e| e.last == Some(Outcome::Timeout))
        .then_some(PassiveSignal::Timeouts)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ep(last: Option<Outcome>) -> EndpointSnapshot {
        EndpointSnapshot {
            addr: "127.0.0.1:1".parse().unwrap(),
            outstanding: 0,
            ejected: false,
            last,
            refused: 0,
            reset: 0,
            timeouts: 0,
            held_back: 0,
            server_errors: 0,
            cut: 0,
            ttft_ms: 0.0,
        }
    }

    #[test]
    fn every_endpoint_refusing_is_strong_evidence() {
        let eps = [ep(Some(Outcome::Refused)), ep(Some(Outcome::Reset))];
        assert_eq!(pool_signal(&eps), Some(PassiveSignal::AllRefused));
    }

    #[test]
    fn one_endpoint_still_answering_means_no_strong_evidence() {
        let eps = [ep(Some(Outcome::Refused)), ep(Some(Outcome::Ok))];
        assert_eq!(pool_signal(&eps), None);
        let eps = [ep(Some(Outcome::Refused)), ep(None)];
        assert_eq!(pool_signal(&eps), None);
    }

    #[test]
    fn a_timeout_anywhere_is_weak_evidence() {
        let eps = [ep(Some(Outcome::Timeout)), ep(Some(Outcome::Ok))];
        assert_eq!(pool_signal(&eps), Some(PassiveSignal::Timeouts));
        assert_eq!(pool_signal(&[]), None);
    }
}

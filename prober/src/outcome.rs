//! What one probe of one replica ended in, and what a round of them says about a pool.
//!
//! This is the seam between the prober and the failover state machine: every garbled or
//! failed response is classified into exactly one [`ProbeOutcome`], and a pool's round of
//! outcomes into one [`CheckResult`]. Classification is by what happened, never by message text.

use std::time::Duration;

use understudy_core::failover::CheckResult;

/// How one generating probe of one replica ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Generated the expected answer within budget.
    Ok { first_token: Duration, total: Duration },
    /// The connection was refused: nothing listens (a crashed or still-starting vLLM).
    Refused,
    /// The connection was reset or closed before a complete answer.
    Reset,
    /// No answer within the probe's timeout.
    Timeout,
    /// An HTTP status other than 200, with the code (out-of-range codes included as sent).
    HttpError(u16),
    /// The stream started and then stopped producing tokens.
    Stalled,
    /// The answer did not match the golden answer.
    WrongOutput,
    /// The answer was right but the first token or the whole answer exceeded its budget.
    TooSlow,
    /// The replica is asleep (vLLM sleep mode); no generation was sent to it.
    Asleep,
    /// The replica's fence refused the work: its pool does not hold the current epoch.
    Fenced,
}

impl ProbeOutcome {
    /// A stable label, for metrics and JSON.
    pub fn as_str(&self) -> &'static str {
        match self {
            ProbeOutcome::Ok { .. } => "ok",
            ProbeOutcome::Refused => "refused",
            ProbeOutcome::Reset => "reset",
            ProbeOutcome::Timeout => "timeout",
            ProbeOutcome::HttpError(_) => "http-error",
            ProbeOutcome::Stalled => "stalled",
            ProbeOutcome::WrongOutput => "wrong-output",
            ProbeOutcome::TooSlow => "too-slow",
            ProbeOutcome::Asleep => "asleep",
            ProbeOutcome::Fenced => "fenced",
        }
    }

    /// Whether the outcome is strong evidence that the replica is down, as opposed to slow or
    /// wrong. A refused connection or an engine answering 5xx cannot be a busy replica.
    pub fn is_hard_failure(&self) -> bool {
        match self {
            ProbeOutcome::Refused | ProbeOutcome::Reset => true,
            ProbeOutcome::HttpError(code) => !(400..500).contains(code),
            _ => false,
        }
    }

    /// Whether the replica refused the probe itself as wrong: a 4xx other than 408 (the server
    /// gave up waiting) and 429 (the server is overloaded), such as 400 for a bad request, 404
    /// for a model it does not serve, 401 for a key the probe lacks. That is the policy's
    /// mistake, not the replica's failure, and says nothing of whether the pool serves.
    pub fn is_probe_rejected(&self) -> bool {
        matches!(self, ProbeOutcome::HttpError(code) if (400..500).contains(code) && *code != 408 && *code != 429)
    }
}

/// A pool's round of probes as one check result, or `None` when the round says nothing of the
/// pool: too few replicas passed, and every one that did not rejected the probe itself
/// ([`ProbeOutcome::is_probe_rejected`]), so the probe, not the pool, is wrong.
///
/// The pool passes when at least `min_serving` replicas passed (a sleeping replica counts as
/// passing only for a standby, which the state machine decides from [`CheckResult::Asleep`]).
/// When it fails, the failure is hard only if every failing replica failed hard: one timeout
/// among refusals makes the evidence weak; a rejected probe is no evidence either way. An empty
/// round is a hard failure: a pool with no replicas to probe cannot serve.
pub fn pool_verdict(outcomes: &[ProbeOutcome], min_serving: usize) -> Option<CheckResult> {
    let min_serving = min_serving.max(1);
    let passed = outcomes
        .iter()
        .filter(|o| matches!(o, ProbeOutcome::Ok { .. }))
        .count();
    let asleep = outcomes
        .iter()
        .filter(|o| matches!(o, ProbeOutcome::Asleep))
        .count();
    if passed >= min_serving {
        return Some(CheckResult::Pass);
    }
    if asleep > 0 && passed + asleep >= min_serving {
        return Some(CheckResult::Asleep);
    }
    let failing: Vec<&ProbeOutcome> = outcomes
        .iter()
        .filter(|o| !matches!(o, ProbeOutcome::Ok { .. } | ProbeOutcome::Asleep))
        .collect();
    if !failing.is_empty() && failing.iter().all(|o| o.is_probe_rejected()) {
        return None;
    }
    let failed = failing.iter().filter(|o| !o.is_probe_rejected());
    if failed.clone().all(|o| o.is_hard_failure()) {
        Some(CheckResult::HardFail)
    } else {
        Some(CheckResult::SoftFail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> ProbeOutcome {
        ProbeOutcome::Ok {
            first_token: Duration::from_millis(80),
            total: Duration::from_millis(300),
        }
    }

    #[test]
    fn enough_passing_replicas_pass_the_pool() {
        assert_eq!(
            pool_verdict(&[ok(), ok(), ProbeOutcome::Timeout], 2),
            Some(CheckResult::Pass)
        );
        assert_eq!(
            pool_verdict(&[ok(), ProbeOutcome::Timeout, ProbeOutcome::Timeout], 2),
            Some(CheckResult::SoftFail)
        );
    }

    #[test]
    fn refusals_everywhere_are_hard_but_one_timeout_makes_them_soft() {
        let refused = [
            ProbeOutcome::Refused,
            ProbeOutcome::HttpError(503),
            ProbeOutcome::Reset,
        ];
        assert_eq!(pool_verdict(&refused, 1), Some(CheckResult::HardFail));
        let mixed = [ProbeOutcome::Refused, ProbeOutcome::Timeout];
        assert_eq!(pool_verdict(&mixed, 1), Some(CheckResult::SoftFail));
    }

    #[test]
    fn client_errors_wrong_output_and_stalls_are_soft() {
        for outcome in [
            ProbeOutcome::HttpError(404),
            ProbeOutcome::WrongOutput,
            ProbeOutcome::Stalled,
            ProbeOutcome::TooSlow,
        ] {
            assert!(!outcome.is_hard_failure(), "{outcome:?}");
        }
        assert!(
            ProbeOutcome::HttpError(700).is_hard_failure(),
            "a status out of range is the server's fault"
        );
    }

    #[test]
    fn a_probe_the_replicas_reject_as_wrong_says_nothing_of_the_pool() {
        for code in [400, 401, 404, 422] {
            assert!(ProbeOutcome::HttpError(code).is_probe_rejected(), "{code}");
            let rejected = [ProbeOutcome::HttpError(code), ProbeOutcome::HttpError(code)];
            assert_eq!(pool_verdict(&rejected, 1), None, "{code}");
        }
        // Overload, a server's own timeout and 5xx are the pool's.
        for code in [408, 429, 500, 503] {
            assert!(!ProbeOutcome::HttpError(code).is_probe_rejected(), "{code}");
            assert!(
                pool_verdict(&[ProbeOutcome::HttpError(code)], 1).is_some(),
                "{code}"
            );
        }
        assert_eq!(
            pool_verdict(&[ProbeOutcome::HttpError(429)], 1),
            Some(CheckResult::SoftFail)
        );
        // Beside real failures, a rejection neither softens nor hardens them.
        let refused = [ProbeOutcome::Refused, ProbeOutcome::HttpError(404)];
        assert_eq!(pool_verdict(&refused, 1), Some(CheckResult::HardFail));
        let slow = [ProbeOutcome::TooSlow, ProbeOutcome::HttpError(404)];
        assert_eq!(pool_verdict(&slow, 1), Some(CheckResult::SoftFail));
        // Enough passing replicas still pass the pool.
        assert_eq!(
            pool_verdict(&[ok(), ProbeOutcome::HttpError(404)], 1),
            Some(CheckResult::Pass)
        );
    }

    #[test]
    fn a_sleeping_pool_reports_asleep_and_an_empty_round_fails_hard() {
        assert_eq!(
            pool_verdict(&[ProbeOutcome::Asleep, ProbeOutcome::Asleep], 2),
            Some(CheckResult::Asleep)
        );
        assert_eq!(pool_verdict(&[], 1), Some(CheckResult::HardFail));
    }
}

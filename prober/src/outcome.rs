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
}

/// A pool's round of probes as one check result.
///
/// The pool passes when at least `min_serving` replicas passed (a sleeping replica counts as
/// passing only for a standby, which the state machine decides from [`CheckResult::Asleep`]).
/// When it fails, the failure is hard only if every failing replica failed hard: one timeout
/// among refusals makes the evidence weak. An empty round is a hard failure: a pool with no
/// replicas to probe cannot serve.
pub fn pool_verdict(outcomes: &[ProbeOutcome], min_serving: usize) -> CheckResult {
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
        return CheckResult::Pass;
    }
    if asleep > 0 && passed + asleep >= min_serving {
        return CheckResult::Asleep;
    }
    let failing = outcomes
        .iter()
        .filter(|o| !matches!(o, ProbeOutcome::Ok { .. } | ProbeOutcome::Asleep));
    let mut any = false;
    let mut all_hard = true;
    for outcome in failing {
        any = true;
        all_hard &= outcome.is_hard_failure();
    }
    if !any || all_hard {
        CheckResult::HardFail
    } else {
        CheckResult::SoftFail
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
            CheckResult::Pass
        );
        assert_eq!(
            pool_verdict(&[ok(), ProbeOutcome::Timeout, ProbeOutcome::Timeout], 2),
            CheckResult::SoftFail
        );
    }

    #[test]
    fn refusals_everywhere_are_hard_but_one_timeout_makes_them_soft() {
        let refused = [
            ProbeOutcome::Refused,
            ProbeOutcome::HttpError(503),
            ProbeOutcome::Reset,
        ];
        assert_eq!(pool_verdict(&refused, 1), CheckResult::HardFail);
        let mixed = [ProbeOutcome::Refused, ProbeOutcome::Timeout];
        assert_eq!(pool_verdict(&mixed, 1), CheckResult::SoftFail);
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
    fn a_sleeping_pool_reports_asleep_and_an_empty_round_fails_hard() {
        assert_eq!(
            pool_verdict(&[ProbeOutcome::Asleep, ProbeOutcome::Asleep], 2),
            CheckResult::Asleep
        );
        assert_eq!(pool_verdict(&[], 1), CheckResult::HardFail);
    }
}

//! How a replica's answer is judged: the policy's `expect` with the golden answer recorded so far,
//! the probe a policy's `spec.probe` describes, and which replicas answer it right. The probing
//! rounds, the standby's keeper and the AwaitServing step all judge by these.

use futures::future::join_all;
use understudy_prober::probe::{self, Budget, Endpoint, Expectation, ProbeReport, ProbeSpec};

use crate::crd::{ExpectMode, GoldenAnswer, ProbeExpect};
use crate::policy::ProbeTiming;

/// How this round judges an answer.
#[derive(Debug)]
pub(crate) enum Judge {
    /// Against this expectation, both pools alike.
    Fixed(Expectation),
    /// No golden answer is known yet: the primary is probed first and its first passing answer
    /// becomes the golden prefix the standby is judged by.
    RecordFromPrimary,
}

/// Each of `endpoints`' answer to `spec`'s probe, probed at once.
pub async fn probe_all(endpoints: &[Endpoint], spec: &ProbeSpec) -> Vec<ProbeReport> {
    join_all(endpoints.iter().map(|e| probe::probe(e, spec))).await
}

/// What a replica's answer must be outside a probing round (before it is put to sleep, proven,
/// or counted serving): the policy's own expectation, or the golden answer recorded from the
/// primary; `None` while neither is known.
#[must_use]
pub fn fixed_expectation(expect: &ProbeExpect, golden: Option<&GoldenAnswer>) -> Option<Expectation> {
    match judge(expect, golden) {
        Ok(Judge::Fixed(expectation)) => Some(expectation),
        Ok(Judge::RecordFromPrimary) | Err(_) => None,
    }
}

/// What the policy's `expect` means with the golden answer recorded so far.
pub(crate) fn judge(expect: &ProbeExpect, golden: Option<&GoldenAnswer>) -> Result<Judge, regex::Error> {
    Ok(match (expect.mode, &expect.value) {
        (ExpectMode::Prefix, Some(prefix)) => Judge::Fixed(Expectation::Prefix(prefix.clone())),
        (ExpectMode::Prefix, None) => match golden {
            Some(golden) => Judge::Fixed(Expectation::Prefix(golden.prefix.clone())),
            None => Judge::RecordFromPrimary,
        },
        (ExpectMode::Regex, Some(pattern)) => Judge::Fixed(Expectation::Regex(regex::Regex::new(pattern)?)),
        // Validation refuses a regex without a pattern; judge it as the weakest rule if one slips by.
        (ExpectMode::Regex, None) | (ExpectMode::NonEmpty, _) => Judge::Fixed(Expectation::NonEmpty),
    })
}

/// The probe a policy's `spec.probe` describes, judged by `expect`. No served model name: vLLM
/// answers with its only model, and the policy does not name one.
#[must_use]
pub fn probe_spec(probe: &crate::crd::ProbeSpec, timing: &ProbeTiming, expect: Expectation) -> ProbeSpec {
    ProbeSpec {
        model: None,
        prompt: probe.prompt.clone(),
        max_tokens: probe.max_tokens,
        expect,
        budget: Budget {
            first_token: timing.first_token_budget,
            total: timing.total_budget,
        },
        timeout: timing.timeout,
        // A replica silent mid-stream for as long as it may take to start answering has stalled.
        stall_after: timing.first_token_budget,
        // Any replica may sleep (a warm standby, or one left asleep): never send it generation.
        check_sleep: true,
        ..ProbeSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_without_a_value_is_recorded_from_the_primary_and_then_used() {
        let expect = ProbeExpect::default();
        assert!(matches!(judge(&expect, None), Ok(Judge::RecordFromPrimary)));
        let probe = crate::crd::ProbeSpec::default();
        let golden = GoldenAnswer {
            prefix: " Paris".to_owned(),
            prompt: probe.prompt,
            max_tokens: probe.max_tokens,
            pool: "east".to_owned(),
            model: None,
            recorded_at: Some("2026-11-30T08:00:00Z".to_owned()),
        };
        let Ok(Judge::Fixed(Expectation::Prefix(prefix))) = judge(&expect, Some(&golden)) else {
            panic!("expected the golden prefix");
        };
        assert_eq!(prefix, " Paris");
        let given = ProbeExpect {
            mode: ExpectMode::Prefix,
            value: Some(" Lyon".into()),
        };
        assert!(matches!(
            judge(&given, Some(&golden)),
            Ok(Judge::Fixed(Expectation::Prefix(p))) if p == " Lyon"
        ));
        let bad = ProbeExpect {
            mode: ExpectMode::Regex,
            value: Some("(".into()),
        };
        assert!(judge(&bad, None).is_err());
    }

    #[test]
    fn the_probe_is_timed_by_the_policys_timeout_and_budgets_and_stalls_after_the_first_token_budget() {
        let spec: crate::crd::FailoverPolicySpec = serde_yaml::from_str(
            "
recoveryObjective: 5m
pools:
  - {name: east, workload: {kind: Deployment, name: llm-east}, replicas: 2}
  - {name: west, workload: {kind: Deployment, name: llm-west}, replicas: 2}
probe: {interval: 20s, timeout: 9s, budgets: {firstToken: 3s, total: 7s}}
",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let policy = crate::policy::validate(&spec).unwrap_or_else(|e| panic!("{e}"));
        let probe = probe_spec(&spec.probe, &policy.probe, Expectation::NonEmpty);
        let seconds = std::time::Duration::from_secs;
        assert_eq!(
            probe.budget,
            Budget {
                first_token: seconds(3),
                total: seconds(7),
            }
        );
        assert_eq!(probe.timeout, seconds(9));
        assert_eq!(probe.stall_after, seconds(3));
    }
}

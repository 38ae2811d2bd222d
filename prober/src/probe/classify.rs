//! What a probe saw, and the one [`ProbeOutcome`] it comes to.
//!
//! The I/O in [`super::http`] records a [`Transcript`]; [`classify`] turns it into an outcome
//! with no clock and no socket, so every garbled case is classified the same way every time.
//! This module must never do I/O or read the time.

use std::time::Duration;

use regex::Regex;

use crate::outcome::ProbeOutcome;

/// How a probe's exchange ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Nothing listens on the port.
    Refused,
    /// The connection broke, or the response head was not HTTP, before any answer.
    Reset,
    /// The deadline passed before the first token.
    Timeout,
    /// A response head with a status other than 200 (out-of-range codes as sent).
    Status { code: u16, fenced: bool },
    /// The connection closed or broke after the head, before `[DONE]`, wherever the cut fell.
    ClosedEarly,
    /// Tokens came, then nothing for the stall window.
    Stalled,
    /// Tokens kept coming, but the deadline passed before `[DONE]`.
    DeadlineWhileStreaming,
    /// An error event inside the stream.
    StreamError(u16),
    /// Bytes that are not a completion stream: a complete invalid event, or a whole non-stream body.
    Garbled,
    /// `data: [DONE]` arrived.
    Done,
}

/// What one generating probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transcript {
    pub ending: Ending,
    /// The generated text, concatenated.
    pub text: String,
    /// From the probe's start to the first chunk with non-empty text.
    pub first_token: Option<Duration>,
    /// From the probe's start to `[DONE]` (or to where it ended).
    pub total: Option<Duration>,
}

/// What the answer must look like: the golden answer recorded when the policy was proven.
#[derive(Debug, Clone)]
pub enum Expectation {
    /// The text starts with this (exact token match across hardware is too strict).
    Prefix(String),
    Regex(Regex),
    /// Any text that is not only whitespace.
    NonEmpty,
}

/// How many characters of the primary's first passing answer become the golden prefix: enough to
/// tell one model's answer from another's, short enough that a late tie broken differently on
/// other hardware does not fail a healthy replica.
pub const GOLDEN_PREFIX_CHARS: usize = 24;

impl Expectation {
    /// A golden answer from the primary's text: its first `chars` characters.
    pub fn golden_prefix(text: &str, chars: usize) -> Expectation {
        Expectation::Prefix(text.chars().take(chars).collect())
    }

    pub fn is_met_by(&self, text: &str) -> bool {
        match self {
            Expectation::Prefix(p) => !text.trim().is_empty() && text.starts_with(p.as_str()),
            Expectation::Regex(r) => r.is_match(text),
            Expectation::NonEmpty => !text.trim().is_empty(),
        }
    }
}

/// How fast a right answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub first_token: Duration,
    pub total: Duration,
}

/// The one outcome a transcript comes to. A wrong answer outranks a slow one; a fence's 503
/// is `Fenced`, any other non-200 an `HttpError`; garbage on a 200 is a wrong answer.
pub fn classify(t: &Transcript, expect: &Expectation, budget: &Budget) -> ProbeOutcome {
    match &t.ending {
        Ending::Refused => ProbeOutcome::Refused,
        Ending::Reset | Ending::ClosedEarly => ProbeOutcome::Reset,
        Ending::Timeout => ProbeOutcome::Timeout,
        Ending::Status {
            code: 503,
            fenced: true,
        } => ProbeOutcome::Fenced,
        Ending::Status { code, .. } => ProbeOutcome::HttpError(*code),
        Ending::Stalled => ProbeOutcome::Stalled,
        Ending::DeadlineWhileStreaming => ProbeOutcome::TooSlow,
        Ending::StreamError(code) => ProbeOutcome::HttpError(*code),
        Ending::Garbled => ProbeOutcome::WrongOutput,
        Ending::Done => {
            if !expect.is_met_by(&t.text) {
                return ProbeOutcome::WrongOutput;
            }
            match (t.first_token, t.total) {
                (Some(first), Some(total)) if first <= budget.first_token && total <= budget.total => {
                    ProbeOutcome::Ok {
                        first_token: first,
                        total,
                    }
                }
                (Some(_), Some(_)) => ProbeOutcome::TooSlow,
                // `[DONE]` without a token is an empty answer, which no expectation accepts.
                _ => ProbeOutcome::WrongOutput,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(text: &str, first_ms: u64, total_ms: u64) -> Transcript {
        Transcript {
            ending: Ending::Done,
            text: text.into(),
            first_token: Some(Duration::from_millis(first_ms)),
            total: Some(Duration::from_millis(total_ms)),
        }
    }

    const BUDGET: Budget = Budget {
        first_token: Duration::from_millis(500),
        total: Duration::from_secs(2),
    };

    #[test]
    fn a_right_answer_in_budget_is_ok_with_its_timings() {
        let outcome = classify(
            &done(" Paris, the", 120, 900),
            &Expectation::Prefix(" Paris".into()),
            &BUDGET,
        );
        assert_eq!(
            outcome,
            ProbeOutcome::Ok {
                first_token: Duration::from_millis(120),
                total: Duration::from_millis(900)
            }
        );
    }

    #[test]
    fn a_slow_first_token_or_a_slow_total_is_too_slow_but_wrong_outranks_slow() {
        let prefix = Expectation::Prefix(" Paris".into());
        assert_eq!(
            classify(&done(" Paris", 501, 900), &prefix, &BUDGET),
            ProbeOutcome::TooSlow
        );
        assert_eq!(
            classify(&done(" Paris", 100, 2001), &prefix, &BUDGET),
            ProbeOutcome::TooSlow
        );
        assert_eq!(
            classify(&done(" Lyon", 900, 9000), &prefix, &BUDGET),
            ProbeOutcome::WrongOutput
        );
    }

    #[test]
    fn expectations_by_prefix_regex_and_non_empty() {
        let regex = Expectation::Regex(Regex::new(r"^\s*Paris\b").unwrap_or_else(|e| panic!("{e}")));
        assert!(regex.is_met_by(" Paris is"));
        assert!(!regex.is_met_by(" Parisian"));
        assert!(Expectation::NonEmpty.is_met_by("x"));
        assert!(!Expectation::NonEmpty.is_met_by(" \n"));
        assert!(
            !Expectation::Prefix(String::new()).is_met_by(""),
            "an empty answer never matches"
        );
        let golden = Expectation::golden_prefix(" Paris is the capital", 6);
        assert!(golden.is_met_by(" Paris was"));
        assert!(!golden.is_met_by(" Pari"));
    }

    #[test]
    fn a_fences_503_is_fenced_and_any_other_status_an_http_error_with_its_code() {
        let with = |ending| Transcript {
            ending,
            text: String::new(),
            first_token: None,
            total: None,
        };
        let any = Expectation::NonEmpty;
        assert_eq!(
            classify(
                &with(Ending::Status {
                    code: 503,
                    fenced: true
                }),
                &any,
                &BUDGET
            ),
            ProbeOutcome::Fenced
        );
        assert_eq!(
            classify(
                &with(Ending::Status {
                    code: 503,
                    fenced: false
                }),
                &any,
                &BUDGET
            ),
            ProbeOutcome::HttpError(503)
        );
        assert_eq!(
            classify(
                &with(Ending::Status {
                    code: 99,
                    fenced: false
                }),
                &any,
                &BUDGET
            ),
            ProbeOutcome::HttpError(99)
        );
        assert_eq!(
            classify(&with(Ending::StreamError(500)), &any, &BUDGET),
            ProbeOutcome::HttpError(500)
        );
        assert_eq!(
            classify(&with(Ending::Garbled), &any, &BUDGET),
            ProbeOutcome::WrongOutput
        );
        assert_eq!(
            classify(&with(Ending::ClosedEarly), &any, &BUDGET),
            ProbeOutcome::Reset
        );
        assert_eq!(
            classify(&with(Ending::Done), &any, &BUDGET),
            ProbeOutcome::WrongOutput
        );
    }
}

//! Load proof: the arithmetic of replaying the primary's recorded traffic against the standby.
//!
//! The routers keep a rolling sample of the shapes of the requests they route ([`RequestShape`]:
//! prompt and asked output tokens, streaming or not, priority class, the gap since the request
//! before; never the content). A proof [`plan`]s a replay of that sample at a share of the rate
//! it was recorded at, keeping its burstiness (each gap is scaled by one factor), for a fixed
//! time; the replayer sends it with synthetic prompts of the recorded lengths, and [`judge`]
//! turns what the replay's client saw ([`Replayed`]) into a [`Verdict`] against the policy's
//! [`Thresholds`].
//!
//! Pure: no clock, no I/O. This module must never see a prompt's text.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The most requests one plan holds, whatever the rate and duration asked for: a replay is a
/// proof, not a flood.
pub const MAX_PLANNED: usize = 100_000;

/// The most of the recorded rate a proof may replay: four times the primary's load.
pub const MAX_RATE_SHARE: f64 = 4.0;

/// Whether `share` of the recorded rate can be replayed: above 0, at most [`MAX_RATE_SHARE`].
#[must_use]
pub fn valid_share(share: f64) -> bool {
    share > 0.0 && share <= MAX_RATE_SHARE
}

/// Whether `rate` is a share of requests that may fail: 0 to 1.
#[must_use]
pub fn valid_error_rate(rate: f64) -> bool {
    (0.0..=1.0).contains(&rate)
}

/// How recent a router's last recorded request must be for its sample to be replayed: a router
/// whose traffic stopped longer ago says nothing of the rate now.
pub const FRESH_FOR: Duration = Duration::from_secs(15 * 60);

/// How late the replayer may send its requests (p99) before its figures stop being the
/// standby's: a client that cannot keep its schedule measures itself.
pub const LATE_LIMIT: Duration = Duration::from_secs(1);

/// One routed request's shape, as a router records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestShape {
    /// Its prompt's tokens, estimated from the prompt's characters ([`estimate_tokens`]).
    pub prompt_tokens: u32,
    /// The output tokens it asked for (`max_tokens`, or the router's default when it named none).
    pub max_tokens: u32,
    /// Whether it asked for a stream.
    pub stream: bool,
    /// Its admission priority class.
    pub priority: String,
    /// Microseconds since the request recorded before it; 0 for the first a router recorded.
    /// Microseconds, not milliseconds: at hundreds of requests a second most gaps are under a
    /// millisecond, and truncated ones would overstate the rate.
    pub gap_us: u64,
}

/// What a router answers for one policy: the shapes it recorded last, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShapeSample {
    /// The policy, `namespace/name` (empty for the unnamed one).
    pub policy: String,
    pub shapes: Vec<RequestShape>,
    /// Milliseconds since the last shape was recorded, when the sample was read.
    #[serde(default)]
    pub last_age_ms: u64,
}

impl ShapeSample {
    /// The rate the sample was recorded at, in requests a second: the gaps it holds over the time
    /// they span. `None` without two requests a measurable time apart.
    #[must_use]
    pub fn rate(&self) -> Option<f64> {
        let gaps = self.shapes.iter().skip(1).map(|s| s.gap_us as f64);
        let span_us: f64 = gaps.clone().sum();
        let count = gaps.count();
        (count > 0 && span_us > 0.0).then(|| count as f64 * 1e6 / span_us)
    }
}

/// The replay of several routers' samples (each routes its own share of the traffic): each fresh
/// sample ([`FRESH_FOR`]) planned at `share` of its own rate, the plans merged by time, at most
/// [`MAX_PLANNED`] requests; with the rate the routers recorded together.
pub fn plan_samples(
    samples: &[ShapeSample],
    share: f64,
    duration: Duration,
) -> Result<(f64, Vec<Planned>), PlanError> {
    let fresh_ms = u64::try_from(FRESH_FOR.as_millis()).unwrap_or(u64::MAX);
    let mut recorded = 0.0;
    let mut planned = Vec::new();
    for sample in samples.iter().filter(|s| s.last_age_ms <= fresh_ms) {
        let Some(rate) = sample.rate() else { continue };
        recorded += rate;
        planned.extend(plan(&sample.shapes, rate, share, duration)?);
    }
    if planned.is_empty() {
        return Err(PlanError::NoShapes);
    }
    planned.sort_by_key(|p| p.at);
    planned.truncate(MAX_PLANNED);
    Ok((recorded, planned))
}

/// A prompt's tokens from its characters: four characters a token, as English text runs with
/// the tokenizers vLLM serves; at least one.
#[must_use]
pub fn estimate_tokens(chars: usize) -> u32 {
    u32::try_from(chars.div_ceil(4)).unwrap_or(u32::MAX).max(1)
}

/// The longest synthetic prompt a replay sends, in tokens, whatever a sample says.
pub const MAX_PROMPT_TOKENS: u32 = 1 << 18;

/// Common words, each one token for the tokenizers vLLM serves (and for the emulator's).
const WORDS: [&str; 32] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you",
    "were", "their",
];

/// A prompt of `tokens` words (at most [`MAX_PROMPT_TOKENS`]), different for each `seed` from its
/// first word, so that a replay does not find its own prompts in the prefix cache.
#[must_use]
pub fn synthetic_prompt(tokens: u32, seed: u64) -> String {
    let tokens = tokens.min(MAX_PROMPT_TOKENS) as usize;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut prompt = String::with_capacity(tokens * 5);
    for i in 0..tokens {
        // xorshift64: cheap, and the same words for the same seed.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if i > 0 {
            prompt.push(' ');
        }
        prompt.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
    }
    prompt
}

/// One request of a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    /// When to send it, from the replay's start.
    pub at: Duration,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub stream: bool,
    pub priority: String,
}

/// Why a replay cannot be planned.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "no traffic was recorded: the routers hold no request shapes for this policy from the last 15 minutes, \
         or too few to tell a rate"
    )]
    NoShapes,
    #[error("the recorded rate {0} is not a positive number of requests a second")]
    BadRate(f64),
    #[error("the share {0} of the recorded rate is not a positive number")]
    BadShare(f64),
}

/// The replay of `shapes`, recorded at `recorded_rate` requests a second, at `share` of that rate
/// for `duration`: the shapes in their order, again from the first when they run out, each sent
/// its recorded gap after the one before, every gap scaled by one factor so that the sample's
/// mean rate becomes the target rate. A sample recorded in one burst (no gaps) is spread evenly.
/// At most [`MAX_PLANNED`] requests.
pub fn plan(
    shapes: &[RequestShape],
    recorded_rate: f64,
    share: f64,
    duration: Duration,
) -> Result<Vec<Planned>, PlanError> {
    if shapes.is_empty() {
        return Err(PlanError::NoShapes);
    }
    if !(recorded_rate.is_finite() && recorded_rate > 0.0) {
        return Err(PlanError::BadRate(recorded_rate));
    }
    if !(share.is_finite() && share > 0.0) {
        return Err(PlanError::BadShare(share));
    }
    let target_gap_s = 1.0 / (recorded_rate * share);
    // The gaps between the sample's own requests (its first gap leads in from before it).
    let gaps_s: Vec<f64> = shapes.iter().skip(1).map(|s| s.gap_us as f64 / 1e6).collect();
    let mean_gap_s = if gaps_s.is_empty() {
        0.0
    } else {
        gaps_s.iter().sum::<f64>() / gaps_s.len() as f64
    };
    let gap_of = |i: usize| -> f64 {
        if mean_gap_s > 0.0 {
            // The gap before shape i; the first shape of each pass follows the last at the mean.
            let recorded = if i == 0 { mean_gap_s } else { gaps_s[i - 1] };
            recorded * target_gap_s / mean_gap_s
        } else {
            target_gap_s
        }
    };
    let end = duration.as_secs_f64();
    let mut planned = Vec::new();
    let mut at = 0.0_f64;
    for (n, (i, shape)) in shapes.iter().enumerate().cycle().enumerate() {
        if n > 0 {
            at += gap_of(i);
        }
        if at >= end || planned.len() >= MAX_PLANNED {
            break;
        }
        planned.push(Planned {
            // To the microsecond: float sums must not turn 800 ms into 799.999999 ms.
            at: Duration::from_micros((at * 1e6).round() as u64),
            prompt_tokens: shape.prompt_tokens,
            max_tokens: shape.max_tokens,
            stream: shape.stream,
            priority: shape.priority.clone(),
        });
    }
    Ok(planned)
}

/// What the replay's client saw of one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// It was answered in full (a 2xx, a stream that ended with `[DONE]`).
    pub ok: bool,
    /// From sending it to its first token, when one came.
    pub first_token: Option<Duration>,
    /// The gaps between its tokens as they arrived.
    pub token_gaps: Vec<Duration>,
    /// When the replayer sent it, from the replay's start, and how late that was against its
    /// plan (a client that cannot keep up says so).
    pub sent_at: Duration,
    pub sent_late: Duration,
}

/// The limits a replay must keep.
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// The largest share of requests that may fail, 0 to 1.
    pub max_error_rate: f64,
    /// The longest 99th-percentile time to first token.
    pub ttft_p99: Duration,
    /// The longest 99th-percentile gap between tokens.
    pub itl_p99: Duration,
}

/// What a replay showed, and whether the standby kept the thresholds.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub proven: bool,
    pub requests: usize,
    pub errors: usize,
    pub error_rate: f64,
    /// The 99th-percentile time to first token of the requests that got one.
    pub ttft_p99: Option<Duration>,
    /// The 99th-percentile gap between tokens, over every request's gaps.
    pub itl_p99: Option<Duration>,
    /// The 99th-percentile lateness of the replayer's own sends.
    pub sent_late_p99: Option<Duration>,
    /// The rate the requests were sent at, a second, from the first send to the last.
    pub sent_rate: Option<f64>,
    /// Each threshold broken, in words; empty when proven.
    pub broken: Vec<String>,
}

/// The nearest-rank percentile `p` (0 to 100) of `values`, which it sorts.
#[must_use]
pub fn percentile(values: &mut [Duration], p: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    Some(values[rank.clamp(1, values.len()) - 1])
}

/// Whether `replayed` kept `limits`. A replay of nothing proves nothing: it is not proven.
#[must_use]
pub fn judge(replayed: &[Replayed], limits: &Thresholds) -> Verdict {
    let requests = replayed.len();
    let errors = replayed.iter().filter(|r| !r.ok).count();
    let error_rate = if requests == 0 {
        0.0
    } else {
        errors as f64 / requests as f64
    };
    let mut ttfts: Vec<Duration> = replayed.iter().filter_map(|r| r.first_token).collect();
    let mut gaps: Vec<Duration> = replayed
        .iter()
        .flat_map(|r| r.token_gaps.iter().copied())
        .collect();
    let mut late: Vec<Duration> = replayed.iter().map(|r| r.sent_late).collect();
    let ttft_p99 = percentile(&mut ttfts, 99.0);
    let itl_p99 = percentile(&mut gaps, 99.0);
    let mut broken = Vec::new();
    if requests == 0 {
        broken.push("no request was replayed".to_owned());
    }
    if error_rate > limits.max_error_rate {
        broken.push(format!(
            "{errors} of {requests} requests failed ({:.1}%, at most {:.1}% allowed)",
            error_rate * 100.0,
            limits.max_error_rate * 100.0
        ));
    }
    if let Some(p99) = ttft_p99.filter(|p| *p > limits.ttft_p99) {
        broken.push(format!(
            "TTFT p99 {} ms, over {} ms",
            p99.as_millis(),
            limits.ttft_p99.as_millis()
        ));
    }
    if let Some(p99) = itl_p99.filter(|p| *p > limits.itl_p99) {
        broken.push(format!(
            "inter-token latency p99 {} ms, over {} ms",
            p99.as_millis(),
            limits.itl_p99.as_millis()
        ));
    }
    let first = replayed.iter().map(|r| r.sent_at).min();
    let last = replayed.iter().map(|r| r.sent_at).max();
    let sent_rate = match (first, last) {
        (Some(first), Some(last)) if last > first => {
            Some((requests - 1) as f64 / (last - first).as_secs_f64())
        }
        _ => None,
    };
    Verdict {
        proven: broken.is_empty(),
        requests,
        errors,
        error_rate,
        ttft_p99,
        itl_p99,
        sent_late_p99: percentile(&mut late, 99.0),
        sent_rate,
        broken,
    }
}

impl Verdict {
    /// Whether the replayer fell behind its plan by more than [`LATE_LIMIT`] (p99): then the
    /// figures measure the client, not the standby, and the proof proves nothing either way.
    #[must_use]
    pub fn replayer_behind(&self) -> bool {
        self.sent_late_p99.is_some_and(|late| late > LATE_LIMIT)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn shape(prompt_tokens: u32, gap_ms: u64) -> RequestShape {
        RequestShape {
            prompt_tokens,
            max_tokens: 16,
            stream: true,
            priority: "interactive".to_owned(),
            gap_us: gap_ms * 1000,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_recorded_rate_is_the_gaps_over_the_time_they_span() {
        let sample = ShapeSample {
            policy: "ns/chat".to_owned(),
            // The first gap leads in from before the sample: not counted.
            shapes: vec![shape(10, 5_000), shape(10, 100), shape(10, 300)],
            last_age_ms: 0,
        };
        assert_eq!(sample.rate(), Some(2.0 / 0.4));
        let one = ShapeSample {
            shapes: vec![shape(10, 100)],
            ..ShapeSample::default()
        };
        assert_eq!(one.rate(), None);
    }

    #[test]
    fn each_routers_sample_is_replayed_at_its_own_rate_and_the_plans_interleave() {
        // One router at 2 a second, one at 4: each keeps its own pace, not a mean of both.
        let a = ShapeSample {
            shapes: vec![shape(1, 0), shape(1, 500)],
            ..ShapeSample::default()
        };
        let b = ShapeSample {
            shapes: vec![shape(2, 0), shape(2, 250)],
            ..ShapeSample::default()
        };
        let (rate, planned) = plan_samples(&[a.clone(), b], 1.0, Duration::from_secs(1)).unwrap();
        assert!((rate - 6.0).abs() < 1e-9, "{rate}");
        let at = |tokens: u32| {
            planned
                .iter()
                .filter(|p| p.prompt_tokens == tokens)
                .map(|p| p.at)
                .collect::<Vec<_>>()
        };
        assert_eq!(at(1), [ms(0), ms(500)]);
        assert_eq!(at(2), [ms(0), ms(250), ms(500), ms(750)]);
        assert!(planned.windows(2).all(|w| w[0].at <= w[1].at), "merged by time");
        // A router whose traffic stopped long ago says nothing of the rate now.
        let stale = ShapeSample {
            last_age_ms: u64::try_from(FRESH_FOR.as_millis()).unwrap() + 1,
            ..a
        };
        assert_eq!(
            plan_samples(&[stale], 1.0, Duration::from_secs(1)),
            Err(PlanError::NoShapes)
        );
        assert_eq!(
            plan_samples(&[ShapeSample::default()], 1.0, Duration::from_secs(1)),
            Err(PlanError::NoShapes)
        );
    }

    #[test]
    fn gaps_under_a_millisecond_count_and_huge_ones_do_not_wrap() {
        // 2000 a second: every gap 500 us.
        let fast = ShapeSample {
            shapes: (0..100)
                .map(|_| RequestShape {
                    gap_us: 500,
                    ..shape(1, 0)
                })
                .collect(),
            ..ShapeSample::default()
        };
        assert!((fast.rate().unwrap() - 2000.0).abs() < 1e-6);
        let huge = ShapeSample {
            shapes: (0..3)
                .map(|_| RequestShape {
                    gap_us: u64::MAX,
                    ..shape(1, 0)
                })
                .collect(),
            ..ShapeSample::default()
        };
        assert!(huge.rate().unwrap() < 1e-12, "summed without wrapping");
    }

    #[test]
    fn a_plan_keeps_the_samples_burstiness_at_the_share_of_its_rate() {
        // Recorded at 5/s: gaps of 100 ms and 300 ms (mean 200 ms).
        let shapes = [shape(1, 0), shape(2, 100), shape(3, 300)];
        // At half the rate, every gap doubles.
        let plan = plan(&shapes, 5.0, 0.5, Duration::from_secs(2)).unwrap();
        let at: Vec<Duration> = plan.iter().map(|p| p.at).collect();
        // 0, +200, +600, then the pass starts again after the mean (400), +200, +600 ...
        assert_eq!(at, [ms(0), ms(200), ms(800), ms(1200), ms(1400)]);
        assert_eq!(
            plan.iter().map(|p| p.prompt_tokens).collect::<Vec<_>>(),
            [1, 2, 3, 1, 2]
        );
        // The mean rate over whole passes is the target: 3 requests every 1.2 s = 2.5/s.
    }

    #[test]
    fn a_burst_is_spread_evenly_and_a_plan_is_bounded() {
        let shapes = [shape(1, 0), shape(1, 0)];
        let plan = plan(&shapes, 10.0, 1.0, Duration::from_millis(350)).unwrap();
        assert_eq!(
            plan.iter().map(|p| p.at).collect::<Vec<_>>(),
            [ms(0), ms(100), ms(200), ms(300)]
        );
        let huge = super::plan(&shapes, 1e9, 1.0, Duration::from_secs(3600)).unwrap();
        assert_eq!(huge.len(), MAX_PLANNED);
    }

    #[test]
    fn bad_input_is_refused_with_the_reason() {
        assert_eq!(plan(&[], 1.0, 1.0, ms(1)), Err(PlanError::NoShapes));
        assert_eq!(
            plan(&[shape(1, 0)], 0.0, 1.0, ms(1)),
            Err(PlanError::BadRate(0.0))
        );
        assert!(matches!(
            plan(&[shape(1, 0)], 1.0, f64::NAN, ms(1)),
            Err(PlanError::BadShare(_))
        ));
    }

    fn ok(ttft_ms: u64, gap_ms: u64) -> Replayed {
        Replayed {
            ok: true,
            first_token: Some(ms(ttft_ms)),
            token_gaps: vec![ms(gap_ms); 3],
            sent_at: Duration::ZERO,
            sent_late: Duration::ZERO,
        }
    }

    fn limits() -> Thresholds {
        Thresholds {
            max_error_rate: 0.01,
            ttft_p99: ms(500),
            itl_p99: ms(100),
        }
    }

    #[test]
    fn a_replay_within_every_threshold_is_proven() {
        let replayed: Vec<Replayed> = (0..100).map(|i| ok(100 + i, 20)).collect();
        let verdict = judge(&replayed, &limits());
        assert!(verdict.proven, "{verdict:?}");
        assert_eq!(verdict.ttft_p99, Some(ms(198)));
        assert_eq!(verdict.itl_p99, Some(ms(20)));
        assert!(!verdict.replayer_behind());
    }

    #[test]
    fn the_rate_sent_and_a_replayer_that_fell_behind_are_told_from_the_sends() {
        let mut replayed: Vec<Replayed> = (0..11)
            .map(|i| Replayed {
                sent_at: ms(100 * i),
                ..ok(10, 10)
            })
            .collect();
        assert_eq!(judge(&replayed, &limits()).sent_rate, Some(10.0));
        for r in &mut replayed {
            r.sent_late = ms(1500);
        }
        assert!(judge(&replayed, &limits()).replayer_behind());
    }

    #[test]
    fn each_broken_threshold_is_named() {
        let mut replayed: Vec<Replayed> = (0..98).map(|_| ok(100, 20)).collect();
        // Two slow first tokens are the p99 of 100; two failures are 2%.
        replayed.push(ok(900, 250));
        replayed.push(ok(900, 250));
        replayed[0].ok = false;
        replayed[1].ok = false;
        let verdict = judge(&replayed, &limits());
        assert!(!verdict.proven);
        assert_eq!(verdict.errors, 2);
        assert_eq!(verdict.broken.len(), 3, "{:?}", verdict.broken);
        assert!(
            verdict.broken[0].contains("2 of 100 requests failed"),
            "{:?}",
            verdict.broken
        );
        assert!(
            verdict.broken[1].contains("TTFT p99 900 ms"),
            "{:?}",
            verdict.broken
        );
        assert!(
            verdict.broken[2].contains("inter-token latency p99 250 ms"),
            "{:?}",
            verdict.broken
        );
    }

    #[test]
    fn a_replay_of_nothing_proves_nothing() {
        let verdict = judge(&[], &limits());
        assert!(!verdict.proven);
        assert_eq!(verdict.broken, ["no request was replayed"]);
    }

    #[test]
    fn a_synthetic_prompt_has_the_words_asked_for_and_differs_by_seed() {
        let a = synthetic_prompt(50, 1);
        assert_eq!(a.split(' ').count(), 50);
        assert_eq!(a, synthetic_prompt(50, 1));
        assert_ne!(
            a.split(' ').take(4).collect::<Vec<_>>(),
            synthetic_prompt(50, 2).split(' ').take(4).collect::<Vec<_>>()
        );
        assert_eq!(synthetic_prompt(0, 1), "");
        assert_eq!(
            synthetic_prompt(u32::MAX, 1).split(' ').count(),
            MAX_PROMPT_TOKENS as usize
        );
    }

    #[test]
    fn prompts_are_estimated_at_four_characters_a_token() {
        assert_eq!(estimate_tokens(0), 1);
        assert_eq!(estimate_tokens(9), 3);
    }
}

//! The rolling sample of request shapes the operator's load proofs replay: for each policy's
//! route, the last [`KEEP`] requests' prompt tokens, asked output tokens, streaming flag,
//! priority class and gap since the request before. Never the content: a prompt is reduced to a
//! count as it is read, and only the count is kept.
//!
//! Served on the admin port as `GET /shapes?policy=<ns/name>` ([`crate::admin`]). Probe traffic
//! (marked with `x-understudy-probe`) is not recorded.
//!
//! This module must never keep a prompt's text, hold its lock across an await, or grow past its
//! bounds.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};

use serde::Deserialize;
use tokio::time::Instant;
use understudy_core::load_proof::{RequestShape, ShapeSample, estimate_tokens};

use crate::admission::Priority;

/// The shapes kept per policy.
pub const KEEP: usize = 1024;
/// The policies a router keeps shapes for; a new one past this evicts the one heard from least
/// recently.
const MAX_POLICIES: usize = 256;
/// The header the prober marks its probes with; a request carrying it is not recorded.
pub const PROBE_HEADER: &str = "x-understudy-probe";
/// The output tokens recorded for a request that names none: vLLM's completions default.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// The fields of an OpenAI request a shape is read from; everything else is skipped unread.
#[derive(Deserialize)]
struct Asked<'a> {
    #[serde(default, borrow)]
    prompt: Option<Prompt<'a>>,
    #[serde(default, borrow)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    Ids(Vec<u32>),
    Batches(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default, borrow)]
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<Part<'a>>),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

/// A request body's prompt tokens, asked output tokens and streaming flag; `None` for a body
/// that is not a completion or chat request.
#[must_use]
pub fn shape_of(body: &[u8]) -> Option<(u32, u32, bool)> {
    let asked: Asked<'_> = serde_json::from_slice(body).ok()?;
    let prompt_tokens = match (&asked.prompt, &asked.messages) {
        (Some(Prompt::Text(text)), _) => estimate_tokens(text.chars().count()),
        (Some(Prompt::Texts(texts)), _) => estimate_tokens(texts.iter().map(|t| t.chars().count()).sum()),
        (Some(Prompt::Ids(ids)), _) => u32::try_from(ids.len()).unwrap_or(u32::MAX),
        (Some(Prompt::Batches(batches)), _) => {
            u32::try_from(batches.iter().map(Vec::len).sum::<usize>()).unwrap_or(u32::MAX)
        }
        (None, Some(messages)) => {
            let chars = messages
                .iter()
                .filter_map(|m| m.content.as_ref())
                .map(|content| match content {
                    Content::Text(text) => text.chars().count(),
                    Content::Parts(parts) => parts
                        .iter()
                        .filter_map(|p| p.text.as_ref())
                        .map(|t| t.chars().count())
                        .sum(),
                })
                .sum();
            estimate_tokens(chars)
        }
        (None, None) => return None,
    };
    let max_tokens = asked
        .max_tokens
        .or(asked.max_completion_tokens)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    Some((prompt_tokens, max_tokens, asked.stream.unwrap_or(false)))
}

#[derive(Debug, Default)]
struct Ring {
    shapes: VecDeque<RequestShape>,
    last: Option<Instant>,
}

/// Every policy's sample.
#[derive(Debug, Default)]
pub struct Shapes {
    policies: Mutex<HashMap<String, Ring>>,
}

impl Shapes {
    /// Records a request's shape under `policy`'s route, arrived at `now`. A body that is not a
    /// completion or chat request is not recorded.
    pub fn record(&self, policy: &str, body: &[u8], priority: Priority, now: Instant) {
        let Some((prompt_tokens, max_tokens, stream)) = shape_of(body) else {
            return;
        };
        let mut policies = self.policies.lock().unwrap_or_else(PoisonError::into_inner);
        if !policies.contains_key(policy) && policies.len() >= MAX_POLICIES {
            let stalest = policies
                .iter()
                .min_by_key(|(_, ring)| ring.last)
                .map(|(name, _)| name.clone());
            if let Some(stalest) = stalest {
                policies.remove(&stalest);
            }
        }
        if !policies.contains_key(policy) {
            policies.insert(policy.to_owned(), Ring::default());
        }
        let Some(ring) = policies.get_mut(policy) else {
            return;
        };
        // Requests are recorded as they are admitted, not quite in arrival order: the clock is
        // kept from going back, so that one late record does not stretch the next gap.
        let now = ring.last.map_or(now, |last| last.max(now));
        let gap_us = ring.last.map_or(0, |last| {
            u64::try_from(now.saturating_duration_since(last).as_micros()).unwrap_or(u64::MAX)
        });
        ring.last = Some(now);
        if ring.shapes.len() == KEEP {
            ring.shapes.pop_front();
        }
        ring.shapes.push_back(RequestShape {
            prompt_tokens,
            max_tokens,
            stream,
            priority: priority.as_str().to_owned(),
            gap_us,
        });
    }

    /// `policy`'s sample as of `now`, oldest first; empty when nothing was recorded.
    #[must_use]
    pub fn sample(&self, policy: &str, now: Instant) -> ShapeSample {
        let policies = self.policies.lock().unwrap_or_else(PoisonError::into_inner);
        let ring = policies.get(policy);
        ShapeSample {
            policy: policy.to_owned(),
            shapes: ring
                .map(|r| r.shapes.iter().cloned().collect())
                .unwrap_or_default(),
            last_age_ms: ring.and_then(|r| r.last).map_or(0, |last| {
                u64::try_from(now.saturating_duration_since(last).as_millis()).unwrap_or(u64::MAX)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_shape_is_read_from_each_kind_of_prompt() {
        assert_eq!(
            shape_of(br#"{"prompt": "abcdefgh", "max_tokens": 5}"#),
            Some((2, 5, false))
        );
        assert_eq!(
            shape_of(br#"{"prompt": ["abcd", "efgh"], "stream": true}"#),
            Some((2, 16, true))
        );
        assert_eq!(shape_of(br#"{"prompt": [1, 2, 3]}"#), Some((3, 16, false)));
        assert_eq!(shape_of(br#"{"prompt": [[1, 2], [3]]}"#), Some((3, 16, false)));
        let chat = br#"{"messages": [{"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "efghijkl"}]}],
            "max_completion_tokens": 7, "stream": true}"#;
        assert_eq!(shape_of(chat), Some((3, 7, true)));
        assert_eq!(shape_of(br#"{"input": "an embedding"}"#), None);
        assert_eq!(shape_of(b"not json"), None);
    }

    #[test]
    fn the_sample_keeps_the_last_requests_and_their_gaps_never_their_text() {
        let shapes = Shapes::default();
        let start = Instant::now();
        for i in 0..(KEEP as u64 + 2) {
            let body = format!(
                r#"{{"prompt": "{}", "max_tokens": 4}}"#,
                "word ".repeat(i as usize % 7)
            );
            shapes.record(
                "ns/chat",
                body.as_bytes(),
                Priority::Batch,
                start + Duration::from_millis(10 * i),
            );
        }
        let sample = shapes.sample(
            "ns/chat",
            start + Duration::from_millis(10 * (KEEP as u64 + 1) + 5),
        );
        assert_eq!(sample.shapes.len(), KEEP);
        assert!(
            sample
                .shapes
                .iter()
                .all(|s| s.gap_us == 10_000 && s.priority == "batch")
        );
        assert_eq!(sample.last_age_ms, 5);
        assert_eq!(sample.rate(), Some(100.0));
        assert!(!serde_json::to_string(&sample).unwrap().contains("word"));
        assert!(shapes.sample("ns/other", start).shapes.is_empty());
    }
}

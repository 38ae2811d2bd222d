//! The `continuation` stream contract, as pure pieces: reading what a completions stream has
//! delivered, event by event; building the follow-up request (the original prompt plus the text
//! delivered, `max_tokens` less the tokens delivered); and re-stamping the follow-up's events with
//! the first stream's id, `created` and model, so that the client sees one stream.
//!
//! Only the completions API is continued. Chat falls back to the retryable-error event: vLLM
//! continues a partial assistant message only with `continue_final_message: true` and
//! `add_generation_prompt: false`, and a server or template that ignores those starts a fresh
//! answer after the delivered text, which the client would take for the rest of the first one.
//!
//! This module must never touch a socket or decide when a stream is cut (that is [`crate::body`]).

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// The longest event held back while it is incomplete; longer ones end the continuation record.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// What a completions stream has delivered to the client so far.
#[derive(Debug, Default)]
pub struct Delivered {
    /// The text of every delivered chunk's first choice, concatenated.
    pub text: String,
    /// Chunks that carried text: vLLM and the emulator send one token per chunk.
    pub tokens: u64,
    /// The first stream's id, `created` and model, stamped on the follow-up's events.
    pub stamp: Option<Stamp>,
    /// A chunk with a `finish_reason` or the `[DONE]` went out: the answer is complete.
    pub finished: bool,
}

/// The fields that make two streams look like one.
#[derive(Clone, Debug, PartialEq)]
pub struct Stamp {
    /// The response id.
    pub id: Value,
    /// Its creation time.
    pub created: Value,
    /// The model name.
    pub model: Value,
}

impl Delivered {
    /// Records one complete event (`data: …` without the blank line).
    pub fn record(&mut self, event: &[u8]) {
        let Some(data) = event.strip_prefix(b"data: ") else {
            return;
        };
        if data.trim_ascii() == b"[DONE]" {
            self.finished = true;
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        if self.stamp.is_none() {
            self.stamp = Some(Stamp {
                id: chunk["id"].clone(),
                created: chunk["created"].clone(),
                model: chunk["model"].clone(),
            });
        }
        let choice = &chunk["choices"][0];
        if let Some(t) = choice["text"].as_str()
            && !t.is_empty()
        {
            self.text.push_str(t);
            self.tokens += 1;
        }
        if !choice["finish_reason"].is_null() {
            self.finished = true;
        }
    }
}

/// Splits a byte stream into complete SSE events, holding back an incomplete tail so that a cut
/// never leaves half an event at the client.
#[derive(Debug, Default)]
pub struct Events {
    tail: BytesMut,
    overflowed: bool,
}

impl Events {
    /// Appends `bytes`; returns the complete events in them (with their blank lines), calling
    /// `each` on every event without its blank line.
    pub fn push(&mut self, bytes: &[u8], mut each: impl FnMut(&[u8])) -> Bytes {
        self.tail.extend_from_slice(bytes);
        let mut end = 0;
        while let Some(at) = find(&self.tail[end..], b"\n\n") {
            each(&self.tail[end..end + at]);
            end += at + 2;
        }
        if self.tail.len() - end > MAX_EVENT_BYTES {
            // Not an event stream we understand: pass everything on, continue nothing.
            self.overflowed = true;
            return self.tail.split().freeze();
        }
        self.tail.split_to(end).freeze()
    }

    /// An incomplete event is held back.
    #[must_use]
    pub fn holding(&self) -> bool {
        !self.tail.is_empty()
    }

    /// An event was too long to hold back, so what was delivered is not known.
    #[must_use]
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Drops the held-back tail (the cut stream's half event).
    pub fn clear(&mut self) {
        self.tail.clear();
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The follow-up request body: the original request with the delivered text appended to the
/// prompt and `max_tokens` reduced by the tokens delivered. `None` when it cannot be continued
/// (a prompt that is not one string, or no tokens left).
#[must_use]
pub fn follow_up(original: &Value, delivered: &Delivered) -> Option<Bytes> {
    let mut req = original.clone();
    let prompt = req.get("prompt")?.as_str()?;
    let prompt = format!("{prompt}{}", delivered.text);
    req["prompt"] = Value::String(prompt);
    if let Some(max) = original.get("max_tokens").and_then(Value::as_u64) {
        let left = max.checked_sub(delivered.tokens).filter(|&n| n > 0)?;
        req["max_tokens"] = Value::from(left);
    }
    serde_json::to_vec(&req).ok().map(Bytes::from)
}

/// True when a request body asks for a completions stream that the contract can continue.
#[must_use]
pub fn continuable(path: &str, request: &Value) -> bool {
    path == "/v1/completions"
        && request["stream"].as_bool() == Some(true)
        && request["prompt"].is_string()
        && request["n"].as_u64().unwrap_or(1) == 1
}

/// Re-stamps one follow-up event (without its blank line) with the first stream's identity;
/// returns it with its blank line. Events that are not JSON chunks pass unchanged.
#[must_use]
pub fn restamp(event: &[u8], stamp: &Stamp) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.len() + 2);
    let parsed = event
        .strip_prefix(b"data: ")
        .and_then(|d| serde_json::from_slice::<Value>(d).ok());
    match parsed {
        Some(mut chunk) if chunk.is_object() => {
            chunk["id"] = stamp.id.clone();
            chunk["created"] = stamp.created.clone();
            chunk["model"] = stamp.model.clone();
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(chunk.to_string().as_bytes());
        }
        _ => out.extend_from_slice(event),
    }
    out.extend_from_slice(b"\n\n");
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn chunk(id: &str, text: &str, finish: Option<&str>) -> String {
        format!(
            "data: {}\n\n",
            json!({"id": id, "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": finish}]})
        )
    }

    #[test]
    fn events_split_across_reads_are_recorded_once_and_a_half_event_is_held_back() {
        let mut events = Events::default();
        let mut delivered = Delivered::default();
        let stream = format!("{}{}", chunk("a", " Paris", None), chunk("a", ",", None));
        let (first, second) = stream.as_bytes().split_at(stream.len() - 10);
        let out1 = events.push(first, |e| delivered.record(e));
        assert_eq!(out1.as_ref(), chunk("a", " Paris", None).as_bytes());
        assert!(events.holding());
        let out2 = events.push(second, |e| delivered.record(e));
        assert_eq!(out2.as_ref(), chunk("a", ",", None).as_bytes());
        assert_eq!((delivered.text.as_str(), delivered.tokens), (" Paris,", 2));
        assert!(!delivered.finished);
        assert_eq!(delivered.stamp.unwrap().id, json!("a"));
    }

    #[test]
    fn a_finish_reason_or_done_marks_the_answer_complete() {
        let mut d = Delivered::default();
        d.record(chunk("a", ".", Some("length")).trim_end().as_bytes());
        assert!(d.finished);
        let mut d = Delivered::default();
        d.record(b"data: [DONE]");
        assert!(d.finished);
    }

    #[test]
    fn the_follow_up_appends_the_delivered_text_and_asks_for_the_tokens_left() {
        let original = json!({"model": "m", "prompt": "The capital of France is", "max_tokens": 10,
                              "stream": true});
        let delivered = Delivered {
            text: " Paris, a".into(),
            tokens: 3,
            ..Delivered::default()
        };
        let body: Value = serde_json::from_slice(&follow_up(&original, &delivered).unwrap()).unwrap();
        assert_eq!(body["prompt"], "The capital of France is Paris, a");
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["stream"], true);
        let spent = Delivered {
            tokens: 10,
            ..Delivered::default()
        };
        assert!(follow_up(&original, &spent).is_none(), "no tokens left");
        assert!(follow_up(&json!({"prompt": ["a", "b"]}), &delivered).is_none());
    }

    #[test]
    fn only_single_string_prompt_completion_streams_are_continuable() {
        let ok = json!({"prompt": "x", "stream": true});
        assert!(continuable("/v1/completions", &ok));
        assert!(!continuable("/v1/chat/completions", &ok));
        assert!(!continuable("/v1/completions", &json!({"prompt": "x"})));
        assert!(!continuable(
            "/v1/completions",
            &json!({"prompt": "x", "stream": true, "n": 2})
        ));
    }

    #[test]
    fn a_follow_up_event_carries_the_first_streams_id_created_and_model() {
        let stamp = Stamp {
            id: json!("cmpl-first"),
            created: json!(1),
            model: json!("m"),
        };
        let event = chunk("cmpl-second", " x", None);
        let out = restamp(event.trim_end().as_bytes(), &stamp);
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with("\n\n"));
        let v: Value = serde_json::from_str(text.trim().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            (v["id"].clone(), v["created"].clone()),
            (json!("cmpl-first"), json!(1))
        );
        assert_eq!(v["choices"][0]["text"], " x");
        assert_eq!(restamp(b"data: [DONE]", &stamp), b"data: [DONE]\n\n");
    }
}

//! An incremental decoder for the server-sent events of a streamed `/v1/completions`.
//!
//! vLLM sends `data: <json>\n\n` per chunk, a usage chunk with `"choices": []`, and always
//! `data: [DONE]\n\n` last, even after an error event (reference §2.7). Anything else that is
//! not a comment or a known field is [`SseEvent::Invalid`]. This module is pure: it must never
//! panic on any byte sequence, and it buffers at most [`MAX_EVENT_BYTES`] of an unfinished event.

/// The largest single event accepted; a probe's chunks are a few hundred bytes.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    /// A completion chunk: the first choice's text (possibly empty).
    Text(String),
    /// The final usage chunk (`choices: []`).
    Usage,
    /// `data: [DONE]`.
    Done,
    /// An error event, with its code (500 when the code is missing or out of range).
    Error(u16),
    /// Not an SSE event a completion stream can carry.
    Invalid,
}

/// Splits a byte stream into events as bytes arrive.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
}

fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

impl SseDecoder {
    /// Feeds bytes; returns the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = event_end(&self.buf) {
            let block: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            if let Some(event) = decode_block(&block) {
                events.push(event);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            self.buf.clear();
            events.push(SseEvent::Invalid);
        }
        events
    }

    /// The stream ended: an unfinished event left over is invalid.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let rest = std::mem::take(&mut self.buf);
        if rest.iter().all(|b| b.is_ascii_whitespace()) {
            None
        } else {
            Some(decode_block(&rest).map_or(SseEvent::Invalid, |_| SseEvent::Invalid))
        }
    }
}

/// One event block; `None` for a block of comments or bare fields that carries no data.
fn decode_block(block: &[u8]) -> Option<SseEvent> {
    let Ok(text) = std::str::from_utf8(block) else {
        return Some(SseEvent::Invalid);
    };
    let mut data: Option<String> = None;
    for line in text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)) {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                let d = data.get_or_insert_with(String::new);
                if !d.is_empty() {
                    d.push('\n');
                }
                d.push_str(value);
            }
            "event" | "id" | "retry" => {}
            _ => return Some(SseEvent::Invalid),
        }
    }
    let data = data?;
    if data.trim() == "[DONE]" {
        return Some(SseEvent::Done);
    }
    let Ok(value) = serde_json::from_str::<serde_json::Value>(&data) else {
        return Some(SseEvent::Invalid);
    };
    if let Some(error) = value.get("error") {
        let code = error
            .get("code")
            .and_then(serde_json::Value::as_u64)
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| (100..=999).contains(c))
            .unwrap_or(500);
        return Some(SseEvent::Error(code));
    }
    match value.get("choices").and_then(serde_json::Value::as_array) {
        Some(choices) if choices.is_empty() => Some(SseEvent::Usage),
        Some(choices) => match choices[0].get("text").and_then(serde_json::Value::as_str) {
            Some(text) => Some(SseEvent::Text(text.to_owned())),
            None => Some(SseEvent::Invalid),
        },
        None => Some(SseEvent::Invalid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllms_chunks_split_anywhere_decode_to_text_usage_and_done() {
        let stream = concat!(
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" Par\",",
            "\"logprobs\":null,\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"is\u{e9}\",\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        let expected = vec![
            SseEvent::Text(" Par".into()),
            SseEvent::Text("is\u{e9}".into()),
            SseEvent::Usage,
            SseEvent::Done,
        ];
        for split in 0..stream.len() {
            let mut d = SseDecoder::default();
            let mut events = d.push(&stream[..split]);
            events.extend(d.push(&stream[split..]));
            assert_eq!(events, expected, "split at {split}");
            assert_eq!(d.finish(), None);
        }
    }

    #[test]
    fn error_events_carry_their_code_and_garbage_is_invalid() {
        let mut d = SseDecoder::default();
        let events = d.push(
            b"data: {\"error\":{\"message\":\"x\",\"code\":500}}\n\ndata: {\"error\":{\"code\":7}}\n\n\
              hello world\n\ndata: {not json\n\n: a comment\n\ndata: [DONE]\n\n",
        );
        assert_eq!(
            events,
            vec![
                SseEvent::Error(500),
                SseEvent::Error(500),
                SseEvent::Invalid,
                SseEvent::Invalid,
                SseEvent::Done
            ]
        );
        assert_eq!(d.push(b"data: {\"choices\":[{\"text\":"), vec![]);
        assert_eq!(
            d.finish(),
            Some(SseEvent::Invalid),
            "an unfinished event at the end"
        );
    }

    #[test]
    fn an_endless_event_is_dropped_as_invalid_instead_of_filling_memory() {
        let mut d = SseDecoder::default();
        let chunk = vec![b'a'; 64 * 1024];
        let mut invalid = 0;
        for _ in 0..20 {
            invalid += d.push(&chunk).iter().filter(|e| **e == SseEvent::Invalid).count();
        }
        assert_eq!(invalid, 1);
    }
}

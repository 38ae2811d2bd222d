//! The OpenAI-compatible response bodies in vLLM's shape, and its SSE framing.
//!
//! Each event is exactly `data: <json>\n\n` with no `event:` or `id:` lines; a stream with
//! `stream_options.include_usage` ends with a usage chunk whose `choices` is `[]`, and every
//! stream ends with `data: [DONE]\n\n`, even after an error event. Field names and nulls follow
//! vLLM's pydantic models so strict clients parse the emulator as they parse vLLM. This module
//! builds bytes; it must never wait or decide how a request ends.

use axum::body::Bytes;
use serde::Serialize;

/// Which OpenAI endpoint a body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

impl Api {
    pub fn id_prefix(self) -> &'static str {
        match self {
            Api::Completions => "cmpl-",
            Api::Chat => "chatcmpl-",
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
    pub completion_tokens: usize,
}

/// The fields every chunk and response share.
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
    /// `system_fingerprint`: `vllm-VERSION-HASH` since 0.32 (in the answer, and in a stream's
    /// usage chunk); 0.11 sent `null`.
    pub fingerprint: Option<&'a str>,
}

#[derive(Serialize)]
struct CompletionChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [CompletionChoice<'a>; 1],
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    stop_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatChunkChoice<'a>; 1],
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

#[derive(Serialize)]
struct UsageChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [(); 0],
    usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_fingerprint: Option<&'a str>,
}

fn frame(json: Vec<u8>) -> Bytes {
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail: no maps with non-string keys, no foreign types.
    serde_json::to_vec(value).unwrap_or_default()
}

/// The chat stream's first chunk, which carries the assistant role.
pub fn chat_role_chunk(env: Envelope<'_>) -> Bytes {
    frame(json(&ChatChunk {
        id: env.id,
        object: "chat.completion.chunk",
        created: env.created,
        model: env.model,
        choices: [ChatChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant"),
                content: "",
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        }],
    }))
}

/// A chunk with new text, and the finish reason when this is the last one.
pub fn token_chunk(
    api: Api,
    env: Envelope<'_>,
    text: &str,
    finish: Option<&str>,
    stop_reason: Option<&str>,
) -> Bytes {
    match api {
        Api::Completions => frame(json(&CompletionChunk {
            id: env.id,
            object: "text_completion",
            created: env.created,
            model: env.model,
            choices: [CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: finish,
                stop_reason,
            }],
            usage: None,
        })),
        Api::Chat => frame(json(&ChatChunk {
            id: env.id,
            object: "chat.completion.chunk",
            created: env.created,
            model: env.model,
            choices: [ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: None,
                    content: text,
                },
                logprobs: None,
                finish_reason: finish,
                stop_reason: finish
                    .map(|_| stop_reason.unwrap_or_default())
                    .filter(|s| !s.is_empty()),
            }],
        })),
    }
}

/// The usage chunk sent last before `[DONE]` (vLLM dumps it with `exclude_none`).
pub fn usage_chunk(api: Api, env: Envelope<'_>, usage: Usage) -> Bytes {
    let object = match api {
        Api::Completions => "text_completion",
        Api::Chat => "chat.completion.chunk",
    };
    frame(json(&UsageChunk {
        id: env.id,
        object,
        created: env.created,
        model: env.model,
        choices: [],
        usage,
        system_fingerprint: env.fingerprint,
    }))
}

/// An error event inside a stream.
pub fn error_chunk(message: &str, kind: &str, code: u16) -> Bytes {
    frame(json(&serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    })))
}

pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// A whole non-streaming response.
pub fn full_response(
    api: Api,
    env: Envelope<'_>,
    text: &str,
    finish: &str,
    stop_reason: Option<&str>,
    usage: Usage,
) -> serde_json::Value {
    let usage = serde_json::json!({
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens_details": null,
    });
    match api {
        Api::Completions => serde_json::json!({
            "id": env.id, "object": "text_completion", "created": env.created, "model": env.model,
            "choices": [{
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
                "stop_reason": stop_reason, "prompt_logprobs": null,
            }],
            "service_tier": null, "system_fingerprint": env.fingerprint, "usage": usage, "kv_transfer_params": null,
        }),
        Api::Chat => serde_json::json!({
            "id": env.id, "object": "chat.completion", "created": env.created, "model": env.model,
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant", "content": text, "refusal": null, "annotations": null,
                    "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null,
                },
                "logprobs": null, "finish_reason": finish, "stop_reason": stop_reason,
            }],
            "service_tier": null, "system_fingerprint": env.fingerprint, "usage": usage,
            "prompt_logprobs": null, "kv_transfer_params": null,
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ENV: Envelope<'static> = Envelope {
        fingerprint: None,
        id: "cmpl-1",
        created: 7,
        model: "m",
    };

    #[test]
    fn chunks_are_single_data_lines_in_vllm_shape() {
        let c = token_chunk(Api::Completions, ENV, " hi", None, None);
        assert_eq!(
            std::str::from_utf8(&c).unwrap(),
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":7,\"model\":\"m\",\"choices\":\
             [{\"index\":0,\"text\":\" hi\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}],\
             \"usage\":null}\n\n"
        );
    }

    #[test]
    fn the_usage_chunk_has_empty_choices_and_no_nulls() {
        let u = usage_chunk(
            Api::Chat,
            ENV,
            Usage {
                prompt_tokens: 3,
                total_tokens: 5,
                completion_tokens: 2,
            },
        );
        let text = std::str::from_utf8(&u).unwrap();
        assert!(text.contains("\"choices\":[]"), "{text}");
        assert!(!text.contains("null"), "{text}");
    }
}

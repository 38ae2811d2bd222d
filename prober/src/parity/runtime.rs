//! What a running replica says about itself: `GET /version`, `GET /v1/models`, and how it
//! tokenizes a fixed text and a fixed chat (`POST /tokenize`), which tells its tokenizer and its
//! chat template apart without the model's files.
//!
//! `created` changes on every `/v1/models` call, so it is never part of the fingerprint. This
//! module reads small documents; it must never send generation or touch dev endpoints.

use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::Fingerprint;
use super::model::hex;
use crate::probe::Endpoint;
use crate::probe::http::{self, BodyRead, Failure};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("{endpoint}{path}: {reason}")]
    Fetch {
        endpoint: String,
        path: &'static str,
        reason: String,
    },
}

/// The text whose tokens are fingerprinted: plain words, digits, punctuation and non-ASCII,
/// where tokenizers differ. (The chat beside it is a system and a user message.)
const TOKENIZE_TEXT: &str = "understudy parity: The quick brown fox, 1234.5 × 6 = ¿7407? ✓ Ünïcödé — ok";

async fn get_json(
    endpoint: &Endpoint,
    path: &'static str,
    deadline: Instant,
) -> Result<serde_json::Value, Error> {
    json_exchange(endpoint, ::http::Method::GET, path, None, deadline)
        .await?
        .ok_or_else(|| Error::Fetch {
            endpoint: endpoint.to_string(),
            path,
            reason: "HTTP 404".to_owned(),
        })
}

/// One JSON exchange; `None` when the replica answers 404 (a route it does not have).
async fn json_exchange(
    endpoint: &Endpoint,
    method: ::http::Method,
    path: &'static str,
    body: Option<Vec<u8>>,
    deadline: Instant,
) -> Result<Option<serde_json::Value>, Error> {
    let fail = |reason: String| Error::Fetch {
        endpoint: endpoint.to_string(),
        path,
        reason,
    };
    let mut exchange = http::send(endpoint, method, path, body, &[], deadline)
        .await
        .map_err(|f: Failure| fail(format!("{f:?}")))?;
    if exchange.status == 404 {
        return Ok(None);
    }
    if exchange.status != 200 {
        return Err(fail(format!("HTTP {}", exchange.status)));
    }
    match http::read_body(&mut exchange, 1 << 20, deadline).await {
        BodyRead::Complete(body) => serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| fail(e.to_string())),
        other => Err(fail(format!("{other:?}"))),
    }
}

/// The first 16 hex digits of the SHA-256 of the token ids `POST /tokenize` gives for `input`
/// (`"prompt"` or `"messages"`) with `model`; `None` when the replica has no `/tokenize`.
async fn tokens_digest(
    endpoint: &Endpoint,
    model: &str,
    input: (&str, serde_json::Value),
    deadline: Instant,
) -> Result<Option<String>, Error> {
    let mut body = serde_json::json!({"model": model});
    body[input.0] = input.1;
    let answer = json_exchange(
        endpoint,
        ::http::Method::POST,
        "/tokenize",
        Some(body.to_string().into_bytes()),
        deadline,
    )
    .await?;
    Ok(answer.and_then(|answer| {
        let tokens = answer.get("tokens")?.as_array()?;
        let mut hasher = Sha256::new();
        for token in tokens {
            hasher.update(token.as_u64()?.to_le_bytes());
        }
        Some(hex(&hasher.finalize()[..8]))
    }))
}

/// `runtime.version`, and per served model `served.<id>.max-model-len`, `served.<id>.root`, and
/// the digests of how it tokenizes a fixed text (`served.<id>.tokenizer`) and a fixed chat
/// (`served.<id>.chat-template`), where it has `/tokenize`;
/// `runtime.image` from the container's image digest when given (`repo@sha256:…` keeps the digest).
pub async fn runtime_fingerprint(
    endpoint: &Endpoint,
    image: Option<&str>,
    timeout: Duration,
) -> Result<Fingerprint, Error> {
    let deadline = Instant::now() + timeout;
    let mut fp = Fingerprint::default();
    let version = get_json(endpoint, "/version", deadline).await?;
    if let Some(v) = version.get("version").and_then(serde_json::Value::as_str) {
        fp.insert("runtime.version", v);
    }
    let models = get_json(endpoint, "/v1/models", deadline).await?;
    for card in models
        .get("data")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(id) = card.get("id").and_then(serde_json::Value::as_str) else {
            continue;
        };
        if let Some(len) = card.get("max_model_len").and_then(serde_json::Value::as_u64) {
            fp.insert(format!("served.{id}.max-model-len"), len.to_string());
        }
        if let Some(root) = card.get("root").and_then(serde_json::Value::as_str) {
            fp.insert(format!("served.{id}.root"), root);
        }
        let text = ("prompt", serde_json::Value::from(TOKENIZE_TEXT));
        if let Some(digest) = tokens_digest(endpoint, id, text, deadline).await? {
            fp.insert(format!("served.{id}.tokenizer"), digest);
        }
        let chat = serde_json::json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say ok."},
        ]);
        if let Some(digest) = tokens_digest(endpoint, id, ("messages", chat), deadline).await? {
            fp.insert(format!("served.{id}.chat-template"), digest);
        }
    }
    if let Some(image) = image {
        let digest = image.rsplit_once('@').map_or(image, |(_, d)| d);
        fp.insert("runtime.image", digest);
    }
    Ok(fp)
}

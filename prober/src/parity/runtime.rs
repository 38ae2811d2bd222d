//! What a running replica says about itself: `GET /version` and `GET /v1/models`.
//!
//! `created` changes on every `/v1/models` call, so it is never part of the fingerprint. This
//! module reads two small documents; it must never send generation or touch dev endpoints.

use std::time::Duration;

use tokio::time::Instant;

use super::Fingerprint;
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

async fn get_json(
    endpoint: &Endpoint,
    path: &'static str,
    deadline: Instant,
) -> Result<serde_json::Value, Error> {
    let fail = |reason: String| Error::Fetch {
        endpoint: endpoint.to_string(),
        path,
        reason,
    };
    let mut exchange = http::send(endpoint, ::http::Method::GET, path, None, &[], deadline)
        .await
        .map_err(|f: Failure| fail(format!("{f:?}")))?;
    if exchange.status != 200 {
        return Err(fail(format!("HTTP {}", exchange.status)));
    }
    match http::read_body(&mut exchange, 1 << 20, deadline).await {
        BodyRead::Complete(body) => serde_json::from_slice(&body).map_err(|e| fail(e.to_string())),
        other => Err(fail(format!("{other:?}"))),
    }
}

/// `runtime.version`, and per served model `served.<id>.max-model-len` and `served.<id>.root`;
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
    }
    if let Some(image) = image {
        let digest = image.rsplit_once('@').map_or(image, |(_, d)| d);
        fp.insert("runtime.image", digest);
    }
    Ok(fp)
}

//! The router: understudy's data path.
//!
//! Not built yet; it is issue #5: the epoch-fenced gateway (a reverse proxy for the
//! OpenAI-compatible API that refuses route updates older than the highest epoch it has seen,
//! retries refused connections before the first byte, holds requests in a waiting room during
//! promotion, and admits work by priority after promotion) and the fence sidecar that refuses
//! generation in a pool that no longer holds the policy's lease.

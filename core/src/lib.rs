//! understudy's domain, with no Kubernetes and no I/O in it.
//!
//! Everything here is pure: the fencing [`Epoch`], the two [`Pool`]s a policy names, durations in
//! the forms Kubernetes and vLLM print them, parity fingerprints and their drift, and the failover state machine that turns
//! observations into decisions, the quorum that says how many of a pool's replicas must serve, and
//! the step driver that carries a promotion out through an executor. The operator runs this logic against Kubernetes, the game-day simulator against a
//! schedule, and both get the same answers.

pub mod drive;
pub mod duration;
pub mod epoch;
pub mod failover;
pub mod fingerprint;
pub mod load_proof;
pub mod pool;
pub mod quorum;
pub mod recovery;
pub mod vllm;

pub use epoch::Epoch;
pub use pool::Pool;

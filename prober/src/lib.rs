//! The prober: how understudy knows whether a pool can do its job.
//!
//! - [`probe`]: a real, deterministic, streamed completion per replica, classified into one
//!   [`outcome::ProbeOutcome`]; sleeping replicas are read, never sent generation.
//! - [`outcome`]: what one probe ended in, and how a round over a pool becomes the one check
//!   result the failover state machine consumes.
//! - [`parity`]: fingerprints of model files, tokenizer, runtime and serving flags, and the
//!   drift report that names each differing key.
//! - [`coldstart`]: where a replica's cold start went, stage by stage, from pod events, vLLM's
//!   log lines and the first token.
//! - [`gpu`]: GPU health through NVML, a node's verdict and its free GPUs; [`agent`] serves it
//!   on each GPU node, with the fingerprints of the node's model cache ([`model_cache`]).
//! - [`replay`]: a load proof's replay of recorded request shapes against a pool, timed from the
//!   client's side.
//! - [`report`]: observations for the state machine, the JSON document, Prometheus metrics.
//! - [`admin`]: probing every interval, and the admin port serving the latest round and metrics.
//!
//! The library does the work; the `understudy-prober` binary only parses arguments and prints.

pub mod admin;
pub mod agent;
pub mod coldstart;
pub mod gpu;
pub mod http1;
pub mod latest;
pub mod model_cache;
pub mod outcome;
pub mod parity;
pub mod podresources;
pub mod probe;
pub mod replay;
pub mod report;
pub mod sleep;

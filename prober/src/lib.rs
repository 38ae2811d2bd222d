//! The prober: how understudy knows whether a pool can do its job.
//!
//! - [`coldstart`]: where a replica's cold start went, stage by stage, from pod events, vLLM's
//!   log lines and the first token.
//! - [`outcome`]: what one probe ended in, and how a round over a pool becomes the one check
//!   result the failover state machine consumes.
//!
//! The library does the work; the `understudy-prober` binary only parses arguments and prints.

pub mod coldstart;
pub mod gpu;
pub mod outcome;
pub mod parity;
pub mod probe;

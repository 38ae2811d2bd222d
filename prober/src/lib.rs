//! The prober: how understudy knows whether a pool can do its job.
//!
//! Built so far: the outcome of one generating probe ([`outcome::ProbeOutcome`]) and how a
//! round of them over a pool's replicas becomes the one check result the failover state
//! machine consumes ([`outcome::pool_verdict`]). The probes themselves (streamed completions
//! with golden answers), parity fingerprints, cold-start timelines and GPU health through NVML
//! are not built yet; they are issue #4.

pub mod outcome;

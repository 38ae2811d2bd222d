//! Game days for understudy.
//!
//! This crate holds the policy simulator ([`simulate`]), which runs a failure schedule through
//! the real failover state machine so a user can see what a policy would do before trusting it,
//! and the vLLM-compatible [`emulator`] (with its faults and a small load generator) that every
//! other part is tested against. Scheduled GameDay resources and their reports come next.

pub mod emulator;
pub mod simulate;

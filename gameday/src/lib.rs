//! Game days for understudy.
//!
//! Today this crate holds the policy simulator ([`simulate`]), which runs a failure schedule
//! through the real failover state machine so a user can see what a policy would do before
//! trusting it. It also holds the vLLM-compatible [`emulator`] that every other part is tested against.
//! Fault injection, load generation and reports come next.

pub mod emulator;
pub mod simulate;

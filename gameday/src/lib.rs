//! Game days for understudy.
//!
//! Today this crate holds the policy simulator ([`simulate`]), which runs a failure schedule
//! through the real failover state machine so a user can see what a policy would do before
//! trusting it. Fault injection, load generation, reports and the vLLM emulator come next.

pub mod simulate;

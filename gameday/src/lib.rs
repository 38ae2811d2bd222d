//! Game days for understudy.
//!
//! This crate holds the local game day ([`local`]): the whole failover system on one machine,
//! emulated replicas as real processes behind fences and routers, the operator's failover logic
//! driving a local executor, load, faults and a report; the policy simulator ([`simulate`]), which
//! runs a failure schedule through the real failover state machine for what-if questions; the
//! recovery [`plan`], which times a standby pool's tiers against the recovery objective; and the
//! data-path [`soak`]. The replicas it starts are the vLLM emulator (`understudy-emulator`), run as
//! this binary's `emulator` subcommand. Scheduled GameDay resources on a cluster are the
//! operator's.

pub mod local;
pub mod plan;
pub mod simulate;
pub mod soak;

//! The failover state machine: observations in, the next state and actions out.
//!
//! It is pure and deterministic. Nothing here reads a clock, a socket or the Kubernetes API:
//! the caller passes the time with every input, executes the [`Action`]s it gets back, and
//! reports each promotion step's outcome as another input. Observations (checks, passive
//! signals, parity, the lease, the control plane) only update what it knows; it decides on
//! [`Input::Tick`] and on commands, so observations fed together are judged together. The
//! operator drives it from reconcile loops, the simulator from a failure schedule, and tests
//! from random sequences.
//!
//! What it guarantees, and what the property tests check:
//! - the epoch only grows, and only through a compare-and-set of the lease;
//! - at most one pool is routable for any epoch;
//! - no promotion starts within `min_dwell` of the end of the previous one;
//! - a standby that is not eligible (failing its own checks, parity broken, paused) is never
//!   promoted automatically, so two unhealthy pools never ping-pong;
//! - promotion is a sequence of recorded steps, each action idempotent, so a restarted
//!   executor resumes at the recorded step and never promotes twice;
//! - a lost compare-and-set makes the loser act on nothing until it has read the lease again,
//!   and an unreachable control plane pauses control actions without touching the data path.

mod config;
mod machine;

pub use config::{ConfigError, FailbackPolicy, FailoverConfig};
pub use machine::{
    Action, Blocked, CheckResult, Command, ControlPlane, Event, FailoverState, Input, Observation,
    PassiveSignal, Phase, PoolHealth, Promotion, Step, StepFailure, TransitionKind,
};

//! The failover state machine.

mod config;

pub use config::{ConfigError, FailbackPolicy, FailoverConfig};

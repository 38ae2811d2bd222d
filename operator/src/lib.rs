//! operator
//!
//! The CRD types, their validation and the epoch Lease are the shared contracts of
//! `understudy_api`, re-exported here so that `understudy_operator::crd::...` keeps reading as
//! the operator's own.
pub use understudy_api::{crd, lease, policy};

pub mod admin;
pub mod clusters;
pub mod coldstart;
pub mod command;
pub mod controller;
pub mod cron;
pub mod gameday;
pub mod gpu_health;
pub mod grants;
pub mod judge;
pub mod leader;
pub mod load_proof;
pub mod metrics;
pub mod observe;
pub mod parity;
pub mod peers;
pub mod ports;
pub mod reconciler;
pub mod replicas;
pub mod reserve;
pub mod rollout;
pub mod route_push;
pub mod route_target;
pub mod router_admin;
pub mod standby;
pub mod wake;
pub mod watchdog;
pub mod workload;

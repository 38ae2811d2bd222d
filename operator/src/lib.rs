//! operator
pub mod admin;
pub mod controller;
pub mod crd;
pub mod cron;
pub mod gameday;
mod http1;
pub mod leader;
pub mod lease;
pub mod metrics;
pub mod observe;
pub mod policy;
pub mod reserve;
pub mod route_push;
pub mod wake;

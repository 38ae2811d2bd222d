//! operator
pub mod crd;
pub mod leader;
pub mod lease;
pub mod policy;

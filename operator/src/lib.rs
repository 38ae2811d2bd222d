//! operator
pub mod crd;
pub mod policy;

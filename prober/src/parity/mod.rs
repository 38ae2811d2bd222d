//! Parity fingerprints read from replicas and model directories.
//!
//! A [`Fingerprint`] (core's: comparing is pure) is a flat, sorted map from a named key to a
//! value, and a [`DriftReport`] names exactly what differs between two. The pieces here read one: [`model`] reads a model directory (Hugging Face cache
//! facts, the cheap safetensors-header digest, the full streamed SHA-256), [`flags`] canonicalises
//! `vllm serve` arguments, [`runtime`] asks a replica for its version and context length.
//! This module compares; it must never decide failover (the state machine gets `Parity { holds }`).

pub mod flags;
pub mod model;
pub mod runtime;

pub use understudy_core::fingerprint::{Difference, DriftReport, Fingerprint, allows};

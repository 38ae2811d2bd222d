//! prober

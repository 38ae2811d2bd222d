//! vLLM's sleep mode as a pure state machine: where the weights and the KV cache are.
//!
//! Level 1 offloads the weights to host memory and discards the KV cache; level 2 discards both.
//! `/wake_up` brings back the tags asked for (all when none are named). After a level-2 wake the
//! weights are allocated but hold garbage until `reload_weights`. The engine generates only when
//! both tags are resident. This module decides states and reports durations to wait; it must
//! never wait itself or know about HTTP.

use std::time::Duration;

use super::cost::transfer;

/// A sleep level as `/sleep?level=` gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepLevel {
    /// Weights kept in host memory.
    One,
    /// Weights discarded (vLLM does this at every level but 1).
    Two,
}

impl SleepLevel {
    /// vLLM reads the level with `int(level)`; its allocator offloads the weights only at level 1
    /// and discards them at any other. Level 0 (pause scheduling, free nothing) and negative
    /// levels are not emulated: `None`, which the API refuses with 400.
    pub fn parse(raw: &str) -> Option<SleepLevel> {
        match raw.trim().parse::<i64>().ok()? {
            1 => Some(SleepLevel::One),
            2.. => Some(SleepLevel::Two),
            _ => None,
        }
    }
}

/// Where the weights are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    OnGpu,
    /// Level 1: copied to host memory, GPU memory freed.
    InHost,
    /// Level 2: gone.
    Discarded,
    /// Level-2 wake: GPU memory allocated again, contents meaningless until `reload_weights`.
    Garbage,
}

/// How sleep treats requests already running (`/sleep?mode=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort them (`finish_reason: "abort"`); vLLM's default.
    Abort,
    /// Let them finish first.
    Wait,
    /// Freeze them; they continue after wake.
    Keep,
}

impl PauseMode {
    pub fn parse(raw: &str) -> Option<PauseMode> {
        match raw {
            "abort" => Some(PauseMode::Abort),
            "wait" => Some(PauseMode::Wait),
            "keep" => Some(PauseMode::Keep),
            _ => None,
        }
    }
}

/// The engine's memory, as sleep mode sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SleepState {
    pub weights: Weights,
    pub kv_cache_resident: bool,
    /// The level of the sleep in force (for `vllm:engine_sleep_state`), if any tag sleeps.
    pub level: Option<SleepLevel>,
}

/// Memory sizes and bandwidths that set how long sleep and wake take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidths {
    pub weights_gib: f64,
    pub load_gib_per_s: f64,
    pub host_gib_per_s: f64,
    pub wake_alloc_s: f64,
}

impl Default for SleepState {
    fn default() -> Self {
        SleepState {
            weights: Weights::OnGpu,
            kv_cache_resident: true,
            level: None,
        }
    }
}

impl SleepState {
    /// vLLM's `is_sleeping`: true until every tag is back.
    pub fn is_sleeping(&self) -> bool {
        self.level.is_some()
    }

    /// Whether generation produces the model's text (false: garbage).
    pub fn weights_valid(&self) -> bool {
        self.weights == Weights::OnGpu
    }

    /// Puts the engine to sleep; returns how long the offload takes. Sleeping again is a no-op.
    pub fn sleep(&mut self, level: SleepLevel, bw: &Bandwidths) -> Duration {
        if self.is_sleeping() {
            return Duration::ZERO;
        }
        self.level = Some(level);
        self.kv_cache_resident = false;
        match level {
            SleepLevel::One if self.weights == Weights::OnGpu => {
                self.weights = Weights::InHost;
                transfer(bw.weights_gib, bw.host_gib_per_s)
            }
            // Garbage weights are not worth keeping; level 1 on them frees them like level 2.
            _ => {
                self.weights = Weights::Discarded;
                Duration::ZERO
            }
        }
    }

    /// Wakes the tags named (`weights`, `kv_cache`; none means all); returns how long it takes.
    /// Waking a tag that is not asleep is a no-op.
    pub fn wake(&mut self, tags: &[String], bw: &Bandwidths) -> Duration {
        let all = tags.is_empty();
        let wants = |tag: &str| all || tags.iter().any(|t| t == tag);
        let mut took = Duration::ZERO;
        if wants("weights") {
            match self.weights {
                Weights::InHost => {
                    self.weights = Weights::OnGpu;
                    took += transfer(bw.weights_gib, bw.host_gib_per_s);
                }
                Weights::Discarded => {
                    self.weights = Weights::Garbage;
                    took += Duration::from_secs_f64(bw.wake_alloc_s);
                }
                Weights::OnGpu | Weights::Garbage => {}
            }
        }
        if wants("kv_cache") && !self.kv_cache_resident {
            self.kv_cache_resident = true;
            took += Duration::from_secs_f64(bw.wake_alloc_s);
        }
        if self.kv_cache_resident && matches!(self.weights, Weights::OnGpu | Weights::Garbage) {
            self.level = None;
        }
        took
    }

    /// `collective_rpc reload_weights`: reads the weights from storage again.
    pub fn reload_weights(&mut self, bw: &Bandwidths) -> Duration {
        match self.weights {
            Weights::Garbage | Weights::OnGpu => {
                self.weights = Weights::OnGpu;
                transfer(bw.weights_gib, bw.load_gib_per_s)
            }
            // No GPU memory to load into while asleep; vLLM would fail; the emulator does nothing.
            Weights::InHost | Weights::Discarded => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const BW: Bandwidths = Bandwidths {
        weights_gib: 10.0,
        load_gib_per_s: 1.0,
        host_gib_per_s: 10.0,
        wake_alloc_s: 0.5,
    };

    #[test]
    fn level_one_wakes_with_valid_weights_at_host_bandwidth() {
        let mut s = SleepState::default();
        assert_eq!(s.sleep(SleepLevel::One, &BW), Duration::from_secs(1));
        assert!(s.is_sleeping());
        let took = s.wake(&[], &BW);
        assert_eq!(took, Duration::from_secs(1) + Duration::from_millis(500));
        assert!(!s.is_sleeping());
        assert!(s.weights_valid());
    }

    #[test]
    fn level_two_wakes_to_garbage_until_weights_are_reloaded_from_storage() {
        let mut s = SleepState::default();
        s.sleep(SleepLevel::Two, &BW);
        s.wake(&["weights".to_string()], &BW);
        assert!(s.is_sleeping(), "the KV cache still sleeps");
        assert!(!s.weights_valid());
        assert_eq!(s.reload_weights(&BW), Duration::from_secs(10));
        s.wake(&["kv_cache".to_string()], &BW);
        assert!(!s.is_sleeping());
        assert!(s.weights_valid());
    }

    #[test]
    fn sleeping_twice_and_waking_an_awake_engine_are_no_ops() {
        let mut s = SleepState::default();
        assert_eq!(s.wake(&[], &BW), Duration::ZERO);
        s.sleep(SleepLevel::One, &BW);
        assert_eq!(s.sleep(SleepLevel::Two, &BW), Duration::ZERO);
        assert_eq!(s.level, Some(SleepLevel::One));
    }

    #[test]
    fn levels_and_modes_parse_like_vllm() {
        assert_eq!(SleepLevel::parse("2"), Some(SleepLevel::Two));
        assert_eq!(SleepLevel::parse("1"), Some(SleepLevel::One));
        assert_eq!(
            SleepLevel::parse("3"),
            Some(SleepLevel::Two),
            "any level but 1 discards"
        );
        assert_eq!(SleepLevel::parse("0"), None, "pausing only is not emulated");
        assert_eq!(SleepLevel::parse("-1"), None);
        assert_eq!(SleepLevel::parse("x"), None);
        assert_eq!(PauseMode::parse("keep"), Some(PauseMode::Keep));
        assert_eq!(PauseMode::parse("later"), None);
    }
}

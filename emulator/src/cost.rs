//! The cost model: how long prefill, decode, weight loads and wakes take, and the prefix cache.
//!
//! The model is deliberately small, so a reader can predict it:
//!
//! * **Prefill** of one request takes `prefill_overhead_s + prefill_s_per_token × uncached prompt
//!   tokens`, and prefills run one at a time in arrival order (the engine's token budget per step
//!   is spent on one prompt after another). A burst of long uncached prompts therefore queues: the
//!   k-th request's time to first token is the sum of the prefills ahead of it. That queue is the
//!   post-failover prefill storm.
//! * **Decode** emits one token per step; a step takes `decode_s_per_token × (1 +
//!   decode_batch_slowdown × (running − 1))`, so a bigger batch is slower per request and faster
//!   in total, until `--max-num-seqs` or the KV cache stops admission.
//! * **Admission**: a request holds one of `--max-num-seqs` slots and KV blocks for
//!   `prompt + max_tokens` tokens (in `--block-size` blocks) from admission to finish. Requests
//!   that do not fit wait (`vllm:num_requests_waiting`).
//! * **Prefix cache**: prompt tokens are hashed in full blocks, each hash chained on the one
//!   before (as vLLM does), and a new prompt's leading blocks found in the cache are not
//!   prefilled. The cache is empty after start, sleep, wake and `/reset_prefix_cache`.
//! * **Weights**: `weights_gib / load_gib_per_s` at start and on `reload_weights`;
//!   `weights_gib / host_gib_per_s` for a level-1 offload or wake.
//!
//! Everything is multiplied by `latency_multiplier` and by a `slow` fault. This module holds pure
//! arithmetic and the cache's bookkeeping; it must never sleep, lock across an await or do I/O.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use super::settings::EmuSettings;

/// The knobs of the cost model, resolved from settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub prefill_s_per_token: f64,
    pub prefill_overhead_s: f64,
    pub decode_s_per_token: f64,
    pub decode_batch_slowdown: f64,
    pub latency_multiplier: f64,
}

impl CostModel {
    pub fn from_settings(s: &EmuSettings) -> CostModel {
        if s.zero_cost {
            return CostModel::zero();
        }
        CostModel {
            prefill_s_per_token: s.prefill_s_per_token,
            prefill_overhead_s: s.prefill_overhead_s,
            decode_s_per_token: s.decode_s_per_token,
            decode_batch_slowdown: s.decode_batch_slowdown,
            latency_multiplier: s.latency_multiplier,
        }
    }

    /// Costs nothing: only the emulator's own overhead remains.
    pub fn zero() -> CostModel {
        CostModel {
            prefill_s_per_token: 0.0,
            prefill_overhead_s: 0.0,
            decode_s_per_token: 0.0,
            decode_batch_slowdown: 0.0,
            latency_multiplier: 1.0,
        }
    }

    /// Time to prefill `uncached` prompt tokens, under an extra `slow` multiplier.
    pub fn prefill(&self, uncached: usize, slow: f64) -> Duration {
        secs(
            (self.prefill_overhead_s + self.prefill_s_per_token * uncached as f64)
                * self.latency_multiplier
                * slow,
        )
    }

    /// One decode step with `running` requests in the batch, under an extra `slow` multiplier.
    pub fn decode_step(&self, running: usize, slow: f64) -> Duration {
        let extra = running.saturating_sub(1) as f64;
        secs(
            self.decode_s_per_token
                * (1.0 + self.decode_batch_slowdown * extra)
                * self.latency_multiplier
                * slow,
        )
    }
}

/// Moving `gib` at `gib_per_s`.
pub fn transfer(gib: f64, gib_per_s: f64) -> Duration {
    secs(gib / gib_per_s)
}

fn secs(s: f64) -> Duration {
    if s > 0.0 && s.is_finite() {
        Duration::from_secs_f64(s)
    } else {
        Duration::ZERO
    }
}

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize, block_size: u32) -> usize {
    tokens.div_ceil(block_size as usize)
}

/// vLLM's prefix cache, reduced to which full prompt blocks are resident.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity_blocks: usize,
    resident: HashSet<u64>,
    /// Insertion order, for evicting the oldest block when full.
    order: VecDeque<u64>,
    enabled: bool,
}

impl PrefixCache {
    pub fn new(block_size: u32, capacity_tokens: u32, enabled: bool) -> PrefixCache {
        PrefixCache {
            block_size: block_size.max(1) as usize,
            capacity_blocks: blocks_for(capacity_tokens as usize, block_size.max(1)).max(1),
            resident: HashSet::new(),
            order: VecDeque::new(),
            enabled,
        }
    }

    /// The chained hashes of the prompt's full blocks.
    pub fn block_hashes(&self, prompt: &[u32]) -> Vec<u64> {
        let mut parent: u64 = 0x1f3d_5b79;
        prompt
            .chunks_exact(self.block_size)
            .map(|block| {
                let mut h = parent ^ 0x9e37_79b9_7f4a_7c15;
                for &t in block {
                    h = (h ^ u64::from(t))
                        .wrapping_mul(0x0000_0100_0000_01b3)
                        .rotate_left(5);
                }
                parent = h;
                h
            })
            .collect()
    }

    /// How many leading prompt tokens are already cached (never the whole prompt: vLLM always
    /// recomputes the last token to produce logits).
    pub fn cached_tokens(&self, hashes: &[u64], prompt_len: usize) -> usize {
        if !self.enabled {
            return 0;
        }
        let hits = hashes.iter().take_while(|h| self.resident.contains(h)).count();
        (hits * self.block_size).min(prompt_len.saturating_sub(1))
    }

    /// Remembers a prefilled prompt's blocks, evicting the oldest when full.
    pub fn insert(&mut self, hashes: &[u64]) {
        if !self.enabled {
            return;
        }
        for &h in hashes {
            if self.resident.insert(h) {
                self.order.push_back(h);
            }
        }
        while self.resident.len() > self.capacity_blocks {
            match self.order.pop_front() {
                Some(old) => {
                    self.resident.remove(&old);
                }
                None => break,
            }
        }
    }

    /// Forgets everything (start, sleep, wake, `/reset_prefix_cache`).
    pub fn clear(&mut self) {
        self.resident.clear();
        self.order.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.resident.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn model() -> CostModel {
        CostModel {
            prefill_s_per_token: 0.001,
            prefill_overhead_s: 0.0,
            decode_s_per_token: 0.01,
            decode_batch_slowdown: 0.1,
            latency_multiplier: 1.0,
        }
    }

    #[test]
    fn prefill_grows_with_uncached_tokens_and_slow_multiplies_it() {
        assert_eq!(model().prefill(1000, 1.0), Duration::from_secs(1));
        assert_eq!(model().prefill(1000, 3.0), Duration::from_secs(3));
        assert_eq!(model().prefill(0, 1.0), Duration::ZERO);
    }

    #[test]
    fn a_bigger_batch_decodes_slower_per_request_but_faster_in_total() {
        let one = model().decode_step(1, 1.0).as_secs_f64();
        let ten = model().decode_step(10, 1.0).as_secs_f64();
        assert!(ten > one);
        assert!(10.0 / ten > 1.0 / one);
        assert_eq!(CostModel::zero().decode_step(100, 5.0), Duration::ZERO);
    }

    #[test]
    fn shared_prefixes_hit_the_cache_block_by_block_and_clearing_empties_it() {
        let mut cache = PrefixCache::new(4, 1024, true);
        let system: Vec<u32> = (0..8).collect();
        let a: Vec<u32> = system.iter().copied().chain([100, 101, 102, 103, 104]).collect();
        let b: Vec<u32> = system.iter().copied().chain([200, 201, 202, 203]).collect();
        let ha = cache.block_hashes(&a);
        assert_eq!(cache.cached_tokens(&ha, a.len()), 0);
        cache.insert(&ha);
        let hb = cache.block_hashes(&b);
        assert_eq!(
            cache.cached_tokens(&hb, b.len()),
            8,
            "the shared 8-token system prompt is two blocks"
        );
        assert_eq!(cache.cached_tokens(&ha, a.len()), 12);
        cache.clear();
        assert_eq!(cache.cached_tokens(&ha, a.len()), 0);
    }

    #[test]
    fn a_fully_cached_prompt_still_prefills_its_last_token() {
        let mut cache = PrefixCache::new(4, 1024, true);
        let p: Vec<u32> = (0..8).collect();
        let h = cache.block_hashes(&p);
        cache.insert(&h);
        assert_eq!(cache.cached_tokens(&h, p.len()), 7);
    }

    #[test]
    fn the_cache_evicts_oldest_blocks_beyond_capacity_and_can_be_disabled() {
        let mut cache = PrefixCache::new(4, 8, true);
        let first: Vec<u32> = (0..8).collect();
        let second: Vec<u32> = (50..58).collect();
        let hf = cache.block_hashes(&first);
        cache.insert(&hf);
        cache.insert(&cache.block_hashes(&second));
        assert_eq!(cache.cached_tokens(&hf, 9), 0);
        let mut off = PrefixCache::new(4, 8, false);
        off.insert(&hf);
        assert_eq!(off.cached_tokens(&hf, 9), 0);
    }
}

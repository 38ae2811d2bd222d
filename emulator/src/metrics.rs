//! vLLM's Prometheus metrics: the same names, labels, help texts and buckets.
//!
//! Written by hand rather than through prometheus-client because the exposition must look like
//! vLLM's (Python `prometheus_client`, text format 0.0.4): `vllm:`-prefixed names with a colon,
//! `model_name` then `engine` labels, `# TYPE vllm:x_total counter`, float values. Recording is
//! atomics only, so the request path takes no lock. This module must never decide anything; it
//! counts what the engine reports.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// vLLM's `FINISH_REASON_STRINGS`.
pub const FINISHED_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];
pub const PARAMS_N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// vLLM's `build_1_2_5_buckets(max_value)`: 1, 2, 5, 10, 20, 50, … up to `max_value`.
pub fn build_1_2_5_buckets(max_value: u32) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exponent = 0;
    loop {
        for m in [1.0, 2.0, 5.0] {
            let v = m * 10f64.powi(exponent);
            if v > f64::from(max_value) {
                return out;
            }
            out.push(v);
        }
        exponent += 1;
    }
}

/// vLLM's `iteration_tokens_total` buckets: 1, 8, 16, … doubling up to 16384.
pub fn iteration_token_buckets() -> Vec<f64> {
    let mut out = vec![1.0];
    let mut v = 8.0;
    while v <= 16384.0 {
        out.push(v);
        v *= 2.0;
    }
    out
}

/// An f64 kept in an atomic.
#[derive(Debug, Default)]
struct AtomicF64(AtomicU64);

impl AtomicF64 {
    fn add(&self, x: f64) {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let next = (f64::from_bits(cur) + x).to_bits();
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }

    fn set(&self, x: f64) {
        self.0.store(x.to_bits(), Ordering::Relaxed);
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// A Prometheus histogram with fixed buckets.
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<AtomicU64>,
    sum: AtomicF64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Histogram {
        Histogram {
            bounds: bounds.to_vec(),
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicF64::default(),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, x: f64) {
        if let Some(i) = self.bounds.iter().position(|b| x <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum.add(x);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Every series the emulator exports.
#[derive(Debug)]
pub struct Metrics {
    labels: String,
    pub num_requests_running: AtomicF64Gauge,
    pub num_requests_waiting: AtomicF64Gauge,
    pub kv_cache_usage_perc: AtomicF64Gauge,
    sleep_state: [AtomicF64Gauge; 3],
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub num_preemptions: AtomicU64,
    request_success: [AtomicU64; 5],
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_time_per_output_token: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
    pub request_inference_time: Histogram,
    pub request_prefill_time: Histogram,
    pub request_decode_time: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    pub request_params_max_tokens: Histogram,
    pub request_max_num_generation_tokens: Histogram,
    pub request_params_n: Histogram,
    pub iteration_tokens: Histogram,
    cache_config_labels: String,
}

/// A gauge holding an f64.
#[derive(Debug, Default)]
pub struct AtomicF64Gauge(AtomicF64);

impl AtomicF64Gauge {
    pub fn set(&self, x: f64) {
        self.0.set(x);
    }

    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

/// Which of vLLM's `sleep_state` series is 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepSeries {
    Awake,
    WeightsOffloaded,
    DiscardAll,
}

impl Metrics {
    /// Series for one engine (index 0) serving `model_name`.
    pub fn new(
        model_name: &str,
        max_model_len: u32,
        block_size: u32,
        num_gpu_blocks: usize,
        prefix_caching: bool,
    ) -> Metrics {
        let escaped = model_name.replace('\\', "\\\\").replace('"', "\\\"");
        let len_buckets = build_1_2_5_buckets(max_model_len);
        let m = Metrics {
            labels: format!("model_name=\"{escaped}\",engine=\"0\""),
            num_requests_running: AtomicF64Gauge::default(),
            num_requests_waiting: AtomicF64Gauge::default(),
            kv_cache_usage_perc: AtomicF64Gauge::default(),
            sleep_state: Default::default(),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            num_preemptions: AtomicU64::new(0),
            request_success: Default::default(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            request_time_per_output_token: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_inference_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_prompt_tokens: Histogram::new(&len_buckets),
            request_generation_tokens: Histogram::new(&len_buckets),
            request_params_max_tokens: Histogram::new(&len_buckets),
            request_max_num_generation_tokens: Histogram::new(&len_buckets),
            request_params_n: Histogram::new(PARAMS_N_BUCKETS),
            iteration_tokens: Histogram::new(&iteration_token_buckets()),
            cache_config_labels: format!(
                "block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",\
                 num_gpu_blocks=\"{num_gpu_blocks}\",engine=\"0\"",
                if prefix_caching { "True" } else { "False" }
            ),
        };
        m.set_sleep_state(SleepSeries::Awake);
        m
    }

    pub fn set_sleep_state(&self, state: SleepSeries) {
        let values = match state {
            SleepSeries::Awake => [1.0, 0.0, 0.0],
            SleepSeries::WeightsOffloaded => [0.0, 1.0, 0.0],
            SleepSeries::DiscardAll => [0.0, 0.0, 1.0],
        };
        for (g, v) in self.sleep_state.iter().zip(values) {
            g.set(v);
        }
    }

    /// Counts a finished request under vLLM's `finished_reason` label.
    pub fn request_finished(&self, reason: &str) {
        if let Some(i) = FINISHED_REASONS.iter().position(|r| *r == reason) {
            self.request_success[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The `/metrics` page.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(24 * 1024);
        self.render_gauges(&mut out);
        self.render_counters(&mut out);
        self.render_histograms(&mut out);
        header(
            &mut out,
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            "gauge",
        );
        let _ = writeln!(out, "vllm:cache_config_info{{{}}} 1.0", self.cache_config_labels);
        out
    }

    /// The gauges: requests running and waiting, the sleep state, KV-cache usage.
    fn render_gauges(&self, out: &mut String) {
        let l = &self.labels;
        gauge(
            out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            l,
            self.num_requests_running.get(),
        );
        gauge(
            out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            l,
            self.num_requests_waiting.get(),
        );
        header(
            out,
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; \
             weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "gauge",
        );
        for (name, g) in ["awake", "weights_offloaded", "discard_all"]
            .iter()
            .zip(&self.sleep_state)
        {
            let _ = writeln!(
                out,
                "vllm:engine_sleep_state{{{l},sleep_state=\"{name}\"}} {:?}",
                g.get()
            );
        }
        gauge(
            out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            l,
            self.kv_cache_usage_perc.get(),
        );
    }

    /// The counters: prefix cache, preemptions, tokens, and finished requests by reason.
    fn render_counters(&self, out: &mut String) {
        let l = &self.labels;
        counter(
            out,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            l,
            &self.prefix_cache_queries,
        );
        counter(
            out,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            l,
            &self.prefix_cache_hits,
        );
        counter(
            out,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            l,
            &self.num_preemptions,
        );
        counter(
            out,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            l,
            &self.prompt_tokens,
        );
        counter(
            out,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            l,
            &self.generation_tokens,
        );
        header(
            out,
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            "counter",
        );
        for (reason, c) in FINISHED_REASONS.iter().zip(&self.request_success) {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {:?}",
                c.load(Ordering::Relaxed) as f64
            );
        }
    }

    /// The histograms: request sizes and parameters, and the latencies of each phase.
    fn render_histograms(&self, out: &mut String) {
        let l = &self.labels;
        let hists: [(&str, &str, &Histogram); 14] = [
            (
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
                &self.request_prompt_tokens,
            ),
            (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                &self.request_generation_tokens,
            ),
            (
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                &self.iteration_tokens,
            ),
            (
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                &self.request_max_num_generation_tokens,
            ),
            (
                "vllm:request_params_n",
                "Histogram of the n request parameter.",
                &self.request_params_n,
            ),
            (
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                &self.request_params_max_tokens,
            ),
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &self.time_to_first_token,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &self.inter_token_latency,
            ),
            (
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                &self.request_time_per_output_token,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                &self.e2e_request_latency,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                &self.request_queue_time,
            ),
            (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                &self.request_inference_time,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                &self.request_prefill_time,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                &self.request_decode_time,
            ),
        ];
        for (name, help, h) in hists {
            histogram(out, name, help, l, h);
        }
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, value: f64) {
    header(out, name, help, "gauge");
    let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
}

fn counter(out: &mut String, name: &str, help: &str, labels: &str, value: &AtomicU64) {
    let total = format!("{name}_total");
    header(out, &total, help, "counter");
    let _ = writeln!(
        out,
        "{total}{{{labels}}} {:?}",
        value.load(Ordering::Relaxed) as f64
    );
}

fn histogram(out: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    header(out, name, help, "histogram");
    let mut cumulative = 0u64;
    for (bound, c) in h.bounds.iter().zip(&h.counts) {
        cumulative += c.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{bound:?}\"}} {:?}",
            cumulative as f64
        );
    }
    let count = h.count.load(Ordering::Relaxed);
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {:?}", count as f64);
    let _ = writeln!(out, "{name}_count{{{labels}}} {:?}", count as f64);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", h.sum.get());
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn one_two_five_buckets_stop_at_the_context_length() {
        assert_eq!(
            build_1_2_5_buckets(100),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(iteration_token_buckets().last(), Some(&16384.0));
        assert_eq!(iteration_token_buckets()[..3], [1.0, 8.0, 16.0]);
    }

    #[test]
    fn histograms_are_cumulative_and_count_everything() {
        let m = Metrics::new("m", 1024, 16, 100, true);
        m.time_to_first_token.observe(0.003);
        m.time_to_first_token.observe(3000.0);
        let page = m.render();
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.005\"} 1.0"
        ));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"2560.0\"} 1.0"
        ));
        assert!(page.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"0\"} 2.0"));
    }

    #[test]
    fn sleep_state_sets_exactly_one_series() {
        let m = Metrics::new("m", 1024, 16, 100, true);
        m.set_sleep_state(SleepSeries::DiscardAll);
        let page = m.render();
        assert!(page.contains("sleep_state=\"awake\"} 0.0"));
        assert!(page.contains("sleep_state=\"discard_all\"} 1.0"));
        assert!(page.contains("sleep_state=\"weights_offloaded\"} 0.0"));
    }
}

//! `vllm-emulator serve MODEL [vLLM flags] [--emu-… settings]`: a drop-in for `vllm serve`
//! without a GPU. See `docs/emulator.md`.

use std::sync::Arc;

use anyhow::Context;
use understudy_gameday::emulator::{self, EmulatorConfig, log::Log};

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let config = EmulatorConfig::from_args(&argv, std::env::vars()).context("vllm-emulator")?;
    // One thread per replica: many replicas share a small machine, and a replica is mostly asleep.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let exit = runtime
        .block_on(emulator::run(config, Arc::new(Log::stdout())))
        .context("vllm-emulator")?;
    std::process::exit(exit.code());
}

//! `vllm-emulator serve MODEL [vLLM flags] [--emu-… settings]`: a drop-in for `vllm serve`
//! without a GPU. See `docs/emulator.md`.

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let code = understudy_emulator::run_to_exit(&argv).context("vllm-emulator")?;
    std::process::exit(code);
}

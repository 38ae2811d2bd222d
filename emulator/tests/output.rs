//! What the engine says under faults that change the text, on tokio's paused clock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use understudy_emulator::EmulatorConfig;
use understudy_emulator::engine::{Engine, Event, GenerationRequest};
use understudy_emulator::faults::Fault;
use understudy_emulator::generate::{Sampling, is_model_token, tokenize};
use understudy_emulator::log::Log;

fn engine() -> Arc<Engine> {
    let argv: Vec<String> = "serve m --emu-zero-cost"
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let config = EmulatorConfig::from_args(&argv, Vec::new()).unwrap();
    config.build_engine(Arc::new(Log::new(1, Box::new(std::io::sink()))))
}

async fn tokens(e: &Arc<Engine>, prompt: &str) -> Vec<&'static str> {
    let mut g = e.generate(GenerationRequest {
        prompt: tokenize(prompt),
        max_tokens: 40,
        sampling: Sampling::Greedy,
        ignore_eos: true,
        stop: Vec::new(),
    });
    let mut out = Vec::new();
    while let Some(ev) = g.next().await {
        if let Event::Token(t) = ev {
            out.push(t);
        }
    }
    out
}

#[tokio::test(start_paused = true)]
async fn wrong_output_is_other_text_in_the_models_own_words() {
    let e = engine();
    let good = tokens(&e, "the golden prompt").await;
    e.apply_fault(&Fault::WrongOutput);
    let wrong = tokens(&e, "the golden prompt").await;
    assert_ne!(wrong, good);
    assert!(wrong.iter().all(|t| is_model_token(t)), "{wrong:?}");
    assert_eq!(
        wrong,
        tokens(&e, "the golden prompt").await,
        "still deterministic"
    );
}

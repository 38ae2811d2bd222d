//! Deterministic text: a toy tokenizer and a token source keyed on the model's identity.
//!
//! Real weights are not here, so "the model" is a hash. With `temperature: 0` (or a `seed`) the
//! same prompt under the same identity (model, served name, revision, tokenizer, weights digest)
//! gives the same tokens, and a different identity gives different ones: exactly what parity and
//! golden-output probes need to catch. Garbage (level-2 wake without `reload_weights`, or a
//! `wrong-output` fault) comes from a different vocabulary. The per-token work is one PRNG step
//! and no allocation beyond the token's text; this module must never sleep or do I/O.

use sha2::{Digest, Sha256};

/// Qwen3's vocabulary size; token ids fall below it.
pub const VOCAB_SIZE: u32 = 151_936;

const WORDS: &[&str] = &[
    " the",
    " model",
    " serves",
    " a",
    " request",
    " and",
    " then",
    " waits",
    " for",
    " tokens",
    " in",
    " order",
    " while",
    " the",
    " cache",
    " holds",
    " every",
    " prefix",
    " of",
    " each",
    " prompt",
    " so",
    " that",
    " replicas",
    " answer",
    " quickly",
    ",",
    ".",
    " when",
    " it",
    " fails",
    " over",
    " to",
    " standby",
    " pool",
    " with",
    " fresh",
    " weights",
    " on",
    " GPU",
    " memory",
    " is",
    " shared",
    " across",
    " batch",
    " steps",
    " decode",
    " prefill",
];

const GARBAGE: &[&str] = &[
    "\u{fffd}",
    " ĠĠ",
    "ĊĊ",
    " !!!!",
    "<unk>",
    " \u{a0}\u{a0}",
    " ########",
    " ,,",
    " Ã©",
    " 0x00",
    " ���",
];

/// Splits text into the emulator's tokens: words with their leading space, long words in pieces.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    let bytes = text.as_bytes();
    let mut start = 0;
    while start < bytes.len() {
        // A token is optional leading whitespace, then up to 6 non-space bytes (on a char boundary).
        let mut end = start;
        while end < bytes.len() && bytes[end].is_ascii_whitespace() {
            end += 1;
        }
        let word_start = end;
        while end < bytes.len() && !bytes[end].is_ascii_whitespace() && end - word_start < 6 {
            end += 1;
        }
        while end < bytes.len() && !text.is_char_boundary(end) {
            end += 1;
        }
        if end == start {
            end = bytes.len();
        }
        ids.push((fnv1a(&bytes[start..end]) % u64::from(VOCAB_SIZE)) as u32);
        start = end;
    }
    ids
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Who the model is, as far as its output is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    pub model: String,
    pub served_name: String,
    pub revision: Option<String>,
    pub tokenizer: Option<String>,
    pub weights_digest: Option<String>,
}

impl ModelIdentity {
    /// A 64-bit digest of everything that decides the output.
    pub fn seed(&self) -> u64 {
        let mut h = Sha256::new();
        for part in [
            Some(self.model.as_str()),
            Some(self.served_name.as_str()),
            self.revision.as_deref(),
            self.tokenizer.as_deref(),
            self.weights_digest.as_deref(),
        ] {
            h.update(part.unwrap_or("\u{0}none").as_bytes());
            h.update([0xff]);
        }
        let d = h.finalize();
        u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
    }
}

/// How a request samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// `temperature: 0`: always the same tokens for the same prompt and identity.
    Greedy,
    /// A `seed` was given: reproducible, but a different stream from greedy.
    Seeded(i64),
    /// Neither: a fresh stream every time (vLLM then uses the model's generation config).
    Random(u64),
}

/// The next tokens of one completion.
#[derive(Debug, Clone)]
pub struct TokenSource {
    state: u64,
    garbage: bool,
    ignore_eos: bool,
    emitted: u32,
}

/// One generated token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    Text(&'static str),
    /// The model chose to end (end-of-sequence).
    Eos,
}

impl TokenSource {
    pub fn new(
        identity_seed: u64,
        prompt: &[u32],
        sampling: Sampling,
        garbage: bool,
        ignore_eos: bool,
    ) -> Self {
        let mut state = identity_seed ^ 0x9e37_79b9_7f4a_7c15;
        for &t in prompt {
            state = splitmix(state ^ u64::from(t));
        }
        state = match sampling {
            Sampling::Greedy => state,
            Sampling::Seeded(s) => splitmix(state ^ (s as u64).rotate_left(17) ^ 0x5eed),
            Sampling::Random(r) => splitmix(state ^ r ^ 0xa11ce),
        };
        TokenSource {
            state,
            garbage,
            ignore_eos,
            emitted: 0,
        }
    }

    /// The next token; an end-of-sequence comes with probability 1/40 after the first token.
    pub fn next_token(&mut self) -> Token {
        self.state = splitmix(self.state);
        let r = self.state;
        self.emitted += 1;
        if !self.ignore_eos && self.emitted > 1 && (r >> 40).is_multiple_of(40) {
            return Token::Eos;
        }
        let vocab = if self.garbage { GARBAGE } else { WORDS };
        Token::Text(vocab[(r % vocab.len() as u64) as usize])
    }
}

/// Whether `token` is one the emulated model says (not the garbage of unloaded weights).
pub fn is_model_token(token: &str) -> bool {
    WORDS.contains(&token)
}

/// The seed of the `wrong-output` fault: the model's vocabulary, fluent-looking, from another
/// stream than the model's own.
pub fn wrong_output_seed(identity_seed: u64) -> u64 {
    splitmix(identity_seed ^ 0x0bad_0a75_7e57_0000)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn identity() -> ModelIdentity {
        ModelIdentity {
            model: "Qwen/Qwen3-0.6B".into(),
            served_name: "qwen".into(),
            revision: None,
            tokenizer: None,
            weights_digest: None,
        }
    }

    fn text(seed: u64, prompt: &str, sampling: Sampling, garbage: bool) -> String {
        let mut src = TokenSource::new(seed, &tokenize(prompt), sampling, garbage, true);
        (0..12)
            .map(|_| match src.next_token() {
                Token::Text(t) => t,
                Token::Eos => "",
            })
            .collect()
    }

    #[test]
    fn greedy_text_depends_only_on_prompt_and_identity() {
        let seed = identity().seed();
        assert_eq!(
            text(seed, "hello", Sampling::Greedy, false),
            text(seed, "hello", Sampling::Greedy, false)
        );
        assert_ne!(
            text(seed, "hello", Sampling::Greedy, false),
            text(seed, "hullo", Sampling::Greedy, false)
        );
        let drifted = ModelIdentity {
            weights_digest: Some("sha256:abc".into()),
            ..identity()
        };
        assert_ne!(
            text(seed, "hello", Sampling::Greedy, false),
            text(drifted.seed(), "hello", Sampling::Greedy, false)
        );
        let revised = ModelIdentity {
            revision: Some("v2".into()),
            ..identity()
        };
        assert_ne!(seed, revised.seed());
    }

    #[test]
    fn garbage_shares_no_words_with_the_model() {
        let seed = identity().seed();
        let bad = text(seed, "hello", Sampling::Greedy, true);
        assert!(
            WORDS
                .iter()
                .all(|w| !bad.contains(w.trim()) || w.trim().len() < 2),
            "{bad}"
        );
    }

    #[test]
    fn tokenizing_counts_words_and_splits_long_ones() {
        assert_eq!(tokenize("The capital of France").len(), 5);
        assert_eq!(tokenize("").len(), 0);
        // Long words split by characters, not bytes: accents do not change the count.
        assert_eq!(tokenize("héllo wörld").len(), tokenize("hello world").len());
    }
}

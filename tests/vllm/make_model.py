"""Makes the tiny model the real-vLLM tier serves: no model hub is reachable from the test machines.

A random Llama of 2 layers, hidden size 128 and 2 attention heads over 1 KV head (head dim 64,
which the CPU attention supports; 16 is refused at the first request), in float32 (vLLM's
bfloat16 CPU kernels died of SIGILL on the test machines, so the tier serves it with `--dtype
float32`), and a byte-level BPE tokenizer trained on a fixed text, with a chat template.
Deterministic: the same seed and text give the same files, so the tier's answers and digests do
not change between machines.

    python make_model.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

NAME = "understudy-tiny-llama"
CONTEXT = 512
# A fixed text to learn merges from: the words the probes and tests send, and a few more.
TEXT = """
The quick brown fox jumps over the lazy dog. Say hello. Count from one to ten: one two three four
five six seven eight nine ten. What is the capital of France? Paris is the capital of France.
A standby pool takes over when the primary pool fails. The router sends each request to a replica.
Reply with the word ready. Ready. Please answer in one short sentence. The model is loaded.
"""
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([TEXT] * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(out: Path) -> None:
    torch.manual_seed(0)
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights would answer single bytes and control characters; silencing every token
        # that is not a learnt merge of printable text (the bytes and the special tokens, the end
        # of text among them) makes greedy answers readable word pieces that run to max_tokens.
        head = model.lm_head.weight
        for token, index in tok.get_vocab().items():
            word = tok.convert_tokens_to_string([token])
            if token in SPECIAL or len(word.strip()) < 2 or not word.isprintable():
                head[index].zero_()
            else:
                head[index].mul_(4.0)
    model.generation_config.do_sample = False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"{NAME}: {sum(p.numel() for p in model.parameters())} parameters, vocabulary {len(tok)}, in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))

"""A synthetic reasoning task with verifiable answers, built in code for the CPU demo and the end-to-end tests.

Problems are "a+b=" for single digits a, b; the answer is the decimal digits of a+b followed by EOS. The vocabulary
is 16 characters, so a tiny Qwen2-shaped model (hidden 64, 2 layers) can learn it on a CPU in minutes.
"""
from __future__ import annotations

from typing import Sequence

from .records import PromptSample

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SYMBOLS = "0123456789+="
_FIRST_SYMBOL_ID = 3
VOCAB_SIZE = 16


class CharTokenizer:
    """Character tokenizer of the synthetic tasks (implements the data.tokenizer.Tokenizer protocol's core): PAD,
    BOS, EOS, then one id per symbol; `vocab_size` may exceed the ids used (the model's embedding rows)."""

    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    bos_token_id = BOS_ID

    def __init__(self, symbols: str = _SYMBOLS, vocab_size: int = VOCAB_SIZE):
        if _FIRST_SYMBOL_ID + len(symbols) > vocab_size:
            raise ValueError(f"{len(symbols)} symbols do not fit a vocabulary of {vocab_size}")
        self.symbols, self.vocab_size = symbols, vocab_size

    def encode(self, text: str) -> list[int]:
        bad = sorted(set(text) - set(self.symbols))
        if bad:
            raise ValueError(f"characters {bad} are not in the synthetic vocabulary {self.symbols!r}")
        return [_FIRST_SYMBOL_ID + self.symbols.index(c) for c in text]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        out = []
        for t in token_ids:
            if t >= _FIRST_SYMBOL_ID and t - _FIRST_SYMBOL_ID < len(self.symbols):
                out.append(self.symbols[t - _FIRST_SYMBOL_ID])
            elif t == EOS_ID and not skip_special_tokens:
                out.append("</s>")
        return "".join(out)


def addition_problems(max_operand: int = 9) -> list[PromptSample]:
    """All (max_operand+1)^2 problems "a+b=" as tokenized prompts (BOS first); answers are decimal strings."""
    tok = CharTokenizer()
    samples = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            ids = (BOS_ID, *tok.encode(f"{a}+{b}="))
            samples.append(PromptSample(index=len(samples), id=f"add-{a}-{b}", prompt_token_ids=ids,
                                        answer=str(a + b)))
    return samples


def answer_token_ids(answer: str) -> list[int]:
    """The reference response of a problem: its digits, then EOS (the supervised warm-start's target)."""
    return CharTokenizer().encode(answer) + [EOS_ID]


def exact_match_reward(response: str, reference: str) -> float:
    """1.0 when the response is exactly the reference digits followed by EOS (as decoded by CharTokenizer)."""
    return 1.0 if response == reference + "</s>" else 0.0


def tiny_model_hf_config(vocab_size: int = VOCAB_SIZE) -> dict:
    """The Qwen2 config.json of the synthetic tasks' model (random init; head_dim 16; 64 positions; the vocabulary
    padded to 1024 in megatron); `vocab_size`: the task's character vocabulary."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab_size, "tie_word_embeddings": False,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
        "use_sliding_window": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    }

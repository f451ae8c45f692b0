"""Tokenizers trained here (nothing is downloaded): a HF tokenizer directory with Qwen2.5's chat markup, for the
tokenizer, data, evaluation, vLLM and trainer tests."""
from __future__ import annotations

import json
import os


# Qwen2.5's chat template, without its tool-calling branches.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


CORPUS = [
    "Solve the following math problem step by step. What is $1 + 1$? The answer is $\\boxed{2}$.",
    "Let $x$ be a real number with $x^2 = 4$. Then $x = \\pm 2$, so Answer: 2",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The sum of the first $n$ odd numbers is $n^2$, and $\\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}$.",
]


def build_hf_tokenizer_dir(directory: str, *, with_pad: bool = True, with_chat_template: bool = True,
                           vocab_size: int = 400, corpus: list[str] | None = None) -> str:
    """A byte-level BPE tokenizer (at most `vocab_size` ids: SPECIAL_TOKENS are 0, 1, 2) trained on `corpus`
    (default: CORPUS) saved as a HF tokenizer directory with Qwen2.5 chat markup."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20 if corpus is None else corpus, trainer)
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "model_max_length": 32768}
    if with_pad:
        config["pad_token"] = "<|endoftext|>"
    if with_chat_template:
        config["chat_template"] = QWEN25_CHAT_TEMPLATE
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return directory

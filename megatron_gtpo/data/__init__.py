"""Prompt data: records from jsonl/parquet, bundled eval sets, prompt templates, tokenizers, RL batching.

    records = load_dataset("/data/dapo_math_17k.jsonl")                  # or "math500", "aime24", "aime25"
    tokenizer = load_tokenizer("/models/Qwen2.5-7B")
    samples = tokenize_prompts(records, tokenizer, DAPO_TEMPLATE)
    loader = PromptLoader(samples, prompts_per_step=512, dp_rank=r, dp_size=d, seed=1)
"""
from megatron_gtpo.data.datasets import EVAL_SET_NAMES, EVAL_SETS_DIR, load_dataset, repair_control_characters
from megatron_gtpo.data.loader import PromptBatch, PromptLoader
from megatron_gtpo.data.records import FieldMapping, PromptRecord, PromptSample, load_prompt_records
from megatron_gtpo.data.templates import (
    BOXED_SUFFIX,
    BOXED_TEMPLATE,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    DAPO_TEMPLATE,
    PROMPT_STYLES,
    PromptTemplate,
    tokenize_prompts,
)
from megatron_gtpo.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    render_plain_chat,
)

__all__ = [
    "BOXED_SUFFIX",
    "BOXED_TEMPLATE",
    "DAPO_PREFIX",
    "DAPO_SUFFIX",
    "DAPO_TEMPLATE",
    "EVAL_SETS_DIR",
    "EVAL_SET_NAMES",
    "FieldMapping",
    "HFTokenizer",
    "PROMPT_STYLES",
    "PromptBatch",
    "PromptLoader",
    "PromptRecord",
    "PromptSample",
    "PromptTemplate",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_dataset",
    "load_prompt_records",
    "load_tokenizer",
    "render_plain_chat",
    "repair_control_characters",
    "tokenize_prompts",
]

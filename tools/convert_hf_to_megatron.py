"""Hugging Face Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE (safetensors) -> megatron_gtpo distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir HF --output-dir MG [--tp N --pp M --dtype bfloat16 --force]

Streams tensor by tensor in one process (no GPUs, no torch.distributed). The checkpoint loads at any TP/PP
(`python -m megatron_gtpo.score --load MG`, the trainer's --load); --tp/--pp are checked against the model and set
how the data is chunked on disk. Tokenizer and generation-config files are copied along (a warning when there are
none: train, score and evaluate need them). The output directory appears only when complete (its parent folder is
created); an existing one is replaced only with --force.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_gtpo.cli import check_conversion_paths, run_cli

DTYPES = ("bfloat16", "float16", "float32")  # checkpoint.megatron_checkpoint.WEIGHT_DTYPES, named before torch loads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--output-dir", required=True, help="megatron_gtpo checkpoint directory to create")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to write for (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to check against (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="cast the weights (default: keep each tensor's dtype)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_conversion_paths("--hf-dir", args.hf_dir, args.output_dir, force=args.force)
    from megatron_gtpo.checkpoint.hf_import import convert_hf_to_megatron
    from megatron_gtpo.checkpoint.megatron_checkpoint import HF_FILES_DIR, WEIGHT_DTYPES
    from megatron_gtpo.data.tokenizer import TOKENIZER_FILES

    meta = convert_hf_to_megatron(args.hf_dir, args.output_dir, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                                  dtype=WEIGHT_DTYPES[args.dtype] if args.dtype else None, force=args.force,
                                  progress=not args.quiet)
    tokenizer_dir = os.path.join(args.output_dir, HF_FILES_DIR)
    if not any(os.path.isfile(os.path.join(tokenizer_dir, name)) for name in TOKENIZER_FILES):
        print(f"warning: {args.hf_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}), so neither has "
              f"{args.output_dir}: copy the model's tokenizer files into {tokenizer_dir} before training, scoring or "
              f"evaluating it", file=sys.stderr)
    print(f"wrote {args.output_dir}: {meta.hf_config['model_type']}, {meta.shape.num_layers} layers, vocab "
          f"{meta.vocab_size} (padded {meta.padded_vocab_size}), {meta.dtype}, checked and chunked for --tp "
          f"{meta.tensor_parallel} --pp {meta.pipeline_parallel} (it loads at any TP/PP)")
    return 0


if __name__ == "__main__":
    run_cli("convert_hf_to_megatron", main)

"""megatron_gtpo checkpoint (converter or trainer output, any TP/PP, with or without optimizer state) -> Hugging Face
Qwen2 / Qwen3 / Qwen3-MoE directory.

    python tools/convert_megatron_to_hf.py --megatron-dir MG --output-dir HF2 [--max-shard-size 5GB --dtype ...
                                           --force]

Streams tensor by tensor in one process. Writes sharded safetensors (with model.safetensors.index.json when there is
more than one file), config.json, generation_config.json and the tokenizer files kept in the checkpoint (where it
holds none, it says so and why); the result loads with transformers.AutoModelForCausalLM.from_pretrained. The output
directory appears only when complete; an existing one is replaced only with --force.
"""
from __future__ import annotations

import argparse

from megatron_gtpo.cli import check_conversion_paths, run_cli

DTYPES = ("bfloat16", "float16", "float32")  # checkpoint.megatron_checkpoint.WEIGHT_DTYPES, named before torch loads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-dir", required=True, help="megatron_gtpo checkpoint directory")
    p.add_argument("--output-dir", required=True, help="Hugging Face model directory to create")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB; default 5GB)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="cast the weights (default: keep the stored dtype)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_conversion_paths("--megatron-dir", args.megatron_dir, args.output_dir, force=args.force)
    from megatron_gtpo.checkpoint.megatron_checkpoint import WEIGHT_DTYPES
    from megatron_gtpo.checkpoint.hf_export import convert_megatron_to_hf, parse_size
    from megatron_gtpo.checkpoint.sources import ModelSource

    files = convert_megatron_to_hf(args.megatron_dir, args.output_dir, max_shard_bytes=parse_size(args.max_shard_size),
                                   dtype=WEIGHT_DTYPES[args.dtype] if args.dtype else None, force=args.force,
                                   progress=not args.quiet)
    print(f"wrote {args.output_dir}: {len(files)} safetensors file(s)")
    source = ModelSource.detect(args.megatron_dir, what="--megatron-dir")
    if source.missing_tokenizer():
        evaluate = f"; evaluate the checkpoint on its task with python -m megatron_gtpo.evaluate --model " \
                   f"{source.path} --output-dir DIR" if source.synthetic_task else ""
        print(f"no tokenizer written: {source.missing_tokenizer()}{evaluate}")
    return 0


if __name__ == "__main__":
    run_cli("convert_megatron_to_hf", main)

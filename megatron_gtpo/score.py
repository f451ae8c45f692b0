"""Per-token log-probs and entropies of given token ids under a checkpoint, at any TP/PP.

    torchrun --nproc_per_node N -m megatron_gtpo.score (--hf HF_DIR | --load MEGATRON_DIR) \
        --input IN.jsonl --output OUT.jsonl [--tp T --pp P --cp C --micro-batch-size B --temperature 1.0]

Each input line is {"token_ids": [...]}; each output line {"logprobs": [...], "entropy": [...]} with L-1 entries:
logprobs[k] = log p(token_ids[k+1] | token_ids[:k+1]), entropy[k] = entropy of that next-token distribution (over
the true vocabulary, at the given temperature). Context parallelism (--cp) splits every sequence over C ranks.
Data-parallel replicas (world / (TP*PP*CP) of them) score disjoint slices. The output file appears only when complete
(written to a temporary name, then renamed).
"""
from __future__ import annotations

import json
import os
import sys

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.cli import ArgumentParser, run_cli


def read_token_ids(path: str, *, vocab_size: int, max_positions: int) -> list[list[int]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path!r} does not exist")
    sequences = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["token_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a 'token_ids' list ({e})") from e
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{path}:{line_no}: 'token_ids' must be a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{path}:{line_no}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
            if len(ids) > max_positions:
                raise ValueError(f"{path}:{line_no}: {len(ids)} tokens exceed the model's max positions "
                                 f"{max_positions}")
            sequences.append(ids)
    if not sequences:
        raise ValueError(f"{path}: no sequences")
    return sequences


def write_jsonl_atomically(path: str, rows: list[dict]) -> None:
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m megatron_gtpo.score", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="Hugging Face Qwen2 / Qwen3 model directory (safetensors)")
    src.add_argument("--load", help="megatron_gtpo distributed checkpoint directory (converter or trainer output)")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size (each sequence split over CP ranks)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk in the log-prob/entropy op")
    return p.parse_args(argv)


def _model_source(args):
    """(hf config dict, loader(model_chunks, parallel)) for --hf or --load."""
    from megatron_gtpo.checkpoint.sources import ModelSource

    given = "--hf" if args.hf else "--load"
    source = ModelSource.detect(args.hf or args.load, what=given)
    if source.is_megatron_checkpoint != bool(args.load):
        flag = "--load" if source.is_megatron_checkpoint else "--hf"
        raise ValueError(f"{given}: {source.path!r} is a "
                         f"{'megatron_gtpo checkpoint' if args.hf else 'Hugging Face directory'}: pass it with {flag} "
                         f"instead ({flag} {source.path})")
    return source.hf_config(), source.load_into


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_gtpo.models.qwen import ModelShape

    hf_config, load_weights = _model_source(args)
    shape = ModelShape.from_hf(hf_config)
    sequences = read_token_ids(args.input, vocab_size=shape.vocab_size, max_positions=shape.max_position_embeddings)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"output directory {out_dir!r} does not exist")

    import torch.distributed as dist

    from megatron_gtpo.distributed import destroy_parallel, initialize_parallel
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import forward_logprobs_and_entropy, make_micro_batches

    parallel = initialize_parallel(args.tp, args.pp, sequence_parallel=args.sequence_parallel,
                                   context_parallel=args.cp)
    chunks = build_model(hf_config, tensor_parallel=args.tp, pipeline_parallel=args.pp, pp_rank=parallel.pp_rank,
                         sequence_parallel=args.sequence_parallel, context_parallel=args.cp)
    load_weights(chunks, parallel)

    my_indices = list(range(parallel.dp_rank, len(sequences), parallel.dp_size))
    mine = [sequences[i] for i in my_indices]
    rows = []
    if mine:  # a DP replica with nothing to score skips the schedule (all its ranks agree on that)
        micro_batches = make_micro_batches(mine, args.micro_batch_size, device=parallel.device,
                                           pad_to_multiple=parallel.sequence_multiple)
        outputs = forward_logprobs_and_entropy(chunks, micro_batches, parallel, vocab_size=shape.vocab_size,
                                                  temperature=args.temperature, chunk_size=args.chunk_size)
        for mb, (logprobs_BL, entropy_BL) in zip(micro_batches, outputs):
            logprobs_BL, entropy_BL = logprobs_BL.cpu(), entropy_BL.cpu()  # the results leave the device once
            for b, length in enumerate(mb.lengths_B.tolist()):
                rows.append({"logprobs": logprobs_BL[b, :length - 1].tolist(),
                             "entropy": entropy_BL[b, :length - 1].tolist()})
    if parallel.is_last_stage and parallel.tp_rank == 0 and parallel.cp_rank == 0:  # CP ranks hold the same rows
        gathered = [None] * parallel.dp_size
        dist.all_gather_object(gathered, list(zip(my_indices, rows)), group=parallel.dp_group)
        if parallel.dp_rank == 0:
            by_index = dict(pair for part in gathered for pair in part)
            write_jsonl_atomically(args.output, [by_index[i] for i in range(len(sequences))])
            print(f"wrote {args.output}: per-token log-probs and entropies of {len(sequences)} sequences",
                  file=sys.stderr)
    dist.barrier()
    destroy_parallel()
    return 0


if __name__ == "__main__":
    run_cli("megatron_gtpo.score", main)

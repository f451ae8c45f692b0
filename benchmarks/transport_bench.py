"""Responses from the rank that generated them to the other ranks of a model replica: tensors (rollout/transport.py)
against the pickled Python lists of `broadcast_object_list` (the path it replaced), in one run.

    torchrun --nproc_per_node 2 benchmarks/transport_bench.py [--prompts 128] [--samples 16] [--tokens 4096]
        [--rounds 3] [--output benchmarks/results/transport.md]

The batch: --prompts x --samples responses of --tokens tokens each (random ids and log-probs; finish reason
"length").
Candidates: "tensors" and "pickled" are timed end to end, from the source's list of `Response` objects to every rank
holding its own list (encoding, the broadcast, decoding); "tensor wire only" is the tensor path's broadcasts of the
already encoded tensors (what remains when producer and consumer keep tensors). Times are the slowest rank's,
median over --rounds after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from megatron_gtpo.rollout.engine import FINISH_LENGTH, Response
from megatron_gtpo.rollout.transport import broadcast_responses, responses_to_tensors

WIRE_SIZES = [0, 0]  # elements of the encoded tensors, for the receiving side of `wire`


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def make_batch(prompts: int, n: int, tokens: int) -> list[list[Response]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151_936, (prompts * n, tokens), generator=gen).tolist()
    logprobs = (-torch.rand(prompts * n, tokens, generator=gen)).tolist()
    return [[Response(ids[i * n + j], logprobs[i * n + j], FINISH_LENGTH) for j in range(n)] for i in range(prompts)]


def pickled(outcome):
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tensors(outcome):
    return broadcast_responses(outcome, 0, dist.group.WORLD, torch.device("cpu"))


def wire(encoded):
    """The tensor path's broadcasts alone (already encoded, not decoded): what the transport itself costs."""
    ints, logprobs_T = encoded if encoded is not None else (torch.empty(WIRE_SIZES[0], dtype=torch.int32),
                                                            torch.empty(WIRE_SIZES[1], dtype=torch.float32))
    dist.broadcast(ints, src=0)
    dist.broadcast(logprobs_T, src=0)
    return None


def timed(fn, outcome, rounds: int) -> tuple[float, object]:
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        result = fn(outcome)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times[1:]), result


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = make_batch(args.prompts, args.samples, args.tokens) if rank == 0 else None
    outcome = ("ok", batch) if rank == 0 else None
    encoded = responses_to_tensors(batch) if rank == 0 else None
    sizes = torch.tensor([0, 0] if encoded is None else [e.numel() for e in encoded])
    dist.broadcast(sizes, src=0)
    WIRE_SIZES[:] = sizes.tolist()
    rows = []
    for name, fn, arg in [("tensors", tensors, outcome), ("pickled", pickled, outcome),
                          ("tensor wire only", wire, encoded)]:
        seconds, result = timed(fn, arg, args.rounds)
        if rank == 1 and result is not None:  # the receiver got the batch (log-probs: float32 in the tensor path)
            reference = make_batch(args.prompts, args.samples, args.tokens)
            got = result[1]
            assert [[r.token_ids for r in rs] for rs in got] == [[r.token_ids for r in rs] for rs in reference]
            assert max(abs(a - b) for rs, qs in zip(got, reference) for r, q in zip(rs, qs)
                       for a, b in zip(r.logprobs, q.logprobs)) < 1e-6
        rows.append((name, seconds))
        del result
    if rank == 0:
        tokens = args.prompts * args.samples * args.tokens
        base = dict(rows)["pickled"]
        lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}", "",
                 f"Command: `torchrun --nproc_per_node {dist.get_world_size()} benchmarks/transport_bench.py "
                 f"--prompts {args.prompts} --samples {args.samples} --tokens {args.tokens} "
                 f"--rounds {args.rounds}`", "",
                 f"Batch: {args.prompts} x {args.samples} responses x {args.tokens} tokens = {tokens / 1e6:.1f} M "
                 f"tokens; {dist.get_world_size()} ranks; {args.rounds} timed rounds.",
                 f"Device: CPU ({platform.machine()}, {os.cpu_count()} cores); torch {torch.__version__}; gloo.", "",
                 "| path | median s | M tokens/s | / pickled |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {s:.2f} | {tokens / s / 1e6:.2f} | {s / base:.3f} |" for name, s in rows]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.output:
            with open(args.output, "a") as f:
                f.write("\n" + text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A rollout's responses from the engine that produced them to the step batch on every rank of its model replica: the
rollout record (rollout/responses.py, rollout/transport.py, training/step_batch.py) against the pickled Python lists
of `broadcast_object_list` (the path the tensor transport replaced), in one run.

    torchrun --nproc_per_node 2 benchmarks/transport_bench.py [--prompts 128] [--samples 16] [--tokens 4096]
        [--prompt-tokens 128] [--micro-batch-size 8] [--rounds 3] [--warmup 3]
        [--output benchmarks/results/transport.md]

The batch: --prompts x --samples responses of --tokens tokens each (random ids and log-probs; finish reason
"length"), prompts of --prompt-tokens tokens. Candidates, each timed from what rank 0's engine produced to what
every rank holds at the end:
- "record -> step batch" (the trainer's path): the engine's record (host tensors, as a vLLM server returns it)
  broadcast by `broadcast_responses`, then `build_step_batch` on every rank: the [S, T] rollout log-probs and mask,
  the [S, L] token rows and the inputs of every micro-batch of a one-mini-batch plan of --micro-batch-size
  sequences, what the old-policy pass and the update consume;
- "pickled" (the baseline): the same responses as `Response` lists through `broadcast_object_list`, to a `Response`
  list on every rank. It stops there: building a step batch from those lists would come on top;
- "record wire only" and "step batch only": the two parts of the first candidate alone (the record's broadcasts;
  `build_step_batch` from a record already on the rank).
Times are the slowest rank's, median over --rounds after --warmup rounds: a trainer runs its step many times, and
the first calls of each candidate pay one-time costs (on this CPU the allocator's heap growing to the step batch's
size made the first 2-3 rounds of the tensor path 2-5x slower).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from megatron_gtpo.data.records import PromptSample
from megatron_gtpo.distributed import ParallelGroups
from megatron_gtpo.rollout.engine import Rollout
from megatron_gtpo.rollout.responses import FINISH_LENGTH, FINISH_LENGTH_CODE, Response, Responses
from megatron_gtpo.rollout.transport import broadcast_responses
from megatron_gtpo.training.experience import RewardedGroups
from megatron_gtpo.training.sampled_groups import SampledGroups
from megatron_gtpo.training.step_batch import build_step_batch

CPU = torch.device("cpu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def make_batch(args) -> tuple[list[tuple[int, ...]], torch.Tensor, torch.Tensor]:
    """(prompts, token ids [R, tokens], log-probs [R, tokens]): the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [tuple(p) for p in torch.randint(0, 151_936, (args.prompts, args.prompt_tokens), generator=gen).tolist()]
    ids_RN = torch.randint(0, 151_936, (args.prompts * args.samples, args.tokens), generator=gen)
    logprobs_RN = -torch.rand(args.prompts * args.samples, args.tokens, generator=gen)
    return prompts, ids_RN, logprobs_RN


def engine_record(args, ids_RN, logprobs_RN) -> Responses:
    R = ids_RN.shape[0]
    return Responses(responses_per_prompt_P=torch.full((args.prompts,), args.samples),
                     lengths_R=torch.full((R,), args.tokens), finish_R=torch.full((R,), FINISH_LENGTH_CODE),
                     token_ids_T=ids_RN.flatten().to(torch.int32), logprobs_T=logprobs_RN.flatten(),
                     weight_updates_T=torch.zeros(ids_RN.numel(), dtype=torch.int32))


def engine_lists(args, ids_RN, logprobs_RN) -> list[list[Response]]:
    ids, logprobs, n = ids_RN.tolist(), logprobs_RN.tolist(), args.samples
    return [[Response(ids[i * n + j], logprobs[i * n + j], FINISH_LENGTH) for j in range(n)]
            for i in range(args.prompts)]


def step_batch(args, prompts, record):
    samples = [PromptSample(i, str(i), ids, "") for i, ids in enumerate(prompts)]
    correct = torch.zeros(args.prompts, args.samples)
    kept = RewardedGroups(SampledGroups.sampled(samples, Rollout(record), 0), correct, correct.clone())
    return build_step_batch(kept, ParallelGroups.data_parallel_rank(None, CPU),
                            mini_batches=[list(range(args.prompts))], max_sequences=args.micro_batch_size,
                            max_tokens=None)


def timed(fn, rounds: int, warmup: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(warmup + rounds):
        result = None  # the previous round's result is gone, as the trainer's previous step batch is
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times[warmup:]), result


def check(args, name: str, result, prompts, ids_RN, logprobs_RN) -> None:
    """What a rank holds at the end equals what the engine produced."""
    if name == "pickled":
        got = [r for rs in result[1] for r in rs]
        assert [r.token_ids for r in got] == ids_RN.tolist() and [r.logprobs for r in got] == logprobs_RN.tolist()
    elif name == "record wire only":
        record = result[1]
        assert torch.equal(record.token_ids_T, ids_RN.flatten().to(torch.int32))
        assert torch.equal(record.logprobs_T, logprobs_RN.flatten())
    else:
        assert torch.equal(result.rollout_logprobs_ST, logprobs_RN) and bool(result.mask_ST.all())
        first = result.plan[0][0]
        for b, s in enumerate(first.rows):
            expected = list(prompts[s // args.samples]) + ids_RN[s].tolist()
            assert first.inputs.tokens_BL[b, :len(expected)].tolist() == expected


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    prompts, ids_RN, logprobs_RN = make_batch(args)
    record = engine_record(args, ids_RN, logprobs_RN) if rank == 0 else None
    lists = engine_lists(args, ids_RN, logprobs_RN) if rank == 0 else None
    outcome = ("ok", record) if rank == 0 else None
    received = broadcast_responses(outcome, 0, dist.group.WORLD, CPU)[1]

    def record_to_step_batch():
        return step_batch(args, prompts, broadcast_responses(outcome, 0, dist.group.WORLD, CPU)[1])

    def pickled():
        box = [("ok", lists)]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    candidates = [("record -> step batch", record_to_step_batch), ("pickled", pickled),
                  ("record wire only", lambda: broadcast_responses(outcome, 0, dist.group.WORLD, CPU)),
                  ("step batch only", lambda: step_batch(args, prompts, received))]
    rows = []
    for name, fn in candidates:
        seconds, result = timed(fn, args.rounds, args.warmup)
        if rank == 1:
            check(args, name, result, prompts, ids_RN, logprobs_RN)
        rows.append((name, seconds))
        del result
    if rank == 0:
        tokens = args.prompts * args.samples * args.tokens
        base = dict(rows)["pickled"]
        lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}", "",
                 f"Command: `torchrun --nproc_per_node {dist.get_world_size()} benchmarks/transport_bench.py "
                 f"--prompts {args.prompts} --samples {args.samples} --tokens {args.tokens} "
                 f"--prompt-tokens {args.prompt_tokens} --micro-batch-size {args.micro_batch_size} "
                 f"--rounds {args.rounds} --warmup {args.warmup}`", "",
                 f"Batch: {args.prompts} x {args.samples} responses x {args.tokens} tokens = {tokens / 1e6:.1f} M "
                 f"tokens, prompts of {args.prompt_tokens} tokens; {dist.get_world_size()} ranks; {args.rounds} "
                 f"timed rounds after {args.warmup} warm-up rounds.",
                 f"Device: CPU ({platform.machine()}, {os.cpu_count()} cores); torch {torch.__version__}; gloo.", "",
                 "| path | median s | M tokens/s | / pickled |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {s:.3f} | {tokens / s / 1e6:.1f} | {s / base:.3f} |" for name, s in rows]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.output:
            with open(args.output, "a") as f:
                f.write("\n" + text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What context parallelism (CP) costs on CPU / gloo, and what it saves on a GPU by the planner's arithmetic.

    .venv/bin/python benchmarks/context_parallel_bench.py [--tokens 4096 --repeats 3 --out results.md]

Time: one long sequence (--tokens) of the tiny synthetic Qwen2 (megatron_gtpo.data.synthetic, its positions raised
to the sequence length; random weights, saved by the first run and loaded by the others) through the same code the
trainer runs, at CP = 1 (one process) with 2 threads and with 1, and at CP = 2 (two gloo processes of 1 thread: the
same 2 cores), each CP rank holding its load-balanced half of the row (distributed/context_parallel.py):
  forward+backward   model_forward on the rank's positions (the all-gather attention of the local spec), the
                     vocab-parallel log-probs and entropies gathered over CP, and the backward of their sum
  logprob pass       forward_logprobs_and_entropy (the old-policy / scoring pass, no autograd)
Per phase: wall clock of the slowest rank, min and median over --repeats after one warm-up; the ratios CP = 2 /
CP = 1 of the minima, and CP = 2 against a perfect split of the 1-thread CP = 1 run (what CP adds to each rank's
half of the work); the largest difference of the CP = 2 log-probs from CP = 1's (they must agree).

Memory: the planner's (megatron_gtpo.planning) per-GPU training peak of the Qwen2.5-32B paper-length recipe
(examples/qwen2.5-32b-dapo-20k.yaml) at CP = 2 and CP = 1 on the same 32 GPUs, with and without recompute.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from megatron_gtpo.distributed import free_local_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "examples/qwen2.5-32b-dapo-20k.yaml"


def _model_config(tokens: int) -> dict:
    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    return {**tiny_model_hf_config(), "max_position_embeddings": tokens}


RUNS = (("CP=1, 2 threads", 1, 2), ("CP=1, 1 thread", 1, 1), ("CP=2, 1 thread per rank", 2, 1))  # label, CP, threads


def _rank_main(rank, cp, threads, port, args, weights_path, result_queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cp),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    from megatron_gtpo.distributed import destroy_parallel, initialize_parallel
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import (forward_logprobs_and_entropy, make_micro_batches, model_forward,
                                                next_token_logprobs_and_entropy, on_context_rank)

    groups = initialize_parallel(1, 1, context_parallel=cp, backend="gloo")
    hf = _model_config(args.tokens)
    model = build_model(hf, tensor_parallel=1, pipeline_parallel=1, pp_rank=0, context_parallel=cp)[0]
    if not os.path.exists(weights_path):
        torch.save(model.state_dict(), weights_path)
    else:
        model.load_state_dict(torch.load(weights_path, weights_only=True))
    row = torch.randint(3, hf["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    mb = make_micro_batches([row], 1, device=groups.device, pad_to_multiple=2 * cp)[0]

    def train_step():
        model.train()
        logits = model_forward(model, on_context_rank(mb, groups), local_attention=True)
        logprobs, entropy = next_token_logprobs_and_entropy(logits, mb.tokens_BL, groups, vocab_size=hf["vocab_size"])
        model.zero_grad(set_to_none=True)
        (logprobs[:, :-1].sum() + 0.1 * entropy[:, :-1].sum()).backward()

    def logprob_pass():
        return forward_logprobs_and_entropy([model], [mb], groups, vocab_size=hf["vocab_size"])[0][0]

    times = {}
    for name, step in (("forward+backward", train_step), ("logprob pass", logprob_pass)):
        seconds = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            torch.distributed.barrier()
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        times[name] = seconds[1:]
    result_queue.put((rank, times, logprob_pass()))
    destroy_parallel()


def _run(cp: int, threads: int, args, weights_path: str) -> tuple[dict, torch.Tensor]:
    """Per phase, the slowest rank's seconds per repeat; and the log-probs of the row (every rank has them whole)."""
    ctx = mp.get_context("spawn")
    result_queue = ctx.SimpleQueue()
    port = free_local_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, cp, threads, port, args, weights_path, result_queue))
             for rank in range(cp)]
    for p in procs:
        p.start()
    per_rank = [result_queue.get() for _ in range(cp)]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a CP={cp} rank exited with {p.exitcode}")
    slowest = {name: [max(r[1][name][i] for r in per_rank) for i in range(args.repeats)] for name in per_rank[0][1]}
    return slowest, per_rank[0][2]


def _planner_rows() -> list[tuple[str, dict]]:
    """The recipe's plan (its layout, on 4 nodes) at CP = 2 and at CP = 1 (DP = 2 on the same 32 GPUs), with and
    without recompute."""
    from megatron_gtpo.config import load_config
    from megatron_gtpo.layout import ParallelLayout
    from megatron_gtpo.models.presets import hf_config
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import plan, settings_from_config, workload_from_config

    cfg = load_config(os.path.join(REPO, RECIPE))
    shape, p = ModelShape.from_hf(hf_config("qwen2.5-32b")), cfg.parallel
    workload, settings = workload_from_config(cfg), settings_from_config(cfg)
    rows = []
    for cp in (2, 1):
        layout = ParallelLayout(tensor=p.tensor, pipeline=p.pipeline, data=32 // (p.tensor * p.pipeline * cp),
                                sequence_parallel=p.sequence_parallel, context=cp)
        for recompute in (False, True):
            result = plan(shape, layout, workload, replace(settings, recompute_activations=recompute))
            rows.append((f"TP={p.tensor} PP={p.pipeline} CP={cp} DP={layout.data} SP={p.sequence_parallel}, "
                         f"recompute {'on' if recompute else 'off'}", result.memory_gib))
    return rows


def _markdown(times: dict, max_diff: float, args, command: str, load: tuple) -> str:
    lines = [f"Command: `{command}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, gloo. Load average before / after: {load[0]} / {load[1]}.", "",
             f"### Time: one row of {args.tokens} tokens, the tiny Qwen2 (2 layers, hidden 64, 4 heads, 2 KV heads), "
             f"{args.repeats} repeats after a warm-up", "",
             "| phase | run | min (s) | median (s) | CP=2 / this (min) |", "|---|---|---|---|---|"]
    cp2 = RUNS[-1][0]
    for name in times[cp2]:
        for label, _, _ in RUNS:
            lines.append(f"| {name} | {label} | {min(times[label][name]):.3f} | "
                         f"{statistics.median(times[label][name]):.3f} | "
                         f"{min(times[cp2][name]) / min(times[label][name]):.2f} |")
    one_thread = RUNS[1][0]
    lines += ["", "CP=2 against a perfect split of the 1-thread CP=1 run over its two ranks (CP=2 min / (CP=1, 1 "
              "thread min / 2)), the cost of CP itself: " + "; ".join(
                  f"{name} {min(times[cp2][name]) / (min(times[one_thread][name]) / 2):.2f}" for name in times[cp2])
              + ".",
              "", f"Largest |log-prob CP=2 - CP=1| over the row: {max_diff:.2e}.", "",
              f"### Memory: the planner's per-GPU peaks, GiB, of {RECIPE} (Qwen2.5-32B, 2048 + 20480 tokens) on 32 "
              f"H100s of 80 GiB", "",
              "| layout | activations | context K/V | training peak | generation peak | fits |",
              "|---|---|---|---|---|---|"]
    for label, mem in _planner_rows():
        fits = max(mem["training_peak"], mem["generation_peak"]) <= mem["gpu"]
        lines.append(f"| {label} | {mem['activations']:.2f} | {mem['context_kv']:.3f} | "
                     f"{mem['training_peak']:.2f} | {mem['generation_peak']:.2f} | {'yes' if fits else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="the row's length (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args(argv)
    if args.tokens % 4:
        raise ValueError("--tokens must be a multiple of 4 (2 x CP)")
    command = "python benchmarks/context_parallel_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    fmt = lambda load: ", ".join(f"{x:.1f}" for x in load)  # noqa: E731
    started = fmt(os.getloadavg())
    times, logprobs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        weights_path = os.path.join(tmp, "weights.pt")
        for label, cp, threads in RUNS:
            times[label], logprobs[label] = _run(cp, threads, args, weights_path)
    max_diff = (logprobs[RUNS[-1][0]] - logprobs[RUNS[0][0]]).abs().max().item()
    text = _markdown(times, max_diff, args, command, (started, fmt(os.getloadavg())))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of GTPO / GRPO-S advantages against GRPO's, and against one policy-loss forward+backward.

    .venv/bin/python benchmarks/advantages_bench.py [--N 128 --G 16 --T 4096 --threads 1 --rounds 12]

Shape N prompts x G responses x T positions, float32, CPU, response lengths uniform in [1, T], rewards
Bernoulli(0.5), entropies uniform in [0, 3) (NaN at padding, which must never be read). Every candidate
runs once per round, in an order that rotates every round, for `rounds` rounds after one warm-up round.
The tables give the median and the minimum over rounds and ratios of medians against the baselines, all
from the same run, once in process CPU time (robust on a machine shared with other jobs: time spent
descheduled is not counted) and once in wall-clock time, with the minor page faults per call (a fresh
[N, G, T] float32 tensor is 8192 pages of 4 KiB). Candidates:

- grpo_advantages: the [N, G] advantages alone (what GRPO computes).
- grpo per-token: grpo_advantages broadcast to a masked [N, G, T] tensor, the per-token advantages a token
  loss reads (torch.where(mask, A[..., None], 0)); the like-for-like baseline for GTPO, whose output is per
  token.
- gtpo_advantages / grpo_s_advantages: what the trainer calls (torch ops, algorithms/token_passes.py).
- policy loss fwd+bwd: token_policy_loss (token-mean, clip-higher, GTPO advantages) forward and backward on
  [N*G, T] log-probs: a stand-in for the cheapest fraction of a training step.

A real training step is bounded below, in the same run, by the matmul FLOPs of Qwen2.5-0.5B's forward and
backward passes over the batch's valid response tokens (3 x planning.forward_flops; prompts, optimizer and
everything else left out) divided by this machine's measured float32 matmul rate with the same threads.

Allocator: by default glibc is told (mallopt) to keep freed memory mapped, as PyTorch's caching allocator does
on GPUs, so that no candidate pays first-touch page faults for a fresh [N, G, T] output (on this VM ~8,200
faults, ~20 ms of system time, paid or not depending on what ran before). `--allocator default` leaves glibc
as it is. The page-fault column shows which regime a run was in.
Prints markdown tables.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import resource
import statistics
import time

import torch

from megatron_gtpo.algorithms import PPOClip, grpo_advantages, grpo_s_advantages, gtpo_advantages, token_policy_loss
from megatron_gtpo.models.qwen import ModelShape
from megatron_gtpo.models.presets import hf_config
from megatron_gtpo.planning import forward_flops

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def make_batch(N, G, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rewards_NG = (torch.rand(N, G, generator=gen) < 0.5).float()
    lengths_NG = torch.randint(1, T + 1, (N, G), generator=gen)
    mask_NGT = torch.arange(T) < lengths_NG.unsqueeze(-1)
    entropy_NGT = torch.where(mask_NGT, 3 * torch.rand(N, G, T, generator=gen), float("nan"))
    old_logprobs_BT = -torch.rand(N * G, T, generator=gen)
    logprobs_BT = old_logprobs_BT + 0.2 * torch.randn(N * G, T, generator=gen)
    return rewards_NG, entropy_NGT, mask_NGT, old_logprobs_BT, logprobs_BT


def keep_freed_memory_mapped() -> None:
    """glibc: serve every allocation from the heap and never give freed memory back to the OS."""
    libc = ctypes.CDLL("libc.so.6")
    for param, value in ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1)):
        if libc.mallopt(param, ctypes.c_int(value)) != 1:
            raise RuntimeError(f"mallopt({param}, {value}) failed; run with --allocator default")


def matmul_flops_per_s(size: int = 1024, repeats: int = 20) -> float:
    """Best float32 [size, size] x [size, size] matmul rate over `repeats` calls, current thread settings."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def training_step_lower_bound_s(mask_NGT: torch.Tensor, flops_per_s: float, model: str = "qwen2.5-0.5b") -> float:
    """Seconds for the matmul FLOPs alone of one forward + backward (3x forward) over the valid tokens."""
    lengths = mask_NGT.sum(dim=-1).flatten().double()
    shape = ModelShape.from_hf(hf_config(model))
    flops = 3 * forward_flops(shape, num_tokens=int(lengths.sum()), sum_squared_lengths=int(lengths.square().sum()))
    return flops / flops_per_s


def load_average() -> str:
    """1-minute load average (Linux), to record how busy the machine was."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, default=128)
    parser.add_argument("--G", type=int, default=16)
    parser.add_argument("--T", type=int, default=4096)
    # One intra-op thread by default: on a machine shared with other jobs, OpenMP threads that wait at a
    # barrier for a descheduled sibling make every parallel op cost up to a scheduler tick (see the results).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--allocator", choices=("cached", "default"), default="cached")
    args = parser.parse_args()
    if args.allocator == "cached":
        keep_freed_memory_mapped()
    torch.set_num_threads(args.threads)
    N, G, T = args.N, args.G, args.T
    rewards_NG, entropy_NGT, mask_NGT, old_logprobs_BT, logprobs_BT = make_batch(N, G, T)
    mask_BT = mask_NGT.reshape(N * G, T)
    gtpo_BT = gtpo_advantages(rewards_NG, entropy_NGT, mask_NGT).reshape(N * G, T)
    num_tokens = int(mask_BT.sum())

    def loss_forward_backward():
        current = logprobs_BT.detach().requires_grad_()
        loss, _ = token_policy_loss(current, old_logprobs_BT, gtpo_BT, mask_BT, loss_normalizer=num_tokens,
                                    clip=PPOClip(0.2, 0.28))
        loss.backward()

    candidates = {
        "grpo_advantages [N, G]": lambda: grpo_advantages(rewards_NG),
        "grpo per-token [N, G, T]": lambda: torch.where(mask_NGT, grpo_advantages(rewards_NG).unsqueeze(-1), 0.0),
        "gtpo_advantages (batch scope)": lambda: gtpo_advantages(rewards_NG, entropy_NGT, mask_NGT),
        "gtpo_advantages (group scope)": lambda: gtpo_advantages(rewards_NG, entropy_NGT, mask_NGT, norm_scope="group"),
        "grpo_s_advantages": lambda: grpo_s_advantages(rewards_NG, entropy_NGT, mask_NGT),
        "policy loss fwd+bwd [N*G, T]": loss_forward_backward,
    }
    load_before = load_average()
    wall = {name: [] for name in candidates}
    cpu = {name: [] for name in candidates}
    faults = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(args.rounds + 1):
        # The order rotates every round, so that each candidate follows every other one equally often (what
        # ran before decides e.g. whether freed memory is still mapped, i.e. how many page faults a fresh
        # [N, G, T] output costs).
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            candidates[name]()
            if round_index:  # round 0 warms up
                wall[name].append(time.perf_counter() - wall_start)
                cpu[name].append(time.process_time() - cpu_start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start)

    flops_per_s = matmul_flops_per_s()
    step_s = training_step_lower_bound_s(mask_NGT, flops_per_s)
    print(f"shape N={N} G={G} T={T} float32 CPU, {num_tokens} valid tokens; torch {torch.__version__}, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.rounds} rounds; allocator {args.allocator}; "
          f"1-min load average {load_before} before, {load_average()} after\n")
    print(f"training step lower bound (Qwen2.5-0.5B matmul FLOPs, fwd+bwd, valid tokens only) at the measured "
          f"{flops_per_s / 1e9:.1f} GFLOP/s: {step_s:.0f} s\n")
    for title, seconds in (("process CPU time", cpu), ("wall-clock time", wall)):
        median = {name: statistics.median(s) for name, s in seconds.items()}
        grpo, grpo_tok, loss = (median[k] for k in ("grpo_advantages [N, G]", "grpo per-token [N, G, T]",
                                                     "policy loss fwd+bwd [N*G, T]"))
        print(f"{title}:\n")
        print("| candidate | median ms | min ms | / grpo_advantages | / grpo per-token | / loss fwd+bwd | "
              "/ step lower bound | page faults (median) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, s in seconds.items():
            print(f"| {name} | {median[name] * 1e3:.2f} | {min(s) * 1e3:.2f} | {median[name] / grpo:.0f}x | "
                  f"{median[name] / grpo_tok:.2f}x | {median[name] / loss:.3f}x | {median[name] / step_s:.1e} | "
                  f"{statistics.median(faults[name]):.0f} |")
        print()


if __name__ == "__main__":
    main()

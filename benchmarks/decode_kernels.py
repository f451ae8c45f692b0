"""The three kernel choices of the built-in engine's CPU decode step, each against what it replaced, at the decode
shapes of benchmarks/generation_bench.py's dense model (hidden 512, 8 heads / 2 KV heads of 64, FFN 1408,
vocabulary 8192), fp32, 1 thread, timed A B A B:

    .venv/bin/python benchmarks/decode_kernels.py [--reps 30] [--output benchmarks/results/generation.md]

- linear: torch.matmul(x, w.t()) (MKL's sgemm: megatron's op) against oneDNN's inner product on a weight packed once
  (models/lean_linears.py), [rows, 512] -> 2816 (the MLP's fc1) and -> 8192 (the output layer);
- attention: one decode query per row against a KV cache, SDPA with `enable_gqa` (8 query heads) against the query
  group's 4 heads folded into query rows (models/sdpa_attention.py), with the left-padding mask;
- sampling: a race of exponentials (argmax p / E, one hashed uniform per token) against the inverse-CDF draw (one
  uniform per row; rollout/sampling.py).
Reported: the median time of each (ms) and the median of the per-repetition ratios (old / new).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare(old, new, reps: int) -> tuple[float, float, float]:
    """(old ms, new ms, median of old / new), interleaved after one warm-up call each."""
    old(), new()
    pairs = [(timed(old), timed(new)) for _ in range(reps)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def cases():
    """(kernel, shape, old, new) at the dense model's decode shapes."""
    from megatron_gtpo.rollout.sampling import counter_uniform, inverse_cdf_draw, stream_keys

    torch.manual_seed(0)
    for rows in (32, 128):
        x = torch.randn(rows, 1, 512)
        for width in (2816, 8192):
            w = torch.randn(width, 512) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            yield ("linear", f"{rows} x 512 -> {width}", lambda x=x, w=w: torch.matmul(x, w.t()),
                   lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        for keys in (80, 190):
            q = torch.randn(rows, 8, 1, 64)
            k, v = torch.randn(rows, 2, keys, 64), torch.randn(rows, 2, keys, 64)
            pads_B1 = (torch.arange(rows) % 40)[:, None]  # left padding: every row's first pads masked
            mask = torch.zeros(rows, keys).masked_fill_(torch.arange(keys) < pads_B1, -torch.inf)[:, None, None]
            yield ("attention", f"{rows} rows x {keys} keys",
                   lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
                   lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q.reshape(-1, 2, 4, 64), k, v,
                                                                                attn_mask=m))
        probs = torch.softmax(torch.randn(rows, 8192), dim=-1)
        keys_B, draws_B = stream_keys(torch.arange(rows)), torch.zeros(rows, dtype=torch.long)
        yield ("sampling", f"{rows} rows x 8192",
               lambda p=probs, s=keys_B, d=draws_B: torch.argmax(
                   p / counter_uniform(s, d, 8192).log_().neg_(), dim=-1),
               lambda p=probs, s=keys_B, d=draws_B: inverse_cdf_draw(p, s, d))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = ["| kernel | shape | before (ms, median) | now (ms, median) | speed-up (median of pairs) |",
             "|---|---|---|---|---|"]
    for kernel, shape, old, new in cases():
        old_ms, new_ms, ratio = compare(old, new, args.reps)
        lines.append(f"| {kernel} | {shape} | {old_ms:.2f} | {new_ms:.2f} | {ratio:.2f}x |")
        print(lines[-1], flush=True)
    report = (f"fp32, 1 thread, {args.reps} interleaved repetitions; 1-minute load average {os.getloadavg()[0]:.1f} "
              f"at the end.\n\n" + "\n".join(lines))
    if args.output:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(f"\n## Decode-step kernels, before and now, {time.strftime('%Y-%m-%d %H:%M')}\n\nCommand: "
                    f"`python benchmarks/decode_kernels.py --reps {args.reps}`\n\n{report}\n")


if __name__ == "__main__":
    main()

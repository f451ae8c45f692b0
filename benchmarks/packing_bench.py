"""Update-phase time per real token: packed rows (data.pack_sequences) against length-bucketed padded micro-batches,
on the same sequences, in one process on CPU.

    nice -n 10 .venv/bin/python benchmarks/packing_bench.py --output benchmarks/results/packing.md

The sequences: --groups prompt groups of --group-size responses, lengths (prompt + response) drawn log-normal and
clipped to [--min-len, --max-len] (a long tail: most short, a few near the cap), random token ids. One step batch
per layout, built by the trainer's own build_step_batch, with fixed old log-probs and per-token advantages (GTPO's
token-level loss); then update_policy, the trainer's update phase (megatron-core's schedule, the vocab-parallel op,
the loss, the optimizer step), timed --repeats times per layout, the layouts interleaved so that load on the machine
hits them alike. Reported: the median time per real (prompt + response) token and the padding fraction (the plan's
padded tokens that are not sequence tokens), which the trainer also logs.

Model: a Qwen2-shaped model built in code (--hidden, --layers, --vocab); random weights (the time does not depend
on them). On megatron-core's local layer spec a packed row attends through a [L, L] mask, so its attention costs
grow with the row length, not with each sequence's: the packed budgets are therefore listed separately.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _hf_config(args) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 32, "num_key_value_heads": 2, "vocab_size": args.vocab,
            "tie_word_embeddings": False, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "initializer_range": 0.02, "use_sliding_window": False}


def _experience(args):
    """Prompt groups whose whole-sequence lengths are log-normal in [min_len, max_len]; prompts of 8 tokens."""
    import torch

    from megatron_gtpo.data.records import PromptSample
    from megatron_gtpo.rollout.engine import Rollout
    from megatron_gtpo.rollout.responses import Response, Responses
    from megatron_gtpo.training.experience import RewardedGroups
    from megatron_gtpo.training.sampled_groups import SampledGroups

    g = torch.Generator().manual_seed(args.seed)
    prompt_len = 8
    n = args.groups * args.group_size
    lengths = torch.exp(torch.randn(n, generator=g) * args.sigma + args.log_median)
    lengths = lengths.round().clamp(args.min_len, args.max_len).long().tolist()
    prompts = [tuple(torch.randint(3, args.vocab, (prompt_len,), generator=g).tolist()) for _ in range(args.groups)]
    response_lengths = [length - prompt_len for length in lengths]
    flat = [Response(torch.randint(3, args.vocab, (n,), generator=g).tolist(), [-1.0] * n, "stop")
            for n in response_lengths]
    responses = Responses.from_lists([flat[i * args.group_size:(i + 1) * args.group_size] for i in range(args.groups)])
    correct = torch.zeros(args.groups, args.group_size)
    samples = [PromptSample(i, str(i), ids, "") for i, ids in enumerate(prompts)]
    return RewardedGroups(SampledGroups.sampled(samples, Rollout(responses), 0), correct, correct.clone()), lengths


def _layouts(args) -> list[tuple[str, dict]]:
    out = [(f"padded, {args.micro_batch_size} sequences / {args.padded_budget} tokens",
            dict(max_sequences=args.micro_batch_size, max_tokens=args.padded_budget, pack=False))]
    out += [(f"packed, rows of {budget} tokens", dict(max_sequences=1, max_tokens=budget, pack=True))
            for budget in args.packed_budgets]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--log-median", type=float, default=4.3, help="log of the median length (e^4.3 = 74)")
    p.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=8, help="padded layout: data.micro_batch_size")
    p.add_argument("--padded-budget", type=int, default=2048, help="padded layout: data.max_tokens_per_micro_batch")
    p.add_argument("--packed-budgets", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the table (markdown) here too")
    args = p.parse_args(argv)

    import torch

    sys.path.insert(0, REPO)

    from megatron_gtpo.algorithms import configure_algorithm
    from megatron_gtpo.config import load_config
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.training.model_setup import build_chunks, wrap_for_training
    from megatron_gtpo.training.reduction import MetricReducer
    from megatron_gtpo.training.update import update_policy
    from megatron_gtpo.training.step_batch import build_step_batch

    groups = initialize_parallel(1, 1)
    torch.manual_seed(args.seed)
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "optim.lr=1e-5",
                             "steps=1000000"])
    policy = wrap_for_training(cfg, build_chunks(cfg, _hf_config(args), groups))
    algorithm = configure_algorithm(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens)  # gtpo

    def update(batch) -> dict:
        metrics = MetricReducer(groups.device)
        update_policy(policy, batch, groups, algorithm, metrics, epochs=1, vocab_size=args.vocab,
                      temperature=cfg.rollout.temperature, chunk_tokens=16)
        return metrics.reduce(groups.dp_group)
    exp, lengths = _experience(args)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = {}
    for name, plan in _layouts(args):
        batch = build_step_batch(exp, groups, mini_batches=[list(range(exp.num_groups))], **plan)
        batch.old_logprobs_ST = (-5.0 + torch.rand(batch.mask_ST.shape, generator=g)).to(groups.device)
        batch.advantages = torch.randn(batch.mask_ST.shape, generator=g).to(groups.device)
        batches[name] = batch
    real_tokens = sum(lengths)
    update(next(iter(batches.values())))  # warm-up (allocator, first-call costs)
    seconds = {name: [] for name in batches}
    padding = {}
    for _ in range(args.repeats):
        for name, batch in batches.items():
            start = time.perf_counter()
            metrics = update(batch)
            seconds[name].append(time.perf_counter() - start)
            padding[name] = metrics["padding_fraction"]
    base = next(iter(batches))
    base_per_token = statistics.median(seconds[base]) / real_tokens
    rows = []
    for name, batch in batches.items():
        per_token = statistics.median(seconds[name]) / real_tokens
        rows.append(f"| {name} | {sum(len(m) for m in batch.plan)} | {padding[name]:.3f} | "
                    f"{per_token * 1e6:.1f} | {per_token / base_per_token:.2f}x | "
                    f"{', '.join(f'{s:.2f}' for s in seconds[name])} |")
    table = "\n".join([
        f"{len(lengths)} sequences, {real_tokens} tokens, lengths {min(lengths)}-{max(lengths)} "
        f"(median {statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.0f}); model hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}; {platform.processor() or platform.machine()}, "
        f"torch threads {torch.get_num_threads()}",
        "",
        "| layout | micro-batches | padding fraction | update us / real token (median) | vs padded | update s "
        "(each repeat) |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows])
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(f"# Sequence packing: update-phase time per real token\n\n    nice -n 10 python "
                    f"benchmarks/packing_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}\n\n"
                    f"{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

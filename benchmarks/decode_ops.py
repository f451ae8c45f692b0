"""What one decode step of the built-in engine dispatches, counted on CPU (no GPU needed): aten ops (in total and
inside the transformer layers, per layer), RNG ops, device-to-host reads and host-list-to-device copies.

    .venv/bin/python benchmarks/decode_ops.py [--preset qwen2.5-0.5b] [--set KEY=VALUE ...] [--rows 32]
        [--prompt 16] [--steps 4] [--core-attention sdpa|unfused] [--profile]
        [--output benchmarks/results/generation.md]

A random-weight megatron-core GPTModel of the preset's topology (TP=1, PP=1, fp32, a gloo world of one) generates
`--rows` rows of `--prompt` tokens (prompt lengths `--prompt` - row % 4, so left padding and its mask are exercised),
sampling at temperature 1 with top-p 0.95, exactly `--steps` + 1 tokens each (no stop token). The prefill (the
first forward step) is not counted; the figures are per decode step (the mean over the `--steps` decode steps).

On a GPU every aten op is at least one kernel launch; a device-to-host read is a host synchronisation, and so is a
`torch.tensor(list, device=...)` copy (a blocking host-to-device copy of pageable memory). On this CPU the reads
and copies dispatch no aten op, so they are counted at the torch-function level (the calls that would read or copy:
Tensor.tolist / cpu / numpy, and torch.tensor of a Python list with a device), except `aten._local_scalar_dense`
(item, bool(t), int(t)); `aten.nonzero` (boolean indexing, torch.nonzero) is a hidden read on CUDA and counted
with the reads. Megatron's RNG tracker, which forks the RNG state around the attention dropout of every layer,
reads scalars on this CPU (the CPU platform layer stands in for the CUDA RNG state); those are counted apart: on a
GPU the RNG state lives on the host and they read no device memory.

`--core-attention`: the layer spec's core attention (config key `model.core_attention`; default sdpa). `--set`:
config.json keys of the preset replaced (integers), e.g. the shape benchmarks/generation_bench.py times:
`--set hidden_size=512 num_hidden_layers=8 num_attention_heads=8 num_key_value_heads=2 intermediate_size=1408
vocab_size=8192 tie_word_embeddings=0`. `--profile`: where the time of a decode step goes as well, from a second
generation without the counters, under torch's profiler: wall time per decode step (sampling included) and the aten
ops taking the most self time, with their share (the profiler's own overhead per op inflates the small ones).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

RNG_TRACKER_FILE = os.path.join("tensor_parallel", "random.py")  # megatron's CUDA RNG tracker
RNG_OPS = ("exponential", "uniform", "normal", "bernoulli", "rand", "multinomial", "random_")
# Reads that dispatch no aten op on a CPU tensor (item, bool(t), int(t) dispatch aten._local_scalar_dense).
HOST_READS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class DispatchCounter(TorchDispatchMode):
    """Counts aten ops (all, inside a layer, RNG, nonzero) while `counting` is set."""

    def __init__(self):
        super().__init__()
        self.counting = False
        self.in_layer = 0
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            name = func.__name__
            self.counts["ops"] += 1
            self.counts["layer_ops"] += bool(self.in_layer)
            self.counts["rng_ops"] += any(r in name for r in RNG_OPS)
            if name.startswith(("nonzero", "_local_scalar_dense")):
                tracker = any(f.filename.endswith(RNG_TRACKER_FILE) for f in traceback.extract_stack())
                self.counts["tracker_reads" if tracker else "host_reads"] += 1
        return func(*args, **(kwargs or {}))


class HostTrafficCounter(TorchFunctionMode):
    """Counts device-to-host reads and list-to-device copies (module doc) while `dispatch.counting` is set."""

    def __init__(self, dispatch: DispatchCounter):
        super().__init__()
        self.dispatch = dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.dispatch.counting:
            self.dispatch.counts["torch_calls"] += 1
            self.dispatch.counts["layer_torch_calls"] += bool(self.dispatch.in_layer)
            if func in HOST_READS and not getattr(args[0], "_read_to_host", False):  # t.cpu().tolist() reads once
                self.dispatch.counts["host_reads"] += 1
                if isinstance(result, torch.Tensor):
                    result._read_to_host = True
            elif func is torch.tensor and isinstance(args[0], (list, tuple)) and kwargs.get("device") is not None:
                self.dispatch.counts["list_to_device"] += 1
        return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config.json keys replaced (integers)")
    p.add_argument("--profile", action="store_true", help="also time a decode step, per aten op")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--core-attention", choices=("sdpa", "unfused"), default="sdpa")
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    args = p.parse_args(argv)
    try:
        args.set = {key: int(value) for key, value in (item.split("=", 1) for item in args.set)}
    except ValueError:
        p.error(f"--set takes KEY=INTEGER items, got {args.set}")
    return args


def build(preset: str, core_attention: str, overrides: dict):
    """(model chunks, parallel groups, vocab size), a random-weight model of `preset`."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.presets import hf_config
    from megatron_gtpo.models.qwen import build_model

    groups = initialize_parallel(1, 1)
    config = hf_config(preset)
    unknown = set(overrides) - set(config)
    if unknown:
        raise SystemExit(f"--set: {sorted(unknown)} are no keys of {preset}'s config.json")
    config.update(overrides)
    torch.manual_seed(0)
    chunks = build_model(config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0, core_attention=core_attention)
    return chunks, groups, config["vocab_size"]


def count_decode_steps(engine, prompts, steps: int) -> tuple[collections.Counter, int]:
    """Counts summed over the decode steps of one generation (the prefill left out), and the layers counted."""
    from megatron_gtpo.rollout import SamplingParams

    dispatch = DispatchCounter()
    layers = [layer for m in engine.models for layer in m.decoder.layers]
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: setattr(dispatch, "in_layer", dispatch.in_layer + 1))
        layer.register_forward_hook(lambda *_: setattr(dispatch, "in_layer", dispatch.in_layer - 1))
    forwards, forward = [], engine._forward

    def counted_forward(*args):  # counting starts with the second forward step (the first decode step)
        forwards.append(None)
        dispatch.counting = len(forwards) > 1
        return forward(*args)

    engine._forward = counted_forward
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=steps + 1, seed=1)
    with dispatch, HostTrafficCounter(dispatch):
        engine.generate(prompts, params)
    engine._forward = forward
    return dispatch.counts, len(layers)


def time_decode_steps(engine, prompts, steps: int, top: int = 12) -> list[str]:
    """Markdown lines: the wall time of a decode step (the mean over `steps`, sampling included) and the `top` aten
    ops by self time under torch's profiler, over the decode steps of one generation (the prefill left out)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_gtpo.rollout import SamplingParams

    profiler, forwards, forward = profile(activities=[ProfilerActivity.CPU]), [], engine._forward
    start_s = [0.0]

    def timed_forward(*args):  # the profiler starts with the second forward step (the first decode step)
        forwards.append(None)
        if len(forwards) == 2:
            profiler.start()
            start_s[0] = time.perf_counter()
        return forward(*args)

    engine._forward = timed_forward
    engine.generate(prompts, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=steps + 1, seed=1))
    step_ms = (time.perf_counter() - start_s[0]) * 1e3 / steps
    profiler.stop()
    engine._forward = forward
    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"Decode step (under the profiler): {step_ms:.1f} ms wall.", "",
             "| aten op | calls per step | self time per step (ms) | share |", "|---|---|---|---|"]
    for e in events[:top]:
        lines.append(f"| {e.key} | {e.count / steps:.0f} | {e.self_cpu_time_total / 1e3 / steps:.2f} | "
                     f"{100 * e.self_cpu_time_total / total:.1f}% |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29563"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron_gtpo.rollout import BuiltinEngine

    chunks, groups, vocab = build(args.preset, args.core_attention, args.set)
    attention = f"model.core_attention={args.core_attention}"
    engine = BuiltinEngine(chunks, groups, vocab)
    prompts = [[3 + (7 * r + t) % 1000 for t in range(args.prompt - r % 4)] for r in range(args.rows)]
    counts, layers = count_decode_steps(engine, prompts, args.steps)
    per_step = {k: counts[k] / args.steps for k in ("ops", "layer_ops", "torch_calls", "layer_torch_calls", "rng_ops",
                                                    "host_reads", "tracker_reads", "list_to_device")}
    lines = ["| per decode step | count |", "|---|---|",
             f"| aten ops | {per_step['ops']:.0f} |",
             f"| aten ops per layer | {per_step['layer_ops'] / layers:.1f} |",
             f"| aten ops outside the layers | {per_step['ops'] - per_step['layer_ops']:.0f} |",
             f"| torch calls per layer (each passes the CPU platform's torch-function mode) | "
             f"{per_step['layer_torch_calls'] / layers:.1f} |",
             f"| torch calls outside the layers | {per_step['torch_calls'] - per_step['layer_torch_calls']:.0f} |",
             f"| RNG ops | {per_step['rng_ops']:.1f} |",
             f"| device-to-host reads | {per_step['host_reads']:.1f} |",
             f"| scalar reads of megatron's RNG tracker (CPU only: host-side state on a GPU) | "
             f"{per_step['tracker_reads']:.1f} |",
             f"| list-to-device copies | {per_step['list_to_device']:.1f} |"]
    if args.profile:
        lines += [""] + time_decode_steps(engine, prompts, args.steps)
    changed = f" with {args.set}" if args.set else ""
    report = (f"Model: random {args.preset} topology{changed} ({layers} layers), fp32, TP=1; attention: {attention}; "
              f"{args.rows} rows, prompts of {args.prompt - 3}-{args.prompt} tokens (left-padded), temperature 1, "
              f"top-p 0.95; mean over {args.steps} decode steps (prefill not counted).\n\n" + "\n".join(lines))
    print(report)
    if args.output:
        command = "python benchmarks/decode_ops.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(f"\n## Decode-step dispatch count, {time.strftime('%Y-%m-%d %H:%M')}\n\nCommand: `{command}`\n\n"
                    f"{report}\n")


if __name__ == "__main__":
    main()

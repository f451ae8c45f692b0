"""Weight-sync throughput (Megatron shards -> full HF tensors in buckets -> engine weights) against a plain copy of
the same bytes on the destination device, in one run.

    torchrun --nproc_per_node 2 benchmarks/weight_sync_bench.py --model qwen2.5-1.5b --tp 2 [--layers N]
        [--bucket-mb 512] [--dtype float32|bfloat16] [--rounds 5] [--output benchmarks/results/weight_sync.md]

Model: the shape of a Qwen2.5 preset (megatron_gtpo/models/presets.py) with megatron's random init (no
checkpoint needed); `--layers` keeps only the first N decoder layers so that a real-shaped model fits a small machine
(embeddings and layer shapes stay the preset's). The destination rank (TP rank 0 of the first pipeline stage, where
a colocated engine lives) preallocates "engine weights": one tensor per HF tensor, on its device, as an engine holds
them. The candidates take turns, one call each per round (round 0 is a warm-up):
  sync      rollout/weight_sync.hf_weight_buckets (TP gathers through the single HF<->Megatron mapping, pipeline
            transfers, buckets of --bucket-mb) to the default destination, with `copy_` of every received tensor
            into the engine weights: the stream and the load without the hand-over (see phased).
  phased    the engine's own path with each phase timed (GPU synchronised between phases): gather = the stream
            above (TP gathers, pipeline broadcasts, HF conversion); transport = on CUDA, packing each bucket into one
            buffer on the GPU and exporting its CUDA IPC handle (rollout/cuda_ipc.py; the worker's opening of the
            handle, in another process, is not timed), on CPU the host path (`pack_bucket` to bytes and
            `unpack_bucket`, as vLLM's RPC carries them); load = `copy_` of every tensor into the engine weights
            (what vLLM's weight loaders do, without their sharding).
  copy      one `copy_` of a flat tensor of the same total bytes into another on the destination device: the
            device-to-device (on CPU: memory-to-memory) bandwidth that bounds any sync.
  gather    (TP > 1, PP = 1) one `dist.gather` onto the destination of a flat 1/TP share of those bytes from every
            TP rank: what the transport alone costs (gloo over TCP on CPU, NCCL on GPUs).
Reported per candidate: median seconds, GB/s (model bytes / median), and the ratio to copy; then phased's split. The
issue's target for a single H100 (TP=1, 7B shape, bf16): a sync within 2x the copy.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    return p.parse_args(argv)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_mapping import hf_tensor_shape
    from megatron_gtpo.models.qwen import ModelShape, build_model
    from megatron_gtpo.models.presets import hf_config as preset_config
    from megatron_gtpo.rollout.cuda_ipc import export_buffer
    from megatron_gtpo.rollout.weight_sync import (hf_weight_buckets, is_sync_destination, pack_bucket, pack_on_device,
                                                   sync_units, unpack_bucket, unpack_flat)

    dtype = getattr(torch, args.dtype)
    groups = initialize_parallel(args.tp, args.pp)
    hf_config = preset_config(args.model)
    if args.layers is not None:
        hf_config["num_hidden_layers"] = args.layers
    shape = ModelShape.from_hf(hf_config)
    chunks = build_model(hf_config, tensor_parallel=args.tp, pipeline_parallel=args.pp, pp_rank=groups.pp_rank,
                         params_dtype=dtype)
    device = groups.device
    destination = is_sync_destination(groups)
    names = [n for unit in sync_units(shape) for m in unit for n in m.hf_names]
    engine = {n: torch.empty(hf_tensor_shape(n, shape), dtype=dtype, device=device) for n in names} \
        if destination else {}
    model_bytes = sum(torch.Size(hf_tensor_shape(n, shape)).numel() for n in names) * dtype.itemsize
    flat_src = torch.empty(model_bytes, dtype=torch.uint8, device=device) if destination else None
    flat_dst = torch.empty_like(flat_src) if destination else None
    bucket_bytes = int(args.bucket_mb * 2**20)

    def sync():
        for bucket in hf_weight_buckets(chunks, groups, shape, bucket_bytes=bucket_bytes):
            for name, tensor in bucket:
                engine[name].copy_(tensor)
            del bucket

    def copy():
        if destination:
            flat_dst.copy_(flat_src)

    def phased():
        """The engine's own path, phase by phase: the stream, the hand-over, the load into the engine's tensors."""
        times = {"gather": 0.0, "transport": 0.0, "load": 0.0}
        start = time.perf_counter()

        def lap(phase):
            nonlocal start
            _synchronize(device)
            now = time.perf_counter()
            times[phase] += now - start
            start = now

        for bucket in hf_weight_buckets(chunks, groups, shape, bucket_bytes=bucket_bytes):
            lap("gather")
            if torch.cuda.is_available():  # (the CPU platform's device is "cuda" too) pack on the GPU, export by IPC
                names, dtype_names, shapes, flat = pack_on_device(bucket)
                export_buffer(flat)
                views = unpack_flat(flat, names, dtype_names, shapes)
            else:  # the host path through vLLM's RPC: pack into host bytes, the worker unpacks a copy
                views = unpack_bucket(*pack_bucket(bucket))
            lap("transport")
            for name, tensor in views:
                engine[name].copy_(tensor)
            lap("load")
            del bucket, views
        phase_seconds.append(times)

    phase_seconds: list[dict] = []
    candidates = {"sync": sync, "copy": copy, "phased": phased}
    if args.tp > 1 and args.pp == 1:  # the transport alone: one flat gather of the same bytes
        # Allocated only here: at TP=1 a model-sized buffer more would not fit beside a 7B bf16 model on one GPU.
        share = torch.empty(model_bytes // args.tp, dtype=torch.uint8, device=device)
        shares = [torch.empty_like(share) for _ in range(args.tp)] if groups.tp_rank == 0 else None

        def gather():
            dist.gather(share, gather_list=shares, dst=dist.get_global_rank(groups.tp_group, 0),
                        group=groups.tp_group)

        candidates["gather"] = gather
    seconds = {name: [] for name in candidates}
    for round_index in range(args.rounds + 1):
        for name, fn in candidates.items():
            dist.barrier()
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            dist.barrier()
            if round_index:
                seconds[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        phases = {p: statistics.median(t[p] for t in phase_seconds[1:]) for p in ("gather", "transport", "load")}
        report(args, groups, shape, model_bytes, seconds, phases, device)
    dist.destroy_process_group()
    return 0


def report(args, groups, shape, model_bytes, seconds, phases, device) -> None:
    median = {name: statistics.median(s) for name, s in seconds.items()}
    rate = {name: model_bytes / median[name] / 1e9 for name in median}
    device_name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else \
        f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')}", "",
        f"Command: `torchrun --nproc_per_node {groups.world_size} benchmarks/weight_sync_bench.py "
        + " ".join(sys.argv[1:]) + "`", "",
        f"Model: {args.model} shape, {shape.num_layers} decoder layers, {args.dtype}, "
        f"{model_bytes / 2**30:.2f} GiB of HF tensors; TP={args.tp} PP={args.pp}, buckets of {args.bucket_mb:g} MiB; "
        f"{args.rounds} timed rounds.",
        f"Device: {device_name}; torch {torch.__version__}; backend {dist.get_backend()}.", "",
        "| candidate | median s | GB/s | / copy |", "|---|---:|---:|---:|",
        *(f"| {name} | {median[name]:.3f} | {rate[name]:.2f} | {rate[name] / rate['copy']:.3f} |" for name in median),
        "", f"phased, per phase (median s; {'CUDA IPC' if torch.cuda.is_available() else 'host bytes'} transport): "
        + ", ".join(f"{p} {t:.3f} ({t / median['copy']:.2f} x copy)" for p, t in phases.items()), "",
    ]
    publish("\n".join(lines), args.output)


def publish(text: str, output: str | None) -> None:
    """Print a results section, and append it to `output` (a benchmarks/results file) when given."""
    print(text)
    if output:
        with open(output, "a", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

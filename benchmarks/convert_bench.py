"""Wall time and peak resident memory of the checkpoint converters on a real-shaped Qwen2.5 model, both ways.

    .venv/bin/python benchmarks/convert_bench.py [--model qwen2.5-1.5b] [--layers N] [--workdir DIR] [--keep]

1. A random bf16 HF checkpoint of the model's exact tensor shapes (megatron_gtpo/models/presets.py) is built
   tensor by tensor straight into safetensors files (no transformers model is instantiated). `--layers N` keeps the
   real widths with fewer layers: the streaming converters' peak memory is set by the largest tensors (embedding,
   output layer), not by depth, so e.g. a 2-layer Qwen2.5-32B measures the 32B peak with a 5 GB file.
2. Each measurement runs in a child process; its peak RSS is the kernel's ru_maxrss of that child (os.wait4, the
   per-child form of getrusage(RUSAGE_CHILDREN)), its time the wall clock around it. Measured, in one run:
     floor      python + torch + megatron_gtpo.checkpoint imported, nothing else: the interpreter's baseline
     read_all   every HF tensor read into memory and kept: the whole model in memory (what a non-streaming
                converter needs at least) and the time to read it once
     copy       the HF files copied to a new directory and fsync'ed: the I/O a converter cannot avoid
     hf_to_mg   convert_hf_to_megatron (TP=1: one chunk per tensor, the largest copies)
     mg_to_hf   convert_megatron_to_hf (5GB shards)
   Ratios: each converter's time against copy, its peak against read_all, and its peak above the floor in units
   of the largest tensor.
3. The exported model is checked against the input, every tensor torch.equal, before anything is reported.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD_FLOOR = "import torch, megatron_gtpo.checkpoint"
_CHILD_READ_ALL = """
import sys
from megatron_gtpo.models.hf_checkpoint import HFCheckpoint
ckpt = HFCheckpoint(sys.argv[1])
tensors = {name: ckpt.get(name).clone() for name in ckpt.weight_map}  # each read into memory once, all kept
print(sum(t.numel() for t in tensors.values()))
"""
_CHILD_COPY = """
import os, shutil, sys
os.makedirs(sys.argv[2])
for name in os.listdir(sys.argv[1]):
    shutil.copyfile(os.path.join(sys.argv[1], name), os.path.join(sys.argv[2], name))
    with open(os.path.join(sys.argv[2], name), 'rb+') as f:
        os.fsync(f.fileno())
"""
_CHILD_HF_TO_MG = """
import sys
from megatron_gtpo.checkpoint import convert_hf_to_megatron
convert_hf_to_megatron(sys.argv[1], sys.argv[2], tensor_parallel=1, progress=False)
"""
_CHILD_MG_TO_HF = """
import sys
from megatron_gtpo.checkpoint import convert_megatron_to_hf
convert_megatron_to_hf(sys.argv[1], sys.argv[2], progress=False)
"""
_CHILD_BUILD = """
import json, sys
import torch
from megatron_gtpo.checkpoint.hf_export import SafetensorsShardWriter, TensorSpec, plan_shards
from megatron_gtpo.models.hf_mapping import hf_tensor_names, hf_tensor_shape
from megatron_gtpo.models.qwen import ModelShape
config = json.load(open(sys.argv[1] + '/config.json'))
shape = ModelShape.from_hf(config)
specs = [TensorSpec(n, hf_tensor_shape(n, shape), torch.bfloat16) for n in hf_tensor_names(shape)]
writer = SafetensorsShardWriter(sys.argv[1], plan_shards(specs, 5 * 10**9))
gen = torch.Generator().manual_seed(0)
for spec in specs:
    tensor = torch.randn(spec.shape, generator=gen, dtype=torch.bfloat16)
    if 'norm' in spec.name:
        tensor.mul_(0.1).add_(1.0)
    else:
        tensor.mul_(0.02)
    writer.write(spec.name, tensor)
    del tensor
writer.close()
"""
_CHILD_COMPARE = """
import sys, torch
from megatron_gtpo.models.hf_checkpoint import HFCheckpoint
a, b = HFCheckpoint(sys.argv[1]), HFCheckpoint(sys.argv[2])
assert sorted(a.weight_map) == sorted(b.weight_map), 'different tensor names'
for name in a.weight_map:
    x, y = a.get(name), b.get(name)
    assert x.dtype == y.dtype and torch.equal(x, y), name
print(len(a.weight_map))
"""


def run_child(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter; its wall time and peak RSS (ru_maxrss of that child, KiB on Linux)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=out, stderr=err, text=True)
        _, status, rusage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so that Popen does not wait again
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"child exited with {proc.returncode}:\n{err.read()[-3000:]}")
        return {"seconds": seconds, "peak_rss_bytes": rusage.ru_maxrss * 1024, "stdout": out.read().strip()}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def torch_version() -> str:
    return run_child("import torch; print(torch.__version__)")["stdout"]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None, help="keep the widths, use this many layers")
    p.add_argument("--workdir", default="/tmp/convert_bench")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    sys.path.insert(0, REPO)
    from megatron_gtpo.models.hf_mapping import hf_tensor_names, hf_tensor_shape
    from megatron_gtpo.models.presets import hf_config
    from megatron_gtpo.models.qwen import ModelShape

    config = hf_config(args.model)
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    shape = ModelShape.from_hf(config)
    largest = 2 * max(math.prod(hf_tensor_shape(n, shape)) for n in hf_tensor_names(shape))  # bf16 bytes

    hf_dir, mg_dir, hf2_dir = (os.path.join(args.workdir, d) for d in ("hf", "megatron", "hf_roundtrip"))
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(hf_dir)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rows = {"build_hf": run_child(_CHILD_BUILD, hf_dir)}
    rows["floor"] = run_child(_CHILD_FLOOR)
    rows["read_all"] = run_child(_CHILD_READ_ALL, hf_dir)
    rows["copy"] = run_child(_CHILD_COPY, hf_dir, os.path.join(args.workdir, "copy"))
    shutil.rmtree(os.path.join(args.workdir, "copy"))
    rows["hf_to_mg"] = run_child(_CHILD_HF_TO_MG, hf_dir, mg_dir)
    rows["mg_to_hf"] = run_child(_CHILD_MG_TO_HF, mg_dir, hf2_dir)
    checked = run_child(_CHILD_COMPARE, hf_dir, hf2_dir)["stdout"]
    sizes = {"hf_bytes": dir_bytes(hf_dir), "megatron_bytes": dir_bytes(mg_dir),
             "hf_roundtrip_bytes": dir_bytes(hf2_dir)}
    if not args.keep:
        shutil.rmtree(args.workdir)

    gib = 2**30
    floor = rows["floor"]["peak_rss_bytes"]
    read_all = rows["read_all"]
    print(f"model {args.model}" + (f" with {args.layers} layers" if args.layers is not None else "")
          + f": {sizes['hf_bytes'] / gib:.2f} GiB of bf16 safetensors, largest tensor {largest / gib:.3f} GiB; "
          f"round trip checked: {checked} tensors torch.equal")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"torch {torch_version()}")
    print(f"{'step':10s} {'wall s':>8s} {'wall / copy':>12s} {'peak RSS GiB':>13s} {'RSS / read_all':>15s} "
          f"{'(RSS-floor) / largest':>22s}")
    for name in ("floor", "read_all", "copy", "hf_to_mg", "mg_to_hf", "build_hf"):
        r = rows[name]
        print(f"{name:10s} {r['seconds']:8.1f} {r['seconds'] / rows['copy']['seconds']:12.2f} "
              f"{r['peak_rss_bytes'] / gib:13.3f} {r['peak_rss_bytes'] / read_all['peak_rss_bytes']:15.2f} "
              f"{(r['peak_rss_bytes'] - floor) / largest:22.2f}")
    if args.json:
        record = {"model": args.model, "layers": shape.num_layers, "largest_tensor_bytes": largest, **sizes,
                  **{name: {"seconds": r["seconds"], "peak_rss_bytes": r["peak_rss_bytes"]}
                     for name, r in rows.items()}}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

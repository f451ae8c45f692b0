"""Running the trainer from tests (its ranks as torchrun starts them, or torchrun itself), and reading what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from distributed_harness import run_module

DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "cpu_demo.yaml")


def train_arguments(output_dir, overrides: list[str]) -> list[str]:
    """The trainer's arguments for a run of the demo's config with `overrides`, writing to `output_dir`."""
    sets = [f"logging.output_dir={output_dir}", "logging.progress_bar=false", "logging.tensorboard=false",
            *overrides]
    return ["--config", DEMO_CONFIG, *sum((["--set", s] for s in sets), [])]


def train_command(output_dir, nproc: int, overrides: list[str]) -> list[str]:
    """The torchrun command of that run (for the tests of what a launched run does with signals and kills)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "-m",
            "megatron_gtpo.train", *train_arguments(output_dir, overrides)]


def run_train(output_dir, nproc: int, overrides: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """That run on `nproc` ranks of one thread each, as torchrun would start them (distributed_harness.run_module:
    without torchrun's agent and each rank's imports, most of a short run's CPU time)."""
    return run_module("megatron_gtpo.train", train_arguments(output_dir, overrides), nproc,
                      env=dict(os.environ, OMP_NUM_THREADS="1"), timeout_s=timeout)


def read_metrics(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def copy_checkpoint(run, to, checkpoint: str, *beside: str) -> None:
    """Copy `checkpoint` of the run in `run` (and the directories `beside` it, e.g. the KL reference) into the
    checkpoint directory of `to`, as `latest`: a run started in `to` resumes from it."""
    import shutil

    for name in (checkpoint, *beside):
        shutil.copytree(os.path.join(run, "checkpoints", name), os.path.join(to, "checkpoints", name))
    with open(os.path.join(to, "checkpoints", "latest"), "w", encoding="utf-8") as f:
        f.write(checkpoint + "\n")


def checkpoint_tensors(checkpoint_dir) -> dict:
    """All tensors of a distributed checkpoint, read in this process (no process group needed)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        dcp_to_torch_save(str(checkpoint_dir), path)
        state = torch.load(path, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def comparable(row: dict) -> dict:
    """A metrics row without what depends on the machine's speed (phase times, tokens per second, the rollout
    engine's busy seconds and fractions); lists (the prompt ids) as tuples, compared exactly, not with approx."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in row.items()
            if not k.startswith(("time_", "rollout_busy_")) and k != "tokens_per_s"}


def assert_resumed_run_equals(full, part, checkpoint: str, *, resumed_at: int | None = None) \
        -> tuple[list[dict], list[str]]:
    """The run in `part` (interrupted and resumed) logged the same metrics as the one in `full` (rel 1e-6) and wrote
    the same tensors to `checkpoint` (rel 1e-5); returns the full run's rows and the checkpoint's tensor names.
    `resumed_at`: `part` only resumed, at that step, from a checkpoint of `full` copied to it (its rows are the
    steps from there on)."""
    import pytest
    import torch

    full_rows, part_rows = read_metrics(full), read_metrics(part)
    if resumed_at is not None:
        full_rows = [r for r in full_rows if r["step"] >= resumed_at]
    assert part_rows and [r["step"] for r in part_rows] == [r["step"] for r in full_rows]
    for a, b in zip(full_rows, part_rows):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == (b[k] if isinstance(b[k], tuple) else pytest.approx(b[k], rel=1e-6, abs=1e-7)), \
                (a["step"], k)
    ta = checkpoint_tensors(os.path.join(full, "checkpoints", checkpoint))
    tb = checkpoint_tensors(os.path.join(part, "checkpoints", checkpoint))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.allclose(ta[k].float(), tb[k].float(), rtol=1e-5, atol=1e-6), k
    return full_rows, list(ta)

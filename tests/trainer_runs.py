"""Running the trainer under torchrun from tests, and reading what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys

DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "cpu_demo.yaml")


def train_command(output_dir, nproc: int, overrides: list[str]) -> list[str]:
    sets = [f"logging.output_dir={output_dir}", "logging.progress_bar=false", "logging.tensorboard=false",
            *overrides]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "-m",
            "megatron_gtpo.train", "--config", DEMO_CONFIG, *sum((["--set", s] for s in sets), [])]


def run_train(output_dir, nproc: int, overrides: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(train_command(output_dir, nproc, overrides), capture_output=True, text=True,
                          timeout=timeout, env=env)


def read_metrics(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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

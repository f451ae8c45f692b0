"""Per-step metrics: `<output dir>/metrics.jsonl` (one JSON object per step), TensorBoard, Weights & Biases when
configured, and a console progress display (a bar on a terminal, plain lines in a log file: progress.py). Only the
logging rank writes; the others hold a disabled logger."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable

import torch
from tqdm import tqdm

from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.progress import progress_bar as progress_display


def _nothing() -> None:
    return None


class PhaseTimer:
    """Wall time of named phases of one step (seconds), and what runs between them.

    A GPU runs the kernels a phase launches after the host has moved on, so each phase ends with one
    `synchronize` (default: torch.cuda.synchronize on a machine with CUDA, nothing on a CPU, where work is done when
    its call returns): the device time lands in the phase that queued it, not in whichever later phase waits.
    `after_phase(name, timer)`, when given, runs when a phase has ended without an error, outside its time (the rollout
    queue's polls of the servers: rollout_queue.RolloutQueue.poll)."""

    def __init__(self, synchronize: Callable[[], None] | None = None,
                 after_phase: Callable[[str, "PhaseTimer"], None] | None = None):
        self.seconds: dict[str, float] = {}
        self._synchronize = synchronize or (torch.cuda.synchronize if torch.cuda.is_available() else _nothing)
        self._after_phase = after_phase

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        if self._after_phase is not None:
            self._after_phase(name, self)

    def skipped(self, name: str) -> None:
        """A phase with nothing to run this step: 0 s (logged as such, not missing), and `after_phase` as after a
        phase that ran (what runs between the phases keeps its place in the step)."""
        self.seconds.setdefault(name, 0.0)
        if self._after_phase is not None:
            self._after_phase(name, self)


class MetricsLogger:
    def __init__(self, output_dir: str, *, enabled: bool, start_step: int, total_steps: int, tensorboard: bool,
                 wandb_project: str | None, progress_bar: bool, run_config: dict):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._truncate_after(start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if wandb_project:
            import wandb  # optional: only when configured, and then its absence is an error

            self._wandb = wandb.init(project=wandb_project, config=run_config, dir=output_dir)
        self._progress_bar = progress_bar
        if progress_bar:
            self._bar = progress_display(total=total_steps, initial=start_step, desc="RL steps", unit="step")

    def progress(self, steps: range, desc: str):
        """`steps` with a progress bar of their own on the logging rank (the warm start's), gone when done."""
        if not (self.enabled and self._progress_bar):
            return steps
        return progress_display(steps, desc=desc, unit="step", leave=False)

    def _truncate_after(self, start_step: int) -> None:
        """A resumed run rewrites the steps it is about to redo (those logged after its checkpoint)."""
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] < start_step]
        write_atomically(self.path, "".join(kept))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            if step >= 0:
                self._wandb.log(numeric, step=step)
            else:  # the warm start's summary (step -1): W&B drops history rows below step 0 (wandb 0.31)
                self._wandb.summary.update({f"warm_start/{k}": v for k, v in numeric.items()})
        if step >= 0 and metrics.get("no_group_kept"):
            tqdm.write(f"step {step}: dynamic sampling kept no group (every prompt's responses were all right or all "
                       f"wrong, in {metrics.get('sampling_rounds', 1)} sampling rounds): no entropy, ratio or loss "
                       f"statistics this step", file=sys.stderr)
        if self._bar is not None and step >= 0:  # step -1 is the warm-start's summary, not an RL step
            self._bar.update(1)
            self._bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward_mean", "entropy_mean",
                                                                   "response_length_mean")
                                   if k in metrics and math.isfinite(metrics[k])})

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

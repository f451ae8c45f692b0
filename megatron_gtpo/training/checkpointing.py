"""Trainer checkpoints: model, optimizer (DistributedOptimizer, fully reshardable), LR schedule, data position,
RNG states, step and config; every K steps, at the end, and on SIGTERM/SIGUSR1 (SLURM pre-emption).

Layout: <checkpoint dir>/step_00000010/ holds a megatron.core.dist_checkpointing checkpoint (model and optimizer
sharded tensors, readable at any TP/PP), trainer_state.json, config.yaml and rng/rank_*.pt; `latest` names the
newest complete one. A checkpoint is written under `<name>.tmp` and renamed when complete, so a crash mid-save
never leaves a directory that looks complete; only the last `keep_last` are kept.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys

import torch
import torch.distributed as dist

from megatron_gtpo.config import save_config, to_dict

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class StopSignal:
    """Remembers SIGTERM / SIGUSR1; the loop checkpoints and exits after the step in progress."""

    def __init__(self):
        self.requested = False

    @classmethod
    def install(cls) -> "StopSignal":
        stop = cls()

        def handler(signum, frame):
            stop.requested = True
            print(f"received signal {signum}: will checkpoint after this step and exit", file=sys.stderr)

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)
        return stop

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (signals reach ranks at slightly different times)."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _sharded_state(run, *, is_loading: bool) -> dict:
    chunks = run.policy.chunks
    model = {f"model{i}" if len(chunks) > 1 else "model": c.sharded_state_dict() for i, c in enumerate(chunks)}
    optimizer = run.policy.optimizer.sharded_state_dict(
        {k: v for sd in model.values() for k, v in sd.items()} if len(chunks) > 1 else model["model"],
        is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
    return {**model, "optimizer": optimizer}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout(groups) -> dict:
    return {"tensor": groups.tp_size, "pipeline": groups.pp_size, "data": groups.dp_size,
            "world": groups.world_size}


def save_checkpoint(run, step: int) -> str:
    from megatron.core import dist_checkpointing

    cfg, groups = run.cfg, run.groups
    root = cfg.checkpoint_dir
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if groups.world_rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(run, is_loading=False), tmp)  # wants an empty directory
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{groups.world_rank:05d}.pt"))
    if groups.world_rank == 0:
        state = {"step": step, "loader": run.loader.state_dict(), "scheduler": run.policy.scheduler.state_dict(),
                 "layout": _layout(groups), "hf_config": run.task.hf_config, "vocab_size": run.vocab_size,
                 "config": to_dict(cfg)}
        with open(os.path.join(tmp, TRAINER_STATE), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
        save_config(cfg, os.path.join(tmp, "config.yaml"))
    dist.barrier()
    if groups.world_rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_latest(root, os.path.basename(final))
        done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in done[:-cfg.checkpoint.keep_last]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        save_config(cfg, os.path.join(root, "config.yaml"))
    dist.barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


def latest_checkpoint(root: str) -> str | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        directory = os.path.join(root, f.read().strip())
    if not os.path.isfile(os.path.join(directory, TRAINER_STATE)):
        raise FileNotFoundError(f"{path} names {directory}, which is not a complete checkpoint "
                                f"(no {TRAINER_STATE}); remove {path} to start over")
    return directory


def restore_if_any(run) -> int:
    """Resume from the newest checkpoint (any TP/PP). Returns the step to continue from (0 if none)."""
    from megatron.core import dist_checkpointing

    cfg, groups = run.cfg, run.groups
    directory = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
    if directory is None:
        return 0
    with open(os.path.join(directory, TRAINER_STATE), encoding="utf-8") as f:
        state = json.load(f)
    if state["vocab_size"] != run.vocab_size or state["hf_config"]["hidden_size"] != run.task.hf_config["hidden_size"]:
        raise ValueError(f"checkpoint {directory} is of a different model than the configured one")
    loaded = dist_checkpointing.load(_sharded_state(run, is_loading=True), directory)
    chunks = run.policy.chunks
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}" if len(chunks) > 1 else "model"])
    run.policy.optimizer.load_state_dict(loaded["optimizer"])
    run.policy.scheduler.load_state_dict(state["scheduler"])
    run.loader.load_state_dict(state["loader"])
    rng_file = os.path.join(directory, "rng", f"rank_{groups.world_rank:05d}.pt")
    if state["layout"] == _layout(groups) and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    elif groups.world_rank == 0:
        print(f"resuming {directory} at a different layout ({state['layout']} -> {_layout(groups)}): RNG states "
              f"are re-seeded, so sampling differs from an uninterrupted run", file=sys.stderr)
    if groups.world_rank == 0:
        print(f"resumed from {directory} at step {state['step']}", file=sys.stderr)
    return int(state["step"])

"""Trainer checkpoints: model, optimizer (DistributedOptimizer, fully reshardable), LR schedule, data position,
RNG states, step and config; every K steps, at the end, and on SIGTERM/SIGUSR1 (SLURM pre-emption).

Layout: <checkpoint dir>/step_00000010/ holds a megatron.core.dist_checkpointing checkpoint (model and optimizer
sharded tensors, readable at any TP/PP), trainer_state.json, config.yaml, rng/rank_*.pt and manifest.json (every
file's size and checksum); `latest` names the newest complete one. A checkpoint is written under `<name>.tmp` and
renamed when complete, so a crash mid-save never leaves a directory that looks complete; only the last `keep_last`
are kept. A resume checks the checkpoint's files against its manifest first: one damaged on disk since (a truncated
or corrupted shard) is named and passed over for the newest intact one before it.
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

from megatron_gtpo.checkpoint.manifest import DamagedCheckpoint, find_damage, write_manifest
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

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank was signalled (signals reach ranks at slightly different times).
        `device`: the default group's (an NCCL group takes no host tensors)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _sharded_state(run, *, is_loading: bool) -> dict:
    chunks = run.policy.chunks
    if is_loading:
        # A fresh torch Adam has no per-parameter state (no 'step'), and the DistributedOptimizer's state_dict
        # needs one; megatron-core's own loader fills it with placeholder values that the load then overwrites.
        for optimizer in getattr(run.policy.optimizer, "chained_optimizers", [run.policy.optimizer]):
            optimizer._init_optimizer_states_with_dummy_values()
    model = {f"model{i}" if len(chunks) > 1 else "model": c.sharded_state_dict() for i, c in enumerate(chunks)}
    optimizer = run.policy.optimizer.sharded_state_dict(
        {k: v for sd in model.values() for k, v in sd.items()} if len(chunks) > 1 else model["model"],
        is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
    return {**model, "optimizer": optimizer}


def _load_optimizer_state(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, working around megatron-core 0.16 with torch's Adam (no Apex / Transformer
    Engine, e.g. on CPU): the fully reshardable parameter state carries no per-parameter 'step' (megatron restores it
    from the param groups first), yet `_set_main_param_and_optimizer_states` copies every key the live state has.
    We hand it the live 'step' back, so that copy is a no-op."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    # The config's hyper-parameters (max_lr / min_lr that the LR schedule reads from each param group, betas, eps,
    # weight decay) win over the checkpoint's, so a resumed run may change them: load_state_dict restores the param
    # groups as saved, so the live values are put back after it (the per-group 'step' comes from the checkpoint).
    live_hyperparameters = [[{k: v for k, v in group.items() if k not in ("params", "step")}
                             for group in opt.optimizer.param_groups] for opt in optimizers]
    patched = []
    for opt in optimizers:
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            live = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in live and "step" not in tensors:
                tensors = {**tensors, "step": live["step"]}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method
    for opt, groups in zip(optimizers, live_hyperparameters):
        for group, live in zip(opt.optimizer.param_groups, groups, strict=True):
            group.update(live)
    # megatron-core hands every parameter the SAME 'step' tensor, and torch's Adam increments each parameter's step
    # in place: without separate copies the step (and with it Adam's bias correction) races ahead after a resume.
    for opt in patched:
        for param_state in opt.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()


def _sharded_keys(run) -> list[str]:
    chunks = run.policy.chunks
    return [f"model{i}" if len(chunks) > 1 else "model" for i in range(len(chunks))] + ["optimizer"]


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
        # The converter's metadata: makes the checkpoint readable by `score --load`, `model.load` and
        # tools/convert_megatron_to_hf.py like any converted one.
        from megatron_gtpo.checkpoint.megatron_checkpoint import (HF_FILES_DIR, CheckpointMetadata,
                                                                  copy_hf_side_files, write_checkpoint_metadata)

        write_checkpoint_metadata(tmp, CheckpointMetadata(
            hf_config=run.task.hf_config, dtype=cfg.model.dtype, tensor_parallel=groups.tp_size,
            pipeline_parallel=groups.pp_size, contents=tuple(_sharded_keys(run)),
            extra={"step": step}))
        if cfg.model.hf_dir:
            copy_hf_side_files(cfg.model.hf_dir, os.path.join(tmp, HF_FILES_DIR))
        elif cfg.model.load:
            copy_hf_side_files(os.path.join(cfg.model.load, HF_FILES_DIR), os.path.join(tmp, HF_FILES_DIR))
    dist.barrier()
    write_manifest(tmp, group=dist.group.WORLD)
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


def resume_candidates(root: str) -> list[str]:
    """The checkpoint `latest` names, then the older ones beside it, newest first ([] when there is no `latest`)."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        named = f.read().strip()
    older = sorted((d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp") and d < named),
                   reverse=True)
    return [os.path.join(root, d) for d in (named, *older)]


def _damage(directory: str) -> str | None:
    """What is wrong with a checkpoint about to be resumed from (None: nothing). Collective."""
    if not os.path.isdir(directory):
        return f"checkpoint {directory} does not exist"
    problem = find_damage(directory, group=dist.group.WORLD)
    if problem is None and not os.path.isfile(os.path.join(directory, TRAINER_STATE)):
        problem = f"checkpoint {directory} is incomplete (no {TRAINER_STATE})"
    return problem


def newest_intact_checkpoint(root: str, *, say) -> str | None:
    """The newest checkpoint under `root` whose files are as written (None when there is none at all). A damaged one
    is reported through `say` and passed over for the one before it; DamagedCheckpoint when none is intact."""
    problems = []
    for directory in resume_candidates(root):
        problem = _damage(directory)
        if problem is None:
            if problems:
                say(f"resuming from {directory} instead, the newest intact checkpoint")
            return directory
        say(f"warning: {problem}")
        problems.append(problem)
    if problems:
        raise DamagedCheckpoint(f"no intact checkpoint to resume from in {root}: {'; '.join(problems)}. Move the "
                                f"damaged checkpoints away, or set checkpoint.resume=false to start over")
    return None


def restore_if_any(run) -> int:
    """Resume from the newest intact checkpoint (any TP/PP). Returns the step to continue from (0 if none)."""
    from megatron.core import dist_checkpointing

    cfg, groups = run.cfg, run.groups

    def say(text: str) -> None:
        if groups.world_rank == 0:
            print(text, file=sys.stderr)

    directory = newest_intact_checkpoint(cfg.checkpoint_dir, say=say) if cfg.checkpoint.resume else None
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
    _load_optimizer_state(run.policy.optimizer, loaded["optimizer"])
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

"""Trainer checkpoints: model, optimizer (DistributedOptimizer, fully reshardable), LR schedule, data position,
RNG states, step and config, and with bounded staleness or partial rollouts the rollouts generated and not yet
trained on; every K steps, at the end, and on SIGTERM/SIGUSR1 (SLURM pre-emption).

The trainer hands its state to the collective checkpoint writer (checkpoint/megatron_checkpoint.save_checkpoint):
<checkpoint dir>/step_00000010/ holds a megatron.core.dist_checkpointing checkpoint (model and optimizer sharded
tensors, readable at any TP/PP), trainer_state.json, config.yaml, rng/rank_*.pt, the checkpoint metadata (so that
`score --load`, `model.load` and the converters read it like any converted one) and manifest.json (every file's size
and checksum); `latest` names the newest complete one. The writer renames a checkpoint into place only when
complete, so a crash mid-save never leaves a directory that looks complete; only the last `keep_last` are kept.
A resume checks the checkpoint's files against its manifest first: one damaged on disk since (a truncated or
corrupted shard) is named and passed over for the newest intact one before it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys

import torch
import torch.distributed as dist

from megatron_gtpo.checkpoint.manifest import DamagedCheckpoint, find_damage
from megatron_gtpo.checkpoint.megatron_checkpoint import (HF_FILES_DIR, LATEST, load_model_state, save_checkpoint,
                                                          series_members)
from megatron_gtpo.config import RolloutConfig, config_text, save_config, to_dict

STEP_PREFIX = "step_"
TRAINER_STATE = "trainer_state.json"
# chained_optim_avoid_prefix: a mixture-of-experts model's optimizer is a chain of two at EP > 1 (its experts'
# gradients reduce over another group) and one at EP = 1; without megatron's chained_<i> key prefix the state's keys
# are the parameters' alone, so a checkpoint resumes at another EP (a dense model's has one optimizer either way).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


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


def _sharded_state(trainer, *, loading_from: str | None = None) -> dict:
    """The model chunks' and the optimizer's sharded state (the optimizer's refers to the model's); to be filled from
    the checkpoint `loading_from`, as much of the model's as it holds (`model_state_to_load`)."""
    from megatron_gtpo.checkpoint.megatron_checkpoint import model_sharded_state_dict, model_state_to_load

    policy = trainer.policy
    if loading_from is not None:
        # A fresh torch Adam has no per-parameter state (no 'step'), and the DistributedOptimizer's state_dict
        # needs one; megatron-core's own loader fills it with placeholder values that the load then overwrites.
        for optimizer in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
            optimizer._init_optimizer_states_with_dummy_values()
        model = model_state_to_load(loading_from, policy.chunks)
    else:
        model = model_sharded_state_dict(policy.chunks)
    optimizer = policy.optimizer.sharded_state_dict(
        {k: v for sd in model.values() for k, v in sd.items()} if len(model) > 1 else model["model"],
        is_loading=loading_from is not None, metadata=_OPTIMIZER_METADATA)
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
    for opt, live_groups in zip(optimizers, live_hyperparameters):
        for group, live in zip(opt.optimizer.param_groups, live_groups, strict=True):
            group.update(live)
    # megatron-core hands every parameter the SAME 'step' tensor, and torch's Adam increments each parameter's step
    # in place: without separate copies the step (and with it Adam's bias correction) races ahead after a resume.
    for opt in patched:
        for param_state in opt.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()


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


def _layout(parallel) -> dict:
    """What a resume compares to decide whether the RNG states still apply. The experts' layout is part of it only
    where it is not a dense model's (the same entries as before experts existed otherwise)."""
    layout = {"tensor": parallel.tp_size, "pipeline": parallel.pp_size, "data": parallel.dp_size,
              "world": parallel.world_size}
    if parallel.ep_size > 1 or parallel.etp_size != parallel.tp_size:
        layout.update(expert=parallel.ep_size, expert_tensor=parallel.etp_size)
    return layout


def save(trainer, step: int) -> str:
    """Write the trainer's checkpoint after `step` steps (collective); returns its directory."""
    cfg, parallel = trainer.cfg, trainer.parallel
    root = cfg.checkpoint_dir
    directory = os.path.join(root, f"{STEP_PREFIX}{step:08d}")
    state = _sharded_state(trainer)
    trainer_state = {"step": step, "loader": trainer.loader.state_dict(),
                     "scheduler": trainer.policy.scheduler.state_dict(), "layout": _layout(parallel),
                     "hf_config": trainer.task.hf_config, "vocab_size": trainer.vocab_size, "config": to_dict(cfg)}
    hf_files = cfg.model.hf_dir or (os.path.join(cfg.model.load, HF_FILES_DIR) if cfg.model.load else None)
    save_checkpoint(directory, trainer.policy.chunks, hf_config=trainer.task.hf_config,
                    model_state={k: v for k, v in state.items() if k != "optimizer"},
                    extra_sharded_state={"optimizer": state["optimizer"]}, extra_metadata={"step": step},
                    hf_files_from=hf_files,
                    files={TRAINER_STATE: json.dumps(trainer_state, indent=1), "config.yaml": config_text(cfg)},
                    rank_files={os.path.join("rng", f"rank_{parallel.world_rank:05d}.pt"): _rng_state(),
                                **_rollouts_in_flight(trainer)},
                    force=True, keep_last=cfg.checkpoint.keep_last)
    if parallel.world_rank == 0:
        save_config(cfg, os.path.join(root, "config.yaml"))
    return directory


def _rollouts_in_flight(trainer) -> dict:
    """The batches asked for and not yet trained on and the unfinished groups (rollout_queue.py), waited for: with
    bounded staleness or partial rollouts only."""
    if not _holds_rollouts(trainer.cfg.rollout):
        return {}
    return {_rollouts_file(trainer.parallel): trainer.rollouts.state_dict()}


def _holds_rollouts(rollout: RolloutConfig) -> bool:
    return bool(rollout.max_staleness or rollout.partial_rollouts)


def _rollouts_file(parallel) -> str:
    return os.path.join("rollouts", f"rank_{parallel.world_rank:05d}.pt")


ROLLOUT_SCHEDULE_KEYS = ("max_staleness", "partial_rollouts", "partial_segment_tokens")


def check_rollout_schedule(saved_config: dict, cfg, directory: str) -> None:
    """ValueError naming the settings when the checkpoint `directory` (its config `saved_config`) holds rollouts in
    flight (bounded staleness, partial rollouts) and this run schedules them otherwise: its batches asked for ahead
    and its unfinished groups were made for the saved settings, and would be dropped or trained beyond the new
    staleness bound."""
    defaults = dataclasses.asdict(RolloutConfig())  # for a checkpoint older than a setting
    saved = RolloutConfig(**{key: saved_config["rollout"].get(key, defaults[key]) for key in ROLLOUT_SCHEDULE_KEYS})
    if not _holds_rollouts(saved):
        return
    changed = [f"rollout.{key} {getattr(saved, key)} -> {getattr(cfg.rollout, key)}" for key in ROLLOUT_SCHEDULE_KEYS
               if getattr(saved, key) != getattr(cfg.rollout, key)]
    if changed:
        raise ValueError(f"checkpoint {directory} holds rollouts generated and not yet trained on under other rollout "
                         f"settings than this run's ({', '.join(changed)}): resume it with the checkpoint's, or start "
                         f"a new run from it (model.load, in a new output directory)")


def resume_candidates(root: str) -> list[str]:
    """The checkpoint `latest` names, then the older ones beside it, newest first ([] when there is no `latest`)."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        named = f.read().strip()
    older = [d for d in reversed(series_members(root, STEP_PREFIX)) if d < named]
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


def restore(trainer) -> int:
    """Resume from the newest intact checkpoint (any TP/PP/EP). Returns the step to continue from (0 if none)."""
    from megatron.core import dist_checkpointing

    cfg, parallel = trainer.cfg, trainer.parallel

    def say(text: str) -> None:
        if parallel.world_rank == 0:
            print(text, file=sys.stderr)

    directory = newest_intact_checkpoint(cfg.checkpoint_dir, say=say) if cfg.checkpoint.resume else None
    if directory is None:
        return 0
    with open(os.path.join(directory, TRAINER_STATE), encoding="utf-8") as f:
        state = json.load(f)
    if (state["vocab_size"] != trainer.vocab_size
            or state["hf_config"]["hidden_size"] != trainer.task.hf_config["hidden_size"]):
        raise ValueError(f"checkpoint {directory} is of a different model than the configured one")
    check_rollout_schedule(state["config"], cfg, directory)
    loaded = dist_checkpointing.load(_sharded_state(trainer, loading_from=directory), directory)
    load_model_state(directory, trainer.policy.chunks, loaded)
    _load_optimizer_state(trainer.policy.optimizer, loaded["optimizer"])
    trainer.policy.scheduler.load_state_dict(state["scheduler"])
    trainer.loader.load_state_dict(state["loader"])
    in_flight = os.path.join(directory, _rollouts_file(parallel))
    if os.path.isfile(in_flight) and _holds_rollouts(cfg.rollout):
        if state["layout"] != _layout(parallel):
            raise ValueError(f"checkpoint {directory} holds rollouts generated and not yet trained on at the layout "
                             f"{state['layout']}; resume it at that layout (this run's is {_layout(parallel)})")
        trainer.rollouts.load_state_dict(torch.load(in_flight, weights_only=False), parallel.device)
    rng_file = os.path.join(directory, "rng", f"rank_{parallel.world_rank:05d}.pt")
    if state["layout"] == _layout(parallel) and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    elif parallel.world_rank == 0:
        print(f"resuming {directory} at a different layout ({state['layout']} -> {_layout(parallel)}): RNG states "
              f"are re-seeded, so sampling differs from an uninterrupted run", file=sys.stderr)
    if parallel.world_rank == 0:
        print(f"resumed from {directory} at step {state['step']}", file=sys.stderr)
    return int(state["step"])

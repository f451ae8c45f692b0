"""Trainer checkpoints: model, optimizer (DistributedOptimizer, fully reshardable), LR schedule, data position,
RNG states, step and config, and with bounded staleness or partial rollouts the rollouts generated and not yet
trained on; every K steps, at the end, and on SIGTERM/SIGUSR1 (SLURM pre-emption).

Each component keeps its own state (`state_dict` / `load_state_dict`); the trainer names them (`TrainerState`) and
this module gathers them for the collective checkpoint writer (checkpoint/megatron_checkpoint.save_checkpoint):
<checkpoint dir>/step_00000010/ holds a megatron.core.dist_checkpointing checkpoint (model and optimizer sharded
tensors, readable at any TP/PP), trainer_state.json (the step, the components the same on every rank under their
names, the layout, the model's config), config.yaml, <name>/rank_*.pt (each rank's own components: rng, rollouts),
the checkpoint metadata (so that `score --load`, `model.load` and the converters read it like any converted one) and
manifest.json (every file's size and checksum); `latest` names the newest complete one. The writer renames a
checkpoint into place only when complete, so a crash mid-save never leaves a directory that looks complete; only the
last `keep_last` are kept. A resume checks the checkpoint's files against its manifest first: one damaged on disk
since (a truncated or corrupted shard) is named and passed over for the newest intact one before it.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_gtpo.checkpoint.manifest import DamagedCheckpoint, find_damage
from megatron_gtpo.checkpoint.megatron_checkpoint import LATEST, load_sharded, save_checkpoint, series_members
from megatron_gtpo.checkpoint.sources import SYNTHETIC_TASK
from megatron_gtpo.cli import say_once
from megatron_gtpo.config import TrainConfig, config_text, save_config, to_dict
from megatron_gtpo.distributed import ParallelGroups

from .model_setup import PolicyModel
from .resume_check import check_resume, check_rollout_schedule
from .task import model_source

STEP_PREFIX = "step_"
TRAINER_STATE = "trainer_state.json"


class Stateful(Protocol):
    """A component that saves and restores its own state (torchtitan's Stateful): the prompt loader, the LR
    schedule, the rollouts in flight, the RNG states."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainerState:
    """What a trainer checkpoint saves and a resume restores, gathered by name (Trainer.checkpoint_state), and what
    the checkpoint is of. A new component adds its entry there, under its name:
    - `policy`: the model and the optimizer, sharded over the ranks (PolicyModel.sharded_state_dict), resumable at
      any TP/PP/EP;
    - `shared`: the same on every rank (its state is JSON), in trainer_state.json under its name;
    - `per_rank`: this rank's own, in <name>/rank_<world rank>.pt (its tensors on the host); meaningful only at the
      layout it was saved at, so a resume at another layout is refused. A component absent here is not
      restored even if the checkpoint holds its files, and one the checkpoint lacks keeps its fresh state.
    The RNG states (`RngStates`) are per rank too, and the checkpoint's own: at another layout they are re-seeded."""

    cfg: TrainConfig
    parallel: ParallelGroups
    policy: PolicyModel
    hf_config: dict
    vocab_size: int
    shared: dict[str, Stateful]
    per_rank: dict[str, Stateful] = field(default_factory=dict)


class StopSignal:
    """Remembers SIGTERM / SIGUSR1 (SLURM pre-emption) and a first SIGINT (Ctrl-C, which torchrun passes on to every
    rank): the loop checkpoints and exits after the step in progress, so no step is lost (`saves`: False where the
    run saves no checkpoint, checkpoint.save_every -1: it only exits). A second Ctrl-C aborts (KeyboardInterrupt:
    cli.run_cli ends the process with one line)."""

    def __init__(self):
        self.requested = False

    @classmethod
    def install(cls, *, saves: bool = True) -> "StopSignal":
        stop = cls()
        then = "checkpoint after this step and exit" if saves else "exit after this step (checkpoint.save_every -1)"

        def handler(signum, frame):
            if signum == signal.SIGINT and stop.requested:
                raise KeyboardInterrupt
            stop.requested = True
            again = "; Ctrl-C again to abort" if signum == signal.SIGINT else ""
            say_once(f"received {signal.Signals(signum).name}: will {then}{again}")

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, handler)
        return stop

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank was signalled (signals reach ranks at slightly different times).
        `device`: the default group's (an NCCL group takes no host tensors)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class RngStates:
    """This process's random number generators: Python's, torch's, megatron's tracker (its model-parallel seeds) and
    CUDA's where there is one."""

    def state_dict(self) -> dict:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state = {"python": random.getstate(), "torch": torch.get_rng_state(),
                 "tracker": get_cuda_rng_tracker().get_states()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        get_cuda_rng_tracker().set_states(state["tracker"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


RNG = "rng"


def _layout(parallel: ParallelGroups) -> dict:
    """What a resume compares to decide whether the per-rank states still apply. The experts' layout is part of it
    only where it is not a dense model's (the same entries as before experts existed otherwise)."""
    layout = {"tensor": parallel.tp_size, "pipeline": parallel.pp_size, "data": parallel.dp_size,
              "world": parallel.world_size}
    if parallel.ep_size > 1 or parallel.etp_size != parallel.tp_size:
        layout.update(expert=parallel.ep_size, expert_tensor=parallel.etp_size)
    return layout


def _rank_file(name: str, parallel: ParallelGroups) -> str:
    return os.path.join(name, f"rank_{parallel.world_rank:05d}.pt")


def save(state: TrainerState, step: int) -> str:
    """Write the trainer's checkpoint after `step` steps (collective); returns its directory."""
    cfg, parallel = state.cfg, state.parallel
    root = cfg.checkpoint_dir
    directory = os.path.join(root, f"{STEP_PREFIX}{step:08d}")
    sharded = state.policy.sharded_state_dict()
    trainer_state = {"step": step, **{name: c.state_dict() for name, c in state.shared.items()},
                     "layout": _layout(parallel), "hf_config": state.hf_config, "vocab_size": state.vocab_size,
                     "config": to_dict(cfg)}
    per_rank = {RNG: RngStates(), **state.per_rank}
    hf_files = model_source(cfg).tokenizer_dir if cfg.model.hf_dir or cfg.model.load else None
    save_checkpoint(directory, state.policy.chunks, hf_config=state.hf_config,
                    model_state={k: v for k, v in sharded.items() if k != "optimizer"},
                    extra_sharded_state={"optimizer": sharded["optimizer"]},
                    extra_metadata={"step": step, **_synthetic_task(cfg)},
                    hf_files_from=hf_files,
                    files={TRAINER_STATE: json.dumps(trainer_state, indent=1), "config.yaml": config_text(cfg)},
                    # the rollouts in flight are waited for here (rollout_queue.RolloutQueue.state_dict)
                    rank_files={_rank_file(name, parallel): c.state_dict() for name, c in per_rank.items()},
                    force=True, keep_last=cfg.checkpoint.keep_last)
    if parallel.world_rank == 0:
        save_config(cfg, os.path.join(root, "config.yaml"))
    return directory


def _synthetic_task(cfg) -> dict:
    """The synthetic task in a checkpoint's metadata (its tokenizer is built in code: evaluate and the HF export
    read the task from there), with the response length its run sampled."""
    if cfg.data.source != "synthetic":
        return {}
    return {SYNTHETIC_TASK: cfg.data.task, "max_new_tokens": cfg.rollout.max_new_tokens}


def resume_candidates(root: str) -> list[str]:
    """The checkpoint `latest` names, then the older ones beside it, newest first ([] when there is no `latest`)."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        named = f.read().strip()
    older = [d for d in reversed(series_members(root, STEP_PREFIX)) if d < named]
    return [os.path.join(root, d) for d in (named, *older)]


def relaunch_check(cfg: TrainConfig) -> str | None:
    """Before anything is built (every rank reads the same files, no collective): ValueError when the checkpoint
    `latest` names was trained with settings this run may not change (resume_check.check_resume); a message when it
    has nothing left to do (its step is this run's `steps`); None otherwise, also when there is no checkpoint or its
    state does not read (`restore` then passes over a damaged one)."""
    candidates = resume_candidates(cfg.checkpoint_dir) if cfg.checkpoint.resume else []
    if not candidates:
        return None
    try:
        with open(os.path.join(candidates[0], TRAINER_STATE), encoding="utf-8") as f:
            saved = json.load(f)
        step, saved_config = int(saved["step"]), saved["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    check_resume(saved_config, cfg, candidates[0])
    if step < cfg.steps:
        return None
    return (f"nothing left to do: {candidates[0]} is at step {step} of this run's steps = {cfg.steps}. To train on, "
            f"raise steps (--set steps=N); to start a new run, give it another logging.output_dir")


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


def restore(state: TrainerState) -> int:
    """Resume from the newest intact checkpoint (any TP/PP/EP). Returns the step to continue from (0 if none)."""
    cfg, parallel = state.cfg, state.parallel

    def say(text: str) -> None:
        if parallel.world_rank == 0:
            print(text, file=sys.stderr)

    directory = newest_intact_checkpoint(cfg.checkpoint_dir, say=say) if cfg.checkpoint.resume else None
    if directory is None:
        return 0
    with open(os.path.join(directory, TRAINER_STATE), encoding="utf-8") as f:
        saved = json.load(f)
    if (saved["vocab_size"] != state.vocab_size
            or saved["hf_config"]["hidden_size"] != state.hf_config["hidden_size"]):
        raise ValueError(f"checkpoint {directory} is of a different model than the configured one")
    check_resume(saved["config"], cfg, directory)
    check_rollout_schedule(saved["config"], cfg, directory)
    loaded = load_sharded(state.policy.sharded_state_dict(loading_from=directory), directory)
    state.policy.load_sharded_state_dict(loaded, directory)
    for name, component in state.shared.items():
        component.load_state_dict(saved[name])
    same_layout = saved["layout"] == _layout(parallel)
    for name, component in state.per_rank.items():
        path = os.path.join(directory, _rank_file(name, parallel))
        if not os.path.isfile(path):
            continue  # written by a run without it (e.g. the rollouts in flight of a run without staleness)
        if not same_layout:
            raise ValueError(f"checkpoint {directory} holds {name} state of each rank at the layout "
                             f"{saved['layout']}; resume it at that layout (this run's is {_layout(parallel)})")
        component.load_state_dict(torch.load(path, weights_only=False))
    rng_file = os.path.join(directory, _rank_file(RNG, parallel))
    if same_layout and os.path.isfile(rng_file):
        RngStates().load_state_dict(torch.load(rng_file, weights_only=False))
    elif parallel.world_rank == 0:
        print(f"resuming {directory} at a different layout ({saved['layout']} -> {_layout(parallel)}): RNG states "
              f"are re-seeded, so sampling differs from an uninterrupted run", file=sys.stderr)
    if parallel.world_rank == 0:
        print(f"resumed from {directory} at step {saved['step']}", file=sys.stderr)
    return int(saved["step"])

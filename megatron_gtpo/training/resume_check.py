"""Which settings a resumed run may change: a checkpoint continues the run that wrote it, in its output directory
and metrics.jsonl, so what that run trains may not change when it is relaunched.

Fixed on resume (`FIXED_ON_RESUME`): the algorithm and its reward shaping (the whole `algorithm` section), routing
replay (`model.moe.routing_replay`), the group size (`rollout.num_responses_per_prompt`), and the data (its source,
file, fields, template, prompt length limit, shuffle seed and prompts per step). A relaunch that changes any of them is
refused with one line naming each changed key and how to start a new run instead. With rollouts in flight (bounded
staleness, partial rollouts) their schedule, the whole `rollout.schedule` section, is fixed too
(`check_rollout_schedule`).

Free to change: `steps` (a finished run is extended by raising it), the optimizer and its LR schedule (they apply on
resume), checkpointing and logging, the parallel layout (checkpoints reshard), the rollout engine and its resources,
the sampling temperature and response length, micro-batching and packing (the update does not depend on them:
docs/loss_contract.md), the reward workers.

Pure functions of the configs (the checkpoint's as saved in its trainer_state.json, read in today's keys:
config.upgrade_saved_config, and this run's).
"""
from __future__ import annotations

import dataclasses
import json

from megatron_gtpo.config import ScheduleConfig, TrainConfig, to_dict, upgrade_saved_config

FIXED_ON_RESUME = ("algorithm", "model.moe.routing_replay", "rollout.num_responses_per_prompt", "data.source",
                   "data.task", "data.path", "data.prompt_field", "data.answer_field", "data.template",
                   "data.max_prompt_tokens", "data.seed", "data.prompts_per_step")


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"a.b": value} of a nested dict, as JSON reads it back (tuples as lists)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _fixed(key: str) -> bool:
    return any(key == fixed or key.startswith(fixed + ".") for fixed in FIXED_ON_RESUME)


def check_resume(saved_config: dict, cfg: TrainConfig, directory: str) -> None:
    """ValueError naming every fixed setting (FIXED_ON_RESUME) this run changes from the checkpoint `directory`'s
    (its config `saved_config`), and how to start a new run instead. A key the checkpoint's config lacks (written
    before the key existed) counts as its default."""
    defaults = _flat(json.loads(json.dumps(to_dict(TrainConfig()))))
    saved = {**defaults, **_flat(upgrade_saved_config(saved_config))}
    current = _flat(json.loads(json.dumps(to_dict(cfg))))
    changed = [f"{key} {saved[key]!r} -> {value!r}" for key, value in current.items()
               if _fixed(key) and saved.get(key) != value]
    if changed:
        raise ValueError(f"{directory} was trained with other settings than this run's ({', '.join(changed)}), "
                         f"which a resumed run may not change: to start a new run, give it another "
                         f"logging.output_dir (with model.load={directory} to start from these weights)")


def check_rollout_schedule(saved_config: dict, cfg, directory: str) -> None:
    """ValueError naming the settings when the checkpoint `directory` (its config `saved_config`) holds rollouts in
    flight (bounded staleness, partial rollouts) and this run's `rollout.schedule` differs from its: its batches
    asked for ahead and its unfinished groups were made under the saved schedule, and would be dropped, trained
    beyond the new staleness bound or asked for again otherwise. A checkpoint older than the section (or a key of it)
    is read in today's keys, its missing keys at their defaults (config.upgrade_saved_config)."""
    schedule = upgrade_saved_config(saved_config).get("rollout", {}).get("schedule", {})
    saved = dataclasses.replace(ScheduleConfig(), **{key: tuple(value) if isinstance(value, list) else value
                                                     for key, value in schedule.items()})
    if not saved.holds_rollouts:
        return
    changed = [f"rollout.schedule.{f.name} {getattr(saved, f.name)} -> {getattr(cfg.rollout.schedule, f.name)}"
               for f in dataclasses.fields(ScheduleConfig)
               if getattr(saved, f.name) != getattr(cfg.rollout.schedule, f.name)]
    if changed:
        raise ValueError(f"checkpoint {directory} holds rollouts generated and not yet trained on under another "
                         f"rollout schedule than this run's ({', '.join(changed)}): resume it with the checkpoint's, "
                         f"or start a new run from it (model.load, in a new output directory)")

"""The per-step metrics, combined over data-parallel ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms.rollout_correction import MISMATCH_METRICS

from .experience import Experience
from .metrics import PhaseTimer
from .step_batch import StepBatch


def _token_sums(batch: StepBatch) -> dict:
    """(sum, count) pairs over response tokens, on the last pipeline stage (where the old-policy pass put entropies
    and log-probs): one device tensor, one host sync."""
    if batch.entropy_ST is None:
        return {}
    mask = batch.mask_ST
    correct_S1 = (batch.per_sequence(batch.correct_NG) == 1)[:, None]
    correct, failed = mask & correct_S1, mask & ~correct_S1
    mismatch = (batch.rollout_logprobs_ST - batch.old_logprobs_ST).abs()
    num_tokens = mask.sum()
    pairs = {
        "entropy": (batch.entropy_ST[mask].sum(), num_tokens),
        "entropy_correct": (batch.entropy_ST[correct].sum(), correct.sum()),
        "entropy_failed": (batch.entropy_ST[failed].sum(), failed.sum()),
        "logprob_mismatch": (mismatch[mask].sum(), num_tokens),
        **{key: (batch.mismatch_sums[key], batch.mismatch_sums["num_tokens"]) for key in MISMATCH_METRICS},
    }
    values = torch.stack([torch.stack([total.double(), count.double()]) for total, count in pairs.values()]).tolist()
    return dict(zip(pairs, map(tuple, values)))


_UPDATE_KEYS = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl", "pg_loss", "ratio_mean",
                "ratio_max", "ratio_min", "grad_norm", "grad_norm_max", "update_successful", "padding_fraction",
                "optimizer_steps", "empty_mini_batches")
_OPTIONAL_UPDATE_KEYS = ("ref_kl",)


def step_metrics(run, exp: Experience, batch: StepBatch, update: dict, timer: PhaseTimer) -> dict:
    groups = run.groups
    local = {"rollout": (exp.stats, exp.stats["groups_generated"]), "token": _token_sums(batch)}
    gathered = [None] * groups.dp_size
    dist.all_gather_object(gathered, local, group=groups.dp_group)
    out = {}
    weights = sum(part["rollout"][1] for part in gathered)
    for key in ("reward_mean", "accuracy", "response_length_mean", "response_clip_ratio"):
        out[key] = sum(p["rollout"][0][key] * p["rollout"][1] for p in gathered) / max(weights, 1)
    out["response_length_max"] = max(p["rollout"][0]["response_length_max"] for p in gathered)
    out["groups_kept"] = sum(p["rollout"][0]["groups_kept"] for p in gathered)
    out["no_group_kept"] = int(out["groups_kept"] == 0)  # then the token and update statistics have no value
    out["groups_generated"] = sum(p["rollout"][0]["groups_generated"] for p in gathered)
    out["sampling_rounds"] = max(p["rollout"][0]["sampling_rounds"] for p in gathered)
    for key, name in (("entropy", "entropy_mean"), ("entropy_correct", "entropy_correct_mean"),
                      ("entropy_failed", "entropy_failed_mean"), ("logprob_mismatch", "rollout_logprob_mismatch"),
                      *((key, key) for key in MISMATCH_METRICS)):
        total, count = (sum(p["token"].get(key, (0.0, 0))[i] for p in gathered) for i in (0, 1))
        out[name] = total / count if count else float("nan")
    # Every update metric the losses report (NaN when no micro-batch reported it, e.g. every mini-batch was empty).
    out.update({key: update.get(key, float("nan")) for key in _UPDATE_KEYS})
    out.update({key: update[key] for key in _OPTIONAL_UPDATE_KEYS if key in update})
    out["lr"] = run.policy.optimizer.param_groups[0]["lr"]
    response_tokens = out["response_length_mean"] * weights * exp.group_size
    step_time = sum(timer.seconds.values())
    out["tokens_per_s"] = response_tokens / step_time if step_time else float("nan")
    out.update({f"time_{k}_s": v for k, v in timer.seconds.items()})
    return out

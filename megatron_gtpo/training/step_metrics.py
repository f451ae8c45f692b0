"""The per-step metrics of ../shared/specs/algorithms.md, combined over data-parallel ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .experience import Experience
from .metrics import PhaseTimer


def _entropy_and_mismatch(exp: Experience) -> dict:
    """Sums and counts on the last pipeline stage (where the old-policy pass put entropies and log-probs)."""
    if exp.entropy_NGT is None:
        return {}
    mask = exp.mask_NGT()
    correct = (exp.correct_NG == 1)[..., None] & mask
    failed = (exp.correct_NG != 1)[..., None] & mask
    rollout = torch.zeros_like(exp.old_logprobs_NGT)
    for n, group in enumerate(exp.responses):
        for g, r in enumerate(group):
            rollout[n, g, :len(r.logprobs)] = torch.tensor(r.logprobs)
    return {
        "entropy": (exp.entropy_NGT[mask].sum().item(), mask.sum().item()),
        "entropy_correct": (exp.entropy_NGT[correct].sum().item(), correct.sum().item()),
        "entropy_failed": (exp.entropy_NGT[failed].sum().item(), failed.sum().item()),
        "logprob_mismatch": ((rollout - exp.old_logprobs_NGT).abs()[mask].sum().item(), mask.sum().item()),
    }


_UPDATE_KEYS = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl", "pg_loss", "ratio_mean",
                "ratio_max", "ratio_min", "grad_norm", "grad_norm_max", "update_successful", "padding_fraction",
                "optimizer_steps", "empty_mini_batches")
_OPTIONAL_UPDATE_KEYS = ("ref_kl",)


def step_metrics(run, exp: Experience, update: dict, timer: PhaseTimer) -> dict:
    groups = run.groups
    local = {"rollout": (exp.stats, exp.stats["groups_generated"]), "token": _entropy_and_mismatch(exp)}
    gathered = [None] * groups.dp_size
    dist.all_gather_object(gathered, local, group=groups.dp_group)
    out = {}
    weights = sum(part["rollout"][1] for part in gathered)
    for key in ("reward_mean", "accuracy", "response_length_mean", "response_clip_ratio"):
        out[key] = sum(p["rollout"][0][key] * p["rollout"][1] for p in gathered) / max(weights, 1)
    out["response_length_max"] = max(p["rollout"][0]["response_length_max"] for p in gathered)
    out["groups_kept"] = sum(p["rollout"][0]["groups_kept"] for p in gathered)
    out["groups_generated"] = sum(p["rollout"][0]["groups_generated"] for p in gathered)
    out["sampling_rounds"] = max(p["rollout"][0]["sampling_rounds"] for p in gathered)
    scored = [p["rollout"][0]["old_logprob_padding_fraction"] for p in gathered
              if "old_logprob_padding_fraction" in p["rollout"][0]]
    out["old_logprob_padding_fraction"] = sum(scored) / len(scored) if scored else float("nan")
    for key, name in (("entropy", "entropy_mean"), ("entropy_correct", "entropy_correct_mean"),
                      ("entropy_failed", "entropy_failed_mean"), ("logprob_mismatch", "rollout_logprob_mismatch")):
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

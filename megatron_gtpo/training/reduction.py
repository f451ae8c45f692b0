"""Every logged metric with its reduction, and the one reducer that gathers them over data-parallel ranks.

A metric is declared once in METRICS: summed, the largest, the smallest, or a mean weighted by a named count
(response tokens, the loss's terms, generated responses, optimizer steps, padded tokens...). Phases record values
into a `MetricReducer` as the step goes, on the device (no host read per micro-batch); at the end of the step
`reduce` makes one all-gather over the data-parallel group and one host read for every metric at once. A metric
declared `over_world` (the phase times: pipeline stages and TP ranks differ in them) is a largest or smallest over
every rank instead, through one more small collective, an all-reduce over the default process group.

A metric no rank recorded this step is NaN (written as null), or left out when it is declared optional.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms.rollout_correction import STALENESS_METRICS
from megatron_gtpo.algorithms.token_selection import SELECTION_METRICS


class Reduce(str, enum.Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    MEAN = "mean"  # sum of value x weight over sum of weight


@dataclass(frozen=True)
class Metric:
    reduce: Reduce
    weight: str | None = None  # MEAN: the name of the count each recorded value stands for
    kind: type = float  # what the reduced value is written as (int counts, bool flags)
    optional: bool = False  # left out of the step's metrics when no rank recorded it
    over_world: bool = False  # MAX / MIN over every rank (the default group), not over the data-parallel group

    def __post_init__(self):
        if self.over_world and self.reduce not in (Reduce.MAX, Reduce.MIN):
            raise ValueError(f"only a MAX or MIN metric can be reduced over the world, not a {self.reduce.value}")


def _mean(weight: str, **kw) -> Metric:
    return Metric(Reduce.MEAN, weight, **kw)


SUM, MAX, MIN = Metric(Reduce.SUM), Metric(Reduce.MAX), Metric(Reduce.MIN)
# Replicated values (the same on every rank: learning rate, optimizer steps) are declared MAX.
METRICS: dict[str, Metric] = {
    # The rollout, over every response generated this step (dynamic sampling's dropped groups included).
    "reward_mean": _mean("responses"),
    "accuracy": _mean("responses"),
    "response_length_mean": _mean("responses"),
    "response_clip_ratio": _mean("responses"),
    "response_length_max": MAX,
    "groups_kept": Metric(Reduce.SUM, kind=int),
    "groups_generated": Metric(Reduce.SUM, kind=int),
    "sampling_rounds": Metric(Reduce.MAX, kind=int),
    # Bounded staleness (rollout.schedule.max_staleness) and partial rollouts, over the kept responses: steps between
    # the policy that sampled a response's first token and the one it trains; the fraction of responses continued over
    # several engine calls; the fraction of kept response tokens an earlier policy sampled; the groups left unfinished
    # for a later step.
    "staleness_mean": _mean("kept_responses"),
    "staleness_max": Metric(Reduce.MAX, kind=int, optional=True),
    "continued_fraction": _mean("kept_responses"),
    "stale_token_fraction": _mean("kept_tokens"),
    "groups_unfinished": Metric(Reduce.SUM, kind=int, optional=True),
    # Informative groups beyond a step's need (dynamic sampling): kept this step from the previous step's, carried
    # over to the next step, dropped as too old for it (rollout_queue.py).
    "groups_from_carry": Metric(Reduce.SUM, kind=int),
    "groups_carried": Metric(Reduce.SUM, kind=int),
    "groups_dropped_stale": Metric(Reduce.SUM, kind=int),
    # Further rounds asked for ahead (rollout.schedule.rounds_ahead; logged only then, rollout_queue.py): the step's
    # further rounds served from them and asked for on the spot (the same on every rank), and the prompt groups of the
    # rounds held for the next steps.
    "rounds_served_ahead": Metric(Reduce.MAX, kind=int, optional=True),
    "rounds_on_the_spot": Metric(Reduce.MAX, kind=int, optional=True),
    "groups_asked_ahead": Metric(Reduce.SUM, kind=int, optional=True),
    # The old-policy pass over the kept response tokens: weighted by tokens (correct / failed: those tokens only).
    "entropy_mean": _mean("tokens"),
    "entropy_correct_mean": _mean("correct_tokens"),
    "entropy_failed_mean": _mean("failed_tokens"),
    "rollout_logprob_mismatch": _mean("tokens"),
    "mismatch_kl": _mean("tokens"),
    "token_mult_prob_error": _mean("tokens"),
    "rollout_is_weight_mean": _mean("tokens"),
    "rollout_is_capped_fraction": _mean("tokens"),
    "rollout_rs_masked_fraction": _mean("tokens"),
    # With rollouts that may be stale (rollout.schedule.max_staleness, partial rollouts), by the staleness of the token:
    # the mean log-ratio old - rollout of tokens 0, 1, 2+ versions old, and the mismatch on the current version's
    # tokens.
    **{name: _mean(weight, optional=True) for name, weight in STALENESS_METRICS.items()},
    # The token selections (Clip-Cov, KL-Cov, the high-entropy fraction), where configured: each computed over a whole
    # mini-batch (the same on every rank), weighted by the mini-batch's valid tokens (algorithms/token_selection.py).
    **{name: _mean("selected_tokens", optional=True) for name in SELECTION_METRICS},
    # The update. Fractions and the mean ratio count the loss's terms: tokens for a token-level loss, sequences for
    # the sequence-level one; the KL estimates count tokens.
    "pg_loss": SUM,  # each micro-batch's share of its optimizer step's loss / the optimizer steps: the mean per step
    "sft_loss": SUM,  # the warm start's, likewise
    "clip_frac_low": _mean("loss_terms"),
    "clip_frac_high": _mean("loss_terms"),
    "dual_clip_frac": _mean("loss_terms"),
    "ratio_mean": _mean("loss_terms"),
    "ratio_max": MAX,
    "ratio_min": MIN,
    "approx_kl": _mean("tokens"),
    "ref_kl": _mean("tokens", optional=True),
    "kl_cov_abs_log_ratio": _mean("tokens", optional=True),  # KL-Cov's mean |log pi_theta / pi_old| (losses.py)
    "num_tokens": SUM,  # the warm start's supervised tokens
    "grad_norm": _mean("optimizer_steps"),  # the same on every rank: the mean over the step's optimizer steps
    "grad_norm_max": MAX,
    "update_successful": Metric(Reduce.MIN, kind=bool),
    "optimizer_steps": Metric(Reduce.MAX, kind=int),
    "empty_mini_batches": Metric(Reduce.MAX, kind=int),  # counted from DP-wide token counts: the same everywhere
    "padding_fraction": _mean("padded_tokens"),  # of the micro-batch plan the old-policy pass and the update ran
    "lr": MAX,
    # Wall time of the step's phases (training/metrics.PhaseTimer): the slowest rank's, of all ranks.
    **{f"time_{phase}_s": Metric(Reduce.MAX, over_world=True)
       for phase in ("generate", "reward", "step_batch", "old_logprob", "advantages", "update", "sync")},
    # Every token the engines generated in the step's answers (partial segments, groups later dropped or carried
    # over included; rollout_queue.py), and per second of the step: each replica's, summed (the run's throughput).
    "tokens_generated": Metric(Reduce.SUM, kind=int),
    "tokens_per_s": SUM,
    # The seconds the rollout engines spent generating the step's answers, each replica's (its engine's, a server's
    # generation wall time), summed; and per second of the step: the mean over replicas, and the least busy one's.
    "rollout_busy_s": SUM,
    "rollout_busy_fraction": _mean("replicas"),
    "rollout_busy_fraction_min": MIN,
}
def moe_metrics(num_layers: int) -> dict[str, Metric]:
    """A mixture-of-experts model's routing metrics (of the old-policy pass, `moe_layer_values`) per layer 1..
    num_layers (megatron's numbers), and the largest imbalance over layers. Each is measured over the step's global
    batch by the ranks of its layer's pipeline stage (the same value on all of them), hence the largest over every
    rank."""
    per_layer = Metric(Reduce.MAX, optional=True, over_world=True)
    names = [f"{name}/layer_{layer:02d}" for layer in range(1, num_layers + 1)
             for name in ("expert_load_imbalance", "router_entropy")] + ["expert_load_imbalance_max"]
    return dict.fromkeys(names, per_layer)


def moe_layer_values(per_layer: dict[int, tuple[float, float]]) -> dict:
    """The metrics of `moe_metrics` from models/moe_routing.RouterStatistics.per_layer's values (this
    rank's layers; already reduced over the data-parallel group)."""
    values = {}
    for layer, (imbalance, entropy) in per_layer.items():
        values[f"expert_load_imbalance/layer_{layer:02d}"] = imbalance
        values[f"router_entropy/layer_{layer:02d}"] = entropy
    if per_layer:
        values["expert_load_imbalance_max"] = max(imbalance for imbalance, _ in per_layer.values())
    return values


WARM_START_METRICS = ("sft_loss", "num_tokens", "grad_norm", "grad_norm_max", "update_successful", "optimizer_steps")
STEP_METRICS = tuple(name for name in METRICS if name not in ("sft_loss", "num_tokens"))


class MetricReducer:
    """Collects one step's metrics on this rank; `reduce` combines them over the data-parallel group (`over_world`
    ones over every rank). Values and weights may be Python numbers or 0-dim device tensors (those stay on the
    device until `reduce`)."""

    def __init__(self, device: torch.device, names: tuple[str, ...] = STEP_METRICS,
                 declared: dict[str, Metric] = METRICS):
        self.declared = declared
        self.names = list(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._device = device
        k = len(self.names)
        self._numerators = torch.zeros(k, dtype=torch.float64, device=device)
        self._extremes = torch.full((k,), -torch.inf, dtype=torch.float64, device=device)  # MAX of v, MIN as -v
        self._weights = torch.zeros(k, dtype=torch.float64, device=device)  # MEAN: the sum of the weights
        self._counts = torch.zeros(k, dtype=torch.float64, device=device)  # how many values were recorded

    def add(self, values: dict, weights: dict | None = None) -> None:
        """Record `values` (name -> value); a MEAN metric takes its declared weight from `weights` (name of the
        count -> count)."""
        self._record(values, weights, totals=False)

    def add_totals(self, totals: dict, weights: dict) -> None:
        """Record MEAN metrics given as totals over their weight (sum of value x weight), e.g. a sum over tokens."""
        self._record(totals, weights, totals=True)

    def _record(self, values: dict, weights: dict | None, *, totals: bool) -> None:
        for name, value in values.items():
            if name not in self._index:
                raise KeyError(f"metric {name!r} is not declared for this reducer (training/reduction.py METRICS)")
            metric, i = self.declared[name], self._index[name]
            value = torch.as_tensor(value, dtype=torch.float64).to(self._device)
            self._counts[i] += 1
            if metric.reduce is Reduce.MEAN:
                if weights is None or metric.weight not in weights:
                    raise KeyError(f"metric {name!r} is a mean weighted by {metric.weight!r}, which was not given")
                weight = torch.as_tensor(weights[metric.weight], dtype=torch.float64).to(self._device)
                self._numerators[i] += value if totals else value * weight
                self._weights[i] += weight
            elif totals:
                raise ValueError(f"metric {name!r} is a {metric.reduce.value}, not a mean: record it with add()")
            elif metric.reduce is Reduce.SUM:
                self._numerators[i] += value
            else:
                signed = value if metric.reduce is Reduce.MAX else -value
                self._extremes[i] = torch.maximum(self._extremes[i], signed)

    def reduce(self, dp_group) -> dict:
        """Every declared metric over the data-parallel group, the `over_world` ones over every rank (collective
        over the default group: every rank calls it; one all-gather, one all-reduce when this reducer has an
        `over_world` metric, one host read)."""
        local = torch.stack([self._numerators, self._weights, self._counts, self._extremes])
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(parts, local, group=dp_group)
        gathered = torch.stack(parts)  # [DP, 4, K]
        summed = torch.cat([gathered[:, :3].sum(0), gathered[:, 3:].amax(0)])
        world = [i for i, name in enumerate(self.names) if self.declared[name].over_world]
        if world:
            # Whether any rank recorded it, and the extreme: both a MAX, so one all-reduce carries them.
            index = torch.tensor(world, device=self._device)
            over_world = torch.stack([(self._counts[index] > 0).double(), self._extremes[index]])
            dist.all_reduce(over_world, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
            summed[2:, index] = over_world
        numerators, weights, counts, extremes = summed.tolist()
        out = {}
        for i, name in enumerate(self.names):
            metric = self.declared[name]
            if counts[i] == 0:
                if not metric.optional:
                    out[name] = float("nan")
                continue
            value = {Reduce.SUM: numerators[i], Reduce.MAX: extremes[i], Reduce.MIN: -extremes[i],
                     Reduce.MEAN: numerators[i] / weights[i] if weights[i] else float("nan")}[metric.reduce]
            out[name] = metric.kind(value)
        return out

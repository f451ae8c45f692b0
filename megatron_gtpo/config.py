"""The run configuration: a typed dataclass tree, loaded from YAML with `--set a.b=c` overrides.

Unknown keys, wrong types and inconsistent settings are errors that name the key (`ConfigError`). The resolved
configuration is written next to the checkpoints (`save_config`).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import types
import typing
from dataclasses import dataclass, field

import yaml

from megatron_gtpo.algorithms.advantages import NORM_SCOPES
from megatron_gtpo.algorithms.losses import SEQUENCE_RATIOS
from megatron_gtpo.algorithms.rollout_correction import ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS
from megatron_gtpo.algorithms.registry import ALGORITHM_NAMES, ALGORITHMS, LENGTH_PENALTIES, resolve_algorithm
from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.config_rules import Features, refused_by
from megatron_gtpo.engine_table import ENGINE_NAMES, ENGINES
from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS
from megatron_gtpo.data.templates import DATA_TEMPLATES
from megatron_gtpo.layout import CP_COMM_TYPES, LayoutError, ParallelLayout, RolloutLayout, check_layout
from megatron_gtpo.models.accelerator import CORE_ATTENTIONS


class ConfigError(ValueError):
    pass


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class MoEConfig:
    """model.moe: the options of a mixture-of-experts model (Qwen3-MoE), read only with one: the trainer refuses a
    setting here on a dense model (validate_for_model)."""

    # "rollout": routing replay, every token of the old-policy pass and the update routed to the experts the rollout
    # engine chose for it (the engines record them); "none": the router chooses again.
    routing_replay: str = "none"  # none | rollout
    # The router's load-balancing loss and z-loss coefficients (models/moe.RouterLosses). Off for RL by default:
    # docs/algorithms.md, "Mixture of experts".
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    @property
    def replays_routing(self) -> bool:
        """Training routes every token to the experts the rollout engine chose for it (routing_replay: rollout)."""
        return self.routing_replay == "rollout"

    def check(self) -> None:
        _need(self.aux_loss_coef >= 0 and self.z_loss_coef >= 0,
              f"model.moe.aux_loss_coef / model.moe.z_loss_coef: must be >= 0, got {self.aux_loss_coef} / "
              f"{self.z_loss_coef}")


@dataclass
class ModelConfig:
    hf_dir: str | None = None  # a Hugging Face Qwen2 / Qwen3 / Qwen3-MoE directory: its model_type picks the family
    load: str | None = None  # or a megatron_gtpo checkpoint directory (converter or trainer output)
    tiny_synthetic: bool = False  # or a tiny random Qwen2 built in code for the synthetic task (the CPU demo)
    # The KL term's reference policy (built when algorithm.kl_coef > 0 or this is set): a HF directory or checkpoint;
    # None: the policy as RL starts (after any warm start), saved once to <checkpoint dir>/reference for resumes.
    reference: str | None = None
    dtype: str = "float32"  # float32 | bfloat16
    recompute_activations: bool = False
    # megatron-core's local layer spec (no Transformer Engine): its core attention, torch's scaled_dot_product_attention
    # ("sdpa", models/sdpa_attention.py) or megatron's "unfused" DotProductAttention (for comparison: it materialises
    # the scores of every head). Transformer Engine's attention ignores it.
    core_attention: str = "sdpa"
    # The vocab-parallel log-prob/entropy op walks the tokens in chunks whose two fp32 [chunk, vocab / TP]
    # workspaces fit this budget (distributed/vocab_parallel.chunk_tokens_for_budget; the planner counts it).
    logprob_workspace_mib: float = 256.0
    moe: MoEConfig = field(default_factory=MoEConfig)  # a mixture-of-experts model's options

    def check(self) -> None:
        _need(sum(x is not None and x is not False for x in (self.hf_dir, self.load, self.tiny_synthetic or None))
              == 1, "model: set exactly one of model.hf_dir, model.load, model.tiny_synthetic")
        _need(self.core_attention in CORE_ATTENTIONS,
              f"model.core_attention: must be one of {list(CORE_ATTENTIONS)}, got {self.core_attention!r}")
        _need(self.logprob_workspace_mib > 0,
              f"model.logprob_workspace_mib: must be > 0, got {self.logprob_workspace_mib}")
        self.moe.check()
        _need(self.reference is None or os.path.isdir(self.reference),
              f"model.reference: {self.reference!r} is not a directory (a HF model directory or a checkpoint)")


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    sequence_parallel: bool = False
    # A mixture-of-experts model's experts: split over `expert` ranks (EP), each expert over `expert_tensor` ranks
    # (ETP; null: parallel.tensor). The rules: layout.check_layout; README, "Expert parallelism".
    expert: int = 1
    expert_tensor: int | None = None
    # Context parallelism (CP): every sequence split over `context` ranks (layout.ParallelLayout); on GPU, Transformer
    # Engine's attention exchanges K/V by `context_comm`: p2p (a ring), all_gather, a2a or a2a+p2p. At CP > 1 the
    # trainer generates on vLLM or rollout servers (config_rules.CROSS_FEATURE_RULES).
    context: int = 1
    context_comm: str = "p2p"

    def check(self) -> None:
        """The layout's rules are layout.check_layout's (validate_layout)."""


@dataclass
class BuiltinEngineConfig:
    """rollout.builtin: the options of the built-in engine in the trainer's processes (rollout.engine: builtin;
    rollout/builtin.py). A built-in rollout server (builtin_remote) takes its own from its command line
    (`python -m megatron_gtpo.rollout.remote_server --max-batch-tokens`), not from this section."""

    # At most this many KV-cache token slots per batch (rows x (longest prompt + max_new_tokens)); null: every row
    # of the replica at once (the planner counts it)
    max_batch_tokens: int | None = None

    def check(self, rollout: RolloutConfig) -> None:
        _need(self.max_batch_tokens is None or self.max_batch_tokens > rollout.max_new_tokens,
              f"rollout.builtin.max_batch_tokens: must exceed rollout.max_new_tokens = {rollout.max_new_tokens} (one "
              f"row's prompt and response), got {self.max_batch_tokens}")


@dataclass
class VLLMEngineConfig:
    """rollout.vllm: the options of the colocated vLLM engines (rollout.engine: vllm; docs/vllm.md). A vLLM rollout
    server (vllm_remote) takes its own from its command line (`python -m megatron_gtpo.rollout.remote_server
    --gpu-memory-utilization / --kv-cache-memory-bytes / --hf-dir / --tensor-parallel-size`), not from this
    section."""

    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None  # a fixed KV-cache size instead of the fraction (use on CPU)
    hf_dir: str | None = None  # HF directory vLLM starts from (default model.hf_dir); weights are then synced
    tensor_parallel: int = 1

    def check(self, rollout: RolloutConfig) -> None:
        _need(self.tensor_parallel >= 1, f"rollout.vllm.tensor_parallel: must be >= 1, got {self.tensor_parallel}")
        _need(0 < self.gpu_memory_utilization <= 1,
              f"rollout.vllm.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        _need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              f"rollout.vllm.kv_cache_memory_bytes: must be > 0 (or unset), got {self.kv_cache_memory_bytes}")


@dataclass
class RemoteEngineConfig:
    """rollout.remote: how the trainer reaches its rollout servers (rollout.engine: vllm_remote or builtin_remote;
    docs/remote_rollout.md). The servers' own engine options are their command line's."""

    # One `python -m megatron_gtpo.rollout.remote_server` (HOST:PORT) per data-parallel replica
    addresses: list[str] = field(default_factory=list)
    connect_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0
    # > 0: a trainer outlives a rollout server's death: it waits this long for a server at the same address, sends it
    # the weights of the last sync and asks again for what was in flight (docs/remote_rollout.md); it keeps a host
    # copy of those weights for it. 15 min: a SLURM requeue of the rollout job (back in the queue, a node, the engine
    # loaded) fits, and it stays under the trainer's 30 min process-group timeout. 0: a dead server ends the run.
    reconnect_timeout_s: float = 900.0
    # How weight buckets reach the servers: auto (NCCL from GPUs, else in the channel's messages), channel, nccl.
    weights: str = "auto"

    def check(self, rollout: RolloutConfig) -> None:
        _need(bool(self.addresses),
              f"rollout.remote.addresses: the {rollout.engine} engine needs one server address (HOST:PORT) per "
              f"data-parallel replica")
        _need(self.reconnect_timeout_s >= 0,
              f"rollout.remote.reconnect_timeout_s: must be >= 0, got {self.reconnect_timeout_s}")
        _need(self.weights in ("auto", "channel", "nccl"),
              f"rollout.remote.weights: auto, channel or nccl, got {self.weights!r}")


@dataclass
class ScheduleConfig:
    """rollout.schedule: when the rollouts are generated against the steps that train on them, the rollout queue's
    options (training/rollout_queue.py; docs/algorithms.md, "Generating while training"). Its own rules are its
    check; those with other sections (the engine, dynamic sampling, the rollout correction, routing replay) are
    config_rules.CROSS_FEATURE_RULES. A run holding rollouts in flight resumes only with the same schedule
    (training/resume_check.py)."""

    # Bounded staleness (docs/algorithms.md, "Generating while training"): step k trains on prompts generated with
    # the policy of step max(0, k - max_staleness); 0 is the on-policy trainer. >= 1 needs engines of their own
    # (vllm_remote, builtin_remote), which then generate the next batches while the current one trains.
    max_staleness: int = 0
    # Partial rollouts (docs/algorithms.md, "Partial rollouts"): an engine call generates at most
    # partial_segment_tokens per response; a group with an unfinished response waits, and the next batch asked for
    # continues it under the weights of then. A response spans at most s = max_new_tokens / partial_segment_tokens
    # policy versions, and is trained at most s x max_staleness versions after its first token (s - 1 at
    # max_staleness 0). Needs dynamic sampling (further rounds fill a step the unfinished groups leave short) and
    # the rollout correction (algorithm.rollout_correction.rollout_is: older versions sampled a continued response's
    # first tokens).
    partial_rollouts: bool = False
    partial_segment_tokens: int | None = None
    # Dynamic sampling's oversampling: further loader batches of prompts in each batch asked for (ahead, with
    # max_staleness >= 1), so that fewer rounds are generated on the spot. The informative groups a step does not
    # need are carried over to the next steps while at most max_staleness versions old (docs/algorithms.md).
    oversample_batches: int = 0
    # No drain (docs/algorithms.md, "Weight updates during generation"): a rollout server takes each weight update
    # between the decode steps of its generations in flight rather than after them; their later tokens are sampled
    # by the new weights (the rows in flight are prefilled again under them) and stamped with that version. Gives up
    # the fixed schedule: which tokens each version samples depends on the engines' speed, so a resumed run trains
    # on other tokens than an uninterrupted one. Needs a rollout server and max_staleness >= 1.
    update_during_generation: bool = False
    # Dynamic sampling's further rounds generated ahead (docs/algorithms.md, "Generating ahead"): after each step's
    # rounds, the queue asks the servers for K more rounds of the loader's next prompts with the weights of then, so
    # they generate while the trainer trains and the next steps' further rounds are served from them (oldest first,
    # while at most max_staleness versions old; older ones are dropped and counted). A fixed schedule: what is asked,
    # with which version and seeds, does not depend on the engines' speed. 0: every further round on the spot. Needs
    # a rollout server, max_staleness >= 1, dynamic sampling, and K <= algorithm.max_resample_rounds.
    rounds_ahead: int = 0
    # When the rounds ahead are asked for: "fixed" (the default: after each step's rounds, until K are held; a
    # resumed run equals an uninterrupted one) or "when_idle" (one at a time, at the step's phase boundaries, whenever
    # every rollout server has answered all it was asked, up to K held: which prompts each version samples then
    # depends on the engines' speed, as with update_during_generation). docs/algorithms.md, "Generating ahead".
    ahead_schedule: str = "fixed"

    @property
    def holds_rollouts(self) -> bool:
        """Rollouts are in flight between steps (bounded staleness, partial rollouts): checkpointed, and each token's
        staleness counted."""
        return bool(self.max_staleness or self.partial_rollouts)

    def check(self, rollout: RolloutConfig) -> None:
        _need(self.max_staleness >= 0, f"rollout.schedule.max_staleness: must be >= 0, got {self.max_staleness}")
        _need(self.oversample_batches >= 0,
              f"rollout.schedule.oversample_batches: must be >= 0, got {self.oversample_batches}")
        segment, longest = self.partial_segment_tokens, rollout.max_new_tokens
        _need(not self.partial_rollouts or (segment is not None and 1 <= segment < longest and longest % segment == 0),
              f"rollout.schedule.partial_segment_tokens: partial rollouts need a segment in [1, rollout.max_new_tokens "
              f"= {longest}) that divides it, got {segment}")
        _need(self.partial_rollouts or segment is None,
              "rollout.schedule.partial_segment_tokens: set only with rollout.schedule.partial_rollouts: true")
        _need(self.rounds_ahead >= 0, f"rollout.schedule.rounds_ahead: must be >= 0, got {self.rounds_ahead}")
        # A round asked for after a step's rounds is one version old when the next step takes it: at staleness 0
        # every one would be dropped.
        _need(self.rounds_ahead == 0 or self.max_staleness >= 1,
              f"rollout.schedule.rounds_ahead: {self.rounds_ahead} needs rollout.schedule.max_staleness >= 1 (a round "
              f"asked for ahead is one version old when the next step takes it; at 0 every one would be dropped)")
        _need(self.ahead_schedule == "fixed" or self.rounds_ahead >= 1,
              f"rollout.schedule.ahead_schedule: {self.ahead_schedule} needs rollout.schedule.rounds_ahead >= 1 (the "
              f"most rounds held ahead); at 0 none is asked for")


@dataclass
class RolloutConfig:
    # builtin | vllm (colocated) | vllm_remote (vLLM servers on other nodes) | builtin_remote (built-in engine servers)
    engine: str = "builtin"
    num_responses_per_prompt: int = 8
    temperature: float = 1.0
    # Truncated sampling after the temperature, top-k (0: off) then top-p (1: off), vLLM's order; the trainer's
    # log-probs (old, current, reference) are then of the truncated, renormalised distribution (docs/algorithms.md,
    # "Truncated sampling").
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    # A random stream per request (reproducible samples, the same after a resume) or one engine-wide stream (faster:
    # vLLM draws seeded requests one at a time); a sampling setting every request carries, so the vLLM engines
    # (vllm, vllm_remote) act on it. The built-in engines always seed each response.
    seeded_sampling: bool = False
    # Each engine's own options (the *EngineConfig sections above): builtin reads rollout.builtin, vllm rollout.vllm,
    # vllm_remote and builtin_remote rollout.remote. The section of an engine not selected is not read (nor
    # checked), so a recipe may hold several and switching rollout.engine needs no resets.
    builtin: BuiltinEngineConfig = field(default_factory=BuiltinEngineConfig)
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    remote: RemoteEngineConfig = field(default_factory=RemoteEngineConfig)
    # When the rollouts are generated, against the steps that train on them (bounded staleness, partial rollouts,
    # oversampling, updates during generation, rounds ahead): the rollout queue's, read by it alone.
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def check(self) -> None:
        _need(self.num_responses_per_prompt >= 2,
              f"rollout.num_responses_per_prompt: group size must be >= 2, got {self.num_responses_per_prompt}")
        _need(self.temperature > 0, f"rollout.temperature: must be > 0, got {self.temperature}")
        _need(0 < self.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        _need(self.top_k >= 0, f"rollout.top_k: must be >= 0 (0 = off), got {self.top_k}")
        _need(self.max_new_tokens >= 1, f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        self.schedule.check(self)
        getattr(self, ENGINES[self.engine].section).check(self)  # the selected engine's only: no other is read


@dataclass
class GTPOOptions:
    """algorithm.gtpo: GTPO's entropy shaping of each token's advantage (algorithms/advantages.gtpo_advantages;
    arXiv 2508.04349), read only when algorithm.name is gtpo."""

    alpha1: float = 1.0
    alpha2: float = 0.1
    norm_scope: str = "batch"  # batch | group: where the entropies are normalised
    entropy_clip: tuple[float, float] | None = None  # [low, high] of the token entropies before shaping

    def check(self) -> None:
        _check_entropy_clip("algorithm.gtpo.entropy_clip", self.entropy_clip)


@dataclass
class GRPOSOptions:
    """algorithm.grpo_s: GRPO-S's entropy shaping of each response's advantage and its sequence ratio
    (algorithms/advantages.grpo_s_advantages, losses.sequence_policy_loss; arXiv 2508.04349), read only when
    algorithm.name is grpo_s."""

    beta1: float = 1.0
    beta2: float = 0.1
    entropy_clip: tuple[float, float] | None = None
    sequence_ratio: str = "arithmetic"  # arithmetic (GRPO-S) | geometric (GSPO's)

    def check(self) -> None:
        _check_entropy_clip("algorithm.grpo_s.entropy_clip", self.entropy_clip)


@dataclass
class ClipCovOptions:
    """algorithm.clip_cov: Clip-Cov removes the gradient of a random `ratio` of the tokens whose covariance of
    log-prob and advantage is in (lb, ub) (algorithms/token_selection.py; arXiv 2505.22617, the defaults of its
    recipes in verl, recipe/entropy), read only when algorithm.name is clip_cov."""

    ratio: float = 2e-4
    lb: float = 1.0
    ub: float = 5.0

    def check(self) -> None:
        _need(0 < self.ratio <= 1, f"algorithm.clip_cov.ratio: must be in (0, 1], got {self.ratio}")
        _need(self.lb < self.ub, f"algorithm.clip_cov.lb: must be < algorithm.clip_cov.ub ({self.ub}), got {self.lb}")


@dataclass
class KLCovOptions:
    """algorithm.kl_cov: KL-Cov penalises the top `ratio` of the tokens by covariance with coef * |log-ratio|
    (algorithms/token_selection.py, losses.py; arXiv 2505.22617), read only when algorithm.name is kl_cov."""

    ratio: float = 2e-3
    coef: float = 1.0

    def check(self) -> None:
        _need(0 < self.ratio <= 1, f"algorithm.kl_cov.ratio: must be in (0, 1], got {self.ratio}")
        _need(self.coef >= 0, f"algorithm.kl_cov.coef: must be >= 0, got {self.coef}")


@dataclass
class OverlongOptions:
    """algorithm.overlong: DAPO's overlong penalty (algorithms/length_penalties.overlong_penalty), read only when the
    run's length penalty is overlong (algorithm.length_penalty, or DAPO's default)."""

    max_len: int | None = None  # None: rollout.max_new_tokens
    cache_len: int | None = None  # None: a fifth of the max length (DAPO: 4096 of 20480)

    def check(self) -> None:
        _need(self.max_len is None or self.max_len >= 1,
              f"algorithm.overlong.max_len: must be >= 1, got {self.max_len}")
        _need(self.cache_len is None or self.cache_len >= 1,
              f"algorithm.overlong.cache_len: must be >= 1, got {self.cache_len}")


@dataclass
class GroupRelativeOptions:
    """algorithm.group_relative: the group-relative length penalty
    (algorithms/length_penalties.group_relative_overlong_penalty), read only when algorithm.length_penalty is
    group_relative."""

    gamma: float = 0.75

    def check(self) -> None:
        _need(self.gamma >= 0, f"algorithm.group_relative.gamma: must be >= 0, got {self.gamma}")


@dataclass
class RolloutCorrectionConfig:
    """algorithm.rollout_correction: the rollout/training mismatch correction (algorithms/rollout_correction.py, its
    names verl's): truncated importance weights exp(old - rollout) per token, their product per sequence, or their
    geometric mean per sequence (GRPO-S's choice), capped at rollout_is_cap; rejection of the tokens / sequences whose
    ratio (or geometric-mean ratio) falls outside rollout_rs_bounds. Required with rollout.schedule.max_staleness >= 1
    or partial rollouts. The old-policy phase reads it, whatever the algorithm."""

    rollout_is: str = "none"  # none | token | sequence | geometric
    rollout_is_cap: float = 2.0  # read only with rollout_is set
    rollout_rs: str = "none"  # none | token | sequence | geometric
    rollout_rs_bounds: tuple[float, float] = (0.5, 2.0)  # read only with rollout_rs set

    def check(self) -> None:
        _need(self.rollout_is_cap > 0,
              f"algorithm.rollout_correction.rollout_is_cap: must be > 0, got {self.rollout_is_cap}")
        _need(0 <= self.rollout_rs_bounds[0] <= self.rollout_rs_bounds[1],
              f"algorithm.rollout_correction.rollout_rs_bounds: need [low, high] with 0 <= low <= high, got "
              f"{list(self.rollout_rs_bounds)}")


def _check_entropy_clip(key: str, entropy_clip) -> None:
    _need(entropy_clip is None or entropy_clip[0] <= entropy_clip[1],
          f"{key}: low must be <= high, got {entropy_clip}")


@dataclass
class AlgorithmConfig:
    """The algorithm (algorithms/registry.py) and its options. The settings every algorithm's loss reads are here;
    each algorithm's own options are its section (gtpo, grpo_s, clip_cov, kl_cov: named as the algorithm), each
    length penalty's its section (overlong, group_relative), read only when chosen: a setting in the section of one
    not chosen is an error naming who reads it (`unread_settings`), as is a rollout correction's bound without
    that correction, so a recipe's option never goes silently unused."""

    name: str = "gtpo"
    eps_low: float | None = None  # None: the algorithm's default (0.2, and 0.28 high for clip-higher ones)
    eps_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0  # the entropy bonus: loss -= entropy_coef * entropy of the current policy
    # Keep the policy gradient on this top fraction of the mini-batch's response tokens by old-policy entropy only
    # (arXiv 2506.01939: 0.2), with any token-level loss; None: every token.
    entropy_token_fraction: float | None = None
    dynamic_sampling: bool | None = None  # None: on for DAPO/GTPO/GRPO-S/Clip-Cov/KL-Cov, off for GRPO
    max_resample_rounds: int = 3  # read only with dynamic sampling on
    length_penalty: str | None = None  # None: the algorithm's default | none | overlong | group_relative
    gtpo: GTPOOptions = field(default_factory=GTPOOptions)
    grpo_s: GRPOSOptions = field(default_factory=GRPOSOptions)
    clip_cov: ClipCovOptions = field(default_factory=ClipCovOptions)
    kl_cov: KLCovOptions = field(default_factory=KLCovOptions)
    overlong: OverlongOptions = field(default_factory=OverlongOptions)
    group_relative: GroupRelativeOptions = field(default_factory=GroupRelativeOptions)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    @property
    def entry(self):
        """The algorithm's registry entry (algorithms/registry.py)."""
        return ALGORITHMS[resolve_algorithm(self.name)]

    @property
    def resolved_length_penalty(self) -> str:
        """algorithm.length_penalty, or the algorithm's default where unset."""
        return self.length_penalty or self.entry.length_penalty

    @property
    def resolved_dynamic_sampling(self) -> bool:
        """algorithm.dynamic_sampling, or the algorithm's default where unset."""
        return self.entry.dynamic_sampling if self.dynamic_sampling is None else self.dynamic_sampling

    def unread_settings(self) -> list[tuple[str, object, str]]:
        """(key, value, who reads it and why this run does not) of each setting off its default that this run does
        not read: an algorithm's section other than algorithm.name's, a length penalty's other than the run's, a
        rollout correction's bound without that correction, max_resample_rounds without dynamic sampling."""
        penalty, correction = self.resolved_length_penalty, self.rollout_correction
        penalty_default = "" if self.length_penalty else f" ({self.name}'s default)"
        sampling_default = "" if self.dynamic_sampling is not None else f" ({self.name}'s default)"
        owners = [*((name, name == self.name, f"{name} (algorithm.name: {name}), and this run's algorithm is "
                     f"{self.name}") for name in ALGORITHM_SECTIONS),
                  *((name, name == penalty, f"the {name} length penalty (algorithm.length_penalty: {name}), and this "
                     f"run's is {penalty}{penalty_default}") for name in LENGTH_PENALTY_SECTIONS)]
        unread = [(f"algorithm.{section}.{key}", value, reader)
                  for section, read, reader in owners if not read
                  for key, value in _changed(getattr(self, section))]
        for unused, owner, key, reader in (
                (correction.rollout_is == "none", correction, "rollout_is_cap", "the importance weights "
                 "(algorithm.rollout_correction.rollout_is: token, sequence or geometric), and this run has none"),
                (correction.rollout_rs == "none", correction, "rollout_rs_bounds", "the rejection "
                 "(algorithm.rollout_correction.rollout_rs: token, sequence or geometric), and this run has none"),
                (not self.resolved_dynamic_sampling, self, "max_resample_rounds", "dynamic sampling "
                 f"(algorithm.dynamic_sampling: true), and this run has it off{sampling_default}")):
            if unused and getattr(owner, key) != getattr(type(owner)(), key):
                section = "rollout_correction." if owner is correction else ""
                unread.append((f"algorithm.{section}{key}", getattr(owner, key), reader))
        return unread

    def check(self) -> None:
        entry = self.entry
        for key, value, why in self.unread_settings()[:1]:
            raise ConfigError(f"{key}: {list(value) if isinstance(value, tuple) else value} is read only by {why}: "
                              f"remove it")
        # GTPO / GRPO-S (the entropy-shaped ones) split each group by a binary reward: a length penalty has nowhere
        # to go.
        _need(not entry.uses_entropy or self.length_penalty in (None, "none"),
              f"algorithm.length_penalty: {self.length_penalty} is not available with {self.name}, whose shaped "
              f"rewards need binary correctness; use none (or grpo / dapo)")
        _need(self.kl_coef >= 0, f"algorithm.kl_coef: must be >= 0, got {self.kl_coef}")
        _need(self.entropy_token_fraction is None or 0 < self.entropy_token_fraction <= 1,
              f"algorithm.entropy_token_fraction: must be in (0, 1], got {self.entropy_token_fraction}")
        _need(self.max_resample_rounds >= 0,
              f"algorithm.max_resample_rounds: must be >= 0, got {self.max_resample_rounds}")
        for section in (*ALGORITHM_SECTIONS, *LENGTH_PENALTY_SECTIONS, "rollout_correction"):
            getattr(self, section).check()
        # GRPO-S's surrogate is one term per sequence: a per-token weight has no term to multiply.
        _need(not entry.sequence_level_loss or self.rollout_correction.rollout_is != "token",
              "algorithm.rollout_correction.rollout_is: token weights need a token-level loss; grpo_s's loss is per "
              "sequence, use geometric (or sequence)")


# The sections of AlgorithmConfig named after a registry entry (its own options) and after a length penalty.
ALGORITHM_SECTIONS = tuple(name for name in ALGORITHM_NAMES if name in AlgorithmConfig.__dataclass_fields__)
LENGTH_PENALTY_SECTIONS = tuple(name for name in LENGTH_PENALTIES if name in AlgorithmConfig.__dataclass_fields__)


def _changed(section) -> list[tuple[str, object]]:
    """(field, value) of each field of the dataclass `section` that differs from its default."""
    default = type(section)()
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(section)
            if getattr(section, f.name) != getattr(default, f.name)]


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0  # RL steps of linear warm-up (each RL step is mini_batches x epochs optimizer steps)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_decay_style: str = "constant"  # constant | linear | cosine, from the end of warm-up to `steps`

    def check(self) -> None:
        _need(self.lr > 0, f"optim.lr: must be > 0, got {self.lr}")
        _need(0 <= self.min_lr <= self.lr, f"optim.min_lr: must be in [0, optim.lr = {self.lr}], got {self.min_lr}")
        _need(self.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        _need(self.grad_clip >= 0, f"optim.grad_clip: must be >= 0 (0: no clipping), got {self.grad_clip}")


@dataclass
class DataConfig:
    source: str = "jsonl"  # jsonl | synthetic
    task: str = "addition"  # the synthetic task (data/synthetic_tasks.py): addition | scratchpad_addition |
    # arithmetic_target
    path: str | None = None
    prompt_field: str = "problem"
    answer_field: str = "answer"
    template: str = "chat"  # chat | dapo | plain (data/templates.py DATA_TEMPLATES)
    prompts_per_step: int = 8  # global, across data-parallel ranks
    micro_batch_size: int = 8  # at most this many sequences per micro-batch
    # At most this many tokens per micro-batch, padding included (None: no token budget). Sequences are sorted by
    # length and cut into micro-batches once per step; the old-log-prob pass and the update run the same ones.
    max_tokens_per_micro_batch: int | None = None
    # Pack several sequences into each row (first-fit decreasing, at most max_tokens_per_micro_batch tokens per row,
    # which must then be set), attention confined to each sequence: no padding between sequences.
    pack_sequences: bool = False
    mini_batches_per_step: int = 1
    epochs_per_step: int = 1
    # auto: a step whose batch takes one optimizer step and whose algorithm reads nothing of the old policy before
    # its update takes the old log-probs from the update's own forward (training/old_policy.py; docs/step_batch.md
    # lists the cases that keep the forward-only old-policy pass, and why) | always: run that pass every step (the
    # same update, one forward more: for comparisons)
    old_policy_pass: str = "auto"
    max_prompt_tokens: int = 2048
    seed: int = 1234
    reward_workers: int = 4  # math-verify worker processes per model replica (jsonl tasks)
    reward_timeout_s: float = 5.0  # per response; a verification that runs longer gets reward 0

    def check(self) -> None:
        _need(self.source != "jsonl" or self.path, "data.path: required when data.source is jsonl")
        _need(self.prompts_per_step >= 1 and self.micro_batch_size >= 1 and self.mini_batches_per_step >= 1
              and self.epochs_per_step >= 1, "data: prompts_per_step, micro_batch_size, mini_batches_per_step and "
                                              "epochs_per_step must be >= 1")
        _need(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
              f"data.max_tokens_per_micro_batch: must be >= 1 (or unset), got {self.max_tokens_per_micro_batch}")
        _need(not self.pack_sequences or self.max_tokens_per_micro_batch is not None,
              "data.pack_sequences: needs data.max_tokens_per_micro_batch (the length of a packed row)")
        _need(self.reward_workers >= 1, f"data.reward_workers: must be >= 1, got {self.reward_workers}")
        _need(self.reward_timeout_s > 0, f"data.reward_timeout_s: must be > 0, got {self.reward_timeout_s}")


@dataclass
class WarmStartConfig:
    """Optional supervised warm-start on the task's reference answers before RL (reported in the metrics)."""

    steps: int = 0
    lr: float = 1e-3
    # None: every step at `lr`; a number: linear from `lr` at the first step to `final_lr` at the last (a decayed end
    # makes the warm start's result depend less on the order of its last few batches)
    final_lr: float | None = None

    def lr_at(self, step: int) -> float:
        """The learning rate of warm-start step `step` (0-based)."""
        if self.final_lr is None or self.steps <= 1:
            return self.lr
        return self.lr + (self.final_lr - self.lr) * step / (self.steps - 1)

    def check(self) -> None:
        _need(self.steps >= 0, f"warm_start.steps: must be >= 0, got {self.steps}")
        _need(self.lr > 0, f"warm_start.lr: must be > 0, got {self.lr}")
        _need(self.final_lr is None or 0 <= self.final_lr <= self.lr,
              f"warm_start.final_lr: must be in [0, warm_start.lr = {self.lr}] (unset: constant), got {self.final_lr}")


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: <output_dir>/checkpoints
    # N > 0: every N steps, at the end and on SIGTERM/SIGUSR1; 0: only at the end and on those signals; -1: never
    # (no checkpoint at all: benchmarks, throwaway runs)
    save_every: int = 0
    keep_last: int = 2
    resume: bool = True

    def check(self) -> None:
        _need(self.keep_last >= 1, f"checkpoint.keep_last: must be >= 1, got {self.keep_last}")
        _need(self.save_every >= -1, f"checkpoint.save_every: must be >= -1 (-1: never), got {self.save_every}")


@dataclass
class LoggingConfig:
    output_dir: str = "outputs/run"
    tensorboard: bool = True
    wandb_project: str | None = None
    progress_bar: bool = True


@dataclass
class TrainConfig:
    steps: int = 10
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.logging.output_dir, "checkpoints")

    def check(self) -> None:
        """Each section's own checks (the `check` methods beside them)."""
        _need(self.steps >= 0, f"steps: must be >= 0, got {self.steps}")
        for section in (self.model, self.parallel, self.rollout, self.algorithm, self.optim, self.data,
                        self.warm_start, self.checkpoint):
            section.check()


_CHOICES = {
    "model.dtype": ("float32", "bfloat16"), "rollout.engine": ENGINE_NAMES,  # engine_table.py: the only list
    "rollout.schedule.ahead_schedule": ("fixed", "when_idle"),
    "algorithm.name": ALGORITHM_NAMES,  # the registry's names (algorithms/registry.py): the only list of them
    "algorithm.gtpo.norm_scope": NORM_SCOPES, "algorithm.grpo_s.sequence_ratio": SEQUENCE_RATIOS,
    "algorithm.length_penalty": LENGTH_PENALTIES,
    "algorithm.rollout_correction.rollout_is": ROLLOUT_IS_LEVELS,
    "algorithm.rollout_correction.rollout_rs": ROLLOUT_RS_LEVELS,
    "model.moe.routing_replay": ("none", "rollout"),
    "parallel.context_comm": CP_COMM_TYPES,
    "optim.lr_decay_style": ("constant", "linear", "cosine"), "data.source": ("jsonl", "synthetic"),
    "data.task": tuple(SYNTHETIC_TASKS),  # data/synthetic_tasks.py: the only list of tasks
    "data.template": tuple(DATA_TEMPLATES),  # data/templates.py: the only list of templates
    "data.old_policy_pass": ("auto", "always"),
}


def _coerce(value, annotation, key: str):
    """Check/convert one YAML value against a field's type annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(annotation)
        return [_coerce(v, item_type, key) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(typing.get_args(annotation)):
            raise ConfigError(f"{key}: expected a list of {len(typing.get_args(annotation))} values, got {value!r}")
        return tuple(_coerce(v, t, key) for v, t in zip(value, typing.get_args(annotation)))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if annotation is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {annotation!r}")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    moved = [prefix + k for k in unknown if prefix + k in MOVED_KEYS]
    if moved:
        raise ConfigError("; ".join(_moved_message(key) for key in moved))
    if unknown:
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(prefix + k + _did_you_mean(k, names, prefix) for k in unknown)}; valid keys "
                          f"here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        annotation = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, value, key + ".")
        else:
            kwargs[name] = _coerce(value, annotation, key)
            if key in _CHOICES and kwargs[name] is not None and kwargs[name] not in _CHOICES[key]:
                raise ConfigError(f"{key}: {kwargs[name]!r} is not one of {', '.join(_CHOICES[key])}")
    return cls(**kwargs)


# Keys that moved to another place, each answered with one line naming its new place (or places) rather than as unknown,
# and read in their new place from a checkpoint's saved config (`upgrade_saved_config`): the rollout schedule, moved
# into rollout.schedule; the rollout engines' options, moved into a section per engine; the algorithms' options, moved
# into a section per algorithm, per length penalty and for the rollout correction; routing replay and the router losses,
# into model.moe.
MOVED_KEYS: dict[str, tuple[str, ...]] = {
    **{f"rollout.{key}": (f"rollout.schedule.{key}",) for key in ScheduleConfig.__dataclass_fields__},
    **{f"rollout.{old}": (f"rollout.{new}",) for old, new in (
        ("builtin_max_batch_tokens", "builtin.max_batch_tokens"),
        ("vllm_gpu_memory_utilization", "vllm.gpu_memory_utilization"),
        ("vllm_kv_cache_memory_bytes", "vllm.kv_cache_memory_bytes"), ("vllm_hf_dir", "vllm.hf_dir"),
        ("vllm_tensor_parallel", "vllm.tensor_parallel"), ("remote_addresses", "remote.addresses"),
        ("remote_connect_timeout_s", "remote.connect_timeout_s"),
        ("remote_request_timeout_s", "remote.request_timeout_s"),
        ("remote_reconnect_timeout_s", "remote.reconnect_timeout_s"))},
    **{f"algorithm.{old}": tuple(f"algorithm.{place}" for place in new) for old, new in (
        ("alpha1", ("gtpo.alpha1",)), ("alpha2", ("gtpo.alpha2",)), ("norm_scope", ("gtpo.norm_scope",)),
        ("entropy_clip", ("gtpo.entropy_clip", "grpo_s.entropy_clip")), ("beta1", ("grpo_s.beta1",)),
        ("beta2", ("grpo_s.beta2",)), ("sequence_ratio", ("grpo_s.sequence_ratio",)),
        ("clip_cov_ratio", ("clip_cov.ratio",)), ("clip_cov_lb", ("clip_cov.lb",)), ("clip_cov_ub", ("clip_cov.ub",)),
        ("kl_cov_ratio", ("kl_cov.ratio",)), ("kl_cov_coef", ("kl_cov.coef",)),
        ("overlong_max_len", ("overlong.max_len",)), ("overlong_cache_len", ("overlong.cache_len",)),
        ("group_relative_gamma", ("group_relative.gamma",)),
        *((key, (f"rollout_correction.{key}",)) for key in ("rollout_is", "rollout_is_cap", "rollout_rs",
                                                             "rollout_rs_bounds")))},
    "algorithm.routing_replay": ("model.moe.routing_replay",),
    "model.moe_aux_loss_coef": ("model.moe.aux_loss_coef",), "model.moe_z_loss_coef": ("model.moe.z_loss_coef",),
}


def _moved_message(key: str) -> str:
    return f"{key} moved to {' or '.join(MOVED_KEYS[key])}"


def upgrade_saved_config(saved: dict) -> dict:
    """A checkpoint's saved configuration (`to_dict` of its run's, read back from JSON) in today's keys: each key that
    moved since it was written (MOVED_KEYS) in its new place, and the settings moved into a section its run did not
    read back at their defaults. (An older run's config held every algorithm's options side by side; only its own
    algorithm's, its length penalty's and the bounds of its correction were read.) Pure: `saved` is not changed."""
    tree = copy.deepcopy(saved)
    for old, places in MOVED_KEYS.items():
        *path, name = old.split(".")
        parent = _node(tree, path)
        if parent is None or name not in parent:
            continue
        value = parent.pop(name)
        for place in places:
            *path, name = place.split(".")
            _node(tree, path, create=True).setdefault(name, value)
    if isinstance(tree.get("algorithm"), dict):
        try:
            algorithm = _build(AlgorithmConfig, tree["algorithm"], "algorithm.")
        except ConfigError as e:
            raise ConfigError(f"the checkpoint's saved configuration: {e}") from None
        defaults = TrainConfig()
        for key, _, _ in algorithm.unread_settings():
            *path, name = key.split(".")
            default = getattr(functools.reduce(getattr, path, defaults), name)
            _node(tree, path)[name] = list(default) if isinstance(default, tuple) else default
    return tree


def _node(tree: dict, path: list[str], create: bool = False) -> dict | None:
    """The mapping at `path` in `tree` (made where missing with `create`), or None."""
    for name in path:
        if create:
            tree = tree.setdefault(name, {})
        elif not isinstance(tree, dict) or not isinstance(tree.get(name), dict):
            return None
        else:
            tree = tree[name]
    return tree


def _did_you_mean(key, names: set[str], prefix: str) -> str:
    """The closest key here, or the new place of the closest key that moved from here."""
    moved = {old[len(prefix):]: " or ".join(places) for old, places in MOVED_KEYS.items()
             if old.startswith(prefix) and "." not in old[len(prefix):]}
    close = difflib.get_close_matches(str(key), sorted({*names, *moved}), n=1)
    return f" (did you mean {moved.get(close[0], prefix + close[0])}?)" if close else ""


def _yaml_error(error: yaml.YAMLError, *, positions: bool = True) -> tuple[str, str]:
    """(`line:column`, problem) of a YAML syntax error: where the parser stopped, and what it was reading (with where
    that began, often the line to fix; without `positions`, not)."""
    mark, context, context_mark = (getattr(error, name, None) for name in ("problem_mark", "context",
                                                                            "context_mark"))
    mark = mark or context_mark
    problem = getattr(error, "problem", None) or str(error)
    if context:
        opened = f" that starts at {context_mark.line + 1}:{context_mark.column + 1}" \
            if context_mark and positions else ""
        problem += f" ({context}{opened})"
    return (f"{mark.line + 1}:{mark.column + 1}" if mark else "?"), problem


def _parse_override(item: str) -> tuple[list[str], object]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-6")
    key, raw = item.split("=", 1)
    try:
        return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not YAML: {_yaml_error(e, positions=False)[1]}") from None


def load_config(path: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The configuration of the YAML file `path` (None: the defaults) with `overrides` applied, validated."""
    cfg = parse_config(path, overrides)
    validate(cfg)
    return cfg


def parse_config(path: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """`load_config` without the validation: typed and with known keys only."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                position, problem = _yaml_error(e)
                raise ConfigError(f"{path}:{position}: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {k} is not a section")
        node[keys[-1]] = value
    return _build(TrainConfig, data, "")


def validate(cfg: TrainConfig) -> None:
    """Each section's checks, the rules between features (config_rules.CROSS_FEATURE_RULES), and the layout's that
    need neither the world size nor the model (validate_layout)."""
    cfg.check()
    view = features(cfg)
    refused = refused_by(view)
    if refused:
        raise ConfigError(refused[0].render(view))
    validate_layout(cfg)


def features(cfg: TrainConfig) -> Features:
    """What the cross-feature rules read of `cfg`."""
    return Features(model=cfg.model, parallel=cfg.parallel, rollout=cfg.rollout, algorithm=cfg.algorithm,
                    data=cfg.data, warm_start=cfg.warm_start, entry=cfg.algorithm.entry)


def validate_layout(cfg: TrainConfig, *, world_size: int | None = None, shape=None) -> None:
    """The parallel layout's rules (layout.check_layout) for this config, as a ConfigError. Without `world_size` the
    rules that need the data-parallel size are not checked (`validate` runs this part when the config is loaded).
    `shape` (models.qwen.ModelShape) adds the model's splits; without it, routing replay stands for a
    mixture-of-experts model (validate_for_model refuses it on a dense one). The trainer runs all of it before any
    process group exists."""
    par, r, d = cfg.parallel, cfg.rollout, cfg.data
    try:
        if world_size is None:
            layout = ParallelLayout(par.tensor, par.pipeline, None, par.virtual_pipeline, par.sequence_parallel,
                                    expert=par.expert, expert_tensor=par.expert_tensor, context=par.context)
        else:
            layout = ParallelLayout.from_world_size(world_size, tensor=par.tensor, pipeline=par.pipeline,
                                                    virtual_pipeline=par.virtual_pipeline,
                                                    sequence_parallel=par.sequence_parallel, expert=par.expert,
                                                    expert_tensor=par.expert_tensor, context=par.context)
        check_layout(layout, shape=shape, prompts_per_step=d.prompts_per_step,
                     mini_batches_per_step=d.mini_batches_per_step,
                     rollout=RolloutLayout(r.engine, r.vllm.tensor_parallel, len(r.remote.addresses)),
                     training=True, routing_replay=cfg.model.moe.replays_routing)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def validate_for_model(cfg: TrainConfig, shape) -> None:
    """The settings that depend on the model (`shape`: models.qwen.ModelShape), as a ConfigError; the trainer checks
    them once it has read the model's config."""
    if shape.moe is None:
        for key, value in _changed(cfg.model.moe)[:1]:
            raise ConfigError(f"model.moe.{key}: {value} is read only by a mixture-of-experts model (Qwen3-MoE); this "
                              f"one is dense: remove it")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_text(cfg: TrainConfig) -> str:
    """The resolved configuration as YAML (what `load_config` reads back)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: TrainConfig, path: str) -> None:
    write_atomically(path, config_text(cfg))

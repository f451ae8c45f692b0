"""The run configuration: a typed dataclass tree, loaded from YAML with `--set a.b=c` overrides.

Unknown keys, wrong types and inconsistent settings are errors that name the key (`ConfigError`). The resolved
configuration is written next to the checkpoints (`save_config`).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field

import yaml

from megatron_gtpo.algorithms.registry import ALGORITHM_NAMES, ALGORITHMS, resolve_algorithm
from megatron_gtpo.atomic_files import write_atomically
from megatron_gtpo.config_rules import REMOTE_ENGINES, Features, refused_by
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
    # Mixture-of-experts models: the router's load-balancing loss and z-loss coefficients (models/moe.RouterLosses).
    # Off for RL by default: docs/algorithms.md, "Mixture of experts".
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0

    def check(self) -> None:
        _need(sum(x is not None and x is not False for x in (self.hf_dir, self.load, self.tiny_synthetic or None))
              == 1, "model: set exactly one of model.hf_dir, model.load, model.tiny_synthetic")
        _need(self.core_attention in CORE_ATTENTIONS,
              f"model.core_attention: must be one of {list(CORE_ATTENTIONS)}, got {self.core_attention!r}")
        _need(self.logprob_workspace_mib > 0,
              f"model.logprob_workspace_mib: must be > 0, got {self.logprob_workspace_mib}")
        _need(self.moe_aux_loss_coef >= 0 and self.moe_z_loss_coef >= 0,
              f"model.moe_aux_loss_coef / model.moe_z_loss_coef: must be >= 0, got {self.moe_aux_loss_coef} / "
              f"{self.moe_z_loss_coef}")
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

    def check(self, max_new_tokens: int) -> None:
        _need(self.max_batch_tokens is None or self.max_batch_tokens > max_new_tokens,
              f"rollout.builtin.max_batch_tokens: must exceed rollout.max_new_tokens = {max_new_tokens} (one row's "
              f"prompt and response), got {self.max_batch_tokens}")


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

    def check(self) -> None:
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

    def check(self, engine: str) -> None:
        _need(bool(self.addresses),
              f"rollout.remote.addresses: the {engine} engine needs one server address (HOST:PORT) per data-parallel "
              f"replica")
        _need(self.reconnect_timeout_s >= 0,
              f"rollout.remote.reconnect_timeout_s: must be >= 0, got {self.reconnect_timeout_s}")
        _need(self.weights in ("auto", "channel", "nccl"),
              f"rollout.remote.weights: auto, channel or nccl, got {self.weights!r}")


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
    # Bounded staleness (docs/algorithms.md, "Generating while training"): step k trains on prompts generated with
    # the policy of step max(0, k - max_staleness); 0 is the on-policy trainer. >= 1 needs engines of their own
    # (vllm_remote, builtin_remote), which then generate the next batches while the current one trains.
    max_staleness: int = 0
    # Partial rollouts (docs/algorithms.md, "Partial rollouts"): an engine call generates at most
    # partial_segment_tokens per response; a group with an unfinished response waits, and the next batch asked for
    # continues it under the weights of then. A response spans at most s = max_new_tokens / partial_segment_tokens
    # policy versions, and is trained at most s x max_staleness versions after its first token (s - 1 at
    # max_staleness 0). Needs dynamic sampling (further rounds fill a step the unfinished groups leave short) and
    # the rollout correction (algorithm.rollout_is: older versions sampled a continued response's first tokens).
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

    def check(self) -> None:
        _need(self.num_responses_per_prompt >= 2,
              f"rollout.num_responses_per_prompt: group size must be >= 2, got {self.num_responses_per_prompt}")
        _need(self.temperature > 0, f"rollout.temperature: must be > 0, got {self.temperature}")
        _need(0 < self.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        _need(self.top_k >= 0, f"rollout.top_k: must be >= 0 (0 = off), got {self.top_k}")
        _need(self.max_new_tokens >= 1, f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        _need(self.max_staleness >= 0, f"rollout.max_staleness: must be >= 0, got {self.max_staleness}")
        _need(self.oversample_batches >= 0,
              f"rollout.oversample_batches: must be >= 0, got {self.oversample_batches}")
        segment, longest = self.partial_segment_tokens, self.max_new_tokens
        _need(not self.partial_rollouts or (segment is not None and 1 <= segment < longest and longest % segment == 0),
              f"rollout.partial_segment_tokens: partial rollouts need a segment in [1, rollout.max_new_tokens = "
              f"{longest}) that divides it, got {segment}")
        _need(self.partial_rollouts or segment is None,
              "rollout.partial_segment_tokens: set only with rollout.partial_rollouts: true")
        if self.engine == "builtin":  # the selected engine's section only: the others are not read
            self.builtin.check(self.max_new_tokens)
        elif self.engine == "vllm":
            self.vllm.check()
        else:
            self.remote.check(self.engine)


@dataclass
class AlgorithmConfig:
    name: str = "gtpo"
    alpha1: float = 1.0
    alpha2: float = 0.1
    beta1: float = 1.0
    beta2: float = 0.1
    norm_scope: str = "batch"  # batch | group (GTPO)
    entropy_clip: tuple[float, float] | None = None
    eps_low: float | None = None  # None: the algorithm's default (0.2, and 0.28 high for clip-higher ones)
    eps_high: float | None = None
    dual_clip: float | None = None
    sequence_ratio: str = "arithmetic"  # arithmetic | geometric (GRPO-S)
    kl_coef: float = 0.0
    entropy_coef: float = 0.0  # the entropy bonus: loss -= entropy_coef * entropy of the current policy
    # Clip-Cov / KL-Cov (arXiv 2505.22617; defaults: the paper's recipes in verl, recipe/entropy): Clip-Cov removes
    # the gradient of a random clip_cov_ratio of the tokens whose covariance is in (lb, ub); KL-Cov penalises the top
    # kl_cov_ratio by covariance with kl_cov_coef * |log-ratio| (docs/algorithms.md, "The entropy methods").
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    # Keep the policy gradient on this top fraction of the mini-batch's response tokens by old-policy entropy only
    # (arXiv 2506.01939: 0.2); None: every token.
    entropy_token_fraction: float | None = None
    dynamic_sampling: bool | None = None  # None: on for DAPO/GTPO/GRPO-S, off for GRPO
    max_resample_rounds: int = 3
    length_penalty: str | None = None  # None: the algorithm's default | none | overlong | group_relative
    overlong_max_len: int | None = None  # None: rollout.max_new_tokens
    overlong_cache_len: int | None = None  # None: a fifth of the max length (DAPO: 4096 of 20480)
    group_relative_gamma: float = 0.75
    # Rollout/training mismatch correction (algorithms/rollout_correction.py): truncated importance weights
    # exp(old - rollout) per token, their product per sequence, or their geometric mean per sequence (GRPO-S's
    # choice), capped; rejection of tokens / sequences whose ratio (or geometric-mean ratio) falls outside the
    # bounds. Required with rollout.max_staleness >= 1 or partial rollouts.
    rollout_is: str = "none"  # none | token | sequence | geometric
    rollout_is_cap: float = 2.0
    rollout_rs: str = "none"  # none | token | sequence | geometric
    rollout_rs_bounds: tuple[float, float] = (0.5, 2.0)
    # Mixture-of-experts models: "rollout" routes every token of the old-policy pass and the update to the experts
    # the rollout engine chose for it (the built-in engine records them); "none" lets the router choose again.
    routing_replay: str = "none"  # none | rollout

    @property
    def replays_routing(self) -> bool:
        """Training routes every token to the experts the rollout engine chose for it (routing_replay: rollout)."""
        return self.routing_replay == "rollout"

    def check(self) -> None:
        entry = ALGORITHMS[resolve_algorithm(self.name)]
        # GTPO / GRPO-S (the entropy-shaped ones) split each group by a binary reward: a length penalty has nowhere
        # to go.
        _need(not entry.uses_entropy or self.length_penalty in (None, "none"),
              f"algorithm.length_penalty: {self.length_penalty} is not available with {self.name}, whose shaped "
              f"rewards need binary correctness; use none (or grpo / dapo)")
        _need(self.entropy_clip is None or self.entropy_clip[0] <= self.entropy_clip[1],
              f"algorithm.entropy_clip: low must be <= high, got {self.entropy_clip}")
        _need(self.kl_coef >= 0, f"algorithm.kl_coef: must be >= 0, got {self.kl_coef}")
        for key in ("clip_cov_ratio", "kl_cov_ratio", "entropy_token_fraction"):
            value = getattr(self, key)
            _need(value is None and key == "entropy_token_fraction" or value is not None and 0 < value <= 1,
                  f"algorithm.{key}: must be in (0, 1], got {value}")
        _need(self.clip_cov_lb < self.clip_cov_ub,
              f"algorithm.clip_cov_lb: must be < clip_cov_ub ({self.clip_cov_ub}), got {self.clip_cov_lb}")
        _need(self.kl_cov_coef >= 0, f"algorithm.kl_cov_coef: must be >= 0, got {self.kl_cov_coef}")
        _need(self.rollout_is_cap > 0, f"algorithm.rollout_is_cap: must be > 0, got {self.rollout_is_cap}")
        _need(0 <= self.rollout_rs_bounds[0] <= self.rollout_rs_bounds[1],
              f"algorithm.rollout_rs_bounds: need [low, high] with 0 <= low <= high, got "
              f"{list(self.rollout_rs_bounds)}")
        # GRPO-S's surrogate is one term per sequence: a per-token weight has no term to multiply.
        _need(not entry.sequence_level_loss or self.rollout_is != "token",
              "algorithm.rollout_is: token weights need a token-level loss; grpo_s's loss is per sequence, use "
              "geometric (or sequence)")


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
    "model.dtype": ("float32", "bfloat16"), "rollout.engine": ("builtin", "vllm", *REMOTE_ENGINES),
    "rollout.ahead_schedule": ("fixed", "when_idle"),
    "algorithm.name": ALGORITHM_NAMES,  # the registry's names (algorithms/registry.py): the only list of them
    "algorithm.norm_scope": ("batch", "group"), "algorithm.sequence_ratio": ("arithmetic", "geometric"),
    "algorithm.length_penalty": ("none", "overlong", "group_relative"),
    "algorithm.rollout_is": ("none", "token", "sequence", "geometric"),
    "algorithm.rollout_rs": ("none", "token", "sequence", "geometric"),
    "algorithm.routing_replay": ("none", "rollout"),
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
        raise ConfigError("; ".join(f"{key} moved to {MOVED_KEYS[key]}" for key in moved))
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


# Keys that moved to another place, each answered with one line naming its new place rather than as unknown: the
# rollout engines' options, moved into a section per engine.
MOVED_KEYS = {f"rollout.{old}": f"rollout.{new}" for old, new in (
    ("builtin_max_batch_tokens", "builtin.max_batch_tokens"),
    ("vllm_gpu_memory_utilization", "vllm.gpu_memory_utilization"),
    ("vllm_kv_cache_memory_bytes", "vllm.kv_cache_memory_bytes"), ("vllm_hf_dir", "vllm.hf_dir"),
    ("vllm_tensor_parallel", "vllm.tensor_parallel"), ("remote_addresses", "remote.addresses"),
    ("remote_connect_timeout_s", "remote.connect_timeout_s"), ("remote_request_timeout_s", "remote.request_timeout_s"),
    ("remote_reconnect_timeout_s", "remote.reconnect_timeout_s"))}


def _did_you_mean(key, names: set[str], prefix: str) -> str:
    close = difflib.get_close_matches(str(key), sorted(names), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _parse_override(item: str) -> tuple[list[str], object]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-6")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


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
            data = yaml.safe_load(f) or {}
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
                    data=cfg.data, warm_start=cfg.warm_start, entry=ALGORITHMS[resolve_algorithm(cfg.algorithm.name)])


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
                     training=True, routing_replay=cfg.algorithm.replays_routing)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def validate_for_model(cfg: TrainConfig, shape) -> None:
    """The settings that depend on the model (`shape`: models.qwen.ModelShape), as a ConfigError; the trainer checks
    them once it has read the model's config."""
    if shape.moe is None:
        for key, value in (("algorithm.routing_replay", cfg.algorithm.replays_routing),
                           ("model.moe_aux_loss_coef", cfg.model.moe_aux_loss_coef > 0),
                           ("model.moe_z_loss_coef", cfg.model.moe_z_loss_coef > 0)):
            if value:
                raise ConfigError(f"{key}: needs a mixture-of-experts model (Qwen3-MoE); this one is dense")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_text(cfg: TrainConfig) -> str:
    """The resolved configuration as YAML (what `load_config` reads back)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: TrainConfig, path: str) -> None:
    write_atomically(path, config_text(cfg))

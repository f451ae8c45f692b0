"""The planner's inputs: one RL step's `Workload`, the machine's and the model's assumptions (`Settings`), both read
from a trainer config (`workload_from_config`, `settings_from_config`), and `check_plan`, which refuses what cannot
run."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.engine_table import ENGINES
from megatron_gtpo.layout import ParallelLayout, RolloutLayout, check_layout
from megatron_gtpo.models.qwen import ModelShape

GIB = float(2**30)
BYTES_PER_ELEMENT = {"bfloat16": 2, "float32": 4}
KERNEL_PROFILES = ("te", "local")


@dataclass(frozen=True)
class Workload:
    """One RL step: prompts x responses, each sequence at most max_prompt + max_response tokens. The phase-time
    model also needs the expected (mean) response length: `mean_response_tokens`, else half the maximum."""

    prompts_per_step: int = 128
    num_responses_per_prompt: int = 16
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 4096
    micro_batch_size: int = 1  # sequences per micro-batch
    mini_batches_per_step: int = 1
    epochs_per_step: int = 1
    mean_response_tokens: int | None = None  # None: half of max_response_tokens (an assumption)
    # Forward-only passes over the step's sequences before the update (the old_logprob phase): the old policy's,
    # none where the update's own forward gives its values (training/old_policy.py), and a KL reference's.
    old_logprob_passes: int = 1

    @property
    def expected_response_tokens(self) -> int:
        """The mean response length the phase-time model uses."""
        if self.mean_response_tokens is not None:
            return self.mean_response_tokens
        return max(1, self.max_response_tokens // 2)

    @property
    def max_sequence_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_response_tokens

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.num_responses_per_prompt


@dataclass(frozen=True)
class Settings:
    gpu_memory_gib: float = 80.0
    params_dtype: str = "bfloat16"
    distributed_optimizer: bool = True
    recompute_activations: bool = False
    kernels: str = "te"  # te | local (activations.py)
    vllm_memory_fraction: float | None = 0.5  # None: no colocated vLLM engine
    vllm_tensor_parallel: int | None = None  # None: see vllm_tensor_parallel()
    gpus_per_node: int = 8
    vllm_overhead_gib: float = 2.0
    framework_overhead_gib: float = 3.0  # CUDA context, NCCL buffers, cuBLAS workspaces (an estimate)
    # PyTorch's caching allocator holds freed blocks and rounds sizes up; with micro-batches of varying length its
    # reserved memory runs above the live peak. Counted as this fraction of the transient allocations (activations,
    # logits, workspaces). An estimate, to be replaced by the H100 measurement (max_memory_reserved / allocated).
    allocator_slack_fraction: float = 0.15
    logprob_workspace_mib: float = 256.0  # model.logprob_workspace_mib: the vocab-parallel op's fp32 workspaces
    # Without a colocated vLLM the built-in engine generates on the training model: its static KV cache holds at
    # most this many token slots per batch (rollout.builtin.max_batch_tokens; None: every row of a replica at once).
    builtin_max_batch_tokens: int | None = None
    # model.moe.routing_replay: rollout. The record of the experts each fed token went to at a rank's MoE layers
    # (memory.routing_record_bytes): on that rank's GPU from generation (built-in engine) or from the step batch
    # (vLLM's, on the host before) to the end of the update.
    routing_replay: bool = False
    # The phase-time model (plan_disaggregated): one GPU's peak rates (H100 SXM datasheet: bf16 dense, HBM3) and the
    # fractions of them each phase reaches. The fractions are assumptions, not measurements.
    peak_flops_per_s: float = 989e12
    hbm_bytes_per_s: float = 3.35e12
    training_mfu: float = 0.4  # old_logprob and update model FLOPs / peak (bubbles and communication included)
    generation_mfu: float = 0.5  # prefill, and a decode step where its FLOPs outlast its reads
    decode_bandwidth_efficiency: float = 0.6  # of HBM bandwidth a decode step's weight and KV-cache reads reach
    # One replica's weight sync into its rollout server, NCCL across nodes from one destination rank: half the line
    # rate of a 400 Gb/s NIC (8 per node, one per GPU), replicas at once.
    weight_sync_bytes_per_s: float = 25e9
    server_memory_fraction: float = 0.9  # a rollout server's share of its GPUs (remote_server --gpu-memory-utilization)


def check_plan(shape: ModelShape, layout: ParallelLayout, workload: Workload | None = None,
                settings: Settings | None = None) -> None:
    """ValueError naming the problem for what cannot run: the layout's rules (layout.check_layout, with the
    colocated vLLM engines of `settings`), then the workload's and the settings' own."""
    vllm_tp = None
    if settings is not None and settings.vllm_memory_fraction is not None:
        vllm_tp = settings.vllm_tensor_parallel
    check_layout(layout, shape=shape,
                 prompts_per_step=workload.prompts_per_step if workload is not None else None,
                 mini_batches_per_step=workload.mini_batches_per_step if workload is not None else 1,
                 rollout=RolloutLayout("vllm", vllm_tp) if vllm_tp is not None else None, training=True)
    if workload is not None:
        _check_workload(shape, workload)
    if settings is not None:
        _check_settings(settings, vllm_tp)


def _check_workload(shape: ModelShape, w: Workload) -> None:
    for name in ("prompts_per_step", "num_responses_per_prompt", "max_prompt_tokens", "max_response_tokens",
                 "micro_batch_size", "mini_batches_per_step", "epochs_per_step"):
        if getattr(w, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(w, name)}")
    if w.old_logprob_passes not in (0, 1, 2):
        raise ValueError(f"old_logprob_passes must be 0, 1 or 2 (the old policy's, the KL reference's), got "
                         f"{w.old_logprob_passes}")
    if w.mean_response_tokens is not None and not 1 <= w.mean_response_tokens <= w.max_response_tokens:
        raise ValueError(f"mean_response_tokens must be in [1, max_response_tokens = {w.max_response_tokens}], "
                         f"got {w.mean_response_tokens}")
    if w.max_sequence_tokens > shape.max_position_embeddings:
        raise ValueError(f"max_prompt_tokens + max_response_tokens = {w.max_sequence_tokens} exceeds the model's "
                         f"max_position_embeddings {shape.max_position_embeddings}")


def _check_settings(settings: Settings, vllm_tp: int | None) -> None:
    if settings.params_dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"params_dtype {settings.params_dtype!r} is not one of {', '.join(BYTES_PER_ELEMENT)}")
    if settings.kernels not in KERNEL_PROFILES:
        raise ValueError(f"kernels {settings.kernels!r} is not one of {', '.join(KERNEL_PROFILES)}")
    if settings.gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory_gib must be > 0, got {settings.gpu_memory_gib}")
    if settings.vllm_memory_fraction is not None and not 0 < settings.vllm_memory_fraction < 1:
        raise ValueError(f"vllm_memory_fraction must be in (0, 1), got {settings.vllm_memory_fraction}")
    for name in ("peak_flops_per_s", "hbm_bytes_per_s", "weight_sync_bytes_per_s"):
        if getattr(settings, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(settings, name)}")
    for name in ("training_mfu", "generation_mfu", "decode_bandwidth_efficiency", "server_memory_fraction"):
        if not 0 < getattr(settings, name) <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {getattr(settings, name)}")
    if vllm_tp is not None and vllm_tp > settings.gpus_per_node:
        raise ValueError(f"vLLM tensor parallel size {vllm_tp} exceeds the {settings.gpus_per_node} GPUs of a "
                         f"node (one engine runs on one node)")


def settings_from_config(cfg, **overrides) -> Settings:
    """The planner's settings of a megatron_gtpo TrainConfig (dtype, recompute, colocated vLLM, routing replay), plus
    overrides. ValueError for the "local" kernel profile of a config on megatron's unfused attention, which it does
    not describe (activations.py)."""
    section = ENGINES[cfg.rollout.engine].section  # the engine's own options: builtin's cap, colocated vLLM's
    vllm, builtin = section == "vllm", section == "builtin"
    if overrides.get("kernels") == "local" and cfg.model.core_attention != "sdpa":
        raise ValueError(f"the planner's local kernel profile is the SDPA attention's; model.core_attention="
                         f"{cfg.model.core_attention} keeps every head's [s, s] scores besides and is not planned")
    return Settings(**{"params_dtype": cfg.model.dtype, "recompute_activations": cfg.model.recompute_activations,
                       "logprob_workspace_mib": cfg.model.logprob_workspace_mib,
                       "builtin_max_batch_tokens": cfg.rollout.builtin.max_batch_tokens if builtin else None,
                       "routing_replay": cfg.model.moe.replays_routing,
                       "vllm_memory_fraction": cfg.rollout.vllm.gpu_memory_utilization if vllm else None,
                       "vllm_tensor_parallel": cfg.rollout.vllm.tensor_parallel if vllm else None, **overrides})


def workload_from_config(cfg) -> Workload:
    """The planner's workload of a megatron_gtpo TrainConfig."""
    from megatron_gtpo.training.old_policy import forward_passes_before_update

    return Workload(prompts_per_step=cfg.data.prompts_per_step,
                    num_responses_per_prompt=cfg.rollout.num_responses_per_prompt,
                    max_prompt_tokens=cfg.data.max_prompt_tokens, max_response_tokens=cfg.rollout.max_new_tokens,
                    micro_batch_size=cfg.data.micro_batch_size, mini_batches_per_step=cfg.data.mini_batches_per_step,
                    epochs_per_step=cfg.data.epochs_per_step,
                    old_logprob_passes=forward_passes_before_update(cfg))

"""The memory plan of a layout: `plan(shape, layout, workload, settings)` gives the per-stage memory of one RL step,
the rollout engine's, the step's FLOPs and whether it fits (with the reasons it does not); `suggest_layouts` plans every
layout of a number of GPUs the rules allow and orders those that fit."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size

from .counts import (active_parameter_count, generation_flops, parameter_count, total_parameter_count,
                     training_flops)
from .inputs import GIB, Settings, Workload, check_plan
from .memory import RolloutMemory, StageMemory, rollout_memory, stage_memory


@dataclass
class Plan:
    model: str
    layout: ParallelLayout
    workload: Workload
    settings: Settings
    params_total: int
    params_active: int  # per token (a mixture-of-experts model's top-k experts; the total for a dense one)
    params_per_stage: list[int]
    stages: list[StageMemory]
    worst_stage: int
    memory_gib: dict
    variants_gib: dict  # training peak with / without distributed optimizer and recompute
    kv_cache: dict
    flops_per_step: dict
    fits: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def params_per_gpu(self) -> int:
        return max(self.params_per_stage)

    def to_json(self) -> dict:
        return {"model": self.model, "layout": {**asdict(self.layout), "world_size": self.layout.world_size},
                "workload": asdict(self.workload), "settings": asdict(self.settings),
                "params_total": self.params_total, "params_active": self.params_active,
                "params_per_gpu": self.params_per_gpu,
                "params_per_stage": self.params_per_stage, "worst_stage": self.worst_stage,
                "memory_gib": self.memory_gib, "variants_gib": self.variants_gib, "kv_cache": self.kv_cache,
                "flops_per_step": self.flops_per_step, "fits": self.fits, "reasons": self.reasons}


def plan(shape: ModelShape, layout: ParallelLayout, workload: Workload = Workload(), settings: Settings = Settings(), *,
         model_name: str = "") -> Plan:
    """The plan of `layout` (check_plan first: ValueError for what cannot run). The training peak of a stage: its
    training state, its transient allocations plus the allocator's slack, the framework's overhead and what a
    sleeping vLLM engine keeps; the generation peak: the largest training state, the overhead and the rollout
    engine's memory."""
    check_plan(shape, layout, workload, settings)
    rollout = rollout_memory(shape, layout, workload, settings)
    chosen = _stages(shape, layout, workload, settings, settings.distributed_optimizer,
                     settings.recompute_activations)
    worst = max(chosen, key=lambda st: (_training_peak(st, settings, rollout), st.persistent))
    memory = _memory_gib(worst, _generation_peak(chosen, settings, rollout), settings, rollout)
    reasons = _reasons(chosen, worst, workload, settings, rollout)
    return Plan(model=model_name, layout=layout, workload=workload, settings=settings,
                params_total=total_parameter_count(shape), params_active=active_parameter_count(shape),
                params_per_stage=[parameter_count(shape, layout, r) for r in range(layout.pipeline)],
                stages=chosen, worst_stage=worst.pp_rank, memory_gib=memory,
                variants_gib=_variants_gib(shape, layout, workload, settings, rollout),
                kv_cache=_kv_cache_report(layout, rollout), flops_per_step=_step_flops(shape, layout, workload),
                fits=not reasons, reasons=reasons)


def _stages(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings,
            distributed_optimizer: bool, recompute: bool) -> list[StageMemory]:
    return [stage_memory(shape, layout, workload, settings, r, distributed_optimizer=distributed_optimizer,
                         recompute=recompute) for r in range(layout.pipeline)]


def _training_peak(stage: StageMemory, settings: Settings, rollout: RolloutMemory) -> float:
    transient = stage.transient * (1 + settings.allocator_slack_fraction)
    return stage.persistent + stage.routing_record + transient + settings.framework_overhead_gib * GIB \
        + rollout.asleep


def _generation_peak(stages: list[StageMemory], settings: Settings, rollout: RolloutMemory) -> float:
    # Routing replay: the built-in engine records on the GPU while it generates; vLLM's routing waits on the host
    # until the step batch (server_engine.py), which puts it on the GPU for training only.
    return max(st.persistent + (0.0 if rollout.colocated else st.routing_record) for st in stages) \
        + settings.framework_overhead_gib * GIB \
        + rollout.budget + rollout.builtin_kv


def _memory_gib(worst: StageMemory, generation_peak: float, settings: Settings, rollout: RolloutMemory) -> dict:
    """The worst stage's memory by term, in GiB (the CLI prints them in this order)."""
    return {
        "parameters": worst.parameters / GIB, "gradients": worst.gradients / GIB, "optimizer": worst.optimizer / GIB,
        "routing_record": worst.routing_record / GIB,
        "activations": worst.activations / GIB, "context_kv": worst.context_kv / GIB, "logits": worst.logits / GIB,
        "logprob_workspaces": worst.logprob_workspaces / GIB, "dispatcher_buffers": worst.dispatcher / GIB,
        "allocator_slack": worst.transient * settings.allocator_slack_fraction / GIB,
        "framework_overhead": settings.framework_overhead_gib * GIB / GIB,
        "vllm_asleep": rollout.asleep / GIB, "training_peak": _training_peak(worst, settings, rollout) / GIB,
        "vllm_budget": rollout.budget / GIB, "vllm_weights": rollout.weights / GIB,
        "vllm_kv_cache": max(rollout.kv_bytes, 0) / GIB, "builtin_kv_cache": rollout.builtin_kv / GIB,
        "generation_peak": generation_peak / GIB, "gpu": settings.gpu_memory_gib,
    }


def _variants_gib(shape: ModelShape, layout: ParallelLayout, workload: Workload, settings: Settings,
                  rollout: RolloutMemory) -> dict:
    """The training peak with and without the distributed optimizer and full activation recompute."""
    variants = {}
    for dist_opt in (True, False):
        for recompute in (False, True):
            peak = max(_training_peak(st, settings, rollout)
                       for st in _stages(shape, layout, workload, settings, dist_opt, recompute))
            variants[f"{'distopt' if dist_opt else 'no_distopt'}_{'recompute' if recompute else 'no_recompute'}"] \
                = peak / GIB
    return variants


def _step_flops(shape: ModelShape, layout: ParallelLayout, workload: Workload) -> dict:
    vocab = padded_vocab_size(shape.vocab_size, layout.tensor)
    train = training_flops(shape, workload, response_tokens=workload.max_response_tokens, padded_vocab=vocab)
    generate = generation_flops(shape, num_sequences=workload.sequences_per_step,
                                prompt_tokens=workload.max_prompt_tokens,
                                response_tokens=workload.max_response_tokens, padded_vocab=vocab)
    return {"generate": generate, **train, "total": generate + train["old_logprob"] + train["update"],
            "note": "at the maximum prompt and response lengths (an upper bound); old_logprob = forward x "
                    f"{workload.old_logprob_passes} forward-only pass(es); update = 3 x forward x epochs"}


def _reasons(stages: list[StageMemory], worst: StageMemory, workload: Workload, settings: Settings,
             rollout: RolloutMemory) -> list[str]:
    """Why the plan does not fit (empty: it fits)."""
    gpu = settings.gpu_memory_gib * GIB
    training_peak, generation_peak = _training_peak(worst, settings, rollout), \
        _generation_peak(stages, settings, rollout)
    state_gib = max(st.persistent for st in stages) / GIB
    reasons = []
    if training_peak > gpu:
        reasons.append(f"training needs {training_peak / GIB:.1f} GiB on pipeline stage {worst.pp_rank}, "
                       f"more than the {settings.gpu_memory_gib:g} GiB GPU")
    if rollout.colocated:
        if generation_peak > gpu:
            reasons.append(f"generation needs {generation_peak / GIB:.1f} GiB (trainer state {state_gib:.1f} + "
                           f"vLLM's {settings.vllm_memory_fraction:g} x {settings.gpu_memory_gib:g} GiB + overhead), "
                           f"more than the GPU; lower vllm_memory_fraction or shard more")
        if rollout.full_sequences < 1:
            reasons.append(f"vLLM's KV cache ({max(rollout.kv_bytes, 0) / GIB:.2f} GiB) cannot hold one sequence of "
                           f"{workload.max_sequence_tokens} tokens; raise vllm_memory_fraction or vLLM's TP")
    elif generation_peak > gpu:
        reasons.append(f"generation on the built-in engine needs {generation_peak / GIB:.1f} GiB (trainer state "
                       f"{state_gib:.1f} + a KV cache of {rollout.builtin_tokens:,} token slots + overhead), more "
                       f"than the GPU; lower rollout.builtin.max_batch_tokens")
    return reasons


def _kv_cache_report(layout: ParallelLayout, rollout: RolloutMemory) -> dict:
    r = rollout
    return {"bytes_per_token": r.kv_bytes_per_token, "tokens": r.kv_tokens, "full_length_sequences": r.full_sequences,
            "vllm_tensor_parallel": r.vllm_tp if r.colocated else None, "engines": r.engines,
            "engines_per_replica": r.engines // layout.data, "gpus_generating": r.engines * r.vllm_tp,
            "kv_cache_gib_per_gpu": max(r.kv_bytes, 0) / GIB, "sequences_per_engine": r.sequences_per_engine,
            "waves_at_full_length": math.ceil(r.sequences_per_engine / r.full_sequences) if r.full_sequences else None,
            "engine": "vllm" if r.colocated else "builtin", "builtin_batch_tokens": r.builtin_tokens}


def suggest_layouts(shape: ModelShape, gpus: int, workload: Workload, settings: Settings) -> list[Plan]:
    """The plans of every layout of `gpus` GPUs the rules allow that fit, best first: TP within a node, dividing
    the heads; PP dividing the layers; CP (context parallelism) dividing what is left where a colocated vLLM engine
    generates (the built-in engine does not under CP); a mixture-of-experts model's EP dividing its experts and
    TP x CP x DP, ETP 1 or TP; sequence parallelism at TP > 1 (a mixture-of-experts model trains only with it, and it
    divides the activations the TP ranks would otherwise each keep whole); each without and with activation
    recompute (`settings` otherwise). Best: a tenth of the GPU left at the training and the generation peak (the
    planner's activation and allocator terms are estimates), then no recompute, the fewest GPUs per model replica
    (TP x PP x CP: the most data-parallel replicas), then the smallest CP (whose K/V exchange a replica of the same
    size at CP = 1 does not pay), then the lowest training peak. So CP comes first only where a sequence does not
    fit a replica without it."""
    plans = []
    for tp in (t for t in _divisors(gpus) if t <= settings.gpus_per_node):
        for pp in (p for p in _divisors(gpus // tp) if shape.num_layers % p == 0):
            for cp in _divisors(gpus // (tp * pp)) if settings.vllm_memory_fraction is not None else [1]:
                plans += _fitting(shape, workload, settings, tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp))

    def tight(p: Plan) -> bool:
        return max(p.memory_gib["training_peak"], p.memory_gib["generation_peak"]) > 0.9 * settings.gpu_memory_gib

    return sorted(plans, key=lambda p: (tight(p), p.settings.recompute_activations,
                                        p.layout.tensor * p.layout.pipeline * p.layout.context, p.layout.context,
                                        p.memory_gib["training_peak"]))


def _fitting(shape: ModelShape, workload: Workload, settings: Settings, *, tp: int, pp: int, cp: int,
             dp: int) -> list[Plan]:
    """The plans that fit of TP x PP x CP x DP with every expert placement, without and with recompute."""
    experts = [(1, None)] if shape.moe is None else [
        (ep, etp) for ep in _divisors(shape.moe.num_experts) if (tp * cp * dp) % ep == 0
        for etp in sorted({1, tp}) if (tp * cp * dp) % (ep * etp) == 0]
    plans = []
    for ep, etp in experts:
        layout = ParallelLayout(tensor=tp, pipeline=pp, data=dp, expert=ep, expert_tensor=etp, context=cp,
                                sequence_parallel=tp > 1)
        for recompute in (False, True):
            try:
                candidate = plan(shape, layout, workload, replace(settings, recompute_activations=recompute))
            except ValueError:  # the layout's rules (layout.check_layout) or the workload's
                continue
            if candidate.fits:
                plans.append(candidate)
    return plans


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

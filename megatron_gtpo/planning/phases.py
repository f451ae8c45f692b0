"""The phase-time model: seconds of one RL step's phases, its FLOPs and HBM bytes at the peak rates of Settings times
the efficiencies Settings assumes (assumptions, not measurements: `phase_assumptions` lists them for the report).
Responses have the workload's expected (mean) length, prompts their maximum (an upper bound)."""
from __future__ import annotations

import math
from functools import partial

from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size

from .counts import forward_flops, matmul_parameters, total_parameter_count, training_flops
from .inputs import Settings, Workload
from .memory import vllm_kv_bytes_per_token


def training_phase_s(shape: ModelShape, workload: Workload, settings: Settings, *, gpus: int,
                     tensor_parallel: int) -> dict[str, float]:
    """old_logprob and update seconds of one step on `gpus` training GPUs: their model FLOPs at the mean response
    length / (gpus x peak_flops_per_s x training_mfu); old_logprob is 0 s where the step runs no forward-only pass
    (`Workload.old_logprob_passes`). Full activation recompute runs the forward once more in the update (4 passes
    where the model FLOPs count 3)."""
    flops = training_flops(shape, workload, response_tokens=workload.expected_response_tokens,
                           padded_vocab=padded_vocab_size(shape.vocab_size, tensor_parallel))
    flops_per_s = gpus * settings.peak_flops_per_s * settings.training_mfu
    old_logprob_s = flops["old_logprob"] / flops_per_s
    update_s = flops["update"] * (4 / 3 if settings.recompute_activations else 1) / flops_per_s
    return {"old_logprob_s": old_logprob_s, "update_s": update_s, "train_s": old_logprob_s + update_s}


def decode_step_s(shape: ModelShape, settings: Settings, *, running: int, context_tokens: int, vllm_tp: int) -> float:
    """One decode step of a vLLM engine on `vllm_tp` GPUs with `running` sequences of `context_tokens` cached tokens
    each: every GPU reads its share of the matmul weights and of those sequences' KV cache from HBM (bytes /
    (hbm_bytes_per_s x decode_bandwidth_efficiency)) and computes one token per sequence (FLOPs / (peak_flops_per_s
    x generation_mfu)); the slower of the two. The reads win at RL batch sizes: decode is bandwidth bound."""
    weights = matmul_parameters(shape, padded_vocab_size(shape.vocab_size, vllm_tp))
    read_bytes = 2.0 * weights / vllm_tp + running * context_tokens * vllm_kv_bytes_per_token(shape, vllm_tp)
    read_s = read_bytes / (settings.hbm_bytes_per_s * settings.decode_bandwidth_efficiency)
    token_flops = 2.0 * weights + 4.0 * shape.num_attention_heads * shape.head_dim * shape.num_layers * context_tokens
    compute_s = running * token_flops / vllm_tp / (settings.peak_flops_per_s * settings.generation_mfu)
    return max(read_s, compute_s)


def generation_phase_s(shape: ModelShape, workload: Workload, settings: Settings, *, engines: int, vllm_tp: int,
                       kv_tokens_per_engine: int) -> dict:
    """Seconds one step's generation takes on `engines` vLLM engines of `vllm_tp` GPUs each (they run at once, the
    step's prompts split evenly over them), each with a KV cache of `kv_tokens_per_engine` tokens:
    - prefill: every prompt's forward once (vLLM's prefix cache shares it between the prompt's G samples), compute
      bound: FLOPs / (vllm_tp x peak_flops_per_s x generation_mfu);
    - decode: waves of as many sequences as the KV cache holds (each its mean response plus its 1/G share of the
      prompt's cache), each wave decoding the mean response length, then one straggler decoding on alone to the
      maximum length (an engine is done when its longest response is); decode_step_s per step. The waves stand for
      continuous batching, which refills a slot when a sequence ends.
    ValueError when the KV cache cannot hold one sequence."""
    prompt, mean, longest = (workload.max_prompt_tokens, workload.expected_response_tokens,
                             workload.max_response_tokens)
    group = workload.num_responses_per_prompt
    prompts_per_engine = math.ceil(workload.prompts_per_step / engines)
    sequences = prompts_per_engine * group
    running = min(sequences, int(kv_tokens_per_engine // (mean + prompt / group)))
    if running < 1:
        raise ValueError(f"a KV cache of {kv_tokens_per_engine:,} tokens cannot hold one sequence")
    prefill_flops = prompts_per_engine * forward_flops(shape, num_tokens=prompt, sum_squared_lengths=prompt**2,
                                                       padded_vocab=padded_vocab_size(shape.vocab_size, vllm_tp))
    prefill_s = prefill_flops / (vllm_tp * settings.peak_flops_per_s * settings.generation_mfu)
    waves = [running] * (sequences // running) + ([sequences % running] if sequences % running else [])
    step = partial(decode_step_s, shape, settings, vllm_tp=vllm_tp)
    decode_s = sum(step(running=batch, context_tokens=prompt + t) for batch in waves for t in range(mean)) \
        + sum(step(running=1, context_tokens=prompt + t) for t in range(mean, longest))
    return {"prefill_s": prefill_s, "decode_s": decode_s, "generate_s": prefill_s + decode_s,
            "sequences_per_engine": sequences, "running_per_engine": running, "waves": len(waves)}


def weight_sync_s(shape: ModelShape, settings: Settings) -> float:
    """One weight update of a rollout server: the whole model in bf16 from its replica's destination rank at
    weight_sync_bytes_per_s (every replica updates its own server at the same time)."""
    return total_parameter_count(shape) * 2.0 / settings.weight_sync_bytes_per_s


def step_s(generate_s: float, train_s: float, sync_s: float, max_staleness: int) -> float:
    """The steady-state seconds of an RL step whose generation and training run on GPUs of their own.

    N = 0 asks for a batch and waits for it: generation, then training, then the weight sync. At N >= 1 batch k is
    asked for when step k - N begins (training/rollout_queue.py), so the engine generates while the trainer trains;
    by default a rollout server answers requests in order and every step ends with a weight sync, which waits for
    the generation before it (the update drains the engine). So one generation overlaps one training step whatever
    N: the step is max(generation, training) + sync at every N >= 1, and staleness 1 is all it takes to keep both
    sides busy in steady state. With rollout.schedule.update_during_generation the engine takes the sync between decode
    steps (it pauses for it) and the trainer does not wait for the generation's tail: each side still spends its
    phase plus the sync per step, so the steady state is the same; what changes is the variance (a generation
    longer than a training step spreads over up to N steps), which this model does not hold."""
    if max_staleness == 0:
        return generate_s + train_s + sync_s
    return max(generate_s, train_s) + sync_s


def step_phases(generation: dict, training: dict[str, float], sync_s: float | None,
                 max_staleness: int) -> dict[str, float]:
    """A step's phase seconds (of generation_phase_s and training_phase_s), its weight sync (None: not counted,
    left out) and its step_s."""
    phases = {**{k: generation[k] for k in ("prefill_s", "decode_s", "generate_s")}, **training}
    if sync_s is not None:
        phases["weight_sync_s"] = sync_s
    phases["step_s"] = step_s(phases["generate_s"], phases["train_s"], sync_s or 0.0, max_staleness)
    return phases


NOT_MODELLED = (
    "dynamic sampling's further rounds (generated on the spot by the current policy, on the step's critical path)",
    "reward scoring, advantages, logging and checkpoints",
    "colocated engines' sleep, wake and device-local weight reload",
    "variance between steps, and stragglers beyond one per engine",
)


def phase_assumptions(workload: Workload, settings: Settings) -> dict:
    """What the phase-time model assumes, for the report: the rates, efficiencies and lengths it uses."""
    names = ("peak_flops_per_s", "hbm_bytes_per_s", "training_mfu", "generation_mfu", "decode_bandwidth_efficiency",
             "weight_sync_bytes_per_s", "server_memory_fraction", "vllm_memory_fraction", "vllm_overhead_gib")
    return {**{name: getattr(settings, name) for name in names},
            "prompt_tokens": workload.max_prompt_tokens,
            "mean_response_tokens": workload.expected_response_tokens,
            "mean_response_source": "given" if workload.mean_response_tokens is not None
            else "assumed: half of max_response_tokens",
            "max_response_tokens": workload.max_response_tokens,
            "not_modelled": list(NOT_MODELLED)}


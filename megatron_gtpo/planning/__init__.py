"""Memory, FLOPs and phase-time planning for a Qwen2 / Qwen3 / Qwen3-MoE model under a TP/PP/DP/EP layout (the
logic behind tools/plan.py), one job per module:

- inputs.py: the `Workload` of one RL step, the `Settings` (machine, dtype, rollout engine, the phase-time model's
  rates), both from a trainer config, and `check_plan`, which refuses what cannot run;
- counts.py: parameters per rank (exactly as megatron-core builds them) and FLOPs;
- activations.py, memory.py, planner.py: the memory plan. `plan(shape, layout, workload, settings)` returns the
  per-stage memory (parameters, gradients and optimizer state exactly as megatron-core's DDP + distributed Adam
  allocate them; activations, vLLM and allocator slack as estimates), the rollout engine's and the FLOPs of one RL
  step; `suggest_layouts` the layouts that fit;
- phases.py, split.py: the phase-time model, and `plan_disaggregated`, which splits a job's nodes between rollout
  servers and training (rollout.engine vllm_remote) by it; its rates and efficiencies are assumptions (Settings).

docs/planning.md says which numbers are exact, which are estimates, and how each was checked. What the package
exports here is its interface to the CLI, the trainer's tests and the benchmarks.
"""
from .activations import layer_activation_bytes
from .counts import (active_parameter_count, forward_flops, generation_flops, parameter_count,
                     total_parameter_count, training_flops)
from .inputs import (KERNEL_PROFILES, Settings, Workload, check_plan, settings_from_config,
                     workload_from_config)
from .phases import generation_phase_s, step_s, training_phase_s
from .planner import Plan, plan, suggest_layouts
from .split import plan_disaggregated

__all__ = ["KERNEL_PROFILES", "Plan", "Settings", "Workload", "active_parameter_count", "check_plan",
           "forward_flops", "generation_flops", "generation_phase_s", "layer_activation_bytes", "parameter_count",
           "plan", "plan_disaggregated", "settings_from_config", "step_s", "suggest_layouts",
           "total_parameter_count", "training_flops", "training_phase_s", "workload_from_config"]

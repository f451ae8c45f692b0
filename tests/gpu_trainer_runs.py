"""The trainer runs of the GPU trainer tests (tests/gpu/test_gpu_trainer.py): their `--set` overrides of the demo
config, the vLLM run's model and the planner's memory for the peak-memory run, in one place. The GPU tests run them
on CUDA; tests/test_gpu_trainer_configs.py builds the same configurations on the CPU, so that a renamed key or a
new rule refusing one fails in the CPU suite, not on the next GPU."""
from __future__ import annotations

import torch

ONE_GPU_BF16 = ["parallel.tensor=1", "model.dtype=bfloat16", "data.prompts_per_step=8", "warm_start.steps=0"]
# One RL step, measured against the planner. The synthetic prompts are 5 tokens; the planner sizes activations for
# max_prompt_tokens.
PEAK_MEMORY_RUN = [*ONE_GPU_BF16, "steps=1", "checkpoint.save_every=0", "data.max_prompt_tokens=16"]
# 2 + 2 steps with a save and resume against 4 in one run. The learning rate is constant: a decaying schedule spans
# the config's `steps`, so the 2-step run would decay faster than the 4-step one before any resume.
RESUME_COMMON = [*ONE_GPU_BF16, "checkpoint.save_every=2", "data.mini_batches_per_step=2",
                 "optim.lr_decay_style=constant"]
RESUME_RUNS = (("full", 4), ("part", 2), ("part", 4))  # (output folder, steps) in the order they run


def resume_run(steps: int) -> list[str]:
    return [*RESUME_COMMON, f"steps={steps}"]


def vllm_model() -> dict:
    """make_tiny_qwen2's arguments of the colocated vLLM run's model: the synthetic task's vocabulary; head_dim 64
    (vLLM's attention backends do not all take the demo model's 16)."""
    from megatron_gtpo.data.synthetic import VOCAB_SIZE

    return dict(dtype=torch.bfloat16, vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_layers=2,
                num_heads=4, num_kv_heads=2, max_positions=64)


def vllm_run(hf_dir) -> list[str]:
    """Two GTPO steps on the colocated vLLM engine. A random model rarely solves a problem: dynamic sampling would
    drop every group (and with them the tokens the log-prob mismatch is measured on)."""
    return [*ONE_GPU_BF16, "steps=2", "checkpoint.save_every=0", "algorithm.dynamic_sampling=false",
            "model.tiny_synthetic=false", f"model.hf_dir={hf_dir}", "rollout.engine=vllm",
            "rollout.vllm.gpu_memory_utilization=0.3"]


def peak_memory_plan(cfg, *, kernels: str, gpu_memory_gib: float):
    """planning.plan() of the peak-memory run's config `cfg` (the demo's tiny synthetic model, one rank) with the
    layer spec `kernels` the trainer takes on that machine."""
    from megatron_gtpo.data.synthetic import tiny_model_hf_config
    from megatron_gtpo.layout import ParallelLayout
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import plan, settings_from_config, workload_from_config

    settings = settings_from_config(cfg, kernels=kernels, gpu_memory_gib=gpu_memory_gib)
    return plan(ModelShape.from_hf(tiny_model_hf_config()), ParallelLayout(), workload_from_config(cfg), settings,
                model_name="cpu_demo tiny")

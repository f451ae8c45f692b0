"""megatron_gtpo: GTPO / GRPO-S entropy-shaped RL on megatron-core.

Importing the package is light on purpose: it imports none of torch, megatron, vllm or transformer_engine.
Sub-packages that need them import them themselves (docs/architecture.md, "Import rules"). The one thing it does
first is decide how megatron-core's fusions will be decorated in this process (`_megatron_jit.py`).
"""
from megatron_gtpo._megatron_jit import skip_megatron_jit_without_triton

skip_megatron_jit_without_triton()

__version__ = "0.1.0"

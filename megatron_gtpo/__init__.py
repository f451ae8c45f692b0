"""megatron_gtpo: GTPO / GRPO-S entropy-shaped RL on megatron-core.

Importing the package is light on purpose: it imports none of megatron, vllm or transformer_engine.
Sub-packages that need them import them themselves (docs/architecture.md, "Import rules").
"""

__version__ = "0.1.0"

"""The stand-in's transformer_engine.pytorch: the module classes megatron-core's TE extensions wrap."""
from . import cpu_offload, distributed, fp8, ops, router, tensor  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .fp8 import fp8_autocast  # noqa: F401
from .modules import GroupedLinear, LayerNorm, LayerNormLinear, Linear, RMSNorm  # noqa: F401

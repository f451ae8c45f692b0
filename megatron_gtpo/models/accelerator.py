"""What this process can run: CUDA, Transformer Engine, and the optional kernels megatron-core's fusions need.

Every choice that depends on the machine (the layer spec, the fusion switches of the TransformerConfig, whether
sequence parallelism is possible) reads an `Accelerator` rather than asking torch or importing a package on its own,
so a CPU test can build exactly what a GPU run builds (`Accelerator(cuda=True, ...)`, on the meta device).
`Accelerator.probe()` answers for this process; it is the one place that imports Transformer Engine.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

# model.core_attention, the local layer spec's: torch's SDPA (models/sdpa_attention.py) or megatron's unfused
# DotProductAttention. Transformer Engine's spec has its own.
CORE_ATTENTIONS = ("sdpa", "unfused")


@dataclass(frozen=True)
class Accelerator:
    cuda: bool
    # TE's PyTorch extension imports and megatron-core took it (not the mock classes megatron-core substitutes when
    # `import transformer_engine.pytorch` fails, e.g. an extension built against another torch).
    transformer_engine: bool = False
    # megatron's fused masked-softmax CUDA extensions (scaled_masked_softmax_cuda and friends: apex or Megatron-LM's
    # legacy build). Nothing in the project's GPU set provides them.
    fused_softmax: bool = False
    # torch.compile's GPU backend: megatron-core's jit_fuser is torch.compile, which the bias-SwiGLU and
    # bias-dropout-add fusions go through; CUDA builds of torch ship triton.
    triton: bool = False

    @staticmethod
    def probe() -> "Accelerator":
        return _probe()

    @property
    def layer_spec(self) -> str:
        """The layer spec a model gets here, as the planner names it: "te" (Transformer Engine's) where TE runs, else
        "local" (megatron-core's)."""
        return "te" if self.transformer_engine else "local"


@functools.cache
def _probe() -> Accelerator:
    if not torch.cuda.is_available():
        return Accelerator(cuda=False)
    return Accelerator(cuda=True, transformer_engine=_transformer_engine_works(),
                       fused_softmax=all(importlib.util.find_spec(m) is not None for m in FUSED_SOFTMAX_MODULES),
                       triton=importlib.util.find_spec("triton") is not None)


FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                         "scaled_softmax_cuda")


def _transformer_engine_works() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401  (the project's one import of Transformer Engine)
    except Exception:  # noqa: BLE001 - a broken build raises OSError / RuntimeError as well as ImportError
        return False
    from megatron.core.extensions import transformer_engine as megatron_te

    return bool(megatron_te.HAVE_TE)


def fusion_settings(accelerator: Accelerator, *, transformer_engine: bool, packed_sequences: bool,
                    core_attention: str = "sdpa") -> dict:
    """The TransformerConfig fusion switches for a model built with (`transformer_engine`) or without TE's layer spec
    on `accelerator`, the local spec's core attention being `core_attention` (CORE_ATTENTIONS):
    each is on only where the kernel behind it exists on that machine.

    - persist_layer_norm: apex's persistent LayerNorm kernel, which Qwen's RMSNorm never uses; megatron-core's
      local spec builds torch norms (WrappedTorchNorm), whose constructor asserts it is off.
    - masked_softmax_fusion: megatron's fused softmax extensions, used by the local spec's unfused attention only;
      off when packing (the fused causal kernel ignores the block-diagonal mask of a packed row).
    - bias_activation_fusion / bias_dropout_fusion: torch.compile'd by megatron-core; on a GPU with triton only.
    - apply_rope_fusion / gradient_accumulation_fusion: TE or apex kernels the project does not rely on.
    """
    cuda = accelerator.cuda
    return dict(
        persist_layer_norm=False,
        masked_softmax_fusion=(cuda and accelerator.fused_softmax and not transformer_engine
                               and core_attention == "unfused" and not packed_sequences),
        bias_activation_fusion=cuda and accelerator.triton,
        bias_dropout_fusion=cuda and accelerator.triton,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not cuda,
    )

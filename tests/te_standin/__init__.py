"""A test-only stand-in for Transformer Engine's PyTorch API, so that megatron-core's real TE layer spec builds and runs
on a CPU with gloo (tests only: it is never part of the package, and nothing outside tests/ imports it).

`activate()` puts the stand-in's `transformer_engine` package first on sys.path. It must run before megatron-core is
imported in the process (megatron decides HAVE_TE once, at import): call it first thing in a rank of the
multi-process harness, never in the pytest process itself, where it would turn every later test's megatron to TE.
Spawned processes inherit sys.path, so ranks started by such a rank see it too.

What it provides (transformer_engine/pytorch): Linear, LayerNormLinear, GroupedLinear, LayerNorm, RMSNorm and
DotProductAttention, computed with torch ops, with
- TE's parameter names (`weight`, `bias`, `layer_norm_weight`, GroupedLinear's `weight0` .. `weight{N-1}`) and the
  attributes TE sets on them (tensor_model_parallel / partition_dim / partition_stride, sequence_parallel on norms);
- TE's extra state: get_extra_state() is an empty uint8 tensor unless the module holds FP8 metadata
  (fp8_meta["fp8_checkpoint"]), then its pickled state, and set_extra_state() takes either back, as TE 2.x does;
- TE's tensor- and sequence-parallel communication inside the modules, on the tp_group they are handed:
  parallel_mode "column" (input copied, or all-gathered along the sequence under sequence parallelism; the input
  gradient all-reduced, or reduce-scattered) and "row" (the output all-reduced, or reduce-scattered), LayerNormLinear
  normalising the local sequence shard before the gather;
- DotProductAttention in sbhd (causal, or no mask) and in thd with cu_seqlens (each packed sequence attends causally
  to itself), with grouped-query heads, in fp32;
- the helpers megatron-core touches at import or build time: the version (2.17.1, the pinned GPU version, so
  megatron takes the code paths of the real wheel), fp8_autocast / FP8GlobalStateManager (FP8 off), the recipes,
  get_cpu_offload_context (offloading off), activation_recompute_forward, _SplitAlongDim, QuantizedTensor,
  CudaRNGStatesTracker. Names megatron-core imports only for features the project leaves off (the op fuser, fused
  router kernels, TE's RNG tracker) raise when used.

What it does NOT prove: anything about TE's own kernels (cuBLAS GEMMs, fused norms, flash / cuDNN attention and
their numerics, bf16 rounding), FP8 / MXFP8 / NVFP4 training and TE's real FP8 metadata, userbuffers
(tp_comm_overlap), TE's fused RoPE / permutation / router / cross-entropy kernels, CPU offloading, context
parallelism, or that a given TE wheel imports on a given machine. The parameter attributes and the extra-state format
are modelled on TE 2.x as documented and read, not checked against a wheel. Those need a GPU (tests/gpu). What it
does prove is
the project's side and megatron-core's TE glue: names, shapes, sharding, extra state, the THD packing path, and
gradients and checkpoints of models built from the real TE layer spec.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))


def activate() -> None:
    """Make `import transformer_engine` find the stand-in. Refuses when megatron-core was already imported without it
    (its HAVE_TE flags are fixed at import)."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    te_extension = sys.modules.get("megatron.core.extensions.transformer_engine")
    if te_extension is not None and not te_extension.HAVE_TE:
        raise RuntimeError("megatron-core was imported before te_standin.activate(): activate it first in the process")
    import transformer_engine

    assert transformer_engine.__file__.startswith(_ROOT), transformer_engine.__file__

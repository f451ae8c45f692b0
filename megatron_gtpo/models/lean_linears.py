"""megatron-core's tensor-parallel linear layers, with a lean forward where no gradient is recorded, and oneDNN's
packed weights for generation on a CPU.

Lean forward. megatron-core 0.16.1's ColumnParallelLinear and RowParallelLinear route every forward through
autograd Functions that exist for the backward pass (the copy-to / reduce-from tensor-parallel regions, identities in
the forward at TP 1, and LinearWithGradAccumulationAndAsyncCommunication, which saves its inputs for the backward),
and RowParallelLinear looks its TP group up again on every call, with a deprecation warning that the warnings filter
then has to drop: about 15 torch calls per linear, each of which also passes the CPU platform's torch-function mode
(distributed/platform.py). Under `torch.no_grad` none of that changes the result. `LeanColumnParallelLinear` /
`LeanRowParallelLinear` compute that forward directly, with megatron's own ops in megatron's order
(`torch.matmul(input, weight.t())`, then `+ bias`; at TP > 1 megatron's own all-gather / all-reduce functions), so
the output is the same, bit for bit. Wherever gradients are recorded, or the layer does something else in its
forward (sequence parallelism, a scattered input, deferred embedding gradients, activation offloading), megatron's
forward runs unchanged. The local layer spec builds its linears as these (models/qwen.layer_spec), and the model
builder its output layer; Transformer Engine's spec keeps its own layers.

Packed weights (`packed_weights`). On this project's CPUs, torch's float32 matmul (MKL's sgemm) reaches about half
of what oneDNN's inner product does on a weight reordered once into oneDNN's blocked layout: at decode shapes (1
thread; benchmarks/decode_kernels.py, figures in benchmarks/results/generation.md) 32 rows x 512 -> 2816 took 3.1x
and 32 x 512 -> 8192 (the output layer) 2.3x the time with sgemm, 1.8-2.0x at 128 rows. The built-in engine
(rollout/builtin.py) therefore packs the weights of a float32 model's lean linears at the start of every generation
call (so an optimizer step or a weight sync between rollouts is always seen) and again
after a weight update in the middle of one: a second copy of those weights for the duration, as long as one pass
over them to make. Inside `packed_weights`, a lean forward without gradients multiplies by the packed copy (oneDNN's
`_linear_pointwise`, the bias fused): the same product up to float rounding (oneDNN sums in another order than MKL),
so generation's log-probs equal the trainer's within float tolerance, not bit for bit, as on a GPU. A packed copy
does not follow its weight: changing the weights in place inside `packed_weights` without calling `pack()` again
would generate from the old ones (the engine repacks wherever it lets the weights change), and a forward given a
weight other than the one packed (a parameter object replaced) raises. Scoring and training never see the packed
copies. bfloat16 models (unmeasured on a CPU) and GPUs multiply by their weights as they are.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.utils import get_pg_size

PACKABLE_DTYPES = (torch.float32,)  # measured (module doc); bfloat16 on a CPU is not


class _Lean:
    """What both lean linears share: the packed copy of the weight (or None) and the product with it."""

    packed = None  # (the weight it packs, its oneDNN-packed copy), inside `packed_weights`

    def _product(self, input_, weight, bias):
        """input_ @ weight.t() (+ bias): megatron's ops, or with `weight`'s packed copy the oneDNN inner product."""
        if self.packed is not None:
            if self.packed[0] is not weight:  # a weight the packed copy is not of: never multiply by a stale one
                raise RuntimeError("a lean linear inside `packed_weights` was given a weight other than the one it "
                                   "packed (a parameter replaced, not updated in place, during generation)")
            return torch.ops.mkldnn._linear_pointwise(input_, self.packed[1], bias, "none", [], "")
        output = torch.matmul(input_, weight.t())
        return output + bias if bias is not None else output


class LeanColumnParallelLinear(_Lean, ColumnParallelLinear):
    """ColumnParallelLinear; without gradients, its forward in three ops at most (module doc). As a model's output
    layer, the positions of its [L, B, H] input before `first_position` are not multiplied (training.forward's
    `logits_from`; never set under sequence parallelism, where the input is this rank's shard of the positions)."""

    first_position = 0

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.first_position:
            input_ = input_[self.first_position:]
        if torch.is_grad_enabled() or self.sequence_parallel or self.config.defer_embedding_wgrad_compute or \
                self.config._cpu_offloading_context is not None:
            return super().forward(input_, weight, runtime_gather_output)
        if weight is None:
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):  # megatron's check
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not "
                               f"{(self.output_size_per_partition, self.input_size)} as expected")
        output = self._product(input_, weight, None if self.skip_bias_add else self.bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and get_pg_size(self.tp_group) > 1:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, self.bias if self.skip_bias_add else None


class LeanRowParallelLinear(_Lean, RowParallelLinear):
    """RowParallelLinear; without gradients, its forward in three ops at most (module doc)."""

    def forward(self, input_):
        if torch.is_grad_enabled() or not self.input_is_parallel or self.sequence_parallel or \
                self.config._cpu_offloading_context is not None:
            return super().forward(input_)
        output = self._product(input_, self.weight, None)
        if not self.explicit_expert_comm and get_pg_size(self.tp_group) > 1:
            output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def can_pack(model_chunks: list) -> bool:
    """Whether `packed_weights` packs anything for these chunks: the model runs on the CPU, in float32, and oneDNN is
    there (in torch's CPU builds; a build without it gets a warning: generation then runs at MKL's speed)."""
    if torch.cuda.is_available() or model_chunks[0].config.params_dtype not in PACKABLE_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        warnings.warn("this build of torch has no oneDNN (torch.backends.mkldnn): the built-in engine multiplies by "
                      "unpacked weights, about half as fast on a CPU (models/lean_linears.py)", stacklevel=2)
        return False
    return True


class PackedWeights:
    """oneDNN-packed copies of the weights of every lean linear of `model_chunks` (module doc), made by `pack` and
    dropped by `drop`. A model's output layer shares its weight with the embedding where the embeddings are tied."""

    def __init__(self, model_chunks: list):
        self.layers = []  # (lean linear, the weight it multiplies by)
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, _Lean) and module.weight is not None:
                    self.layers.append((module, module.weight))
            if getattr(chunk, "post_process", False) and chunk.share_embeddings_and_output_weights:
                self.layers.append((chunk.output_layer, chunk.shared_embedding_or_output_weight()))

    def pack(self) -> None:
        """Pack the weights as they are now (again after the weights changed: a packed copy does not follow)."""
        with torch.no_grad():
            for module, weight in self.layers:
                module.packed = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))

    def drop(self) -> None:
        for module, _ in self.layers:
            module.packed = None


@contextlib.contextmanager
def packed_weights(model_chunks: list):
    """The chunks' lean linears multiply by oneDNN-packed weights inside (where `can_pack`; else nothing changes).
    Yields the PackedWeights (call `pack()` again after changing the weights inside), or None."""
    if not can_pack(model_chunks):
        yield None
        return
    packed = PackedWeights(model_chunks)
    packed.pack()
    try:
        yield packed
    finally:
        packed.drop()

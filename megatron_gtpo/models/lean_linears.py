"""megatron-core's tensor-parallel linear layers, with a lean forward where no gradient is recorded.

megatron-core 0.16.1's ColumnParallelLinear and RowParallelLinear route every forward through autograd Functions
that exist for the backward pass (the copy-to / reduce-from tensor-parallel regions, which are identities in the
forward at TP 1, and LinearWithGradAccumulationAndAsyncCommunication, which saves its inputs for the backward), and
RowParallelLinear looks its TP group up again on every call, with a deprecation warning that the warnings filter
then has to drop. Under `torch.no_grad` (a decode step of the built-in engine, the scoring passes) none of that
changes the result, and at small batches it is a large share of a decode step: about 15 torch calls per linear,
each of which also passes the CPU platform's torch-function mode (distributed/platform.py).

`LeanColumnParallelLinear` / `LeanRowParallelLinear` compute that forward directly, with megatron's own ops in
megatron's order (`torch.matmul(input, weight.t())`, then `+ bias`; at TP > 1 megatron's own all-gather /
all-reduce functions), so the output is the same, bit for bit. Wherever gradients are recorded, or the layer does
something else in its forward (sequence parallelism, a scattered input, a weight passed in, deferred embedding
gradients, activation offloading), megatron's forward runs unchanged. The local layer spec uses them
(models/qwen.layer_spec); Transformer Engine's spec keeps its own layers.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.utils import get_pg_size


class LeanColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear; without gradients, its forward in three ops at most (module doc)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if torch.is_grad_enabled() or weight is not None or self.sequence_parallel or \
                self.config.defer_embedding_wgrad_compute or self.config._cpu_offloading_context is not None:
            return super().forward(input_, weight, runtime_gather_output)
        output = torch.matmul(input_, self.weight.t())
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and get_pg_size(self.tp_group) > 1:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, self.bias if self.skip_bias_add else None


class LeanRowParallelLinear(RowParallelLinear):
    """RowParallelLinear; without gradients, its forward in three ops at most (module doc)."""

    def forward(self, input_):
        if torch.is_grad_enabled() or not self.input_is_parallel or self.sequence_parallel or \
                self.config._cpu_offloading_context is not None:
            return super().forward(input_)
        output = torch.matmul(input_, self.weight.t())
        if not self.explicit_expert_comm and get_pg_size(self.tp_group) > 1:
            output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


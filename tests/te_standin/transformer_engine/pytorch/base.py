"""What every stand-in module shares: TE's extra state (get_extra_state / set_extra_state of TE 2.x's
TransformerEngineBaseModule) and TE's tensor- / sequence-parallel communication, written with plain torch.distributed
collectives (gloo has no reduce-scatter: it is an all-reduce and a slice, which gives the same values)."""
from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist


class BaseModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None, "num_gemms": 1}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        self.fp8_meta["num_gemms"] = num_gemms

    def get_extra_state(self) -> torch.Tensor:
        """TE 2.x: an empty byte tensor without FP8 metadata; else the pickled recipe and FP8 variables."""
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        extra = {k: v for k, v in self.fp8_meta.items() if isinstance(v, (bool, int, float, str, tuple, list))}
        state = {"recipe": self.fp8_meta["recipe"], "extra_fp8_variables": extra}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return
            state = pickle.loads(state.detach().cpu().numpy().tobytes())
        elif isinstance(state, io.BytesIO):
            state.seek(0)
            state = torch.load(state)
        else:
            raise RuntimeError("Unsupported checkpoint format.")
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    return _all_reduce(x, group).chunk(_size(group), dim=0)[dist.get_rank(group)].contiguous()


class _Comm(torch.autograd.Function):
    """`forward_op` on the values, `backward_op` on the gradient (the pairs TE's column / row linears use)."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group) if forward_op else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (ctx.backward_op(grad, ctx.group) if ctx.backward_op else grad), None, None, None


def column_input(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """A column-parallel layer's input: all-gathered along the sequence (SP), else copied; its gradient comes back
    reduce-scattered (SP), else all-reduced."""
    if _size(group) == 1:
        return x
    if sequence_parallel:
        return _Comm.apply(x, group, _all_gather_dim0, _reduce_scatter_dim0)
    return _Comm.apply(x, group, None, _all_reduce)


def row_output(y: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """A row-parallel layer's partial output: reduce-scattered along the sequence (SP), else all-reduced."""
    if _size(group) == 1:
        return y
    if sequence_parallel:
        return _Comm.apply(y, group, _reduce_scatter_dim0, _all_gather_dim0)
    return _Comm.apply(y, group, _all_reduce, None)

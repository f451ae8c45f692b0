"""TE's Linear, LayerNormLinear, GroupedLinear, LayerNorm and RMSNorm, computed with torch ops (the constructor
arguments megatron-core 0.16.1 passes; options that change what TE computes, such as userbuffers, are refused)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .base import BaseModule, column_input, row_output

_UNSUPPORTED = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad", "ub_bulk_dgrad",
                "delay_wgrad_compute", "fuse_wgrad_accumulation", "symmetric_ar_type", "return_layernorm_output")
_IGNORED = ("ub_name", "name")  # userbuffer and debug names: no effect on what is computed


def _refuse_unsupported(kwargs: dict) -> None:
    used = sorted(k for k in _UNSUPPORTED if kwargs.get(k))
    unknown = sorted(k for k in kwargs if k not in _UNSUPPORTED and k not in _IGNORED)
    if used or unknown:
        raise NotImplementedError(f"the Transformer Engine stand-in does not model {used + unknown}")


def _mark_parallel(param: torch.nn.Parameter, dim: int) -> None:
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1


class _Parallel(BaseModule):
    """Shape and TP placement of a linear layer: `parallel_mode` "column" splits the output features over the
    tp_group, "row" the input features, None neither (megatron-core then communicates itself)."""

    def __init__(self, in_features, out_features, *, sequence_parallel=False, tp_group=None, tp_size=1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None, bias=True, return_bias=False,
                 params_dtype=None, parallel_mode=None, device="cuda", **kwargs):
        super().__init__()
        _refuse_unsupported(kwargs)
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode {parallel_mode!r}")
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.out_local = out_features // self.tp_size if parallel_mode == "column" else out_features
        self.in_local = in_features // self.tp_size if parallel_mode == "row" else in_features
        self._factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        self._init = (init_method or (lambda w: torch.nn.init.normal_(w, 0.0, 0.023)), get_rng_state_tracker,
                      rng_tracker_name)

    def _new_weight(self, name: str) -> None:
        weight = torch.nn.Parameter(torch.empty(self.out_local, self.in_local, **self._factory))
        init_method, tracker, tracker_name = self._init
        # TE draws a weight from the CUDA RNG tracker's stream; a host weight (use_cpu_initialization) from the host
        # generator, which the CPU platform's tracker would otherwise see change inside its fork.
        on_device = weight.device.type == "cuda"
        if weight.device.type != "meta":
            with tracker().fork(*([tracker_name] if tracker_name else [])) if tracker and on_device else \
                    contextlib.nullcontext():
                init_method(weight)
        _mark_parallel(weight, 1 if self.parallel_mode == "row" else 0)
        self.register_parameter(name, weight)

    def _new_bias(self, name: str) -> None:
        if not self.use_bias:
            return
        bias = torch.nn.Parameter(torch.zeros(self.out_local, **self._factory))
        if self.parallel_mode == "column":
            _mark_parallel(bias, 0)
        elif self.parallel_mode == "row":
            bias.sequence_parallel = self.sequence_parallel
        self.register_parameter(name, bias)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        if self.parallel_mode == "column":
            x = column_input(x, self.tp_group, self.sequence_parallel)
        add_bias = bias is not None and not self.return_bias
        y = F.linear(x, weight, bias if add_bias and self.parallel_mode != "row" else None)
        if self.parallel_mode == "row":
            y = row_output(y, self.tp_group, self.sequence_parallel)
            if add_bias:
                y = y + bias
        return y


class Linear(_Parallel):
    def __init__(self, in_features, out_features, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self._new_weight("weight")
        self._new_bias("bias")
        if not self.use_bias:
            self.bias = None

    def forward(self, inp, is_first_microbatch=None):
        out = self._linear(inp, self.weight, self.bias)
        return (out, self.bias) if self.return_bias else out


def _normalize(x, weight, bias, *, normalization: str, eps: float, zero_centered_gamma: bool):
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (y * gamma.float()).to(x.dtype)
    if normalization == "LayerNorm":
        return F.layer_norm(x.float(), x.shape[-1:], gamma.float(), bias.float(), eps).to(x.dtype)
    raise ValueError(f"normalization {normalization!r}")


class LayerNormLinear(_Parallel):
    """A norm over the input features, then a (column-parallel) linear layer: the norm runs on this rank's sequence
    shard under sequence parallelism, before the gather, as in TE."""

    def __init__(self, in_features, out_features, eps=1e-5, *, zero_centered_gamma=False,
                 normalization="LayerNorm", **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        sequence_parallel = self.sequence_parallel
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        fill = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(fill(in_features, **self._factory))
        self.layer_norm_weight.sequence_parallel = sequence_parallel
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, **self._factory))
            self.layer_norm_bias.sequence_parallel = sequence_parallel
        else:
            self.layer_norm_bias = None
        self._new_weight("weight")
        self._new_bias("bias")
        if not self.use_bias:
            self.bias = None

    def forward(self, inp, is_first_microbatch=None):
        normed = _normalize(inp, self.layer_norm_weight, self.layer_norm_bias, normalization=self.normalization,
                            eps=self.eps, zero_centered_gamma=self.zero_centered_gamma)
        out = self._linear(normed, self.weight, self.bias)
        return (out, self.bias) if self.return_bias else out


class GroupedLinear(_Parallel):
    """`num_gemms` linear layers (`weight0` .. `weight{num_gemms - 1}`): the rows of the input are split by `m_splits`
    and row block i goes through layer i. With megatron-core's experts (TEGroupedLinear) it never communicates: at
    (expert) TP > 1 or EP > 1 megatron-core hands it parallel_mode None and does the communication itself."""

    def __init__(self, num_gemms, in_features, out_features, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        if self.parallel_mode is not None and self.tp_size > 1:  # megatron-core communicates for its experts itself
            raise NotImplementedError("GroupedLinear's own TP communication is not part of the stand-in")
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self._new_weight(f"weight{i}")
            self._new_bias(f"bias{i}")

    def forward(self, inp, m_splits, is_first_microbatch=None):
        if len(m_splits) != self.num_gemms or sum(m_splits) != inp.shape[0]:
            raise ValueError(f"m_splits {list(m_splits)} do not split {inp.shape[0]} rows into {self.num_gemms}")
        biases = [getattr(self, f"bias{i}") if self.use_bias else None for i in range(self.num_gemms)]
        outs = [self._linear(x, getattr(self, f"weight{i}"), biases[i])
                for i, x in enumerate(torch.split(inp, list(m_splits)))]
        out = torch.cat(outs) if outs else inp.new_empty(0, self.out_local)
        return (out, biases) if self.return_bias else out


class _Norm(BaseModule):
    def __init__(self, normalization, hidden_size, eps=1e-5, sequence_parallel=False, params_dtype=None,
                 zero_centered_gamma=False, device="cuda", **kwargs):
        super().__init__()
        _refuse_unsupported(kwargs)
        factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.weight = torch.nn.Parameter((torch.zeros if zero_centered_gamma else torch.ones)(hidden_size, **factory))
        self.weight.sequence_parallel = sequence_parallel
        if normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.bias = None

    def forward(self, inp):
        return _normalize(inp, self.weight, self.bias, normalization=self.normalization, eps=self.eps,
                          zero_centered_gamma=self.zero_centered_gamma)


class LayerNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, **kwargs):
        super().__init__("LayerNorm", hidden_size, eps, **kwargs)


class RMSNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, **kwargs):
        super().__init__("RMSNorm", hidden_size, eps, **kwargs)

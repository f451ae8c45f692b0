"""The CPU platform layer: lets unmodified megatron-core run on a machine without CUDA.

megatron-core assumes CUDA in a handful of places (see shared notes/megatron-on-cpu.md): `device="cuda"` literals
and `torch.cuda.current_device()` as a device, `Tensor.cuda()`, the model-parallel RNG tracker built on the CUDA
generator, and `param.type() == 'torch.cuda.FloatTensor'` checks in the optimizer and grad clipping. This module
maps all of them onto the CPU:

- a process-wide TorchFunctionMode rewrites every `device=` argument that names CUDA (a string, a torch.device or a
  bare int ordinal) to the CPU, makes `Tensor.cuda()` a no-op and `Tensor.to("cuda")` stay on the CPU, and makes
  `Tensor.type()` report `torch.cuda.*Tensor` for CPU tensors (the only thing megatron inspects it for);
- `torch.cuda.{current_device, synchronize, manual_seed, get_rng_state, set_rng_state, ...}` get CPU stand-ins,
  so megatron's RNG tracker forks and restores the CPU generator exactly as it would the CUDA one;
- megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` helpers get the same CPU stand-ins;
- megatron's CUDA_DEVICE_MAX_CONNECTIONS advice (a CUDA stream setting) is marked as already given.

`activate_cpu_platform()` is the one place this happens. It is a no-op when CUDA is available, idempotent, and must
run before megatron-core builds anything (it is called by `megatron_gtpo.distributed.initialize_parallel`).
`torch.cuda.is_available()` keeps returning False, so code can still ask what the hardware really is.
"""
from __future__ import annotations

import warnings

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_mode: TorchFunctionMode | None = None


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare ordinal means a CUDA device to torch
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


class _CudaOnCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU for every torch call made while the mode is on the stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def is_cpu_platform_active() -> bool:
    return _mode is not None


def activate_cpu_platform() -> bool:
    """Install the CPU stand-ins if CUDA is absent. Returns True if the CPU platform is (now) active."""
    global _mode
    if torch.cuda.is_available():
        return False
    if _mode is not None:
        return True

    # Expected on a CPU machine, and printed by every rank on every step otherwise.
    for message in (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
                    ".*all_gather_into_tensor` is deprecated.*", ".*reduce_scatter_tensor` is deprecated.*",
                    ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed  # torch.manual_seed calls it: must not call torch.manual_seed back
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda device: None

    from megatron.core.tensor_parallel import layers as megatron_layers
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = _cpu_get_rng_state
    megatron_random._set_cuda_rng_state = _cpu_set_rng_state
    # Its advice to set CUDA_DEVICE_MAX_CONNECTIONS (how CUDA streams order communication and compute) has no
    # meaning on the CPU: mark it as given. On a GPU it stays, and applies.
    megatron_layers.linear_with_grad_accumulation_and_async_allreduce.warned = True

    # Entered once and never exited: the mode stays on the stack for the life of the process.
    _mode = _CudaOnCpuMode()
    _mode.__enter__()
    return True

"""The CPU platform layer: lets unmodified megatron-core run on a machine without CUDA.

megatron-core assumes CUDA in a handful of places: `device="cuda"` literals and `torch.cuda.current_device()` as
a device, `Tensor.cuda()`, the model-parallel RNG tracker built on the CUDA generator, and
`param.type() == 'torch.cuda.FloatTensor'` checks in the optimizer and grad clipping. This module maps all of them
onto the CPU:

- a process-wide TorchFunctionMode rewrites every `device=` argument that names CUDA (a string, a torch.device or a
  bare int ordinal) to the CPU, keeps `Tensor.cuda()` and `Tensor.to("cuda")` on the CPU, and makes
  `Tensor.type()` report `torch.cuda.*Tensor` for CPU tensors (the only thing megatron inspects it for);
- the same mode runs the device audit (device_audit.py): every tensor keeps the place it would have on a GPU, and a
  host tensor meeting a device tensor, or going to a collective on a group that is NCCL on a GPU, raises
  DeviceMixError, so the CPU runs catch what would fail on CUDA;
- `pin_memory=True` (megatron-core's RoPE under context parallelism pins a host tensor) allocates ordinary host
  memory: the CPU build of torch has no pinned-memory allocator;
- `torch.Generator(device="cuda")` gives a CPU generator;
- CUDA streams and events (megatron-core's MoE token dispatcher copies its split sizes to the host on a side
  stream) get stand-ins that order nothing, as everything on the CPU runs in program order: there is one stream,
  so no tensor is ever used on a side stream (nothing calls `record_stream`, which takes real streams only);
- `torch.cuda.{current_device, synchronize, manual_seed, get_rng_state, set_rng_state, ...}` get CPU stand-ins,
  so megatron's RNG tracker forks and restores the CPU generator exactly as it would the CUDA one;
- megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` helpers get the same CPU stand-ins;
- megatron's autograd functions allocate on `torch.cuda.current_device()` in their backward passes too (the
  sequence-parallel gather / reduce-scatter and linear layers, the MoE all-to-all), where no torch-function mode is
  active (the mode stack is thread-local, and autograd's engine does not carry it): every custom autograd function's
  backward runs under the platform's mode;
- megatron's CUDA_DEVICE_MAX_CONNECTIONS advice (a CUDA stream setting) is marked as already given.

`activate_cpu_platform()` is the one place this happens. It is a no-op when CUDA is available, idempotent, and must
run before megatron-core builds anything (it is called by `megatron_gtpo.distributed.initialize_parallel`).
`torch.cuda.is_available()` keeps returning False, so code can still ask what the hardware really is. It refuses to
start on a machine whose NVIDIA GPUs torch cannot use (`GpuWithoutCuda`): a driver too old for torch's CUDA, or a CPU
build of torch, would otherwise train on the CPU without a word.
"""
from __future__ import annotations

import contextlib
import os
import re
import warnings

import torch
from torch.overrides import TorchFunctionMode

from megatron_gtpo.notices import ignore_optional_kernel_notices

from .device_audit import DeviceAudit, wrap_collectives, wrap_parameter_new

_CPU = torch.device("cpu")
_mode: "_CudaOnCpuMode | None" = None


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
    """Runs every torch call made while the mode is on the stack on the CPU, through the device audit."""

    def __init__(self, audit: DeviceAudit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):  # page-locked host memory speeds up copies to a GPU; there is none to pin for
            kwargs["pin_memory"] = False
        return self.audit.call(func, args, kwargs, is_cuda_device=_is_cuda_device)


class _CpuGenerator(torch.Generator):
    """torch.Generator(device="cuda") gives a CPU generator (the CPU build of torch has no CUDA generator)."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, device=_CPU if _is_cuda_device(device) else device)

    def __init__(self, device="cpu"):
        pass


class _CpuEvent:
    """A CUDA event on the CPU: every operation before it has already happened."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class _CpuStream:
    """The CPU's one stream: work runs in program order, so waiting and recording order nothing."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        pass


_DEFAULT_STREAM = _CpuStream()


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _under_platform_mode(function):
    """`function` run under the platform's mode where it is called without any (autograd's backward)."""
    def wrapped(*args, **kwargs):
        if _mode is None or torch._C._len_torch_function_stack() > 0:
            return function(*args, **kwargs)
        with _mode:
            return function(*args, **kwargs)

    return wrapped


def is_cpu_platform_active() -> bool:
    return _mode is not None


def device_audit() -> DeviceAudit | None:
    """The CPU platform's device audit (distributed/device_audit.py), None without the platform."""
    return _mode.audit if _mode is not None else None


ALLOW_CPU_ENV = "MEGATRON_GTPO_ALLOW_CPU"


class GpuWithoutCuda(OSError):
    """NVIDIA GPUs are present, but this torch cannot use them."""


def visible_nvidia_gpus(dev: str = "/dev") -> list[str]:
    """The NVIDIA GPU device nodes of this machine (/dev/nvidia0, ...), whatever torch was built for."""
    if not os.path.isdir(dev):
        return []
    return sorted((n for n in os.listdir(dev) if re.fullmatch(r"nvidia\d+", n)), key=lambda n: int(n[6:]))


def check_gpus_are_usable(dev: str = "/dev", environ=None) -> None:
    """GpuWithoutCuda when this machine has NVIDIA GPUs that torch cannot use, unless they are hidden on purpose
    (CUDA_VISIBLE_DEVICES empty or -1) or MEGATRON_GTPO_ALLOW_CPU=1 says to run on the CPU anyway."""
    env = os.environ if environ is None else environ
    gpus = visible_nvidia_gpus(dev)
    if not gpus or torch.cuda.is_available() or env.get(ALLOW_CPU_ENV, "") not in ("", "0") \
            or env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return
    why = ("it is a CPU-only build" if torch.version.cuda is None else
           f"it is built for CUDA {torch.version.cuda}, and torch.cuda.is_available() is False: usually an NVIDIA "
           f"driver too old for that CUDA (PyPI's torch 2.13 needs a driver for CUDA 13, >= 580; see nvidia-smi)")
    raise GpuWithoutCuda(f"this machine has {len(gpus)} NVIDIA GPU(s) ({', '.join(gpus)}) but torch "
                         f"{torch.__version__} cannot use them: {why}. Install a torch that matches the driver, or "
                         f"set {ALLOW_CPU_ENV}=1 to run on the CPU anyway")


def activate_cpu_platform(dev: str = "/dev") -> bool:
    """Install the CPU stand-ins if CUDA is absent. Returns True if the CPU platform is (now) active. GpuWithoutCuda
    when the machine has NVIDIA GPUs (device nodes under `dev`) that torch cannot use."""
    global _mode
    if torch.cuda.is_available():
        return False
    if _mode is not None:
        return True
    check_gpus_are_usable(dev)

    # Expected on a CPU machine, and printed by every rank on every step otherwise.
    ignore_optional_kernel_notices()
    for message in (".*all_gather_into_tensor` is deprecated.*", ".*reduce_scatter_tensor` is deprecated.*",
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
    cuda.Stream = lambda *args, **kwargs: _DEFAULT_STREAM
    cuda.Event = _CpuEvent
    cuda.current_stream = cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()

    from megatron.core.tensor_parallel import layers as megatron_layers
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = _cpu_get_rng_state
    megatron_random._set_cuda_rng_state = _cpu_set_rng_state
    # Its advice to set CUDA_DEVICE_MAX_CONNECTIONS (how CUDA streams order communication and compute) has no
    # meaning on the CPU: mark it as given. On a GPU it stays, and applies.
    megatron_layers.linear_with_grad_accumulation_and_async_allreduce.warned = True

    torch.autograd.function.BackwardCFunction.apply = _under_platform_mode(
        torch.autograd.function.BackwardCFunction.apply)

    torch.Generator = _CpuGenerator
    audit = DeviceAudit()
    wrap_parameter_new(audit)
    wrap_collectives(audit)
    # Entered once and never exited: the mode stays on the stack for the life of the process.
    _mode = _CudaOnCpuMode(audit)
    _mode.__enter__()
    return True

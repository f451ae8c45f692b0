"""The device audit of the CPU platform: remembers which tensors would live on the accelerator, and raises where a
CUDA run would fail because a host tensor meets one of them.

On a machine without CUDA every tensor is on the CPU, so code that builds a loss mask on the host and combines it
with the model's log-probs runs fine there and fails on the first GPU step ("Expected all tensors to be on the same
device"). The audit gives each tensor a logical place, as CUDA would:
- device: made with a CUDA `device=` (a factory, `new_*`, `.to("cuda")`, `.cuda()`, `Module.cuda()`), or computed
  from a device tensor; such a tensor reports `device` cuda:N and `is_cuda` True, so code that follows
  `x.device` behaves as on a GPU;
- host: made without a device or with a CPU one, or copied back with `.cpu()` / `.to("cpu")`;
- unknown: made where no torch call is seen (the autograd engine's gradients, collectives' outputs, tensors from
  numpy or files). An unknown tensor never raises and lends no place to what is computed from it.
A torch call that mixes a device tensor with a host tensor of one or more dimensions raises `DeviceMixError` (torch
allows 0-dim host tensors next to CUDA ones, and so does the audit). Copies are explicit transfers and allowed
(`dst.copy_(src)`), and so are host indices into a device tensor (`x[idx]`, `x[idx] = v`), as in torch.
Transfers between places copy, as they would on a GPU: `.cuda()` of a host tensor returns a new tensor, so the host
original stays host.

Collectives and point-to-point ops (`wrap_collectives`): on a GPU every process group is NCCL unless it was created
as gloo (`new_group(backend="gloo")`, as megatron-core makes its *_GLOO groups), and NCCL takes only CUDA tensors.
A host tensor given to torch.distributed on any other group raises DeviceMixError. The audit also remembers which
groups carried collectives (`collective_groups`).

The audit runs inside the platform's TorchFunctionMode (distributed/platform.py) and only where the CPU platform is
active; with CUDA present nothing here runs.
"""
from __future__ import annotations

import functools
import inspect
import weakref

import torch

DEVICE, HOST = True, False
_LOGICAL_DEVICE = torch.device("cuda", 0)  # what torch.cuda.current_device() is on the CPU platform


class DeviceMixError(RuntimeError):
    """A host tensor met a device tensor in a torch call: the same code fails on CUDA."""


class _Place(weakref.ref):
    """A tracked tensor's entry: a weak reference to it, its place, and its key in the audit's table."""
    __slots__ = ("key", "place")


class DeviceAudit:
    # The audit runs on every torch call of a CPU run, so its common path is written for speed: `call` recognises a
    # plain op by one set lookup, `_op` looks each tensor up once, `mark` makes no closure per tensor (30 steps of the
    # demo at TP 2: 23.5 s in the step's phases before, 20.1 s after, 18.7 s with no audit at all).
    def __init__(self):
        self._places: dict[int, _Place] = {}
        self.host_syncs = 0  # device -> host reads (.item(), .tolist(), .cpu(), ...): each is a sync on CUDA
        self.gloo_groups: list = []  # process groups created as gloo: host tensors are theirs
        self.collective_groups: list = []  # every group that carried a collective (None: the default group)
        self._plain_ops: set = set()  # the calls `call` has seen that are none of its special cases

        def forget(entry: _Place, places=self._places):
            if places.get(entry.key) is entry:
                del places[entry.key]

        self._forget = forget

    def place(self, tensor: torch.Tensor) -> bool | None:
        """DEVICE, HOST, or None (unknown)."""
        entry = self._places.get(id(tensor))
        if entry is not None and entry() is tensor:
            return entry.place
        return None

    def mark(self, tensor, place: bool | None):
        if place is None or not isinstance(tensor, torch.Tensor):
            return tensor
        key = id(tensor)
        entry = self._places.get(key)
        if entry is not None and entry() is tensor:  # e.g. an in-place op's result, its own input
            entry.place = place
            return tensor
        entry = _Place(tensor, self._forget)
        entry.key, entry.place = key, place
        self._places[key] = entry
        return tensor

    def mark_all(self, result, place: bool | None):
        if place is not None:
            if isinstance(result, torch.Tensor):
                self.mark(result, place)
            else:
                for t in _tensors(result):
                    self.mark(t, place)
        return result

    # -- the torch calls ------------------------------------------------------------------------------------------
    def call(self, func, args, kwargs, *, is_cuda_device):
        """Run `func` on the CPU (a CUDA `device=` becomes the CPU) and give its outputs their place; raise
        DeviceMixError where a CUDA run would fail. `is_cuda_device(d)` says whether a device argument names CUDA."""
        # Most calls: one set lookup instead of the cases below. The set is not touched while dynamo traces a compiled
        # function (megatron's fusions): dynamo fails to wrap a set reached through the mode stack (torch 2.13).
        traced = torch.compiler.is_compiling()
        if not traced and func in self._plain_ops:
            return self._op_or_factory(func, args, kwargs, is_cuda_device)
        if func is torch.Tensor.cuda:
            return self._transfer(args[0], DEVICE)
        if func is torch.Tensor.cpu:
            return self._transfer(args[0], HOST)
        if func is torch.Tensor.to:
            return self._to(args, kwargs, is_cuda_device)
        if func is torch._C._nn._parse_to:  # Module.to's parser: it makes no tensor, and must see the CUDA device
            return func(*[_named(a) for a in args], **{k: _named(v) for k, v in kwargs.items()})
        descriptor = getattr(func, "__self__", None)
        if type(descriptor).__name__ == "getset_descriptor":
            return self._attribute(func, descriptor.__name__, args)
        if func in _HOST_READS:
            if self.place(args[0]) == DEVICE:
                self.host_syncs += 1
                if func is torch.Tensor.numpy:
                    raise DeviceMixError("numpy() of a device tensor: on CUDA this fails; copy it with .cpu() first")
        elif not traced:
            self._plain_ops.add(func)
        return self._op_or_factory(func, args, kwargs, is_cuda_device)

    def _op_or_factory(self, func, args, kwargs, is_cuda_device):
        if kwargs.get("device") is not None:
            place = _place_of_device(kwargs["device"], is_cuda_device)
            if place == DEVICE:
                kwargs["device"] = "cpu"
            return self.mark_all(func(*args, **kwargs), place)
        return self._op(func, args, kwargs)

    def _transfer(self, tensor, place: bool):
        if self.place(tensor) == place or (place == HOST and self.place(tensor) is None):
            return tensor
        if place == HOST:
            self.host_syncs += 1
        return self.mark(tensor.clone(), place)

    def _to(self, args, kwargs, is_cuda_device):
        tensor, rest = args[0], args[1:]
        copy = kwargs.pop("copy", False)
        if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's place and dtype
            target_place, rest = self.place(rest[0]), (rest[0].dtype, *rest[1:])
            _, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
        else:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
                *[_named(a) for a in rest], **{k: _named(v) for k, v in kwargs.items()})
            target_place = self.place(tensor) if device is None else _place_of_device(device, is_cuda_device)
        conversion = {k: v for k, v in (("dtype", dtype), ("memory_format", memory_format)) if v is not None}
        moved = torch.Tensor.to(tensor, non_blocking=non_blocking, copy=copy, **conversion)
        if target_place is None or target_place == self.place(tensor):
            return self.mark(moved, self.place(tensor)) if moved is not tensor else tensor
        if moved is tensor:
            moved = tensor.clone()
        if target_place == HOST and self.place(tensor) == DEVICE:
            self.host_syncs += 1
        return self.mark(moved, target_place)

    def _attribute(self, func, name: str, args):
        owner = args[0]
        place = self.place(owner)
        if name == "device" and place == DEVICE:
            return _LOGICAL_DEVICE
        if name == "is_cuda" and place == DEVICE:
            return True
        result = func(*args)
        if name == "data" and func.__name__ == "__set__":  # `param.data = x` moves the parameter to x's place
            self.mark(owner, self.place(args[1]))
        elif isinstance(result, torch.Tensor):
            self.mark(result, place)
        return result

    def _op(self, func, args, kwargs):
        inputs = _tensors(args)
        if kwargs:
            inputs += _tensors(kwargs)
        on_device = on_host = False
        places = self._places
        for t in inputs:
            entry = places.get(id(t))
            if entry is not None and entry() is t:
                if entry.place:
                    on_device = True
                else:
                    on_host = True
        if on_device and on_host:
            self._check_mix(func, args, inputs, [self.place(t) for t in inputs])
        result = func(*args, **kwargs)
        if on_device:
            return self.mark_all(result, DEVICE)
        # No tensor in: a factory on torch's default device, the host.
        return self.mark_all(result, HOST if on_host or not inputs else None)

    def _check_mix(self, func, args, inputs, places):
        if func in _TRANSFERS_AND_QUERIES:
            return
        if func in _INDEXING and self.place(args[0]) == DEVICE:
            return  # host indices (and, for assignments, host values) into a device tensor are allowed by torch
        if func is torch.Tensor.__setitem__ and DEVICE not in [self.place(t) for t in _tensors(args[1])]:
            self.host_syncs += 1  # host[idx] = device values: a device -> host copy, allowed by torch
            return
        host = [t for t, p in zip(inputs, places) if p == HOST and t.dim() > 0]
        if not host:
            return
        device = [t for t, p in zip(inputs, places) if p == DEVICE]
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        raise DeviceMixError(
            f"{name} mixes host tensor(s) {[tuple(t.shape) for t in host]} with device tensor(s) "
            f"{[tuple(t.shape) for t in device]}: on CUDA this fails (Expected all tensors to be on the same "
            f"device). Create the host tensor(s) on the training device (device=groups.device) or move them with "
            f".to(device) once, outside the per-micro-batch path")


    # -- torch.distributed -----------------------------------------------------------------------------------------
    def collective(self, name: str, group, tensors: list) -> None:
        """DeviceMixError when a host tensor goes to a collective `name` on a group that is NCCL on a GPU."""
        if not any(group is g for g in self.collective_groups):
            self.collective_groups.append(group)
        if any(group is g for g in self.gloo_groups):
            return
        host = [tuple(t.shape) for t in tensors if self.place(t) == HOST]
        if host:
            raise DeviceMixError(
                f"torch.distributed.{name} got host tensor(s) {host} on a process group that is NCCL on a GPU, "
                f"which takes CUDA tensors only: create them on the training device (device=parallel.device), or "
                f"use a group created with backend='gloo'")


# The ops that move tensors, and the arguments that hold them.
_COLLECTIVE_TENSORS = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor_list", "tensor"), "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output", "input_list"), "reduce_scatter_tensor": ("output", "input"),
    "all_to_all": ("output_tensor_list", "input_tensor_list"), "all_to_all_single": ("output", "input"),
    "gather": ("tensor", "gather_list"), "scatter": ("tensor", "scatter_list"),
    "send": ("tensor",), "recv": ("tensor",), "isend": ("tensor",), "irecv": ("tensor",),
}


def wrap_collectives(audit: DeviceAudit) -> None:
    """Route torch.distributed's collectives, point-to-point ops and new_group through the audit. Only the public
    names are replaced: torch's own object collectives (all_gather_object, ...) call the originals, with the tensors
    torch picks for the group's backend. isend / irecv are replaced in distributed_c10d as well, because
    P2POp accepts only the functions that module holds."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    original_new_group = c10d.new_group

    @functools.wraps(original_new_group)
    def new_group(*args, **kwargs):
        group = original_new_group(*args, **kwargs)
        backend = inspect.signature(original_new_group).bind(*args, **kwargs).arguments.get("backend")
        if backend is not None and str(backend).lower() == "gloo":
            audit.gloo_groups.append(group)
        return group

    dist.new_group = new_group
    for name, tensor_args in _COLLECTIVE_TENSORS.items():
        wrapper = _audited(getattr(c10d, name), name, tensor_args, audit)
        setattr(dist, name, wrapper)
        if name in ("isend", "irecv"):
            setattr(c10d, name, wrapper)
    original_batch = c10d.batch_isend_irecv

    @functools.wraps(original_batch)
    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            audit.collective("batch_isend_irecv", op.group, [op.tensor])
        return original_batch(p2p_op_list)

    dist.batch_isend_irecv = batch_isend_irecv


def _audited(original, name: str, tensor_args: tuple, audit: DeviceAudit):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        audit.collective(name, arguments.get("group"), _tensors([arguments.get(a) for a in tensor_args]))
        return original(*args, **kwargs)

    return call


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put)
# An explicit copy, and questions about tensors that touch no data.
_TRANSFERS_AND_QUERIES = (torch.Tensor.copy_, torch._has_compatible_shallow_copy_type, torch.Tensor.is_set_to)
_HOST_READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__)


def _named(device):
    """A bare int ordinal as the CUDA device it means (the CPU build of torch rejects ordinals)."""
    return torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) else device


def _place_of_device(device, is_cuda_device) -> bool | None:
    """DEVICE for a CUDA device, HOST for the CPU, None (no place tracked) for others, e.g. meta."""
    if is_cuda_device(device):
        return DEVICE
    return HOST if torch.device(device).type == "cpu" else None


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in nested tuples / lists / dicts (the shapes torch calls take and return)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return []
    found = []
    for item in tree:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            found += _tensors(item)
    return found


def wrap_parameter_new(audit: DeviceAudit):
    """nn.Parameter(data) makes a new tensor without a torch call the mode sees: give it data's place."""
    original = torch.nn.Parameter.__new__

    def __new__(cls, data=None, requires_grad=True):
        param = original(cls, data, requires_grad)
        if data is not None:
            audit.mark(param, audit.place(data))
        return param

    torch.nn.Parameter.__new__ = __new__

"""The declared format of the rollout channel's control messages (docs/remote_rollout.md): what a message may hold,
and how it becomes bytes and back. Nothing read from the network is unpickled or executed.

A message is a safetensors file in memory: its tensors, and in its metadata (key "gtpo") a JSON body that holds the
message's values in this grammar, and nothing else:

    null, true / false, numbers, strings      themselves
    [v, ...]                                  a list
    {"tuple": [v, ...]}                       a tuple
    {"dict": {"key": v, ...}}                 a dict with string keys
    {"tensor": "name"}                        the message's tensor of that name (its dtype and shape declared by
                                              safetensors)
    {"responses": {"field": "name", ...}}     a rollout record (responses.py), every field one tensor; checked
                                              (`Responses.check`) when read
    {"sampling": {"field": v, ...}}           engine.SamplingParams, validated by its constructor

Anything else in a body is refused (`MalformedMessage`); so is a body or a file that does not parse.
Floats cross as Python's shortest round-tripping repr, so values are equal after the trip, bit for bit.
"""
from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .engine import SamplingParams
from .responses import Responses

_BODY = "gtpo"  # the metadata key of the JSON body
_RESPONSE_FIELDS = tuple(f.name for f in dataclasses.fields(Responses))
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


class MalformedMessage(ValueError):
    """Bytes that are not a message of the declared format (module doc)."""


def dumps(value) -> bytes:
    """The message that holds `value` (of the grammar in the module doc; tensors are sent from the host)."""
    tensors: dict[str, torch.Tensor] = {}

    def tensor(t: torch.Tensor) -> str:
        name = str(len(tensors))
        tensors[name] = t.detach().cpu().contiguous()
        return name

    def encode(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [encode(x) for x in v]
        if isinstance(v, tuple):
            return {"tuple": [encode(x) for x in v]}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise TypeError(f"a message's dict keys must be strings, got {sorted(map(repr, v))[:3]}")
            return {"dict": {k: encode(x) for k, x in v.items()}}
        if isinstance(v, torch.Tensor):
            return {"tensor": tensor(v)}
        if isinstance(v, Responses):
            return {"responses": {name: tensor(getattr(v, name)) for name in _RESPONSE_FIELDS}}
        if isinstance(v, SamplingParams):
            return {"sampling": {name: encode(getattr(v, name)) for name in _SAMPLING_FIELDS}}
        raise TypeError(f"a message cannot hold a {type(v).__name__} (remote_messages.py declares what it can)")

    body = json.dumps(encode(value), allow_nan=True)
    return save_tensors(tensors, metadata={_BODY: body})


def loads(data: bytes):
    """The value of message `data`; MalformedMessage for bytes that are not one."""
    try:
        tensors = load_tensors(data)
        header_bytes = int.from_bytes(data[:8], "little")
        body = json.loads(json.loads(data[8:8 + header_bytes])["__metadata__"][_BODY])
    except Exception as e:  # noqa: BLE001 - safetensors, JSON and key errors alike: not a message
        raise MalformedMessage(f"not a message of the declared format ({type(e).__name__}: {e})") from None

    def tensor(name) -> torch.Tensor:
        if not isinstance(name, str) or name not in tensors:
            raise MalformedMessage(f"the message names tensor {name!r}, which it does not hold")
        return tensors[name]

    def decode(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [decode(x) for x in v]
        if not isinstance(v, dict) or len(v) != 1:
            raise MalformedMessage(f"a message body holds {type(v).__name__} {str(v)[:80]}, which the grammar has not")
        (tag, inner), = v.items()
        if tag == "tuple" and isinstance(inner, list):
            return tuple(decode(x) for x in inner)
        if tag == "dict" and isinstance(inner, dict):
            return {k: decode(x) for k, x in inner.items()}
        if tag == "tensor":
            return tensor(inner)
        if tag == "responses" and isinstance(inner, dict) and sorted(inner) == sorted(_RESPONSE_FIELDS):
            record = Responses(**{name: tensor(inner[name]) for name in _RESPONSE_FIELDS})
            record.check()
            return record
        if tag == "sampling" and isinstance(inner, dict) and set(inner) <= set(_SAMPLING_FIELDS):
            return SamplingParams(**{k: decode(x) for k, x in inner.items()})
        raise MalformedMessage(f"a message body holds {{{tag!r}: ...}}, which the grammar has not")

    try:
        return decode(body)
    except MalformedMessage:
        raise
    except Exception as e:  # noqa: BLE001 - a record or sampling parameters that do not check out
        raise MalformedMessage(f"a message's value does not check out ({type(e).__name__}: {e})") from None

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

Anything else in a body is refused (`MalformedMessage`); so is a body or a file that does not parse. A request is
{"op": str, "payload": ...}, its payload of the types `check_request` declares for its op; a reply is ("ok",
value) or ("error", text), a generate's value of the types `check_generate_reply` declares.
Floats cross as Python's shortest round-tripping repr, so values are equal after the trip, bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math

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


def check_request(op: str, payload) -> None:
    """TypeError, naming the op, unless `payload` has the types the protocol declares for request `op`; ValueError
    for an unknown op. (What the values mean, and whether they fit the server, its handlers check.)"""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    def int_lists(x):
        return isinstance(x, list) and all(isinstance(v, list) and all(is_int(i) for i in v) for v in x)

    def strings(x):
        return isinstance(x, list) and all(isinstance(v, str) for v in x)

    p = payload
    declared = {  # op: (what its payload is, whether this one is)
        "hello": ("a dict", lambda: isinstance(p, dict)),
        "join": ("a timeout in seconds", lambda: isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0),
        "generate": ("(prompts: [[int]], SamplingParams, first_prompt: int)", lambda: isinstance(p, tuple)
                     and len(p) == 3 and int_lists(p[0]) and isinstance(p[1], SamplingParams) and is_int(p[2])
                     and p[2] >= 0),
        "begin": ("null", lambda: p is None),
        "bucket": ("(names: [str], dtypes: [str], shapes: [[int]]) of equal lengths, torch dtypes, sizes >= 0",
                   lambda: isinstance(p, tuple) and len(p) == 3 and strings(p[0]) and strings(p[1])
                   and int_lists(p[2]) and len(p[0]) == len(p[1]) == len(p[2])
                   and all(isinstance(getattr(torch, d, None), torch.dtype) for d in p[1])
                   and all(n >= 0 for shape in p[2] for n in shape)),
        "finish": ("{name: (sum, sum of squares)}", lambda: isinstance(p, dict) and all(
            isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, float) for x in v) for v in p.values())),
        "close": ("null", lambda: p is None),
        "shutdown": ("null", lambda: p is None),
    }
    if op not in declared:
        raise ValueError(f"unknown request {op[:40]!r}; this server answers {sorted(declared)}")
    expected, holds = declared[op]
    if not holds():
        raise TypeError(f"{op!r} takes {expected}, got {str(payload)[:80]}")


def check_generate_reply(value) -> None:
    """MalformedMessage unless `value` is what a server answers a generate with: (the record, its routing (a list of
    tensors) or null, the policy version the request was made with, the seconds the server spent generating it (a
    finite float >= 0)). (Whether the routing fits the record, server_engine.ServerEngine checks.)"""
    if not (isinstance(value, tuple) and len(value) == 4 and isinstance(value[0], Responses)
            and (value[1] is None or isinstance(value[1], list) and all(isinstance(e, torch.Tensor) for e in value[1]))
            and isinstance(value[2], int) and not isinstance(value[2], bool)
            and isinstance(value[3], float) and math.isfinite(value[3]) and value[3] >= 0):
        raise MalformedMessage(f"'generate' answers (record, routing: [tensor] or null, made_with: int, "
                               f"generation_s: finite float >= 0), got {str(value)[:120]}")

"""An engine's answer (or its error) from the rank that ran it to the other ranks of its group, as tensors on the
group's device: the rollout record (responses.py) itself crosses, no Python object per response or token.

    header_6  int64 [status (0 ok, 1 error), prompts P, responses R, tokens T, error bytes E,
                     the source's generation seconds in microseconds]
    then, ok:    every field of the record in declaration order ([P], [R] or [T] elements of its dtype)
          error: the error text as E uint8 bytes

A record that fails `Responses.check` (or is no record) is an error on the source rank, which every rank then
raises. Empty responses (length 0) and records without prompts are allowed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .responses import Responses

_OK, _ERROR = 0, 1
_US_PER_S = 1_000_000


def broadcast_responses(outcome, src: int, group, device: torch.device, *, generation_s: float = 0.0):
    """The source rank's outcome, ("ok", Responses) or ("error", text), and the seconds its engine spent generating
    it (`generation_s`, the source's; to the microsecond), on every rank of `group` (`src` is a global rank; other
    ranks pass None and 0), as (status, record or text, seconds), the record on `device` (the source's own record
    moves there). Collective over `group`. If the record cannot be sent, every rank gets ("error", why, seconds)."""
    source = dist.get_rank() == src
    record = error = None
    if source:
        status, payload = outcome
        if status == "ok":
            try:
                if not isinstance(payload, Responses):
                    raise TypeError(f"the engine answered {type(payload).__name__}, not a Responses record")
                payload.check()
                record = payload.to(device)
            except (ValueError, TypeError) as e:
                error = f"the engine's responses cannot be sent: {type(e).__name__}: {e}"
        else:
            error = str(payload)
        if error is None:
            header = [_OK, record.num_prompts, record.num_responses, record.num_tokens, 0]
        else:
            error_bytes = torch.tensor(list(error.encode()), dtype=torch.uint8)
            header = [_ERROR, 0, 0, 0, error_bytes.numel()]
        header_6 = torch.tensor(header + [round(generation_s * _US_PER_S)], dtype=torch.int64, device=device)
    else:
        header_6 = torch.empty(6, dtype=torch.int64, device=device)
    dist.broadcast(header_6, src=src, group=group)
    status, num_prompts, num_responses, num_tokens, num_error_bytes, generation_us = header_6.cpu().tolist()
    seconds = generation_us / _US_PER_S
    if status == _ERROR:
        text = error_bytes.to(device) if source else torch.empty(num_error_bytes, dtype=torch.uint8, device=device)
        dist.broadcast(text, src=src, group=group)
        return "error", bytes(text.cpu().tolist()).decode(errors="replace"), seconds
    if not source:
        record = Responses.allocate(num_prompts, num_responses, num_tokens, device)
    for tensor in record.tensors():
        if tensor.numel():  # every rank knows the sizes: empty fields need no collective
            dist.broadcast(tensor, src=src, group=group)
    return "ok", record, seconds

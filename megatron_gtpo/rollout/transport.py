"""Responses between ranks as tensors: a rollout engine's answer (or its error) broadcast from the rank that ran it.

A pickled list of `Response` objects costs a Python object per token on both sides and travels through host memory
(`broadcast_object_list`); here the same content is three tensors on the group's device:

    header_5   int64  [status (0 ok, 1 error), prompts P, responses R, tokens T, error bytes E]
    ints       int32  [responses of each prompt (P), lengths (R), finish-reason codes (R), token ids (T)]
    logprobs_T float32

(or, on error, the error text as E uint8 bytes). Log-probs travel as float32: both engines compute them in float32
(vLLM's sampler, the built-in engine's fp32 log-softmax), so nothing is lost for their values; a float64 log-prob
that float32 cannot hold is rounded. Finish reasons are codes into `FINISH_REASONS`; any other reason is an error
on the source rank, which every rank then raises. Empty responses (length 0) are allowed.
"""
from __future__ import annotations

import array

import torch
import torch.distributed as dist

from .engine import FINISH_LENGTH, FINISH_STOP, Response

FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)
_OK, _ERROR = 0, 1


def responses_to_tensors(responses: list[list[Response]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ints, logprobs_T) on the host, laid out as in the module doc. ValueError for an unknown finish reason or a
    response whose log-probs do not match its tokens."""
    flat = [r for rs in responses for r in rs]
    for r in flat:
        if r.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {r.finish_reason!r} is none of {FINISH_REASONS}")
        if len(r.logprobs) != len(r.token_ids):
            raise ValueError(f"a response has {len(r.token_ids)} tokens and {len(r.logprobs)} log-probs")
    counts = [len(rs) for rs in responses]
    lengths = [len(r.token_ids) for r in flat]
    codes = [FINISH_REASONS.index(r.finish_reason) for r in flat]
    # array.extend converts a list in C: twice as fast as torch.tensor over one flattened list (measured).
    tokens, logprobs = array.array("i"), array.array("f")
    for r in flat:
        tokens.extend(r.token_ids)
        logprobs.extend(r.logprobs)
    ints = torch.cat([torch.tensor(counts + lengths + codes, dtype=torch.int32), _from_array(tokens, torch.int32)])
    return ints, _from_array(logprobs, torch.float32)


def _from_array(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)


def tensors_to_responses(ints: torch.Tensor, logprobs_T: torch.Tensor, num_prompts: int) -> list[list[Response]]:
    """The inverse of `responses_to_tensors` (host or device tensors; one device->host copy each)."""
    values = ints.cpu().tolist()
    logprobs = logprobs_T.cpu().tolist()
    counts = values[:num_prompts]
    num_responses = sum(counts)
    lengths = values[num_prompts:num_prompts + num_responses]
    codes = values[num_prompts + num_responses:num_prompts + 2 * num_responses]
    tokens = values[num_prompts + 2 * num_responses:]
    flat, start = [], 0
    for length, code in zip(lengths, codes):
        flat.append(Response(tokens[start:start + length], logprobs[start:start + length], FINISH_REASONS[code]))
        start += length
    out, start = [], 0
    for count in counts:
        out.append(flat[start:start + count])
        start += count
    return out


def broadcast_responses(outcome, src: int, group, device: torch.device):
    """The source rank's outcome, ("ok", [prompt][n] responses) or ("error", text), on every rank of `group`
    (`src` is a global rank; other ranks pass None). Collective over `group`. If the responses cannot be encoded,
    every rank gets ("error", why)."""
    source = dist.get_rank() == src
    ints = logprobs_T = error = None
    if source:
        status, payload = outcome
        if status == "ok":
            try:
                ints, logprobs_T = responses_to_tensors(payload)
            except (ValueError, TypeError, OverflowError) as e:
                error = f"the engine's responses cannot be sent: {type(e).__name__}: {e}"
        else:
            error = str(payload)
        if error is None:
            header = [_OK, len(payload), sum(len(rs) for rs in payload), logprobs_T.numel(), 0]
        else:
            error_bytes = torch.tensor(list(error.encode()), dtype=torch.uint8)
            header = [_ERROR, 0, 0, 0, error_bytes.numel()]
        header_5 = torch.tensor(header, dtype=torch.int64, device=device)
    else:
        header_5 = torch.empty(5, dtype=torch.int64, device=device)
    dist.broadcast(header_5, src=src, group=group)
    status, num_prompts, num_responses, num_tokens, num_error_bytes = header_5.cpu().tolist()
    if status == _ERROR:
        text = error_bytes.to(device) if source else torch.empty(num_error_bytes, dtype=torch.uint8, device=device)
        dist.broadcast(text, src=src, group=group)
        return "error", bytes(text.cpu().tolist()).decode(errors="replace")
    if source:
        dist.broadcast(ints.to(device), src=src, group=group)
        dist.broadcast(logprobs_T.to(device), src=src, group=group)
        # What the others decode, so that every rank holds the same values (log-probs rounded to float32).
        return "ok", tensors_to_responses(ints, logprobs_T, num_prompts)
    ints = torch.empty(num_prompts + 2 * num_responses + num_tokens, dtype=torch.int32, device=device)
    logprobs_T = torch.empty(num_tokens, dtype=torch.float32, device=device)
    dist.broadcast(ints, src=src, group=group)
    dist.broadcast(logprobs_T, src=src, group=group)
    return "ok", tensors_to_responses(ints, logprobs_T, num_prompts)

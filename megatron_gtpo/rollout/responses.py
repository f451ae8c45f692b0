"""The rollout record: one engine call's responses as ragged flat tensors, handed from the engine through the
transport and the experience to the step batch without a Python object per response or token.

    responses_per_prompt_P  int64    [P]  responses of each prompt, in prompt order
    lengths_R               int64    [R]  tokens of each response (0 allowed), prompt-major (R = sum of the above)
    finish_R                int64    [R]  finish reasons, codes into FINISH_REASONS
    token_ids_T             int32    [T]  all responses' tokens back to back (T = sum of lengths_R)
    logprobs_T              float32  [T]  logprobs_T[t] belongs to token_ids_T[t] (the convention of engine.py)
    weight_updates_T        int32    [T]  weight updates the engine took between the call and sampling the token:
                                          0 (the weights the call was made with) but for a rollout server that takes
                                          updates while it generates (rollout.schedule.update_during_generation)

A field's name ends with its axis: _P per prompt, _R per response, _T per token. Selection (`select_prompts`),
concatenation (`cat`), continuation (`extend`), moves (`to`), allocation (`allocate`) and the transport work field
by field from that suffix and the field's declared dtype, so a new per-token or per-response field is one more
declaration here. (Policy versions stay beside the record, training/sampled_groups.py: an engine knows only the
updates it took during a call.) A response ends with its stop token when its finish reason is
"stop"; "length" means max_new_tokens were generated without one.

The tensors live wherever their producer put them: the built-in engine's on the training device, a vLLM server's on
the host; the transport (transport.py) and the step batch move them to the training device. Python lists appear
only where text is needed (`token_id_lists`, for decoding) and in the list view `to_lists` / `from_lists` (tests,
the warm start's demonstrations, evaluation, vLLM's output).
"""
from __future__ import annotations

import array
import dataclasses
from dataclasses import dataclass

import torch

FINISH_STOP, FINISH_LENGTH = "stop", "length"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)  # finish_R holds indices into this
FINISH_STOP_CODE, FINISH_LENGTH_CODE = FINISH_REASONS.index(FINISH_STOP), FINISH_REASONS.index(FINISH_LENGTH)
AXES = ("P", "R", "T")  # per prompt, per response, per token


def _tensor_field(dtype: torch.dtype):
    return dataclasses.field(metadata={"dtype": dtype})


@dataclass(frozen=True)
class Response:
    """One response as Python lists: the list view of a record's response (`Responses.to_lists`/`from_lists`)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class Responses:
    """One engine call's responses (module doc). Every method but `to` and the list views (`token_id_lists`,
    `to_lists`) keeps the tensors on their device."""

    responses_per_prompt_P: torch.Tensor = _tensor_field(torch.int64)
    lengths_R: torch.Tensor = _tensor_field(torch.int64)
    finish_R: torch.Tensor = _tensor_field(torch.int64)
    token_ids_T: torch.Tensor = _tensor_field(torch.int32)  # half the bytes of int64 on the wire; ids < 2**31
    logprobs_T: torch.Tensor = _tensor_field(torch.float32)
    weight_updates_T: torch.Tensor = _tensor_field(torch.int32)  # gloo broadcasts no int16

    # -- construction -----------------------------------------------------------------------------------------
    @classmethod
    def allocate(cls, num_prompts: int, num_responses: int, num_tokens: int, device=None) -> Responses:
        """Uninitialised fields of these sizes (what a receiving rank broadcasts into)."""
        sizes = dict(zip(AXES, (num_prompts, num_responses, num_tokens)))
        return cls(**{f.name: torch.empty(sizes[_axis(f.name)], dtype=f.metadata["dtype"], device=device)
                      for f in dataclasses.fields(cls)})

    @classmethod
    def empty(cls, device=None) -> Responses:
        """No prompts (an engine host without a share of the prompts, a rank that kept no group)."""
        return cls.allocate(0, 0, 0, device)

    @classmethod
    def cat(cls, records: list[Responses]) -> Responses:
        """The records one after the other (prompt order); at least one record, all on one device."""
        return cls(**{f.name: torch.cat([getattr(r, f.name) for r in records]) for f in dataclasses.fields(cls)})

    @classmethod
    def from_lists(cls, groups: list[list[Response]], device=None) -> Responses:
        """The record of [prompt][sample] list-view responses (sampled by the call's weights: no weight update);
        log-probs rounded to float32. ValueError for an
        unknown finish reason or a response whose log-probs do not match its tokens; OverflowError for a token id
        that int32 cannot hold."""
        flat = [r for group in groups for r in group]
        for r in flat:
            if r.finish_reason not in FINISH_REASONS:
                raise ValueError(f"finish reason {r.finish_reason!r} is none of {FINISH_REASONS}")
            if len(r.logprobs) != len(r.token_ids):
                raise ValueError(f"a response has {len(r.token_ids)} tokens and {len(r.logprobs)} log-probs")
        # array.extend converts a list in C: twice as fast as torch.tensor over one flattened list (measured).
        tokens, logprobs = array.array("i"), array.array("f")
        for r in flat:
            tokens.extend(r.token_ids)
            logprobs.extend(r.logprobs)
        record = cls(responses_per_prompt_P=torch.tensor([len(g) for g in groups], dtype=torch.int64),
                     lengths_R=torch.tensor([len(r.token_ids) for r in flat], dtype=torch.int64),
                     finish_R=torch.tensor([FINISH_REASONS.index(r.finish_reason) for r in flat], dtype=torch.int64),
                     token_ids_T=_from_array(tokens, torch.int32), logprobs_T=_from_array(logprobs, torch.float32),
                     weight_updates_T=torch.zeros(len(tokens), dtype=torch.int32))
        return record.to(device) if device is not None else record

    # -- sizes and moves --------------------------------------------------------------------------------------
    @property
    def num_prompts(self) -> int:
        return self.responses_per_prompt_P.shape[0]

    @property
    def num_responses(self) -> int:
        return self.lengths_R.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_ids_T.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_ids_T.device

    def tensors(self) -> list[torch.Tensor]:
        """The fields in declaration order (the order the transport sends them in)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def to(self, device) -> Responses:
        """The record on `device` (the same tensors where they are there already)."""
        return type(self)(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def check(self) -> None:
        """ValueError unless the fields are consistent: declared dtypes, 1-D and contiguous, R = sum of
        responses_per_prompt_P, T = sum of lengths_R, no negative count, known finish codes. Reads a few values to
        the host."""
        fields = {f.name: (getattr(self, f.name), f.metadata["dtype"]) for f in dataclasses.fields(self)}
        for name, (value, dtype) in fields.items():
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.ndim != 1 \
                    or not value.is_contiguous():
                described = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(f"{name} must be a contiguous 1-D {dtype} tensor, got {described}")
        sizes = {"P": self.num_prompts, "R": self.num_responses, "T": self.num_tokens}
        for name, (value, _) in fields.items():
            if value.shape[0] != sizes[_axis(name)]:
                raise ValueError(f"{name} has {value.shape[0]} elements, the record {sizes[_axis(name)]} along "
                                 f"{_axis(name)}")
        if int(self.responses_per_prompt_P.sum()) != self.num_responses:
            raise ValueError(f"responses_per_prompt_P sums to {int(self.responses_per_prompt_P.sum())}, the record "
                             f"holds {self.num_responses} responses")
        if int(self.lengths_R.sum()) != self.num_tokens:
            raise ValueError(f"lengths_R sums to {int(self.lengths_R.sum())}, the record holds {self.num_tokens} "
                             "tokens")
        if (self.num_prompts and int(self.responses_per_prompt_P.min()) < 0) or \
                (self.num_responses and int(self.lengths_R.min()) < 0):
            raise ValueError("negative response counts or lengths")
        if self.num_responses and not bool(((self.finish_R >= 0) & (self.finish_R < len(FINISH_REASONS))).all()):
            raise ValueError(f"finish codes outside FINISH_REASONS {FINISH_REASONS}: "
                             f"{sorted(set(self.finish_R.tolist()))}")

    # -- views ------------------------------------------------------------------------------------------------
    def token_starts_R(self) -> torch.Tensor:
        """Where each response's tokens start in the per-token fields."""
        return _exclusive_cumsum(self.lengths_R)

    def lengths_NG(self) -> torch.Tensor:
        """lengths_R as [P, G]; every prompt must have the same number G of responses (a training rollout)."""
        if self.num_prompts and self.num_responses % self.num_prompts:
            raise ValueError(f"{self.num_responses} responses do not make {self.num_prompts} equal groups")
        return self.lengths_R.view(self.num_prompts, -1 if self.num_prompts else 0)

    def truncated_R(self) -> torch.Tensor:
        """bool [R]: the response hit max_new_tokens (finish reason "length")."""
        return self.finish_R == FINISH_LENGTH_CODE

    def select_prompts(self, index_P) -> Responses:
        """The record of prompts `index_P` (long indices, any device, in that order), with their responses and
        tokens: gathers by tensor indexing, three host reads of sizes."""
        return self.gather(self.prompt_index(index_P))

    def gather(self, index: dict[str, torch.Tensor]) -> Responses:
        """The record of the indices `index` gives along each axis (`prompt_index`'s)."""
        return type(self)(**{f.name: getattr(self, f.name).index_select(0, index[_axis(f.name)])
                             for f in dataclasses.fields(self)})

    def prompt_index(self, index_P) -> dict[str, torch.Tensor]:
        """{"P", "R", "T"}: the long indices along each axis of prompts `index_P`, their responses and their tokens,
        in that order (what `select_prompts` gathers; also what selects tensors kept beside the record)."""
        index_P = torch.as_tensor(index_P, dtype=torch.int64).to(self.device)
        counts_P = self.responses_per_prompt_P
        index_R = _ranges(_exclusive_cumsum(counts_P)[index_P], counts_P[index_P])
        index_T = _ranges(self.token_starts_R()[index_R], self.lengths_R[index_R])
        return {"P": index_P, "R": index_R, "T": index_T}

    def extend(self, continuation: Responses) -> Responses:
        """Each response followed by `continuation`'s response of the same index (the same responses per prompt):
        its tokens and log-probs appended, lengths added, and the continuation's finish reason (a partial response
        continued; an empty continuation keeps a response's tokens and takes its finish reason)."""
        if not torch.equal(self.responses_per_prompt_P, continuation.responses_per_prompt_P):
            raise ValueError("a continuation must have the responses per prompt of the record it extends")
        per_token = {f.name: concat_per_response(getattr(self, f.name), self.lengths_R,
                                                 getattr(continuation, f.name), continuation.lengths_R)
                     for f in dataclasses.fields(self) if _axis(f.name) == "T"}
        return dataclasses.replace(self, lengths_R=self.lengths_R + continuation.lengths_R,
                                   finish_R=continuation.finish_R, **per_token)

    def token_id_lists(self) -> list[list[int]]:
        """Each response's token ids as a host list (what a tokenizer decodes): one copy to the host."""
        tokens = self.token_ids_T.cpu().tolist()
        starts = [0]
        for length in self.lengths_R.tolist():
            starts.append(starts[-1] + length)
        return [tokens[a:b] for a, b in zip(starts, starts[1:])]

    def to_lists(self) -> list[list[Response]]:
        """The list view: [prompt][sample] `Response`s (one copy of each field to the host; without the weight
        updates, which only the training record keeps)."""
        tokens = self.token_id_lists()
        logprobs = self.logprobs_T.cpu().tolist()
        reasons = [FINISH_REASONS[c] for c in self.finish_R.tolist()]
        flat, start = [], 0
        for ids, reason in zip(tokens, reasons):
            flat.append(Response(ids, logprobs[start:start + len(ids)], reason))
            start += len(ids)
        groups, start = [], 0
        for count in self.responses_per_prompt_P.tolist():
            groups.append(flat[start:start + count])
            start += count
        return groups


def _axis(name: str) -> str:
    axis = name.rsplit("_", 1)[-1]
    if axis not in AXES:
        raise AssertionError(f"field {name!r} names no axis of {AXES}")
    return axis


def concat_per_response(first_T: torch.Tensor, first_lengths_R: torch.Tensor, then_T: torch.Tensor,
                        then_lengths_R: torch.Tensor) -> torch.Tensor:
    """Per-token values of responses laid back to back (`first_T`, lengths `first_lengths_R`), each response's
    followed by its values in `then_T` (lengths `then_lengths_R`, the same responses): [sum of both lengths]."""
    lengths_2R = torch.stack([first_lengths_R, then_lengths_R], dim=1).flatten()
    starts_2R = torch.stack([_exclusive_cumsum(first_lengths_R),
                             first_T.shape[0] + _exclusive_cumsum(then_lengths_R)], dim=1).flatten()
    return torch.cat([first_T, then_T]).index_select(0, _ranges(starts_2R, lengths_2R))


def _from_array(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)


def _exclusive_cumsum(counts_K: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts_K, 0) - counts_K


def _ranges(starts_K: torch.Tensor, counts_K: torch.Tensor) -> torch.Tensor:
    """long [sum(counts_K)]: starts_K[k], starts_K[k] + 1, ..., starts_K[k] + counts_K[k] - 1, for k in order."""
    total = int(counts_K.sum())
    shift_K = starts_K - _exclusive_cumsum(counts_K)
    return torch.repeat_interleave(shift_K, counts_K, output_size=total) + torch.arange(total, device=counts_K.device)

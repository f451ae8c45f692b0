"""The rollout engine contract shared by the built-in Megatron generation and the vLLM engine.

Log-prob convention: a response token's log-prob (`Responses.logprobs_T`, responses.py) is its log-probability under
the distribution it was sampled from: softmax(logits / temperature) over the true vocabulary, truncated by top-k then
top-p (distributed/truncation.py: vLLM's selection, ties to the lower id) and renormalised over the tokens kept. That
is vLLM's `processed_logprobs`, and exactly what the scoring path (`training.forward.forward_logprobs_and_entropy`)
gives for the same tokens at the same temperature and truncation (distributed/truncation.Truncation(top_k, top_p)),
so the trainer's rollout-vs-training mismatch compares like with like. Greedy decoding is `temperature == 0`: the
argmax of the logits (ties go to the lowest token id), and its log-probs are those of the untempered, untruncated
(T = 1) distribution, as vLLM reports them. (`top_k == 1` is also greedy in which token it picks, with log-prob 0.)
Both engines follow this convention (docs/vllm.md, "Sampling").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .responses import Responses

_SEED_STRIDE = 1_000_003  # > any prompts x n of one call: the rows of calls with seeds s and s + 1 never share a seed


def response_seed(seed: int, prompt_index: int, sample_index: int, n: int) -> int:
    """The seed of sample `sample_index` of prompt `prompt_index` in a call with `SamplingParams(seed=seed, n=n)`:
    every response of a call gets its own random stream, a function of these numbers only (not of batching)."""
    return seed * _SEED_STRIDE + prompt_index * n + sample_index


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `seed`: sample j of prompt i draws from its own random stream, seeded `response_seed(seed, i,
    j, n)` (the built-in engine's counter-based noise per row; vLLM's per-request seed): a fixed seed, the same prompts
    and the same TP/PP give the same responses. Callers that want different samples per step or per data-parallel
    replica vary it.

    `per_request_seeds=False` (vLLM only; the built-in engine always seeds each response) lets vLLM draw from its one
    engine-wide stream, seeded once when it starts: vLLM 0.32 samples seeded requests one at a time, a kernel each
    per decode step. Responses then depend on everything the engine generated before, so a resumed run (a new
    engine) samples differently from an uninterrupted one (docs/algorithms.md, "Sampling seeds")."""

    n: int = 1  # responses per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of most likely tokens with mass >= top_p (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    per_request_seeds: bool = True

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of non-negative ints, got {self.stop_token_ids!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Rollout:
    """What every engine's and every rollout server's `submit` gives: the record of the call's responses and, where
    the engine records routing, per response (record order) the experts its fed tokens went to at the MoE layers
    the engine runs, int16 [P + R - 1, M, k]: its prompt's P tokens and all its tokens but the last, which is never
    fed back (models/moe_routing.py). A trainer's engine (the built-in engine with `record_routing`, a server
    engine with `routed_layers`) gives this rank's MoE layers (rank-local, for routing replay); a rollout server
    (server_engine.RolloutServer) every layer of the model. None: no routing recorded (the routers choose in
    training). `generation_s`: the wall seconds the engine that answered spent generating this call (from the start
    of its generation to its end, on the machine that generated; the longest of a call's engines where several
    answer it; kept with a round held in a checkpoint), what the trainer's `rollout_busy_fraction` counts; 0 where
    nothing was generated (a host without prompts). `entropies_T`: the built-in engine with `record_entropies`
    gives per token (record order) the float32 entropy of the full tempered distribution it was sampled from,
    softmax(logits / temperature) over the true vocabulary before any top-k / top-p (the trainer's entropy, not the
    truncated distribution's that the log-prob convention above takes), on the record's device; None: not
    recorded. Beside the record, not in it: no other engine computes them, and no message carries them."""

    responses: Responses
    routed_experts: list[torch.Tensor] | None = None
    generation_s: float = 0.0
    entropies_T: torch.Tensor | None = None


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Responses:
        """params.n responses per prompt, in prompt order, as one record (responses.py). Called collectively by
        every rank of a model-parallel group with the same prompts (each data-parallel replica with its own); every
        rank of the group gets the same record, on the training device where the engine's ranks train."""
        ...

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Callable[[], Rollout]:
        """`generate` in two halves, both collective: the call asks, the function it returns gives the rollout (the
        record, and the routing where the engine records it). An engine on processes of its own generates in
        between, with the weights of the last sync before the call (what lets the trainer train meanwhile:
        rollout.schedule.max_staleness); an engine on the trainer's ranks answers at once."""
        ...

    def idle(self) -> bool:
        """Whether this rank's server (an engine host's) has answered every generation asked of it: True on a rank
        that hosts none and for an engine that answers within the call. Not collective (rollout_queue.py agrees on it
        over every rank)."""
        ...

    def stand_by(self) -> None:
        """Generate nothing this time, collectively with the ranks that do (a rank with enough groups in a round of
        dynamic sampling): the built-in engine takes part in its expert-parallel peers' forward steps; a no-op for
        engines without such peers."""
        ...

    def sync_weights(self, model_chunks: list, parallel) -> None:
        """Make the engine's weights those of `model_chunks` (collective over the model-parallel group)."""
        ...


def check_prompts(prompts, *, vocab_size: int, max_positions: int, max_new_tokens: int) -> None:
    """ValueError naming the first bad prompt: each must be a non-empty list of ids in [0, vocab_size) that leaves
    room for max_new_tokens within max_positions."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token id lists, got {type(prompts).__name__} "
                         f"of length {len(prompts) if hasattr(prompts, '__len__') else '?'}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {prompt!r}")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if len(prompt) + max_new_tokens > max_positions:
            raise ValueError(f"prompts[{i}] has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that "
                             f"exceeds the model's {max_positions} positions")

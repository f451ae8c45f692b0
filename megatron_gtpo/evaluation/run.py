"""Generate and grade one dataset's problems on this rank's replica; rank 0 gathers the graded problems.

Whichever the engine (replicas.py), the problems of a dataset go to it in calls of at most --prompts-per-call
prompts (fewer when that is needed to give every replica a share), call k on replica k mod R; the call starting at
prompt s has seed --seed + s, and sample j of its prompt i the stream `rollout.engine.response_seed(seed + s, i, j,
n)`. Rank 0 gathers the graded problems, writes the report and speaks.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from megatron_gtpo.data import PromptSample, Tokenizer
from megatron_gtpo.progress import progress_bar
from megatron_gtpo.rewards import RewardPool, extract_final_answer
from megatron_gtpo.rollout.engine import SamplingParams, check_prompts

from .passk import ProblemResult
from .replicas import Replica, ReplicaShare


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    num_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def replica_calls(num_prompts: int, *, prompts_per_call: int, share: ReplicaShare) -> list[range]:
    """The prompt ranges `share`'s replica asks its engine for: consecutive calls of at most prompts_per_call
    prompts, and at most ceil(num_prompts / share.count) so that every replica gets some; call k goes to replica
    k mod share.count."""
    if prompts_per_call < 1:
        raise ValueError(f"prompts_per_call must be >= 1, got {prompts_per_call}")
    per_call = min(prompts_per_call, -(-num_prompts // share.count))
    calls = [range(start, min(start + per_call, num_prompts)) for start in range(0, num_prompts, per_call)]
    return calls[share.index::share.count]


def generate_responses(
    replica: Replica,
    prompts_token_ids: Sequence[Sequence[int]],
    sampling: SamplingSettings,
    *,
    calls: Sequence[range],
    progress: bool = True,
) -> list[list[list[int]]]:
    """Response token ids [prompt][sample][token] of the prompts in `calls` (in that order), one engine call each;
    ValueError before any generation for prompts outside the replica's vocabulary or too long for its positions.

    The call starting at prompt index s uses seed `sampling.seed + s`, so calls never share a random stream
    and a rerun with the same settings asks for the same samples, whichever replica makes the call.
    """
    if calls:
        check_prompts([list(prompts_token_ids[position]) for call in calls for position in call],
                      vocab_size=replica.vocab_size, max_positions=replica.max_positions,
                      max_new_tokens=sampling.max_new_tokens)
    responses: list[list[list[int]]] = []
    for call in progress_bar(calls, desc="generating", unit="call", disable=not progress):
        prompts = [list(prompts_token_ids[position]) for position in call]
        params = SamplingParams(n=sampling.num_samples, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_new_tokens=sampling.max_new_tokens, stop_token_ids=(replica.eos_token_id,),
                                seed=sampling.seed + call.start)
        outputs = replica.engine.generate(prompts, params).to_lists()  # decoding needs the token ids as lists
        if len(outputs) != len(prompts) or any(len(samples) != sampling.num_samples for samples in outputs):
            raise RuntimeError(
                f"the engine returned {[len(samples) for samples in outputs]} responses for {len(prompts)} prompts "
                f"with n={sampling.num_samples}"
            )
        responses.extend([response.token_ids for response in samples] for samples in outputs)
    return responses


def evaluate_dataset(
    all_samples: Sequence[PromptSample],
    *,
    replica: Replica,
    tokenizer: Tokenizer,
    sampling: SamplingSettings,
    reward_pool: RewardPool,
    prompts_per_call: int = 64,
    progress: bool = True,
    skip_special_tokens: bool = True,
) -> list[ProblemResult]:
    """Generate `sampling.num_samples` responses per problem (its prompt token ids) and grade each (the reward
    pool's reward == 1.0: math verification, or a synthetic task's reward, on the text decoded with or without the
    special tokens, as its reward reads it): all problems on rank 0 (the others return []), each generated and graded
    by one replica (`replica.share`). `progress`: show progress displays (one rank does)."""
    calls = replica_calls(len(all_samples), prompts_per_call=prompts_per_call, share=replica.share)
    positions = [position for call in calls for position in call]
    samples = [all_samples[position] for position in positions]
    response_ids = generate_responses(
        replica, [sample.prompt_token_ids for sample in all_samples], sampling, calls=calls, progress=progress,
    )
    texts = [[tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in per_prompt]
             for per_prompt in response_ids]
    flat_texts = [text for per_prompt in texts for text in per_prompt]
    flat_references = [sample.answer for sample in samples for _ in range(sampling.num_samples)]
    rewards = reward_pool.rewards(flat_texts, flat_references, progress=progress)
    results = []
    for position, sample in enumerate(samples):
        first = position * sampling.num_samples
        results.append(
            ProblemResult(
                problem_id=sample.id,
                answer=sample.answer,
                correct=tuple(reward == 1.0 for reward in rewards[first : first + sampling.num_samples]),
                predicted_answers=tuple(extract_final_answer(text) for text in texts[position]),
                responses=tuple(texts[position]),
            )
        )
    return _gather_on_rank0(list(zip(positions, results)) if replica.share.leader else [], len(all_samples))


def _gather_on_rank0(position_results: list[tuple[int, ProblemResult]], num_problems: int) -> list[ProblemResult]:
    """Every replica's (problem position, result) pairs on rank 0, in problem order; [] on the other ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [result for _, result in sorted(position_results, key=lambda pair: pair[0])]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(position_results, gathered, dst=0)
    if dist.get_rank() != 0:
        return []
    by_position = dict(pair for rank_pairs in gathered for pair in rank_pairs)
    return [by_position[position] for position in range(num_problems)]

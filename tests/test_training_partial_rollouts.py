"""Partial rollouts (training/partial_rollouts.py) on hand-built records: the engine request that continues
unfinished responses, and the groups an answer completes or leaves unfinished, with every token's policy version and
log-prob, checked against lists written out by hand."""
from types import SimpleNamespace

import pytest
import torch

from megatron_gtpo.data.records import PromptSample
from megatron_gtpo.rollout.engine import Rollout, SamplingParams
from megatron_gtpo.rollout.responses import Response, Responses, concat_per_response
from megatron_gtpo.training.partial_rollouts import PartialRollouts
from megatron_gtpo.training.sampled_groups import SampledGroups

G = 2
PARTIAL = PartialRollouts(group_size=G, max_new_tokens=4, segment_tokens=2)


def _prompt(*ids):
    """The loader's item of the prompt `ids`, named by its first token."""
    return PromptSample(ids[0], str(ids[0]), ids, "")


def _carried() -> SampledGroups:
    """Two groups sampled at version 3: group A's first response stopped (token 9 is the stop token), its second
    was cut at the segment's end; group B's responses were both cut."""
    record = Responses.from_lists([
        [Response([5, 9], [-0.5, -0.9], "stop"), Response([6, 7], [-0.6, -0.7], "length")],
        [Response([1, 2], [-0.1, -0.2], "length"), Response([3, 4], [-0.3, -0.4], "length")],
    ])
    return SampledGroups.sampled([_prompt(100, 101), _prompt(200)], Rollout(record), 3)


def test_the_request_continues_unfinished_responses_then_starts_new_groups():
    rows, params = PARTIAL.request(_carried(), [_prompt(300, 301)], SamplingParams(n=G, max_new_tokens=4, seed=7))
    assert rows == [[100, 101, 6, 7], [200, 1, 2], [200, 3, 4], [300, 301], [300, 301]]
    assert (params.n, params.max_new_tokens, params.seed) == (1, 2, 7)
    rows, _ = PARTIAL.request(None, [_prompt(300)], SamplingParams(n=G))
    assert rows == [[300], [300]]


def test_an_answer_completes_groups_and_leaves_the_others_for_later():
    answer = Responses.from_lists([
        [Response([8, 9], [-0.8, -0.9], "stop")],  # group A's second response, finished by a stop token
        [Response([5, 6], [-0.5, -0.6], "length")],  # group B's first: 4 tokens in all, max_new_tokens: finished
        [Response([9], [-0.9], "stop")],  # group B's second
        [Response([1, 2], [-0.1, -0.2], "length")],  # the new group C: cut, so unfinished
        [Response([9], [-0.99], "stop")],
        [Response([9], [-0.4], "stop")], [Response([3, 9], [-0.3, -0.2], "stop")],  # the new group D: finished
    ])
    complete, unfinished = PARTIAL.merge(_carried(), [_prompt(300), _prompt(400)], Rollout(answer), 4)
    # The continued (older) groups first, then the new ones, each in the order asked for.
    assert [p.id for p in complete.prompts] == ["100", "200", "400"] and [p.id for p in unfinished.prompts] == ["300"]
    groups = complete.responses.to_lists()
    assert [[r.token_ids for r in g] for g in groups] == [[[5, 9], [6, 7, 8, 9]], [[1, 2, 5, 6], [3, 4, 9]],
                                                          [[9], [3, 9]]]
    assert [[r.finish_reason for r in g] for g in groups] == [["stop", "stop"], ["length", "stop"], ["stop"] * 2]
    assert torch.allclose(complete.responses.logprobs_T, torch.tensor(
        [-0.5, -0.9, -0.6, -0.7, -0.8, -0.9, -0.1, -0.2, -0.5, -0.6, -0.3, -0.4, -0.9, -0.4, -0.3, -0.2]))
    # Each token keeps the version that sampled it; each response the version of its first segment.
    assert complete.versions_T.tolist() == [3, 3, 3, 3, 4, 4, 3, 3, 4, 4, 3, 3, 4, 4, 4, 4]
    assert complete.start_versions_R.tolist() == [3, 3, 3, 3, 4, 4]
    assert complete.continued_R().tolist() == [False, True, True, True, False, False]
    assert unfinished.versions_T.tolist() == [4, 4, 4] and unfinished.start_versions_R.tolist() == [4, 4]
    assert unfinished.continued_R().tolist() == [False, False]
    complete.responses.check()
    unfinished.responses.check()


def test_continuing_the_unfinished_groups_again_finishes_them():
    _, unfinished = PARTIAL.merge(None, [_prompt(300)], Rollout(Responses.from_lists(
        [[Response([1, 2], [-0.1, -0.2], "length")], [Response([3, 4], [-0.3, -0.4], "length")]])), 0)
    rows, _ = PARTIAL.request(unfinished, [], SamplingParams(n=G, max_new_tokens=4))
    assert rows == [[300, 1, 2], [300, 3, 4]]
    complete, left = PARTIAL.merge(unfinished, [], Rollout(Responses.from_lists(
        [[Response([5, 6], [-0.5, -0.6], "length")], [Response([7], [-0.7], "stop")]])), 1)
    assert left.num_groups == 0 and complete.versions_T.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert [r.finish_reason for r in complete.responses.to_lists()[0]] == ["length", "stop"]


def test_concat_per_response_against_lists():
    first = [[1, 2], [], [3]]
    then = [[4], [5, 6], []]
    out = concat_per_response(torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1]), torch.tensor([4, 5, 6]),
                              torch.tensor([1, 2, 0]))
    assert out.tolist() == [x for a, b in zip(first, then) for x in a + b]


def _schedule(max_staleness: int, steps: int) -> dict[int, tuple[int, list[int]]]:
    """RolloutQueue (rollout_queue.py) over `steps` steps with partial rollouts of 1-token segments of a 3-token
    budget, one new group of G responses per batch, an engine that never samples a stop token (every response takes
    its 3 segments). Per batch (its prompt's index): the step that took its complete group, and its first response's
    token versions."""
    from hand_built import scripted_queue

    partial = PartialRollouts(group_size=G, max_new_tokens=3, segment_tokens=1)
    queue = scripted_queue(lambda rows, params: Rollout(Responses.from_lists(
        [[Response([7], [-0.5], "length")] for _ in rows])), partial, max_staleness=max_staleness, steps=steps,
        group_size=G)
    trained = {}
    for step in range(steps):
        groups, _ = queue.take(step)
        for i, prompt in enumerate(groups.prompts):
            first = groups.select(torch.tensor([i]))
            trained[prompt.index] = (step, first.versions_T[:3].tolist())
    return trained


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_a_step_waits_for_its_batch_before_asking_so_a_segment_continues_n_versions_later(max_staleness):
    """Batch k is sampled by version max(0, k - N); its unfinished responses continue in the next batch asked for,
    which is batch k + N (asked at step k, after batch k was waited for; N = 0: batch k + 1 at step k + 1), so the
    segments of a response are N versions apart (1 at N = 0) and it is trained (s - 1) x max(N, 1) + N = 3N (2 at
    N = 0) versions after its first token."""
    trained = _schedule(max_staleness, 12)
    if max_staleness == 0:  # batch b: versions b, b + 1, b + 2; complete in batch b + 2, trained at step b + 2
        expected = {b: (b + 2, [b, b + 1, b + 2]) for b in range(10)}
    elif max_staleness == 1:  # batch b (b >= 1) at version b - 1; its segments in batches b, b + 1, b + 2
        expected = {0: (2, [0, 0, 1]), **{b: (b + 2, [b - 1, b, b + 1]) for b in range(1, 10)}}
    else:  # batch b at version max(0, b - 2); its segments in batches b, b + 2, b + 4
        expected = {0: (3, [0, 0, 1]), 1: (5, [0, 1, 3]), **{b: (b + 4, [b - 2, b, b + 2]) for b in range(2, 8)}}
    assert trained == expected
    steady = [b for b in expected if b >= max_staleness]
    assert {step - versions[0] for b, (step, versions) in trained.items() if b in steady} == \
        {3 * max_staleness if max_staleness else 2}


def test_a_prompt_and_a_whole_response_must_fit_the_model_at_start():
    """Checked against max_new_tokens, not one segment: with partial rollouts a 60-token prompt passes its first
    2-token segment in a 64-position model and would fail at a later one."""
    from megatron_gtpo.config import ConfigError
    from megatron_gtpo.training.task import check_prompt_lengths

    samples = [SimpleNamespace(id="short", prompt_token_ids=(1,) * 4), SimpleNamespace(id="long",
                                                                                       prompt_token_ids=(1,) * 60)]
    check_prompt_lengths(samples, max_new_tokens=4, max_positions=64)
    with pytest.raises(ConfigError, match="rollout.max_new_tokens: prompt 'long' has 60 tokens; with max_new_tokens "
                                          "= 8 that exceeds the model's 64 positions"):
        check_prompt_lengths(samples, max_new_tokens=8, max_positions=64)


@pytest.mark.parametrize("saved,now,message", [
    (dict(max_staleness=1), dict(max_staleness=0), r"rollout.schedule.max_staleness 1 -> 0\)"),
    (dict(max_staleness=1, partial_rollouts=True, partial_segment_tokens=2),
     dict(max_staleness=2, partial_rollouts=True, partial_segment_tokens=1),
     r"rollout.schedule.max_staleness 1 -> 2, rollout.schedule.partial_segment_tokens 2 -> 1\)"),
    (dict(partial_rollouts=True, partial_segment_tokens=2), dict(),
     r"rollout.schedule.partial_rollouts True -> False, rollout.schedule.partial_segment_tokens 2 -> None\)"),
    (dict(max_staleness=1, rounds_ahead=2), dict(max_staleness=1), r"rollout.schedule.rounds_ahead 2 -> 0\)"),
    (dict(max_staleness=1), dict(max_staleness=1), None),
    (dict(), dict(max_staleness=2), None),  # nothing in flight: the new schedule starts afresh
])
def test_a_resume_under_other_rollout_settings_than_the_in_flight_work_is_refused(saved, now, message):
    """A checkpoint of bounded staleness or partial rollouts holds batches asked for ahead and unfinished groups;
    resuming it with another schedule would skip them (max_staleness 0) or train them beyond the new bound."""
    from megatron_gtpo.config import RolloutConfig, ScheduleConfig
    from megatron_gtpo.training.resume_check import check_rollout_schedule

    saved_config = {"rollout": dict(engine="builtin_remote", schedule=saved)}  # an older checkpoint may lack keys
    cfg = SimpleNamespace(rollout=RolloutConfig(schedule=ScheduleConfig(**now)))
    if message is None:
        check_rollout_schedule(saved_config, cfg, "ckpt/step_00000003")
        return
    with pytest.raises(ValueError, match="checkpoint ckpt/step_00000003 holds rollouts generated and not yet "
                                         "trained on under another rollout schedule than this run's "
                                         + f"\\({message}"):
        check_rollout_schedule(saved_config, cfg, "ckpt/step_00000003")


def test_a_saved_queue_keeps_the_routing_of_its_batches_in_flight():
    """Routing replay with rollouts in flight (rollout.schedule.max_staleness 1 on a vLLM rollout server): the batch
    asked for ahead is saved with its routing and comes back with it on the host after a resume (rollout_queue.py)."""
    from hand_built import scripted_queue
    from megatron_gtpo.training.partial_rollouts import WholeResponses

    def answer(rows, params):  # step k's batch (seed 10 k) routes response j's tokens to experts 10 k + j
        record = Responses.from_lists([[Response([7, 8], [-0.5, -0.25], "length")] for _ in range(G)])
        return Rollout(record, [torch.full((3, 1, 2), params.seed + j, dtype=torch.int16) for j in range(G)])

    queue, resumed = (scripted_queue(answer, WholeResponses(), max_staleness=1, steps=3, group_size=G)
                      for _ in range(2))
    assert queue.take(0)[0].routed_experts[1][0, 0, 0] == 1
    resumed.load_state_dict(queue.state_dict())  # batch 1, asked for at step 0
    groups, _ = resumed.take(1)
    assert [r[0, 0, 0].item() for r in groups.routed_experts] == [10 + j for j in range(G)]
    assert all(r.device.type == "cpu" and r.dtype == torch.int16 for r in groups.routed_experts)


def test_a_step_counts_every_token_of_its_engine_answers_once():
    """StepCounts.tokens_generated (the `tokens_generated` metric) at N = 1 with partial rollouts of 2-token
    segments of a 4-token budget: a step counts the answers it waits for (its batch and its further rounds), with the
    unfinished responses and the groups it will not train on; the batch asked for ahead counts in the step that waits
    for it, once, even when a checkpoint waited for it first."""
    from hand_built import scripted_queue
    from megatron_gtpo.training.metrics import PhaseTimer

    answers = {  # (step, round) -> the engine's answer, one response per row
        (0, 0): [Response([1, 2], [-0.1, -0.2], "length"), Response([9], [-0.9], "stop")],  # A: 3 tokens, unfinished
        (1, 0): [Response([5, 9], [-0.5, -0.9], "stop"),  # A's first response continued: 2 tokens
                 Response([9], [-0.9], "stop"), Response([3, 9], [-0.3, -0.9], "stop")],  # B: 3 tokens
        (0, 1): [Response([7, 9], [-0.7, -0.9], "stop"), Response([9], [-0.9], "stop")],  # C (round 1): 3 tokens
    }

    def answer(rows, params):  # round r of step k is asked with seed 10 k + r
        step_answer = answers[divmod(params.seed, 10)]
        assert len(rows) == len(step_answer)
        return Rollout(Responses.from_lists([[r] for r in step_answer]))

    # Draws: A (step 0's batch), B (batch 1, asked at step 0), C (step 0's round 1).
    queue = scripted_queue(answer, PARTIAL, max_staleness=1, steps=2, group_size=G)
    sample_round = queue.rounds(0, PhaseTimer())
    step_0 = queue.counts  # handed out by step 0's `take`
    assert sample_round(0)[0]().num_groups == 0 and step_0.tokens_generated == 3  # A left unfinished
    assert [p.id for p in sample_round(1)[0]().prompts] == ["p2"] and step_0.tokens_generated == 3 + 3
    queue.state_dict()  # waits for batch 1 (asked for at step 0) without counting it
    assert step_0.tokens_generated == 6
    groups, step_1 = queue.take(1)
    assert [p.id for p in groups.prompts] == ["p0", "p1"] and step_1.tokens_generated == 2 + 3
    assert step_0.tokens_generated == 6 and step_1 is queue.counts  # one object per step


def test_continued_counts_the_responses_sampled_by_more_than_one_version():
    """A server's record under rollout.schedule.update_during_generation, asked for at version 5: a response that an
    update reached mid-way was sampled by two versions; one that started after the update (every token counts it), one
    before it, an empty one and a one-token one by one version each."""
    lengths, updates = [4, 3, 2, 0, 1], [0, 0, 1, 1, 1, 1, 1, 0, 0, 2]
    record = Responses(responses_per_prompt_P=torch.tensor([1] * 5), lengths_R=torch.tensor(lengths),
                       finish_R=torch.zeros(5, dtype=torch.int64), token_ids_T=torch.arange(10, dtype=torch.int32),
                       logprobs_T=torch.zeros(10), weight_updates_T=torch.tensor(updates, dtype=torch.int32))
    groups = SampledGroups.sampled([_prompt(i) for i in range(5)], Rollout(record), 5)
    assert groups.continued_R().tolist() == [True, False, False, False, False]
    assert groups.last_versions_R().tolist() == [6, 6, 5, 5, 7]

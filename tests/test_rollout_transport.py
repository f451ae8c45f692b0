"""Responses as tensors between ranks (rollout/transport.py): exact round trips of ragged, empty and every finish
reason, over gloo from a non-zero source rank, and errors that reach every rank as one error."""
import random

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.rollout.engine import FINISH_LENGTH, FINISH_STOP, Response
from megatron_gtpo.rollout.transport import FINISH_REASONS, responses_to_tensors, tensors_to_responses


def _responses(seed: int, prompts: int = 5) -> list[list[Response]]:
    """Ragged [prompt][n] responses: varying n, lengths 0..40, both finish reasons, float32-exact log-probs."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        group = []
        for _ in range(rng.randint(1, 4)):
            length = rng.choice([0, 1, rng.randint(2, 40)])
            logprobs = torch.randn(length, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
            group.append(Response([rng.randint(0, 151_935) for _ in range(length)], logprobs.tolist(),
                                  rng.choice(FINISH_REASONS)))
        out.append(group)
    return out


def test_round_trip_is_exact():
    responses = _responses(0, prompts=40)
    assert {r.finish_reason for rs in responses for r in rs} == {FINISH_STOP, FINISH_LENGTH}
    assert any(not r.token_ids for rs in responses for r in rs)
    ints, logprobs_T = responses_to_tensors(responses)
    assert tensors_to_responses(ints, logprobs_T, len(responses)) == responses


@pytest.mark.parametrize("bad,message", [
    (Response([1, 2], [-0.1, -0.2], "abort"), "finish reason 'abort'"),
    (Response([1, 2], [-0.1], FINISH_STOP), "2 tokens and 1 log-probs"),
])
def test_unsendable_responses_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        responses_to_tensors([[bad]])


def _broadcast(rank, world_size, src):
    import torch.distributed as dist

    from megatron_gtpo.rollout.transport import broadcast_responses

    device = torch.device("cpu")
    results = []
    for outcome in [("ok", _responses(1)),  # ragged
                    ("ok", [[Response([], [], FINISH_LENGTH)], [Response([7], [-1 / 3], FINISH_STOP)]]),
                    ("error", "ValueError: out of KV cache"),
                    ("ok", [[Response([1], [-0.5], "abort")]])]:  # cannot be encoded: an error everywhere
        results.append(broadcast_responses(outcome if rank == src else None, src, dist.group.WORLD, device))
    return results


def test_broadcast_reaches_every_rank_exactly_and_errors_stay_errors():
    per_rank = run_distributed(_broadcast, 3, args=(1,), timeout_s=120)
    for results in per_rank:
        ragged, tiny, error, unsendable = results
        assert ragged == ("ok", _responses(1))
        # -1/3 is not a float32: every rank, the source included, holds the same float32-rounded value.
        assert tiny == ("ok", [[Response([], [], FINISH_LENGTH)],
                               [Response([7], [float(torch.tensor(-1 / 3, dtype=torch.float32))], FINISH_STOP)]])
        assert error == ("error", "ValueError: out of KV cache")
        assert unsendable[0] == "error" and "finish reason 'abort'" in unsendable[1]


def _failing_engine(rank, world_size):
    from types import SimpleNamespace

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.server_engine import ServerEngine

    groups = initialize_parallel(1, 2)

    class Server:
        def generate(self, prompts, params, first_prompt=0):
            raise MemoryError("no room for the KV cache")

    engine = ServerEngine(Server() if groups.pp_rank == 0 else None, groups,
                          SimpleNamespace(vocab_size=100, max_position_embeddings=64))
    try:
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_an_engine_failure_is_raised_on_every_rank():
    messages = run_distributed(_failing_engine, 2, timeout_s=120)
    assert all(m is not None and "MemoryError: no room for the KV cache" in m for m in messages), messages

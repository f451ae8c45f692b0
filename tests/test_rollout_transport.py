"""The rollout record between ranks (rollout/transport.py): exact round trips of ragged groups, empty responses and
a record without prompts, over gloo from a non-zero source rank, with the source's generation seconds (to the
microsecond), and errors (the engine's, or a record that cannot be sent) that reach every rank as one error."""
import dataclasses
import random

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.rollout.responses import FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, Response, Responses


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


def _broadcast(rank, world_size, src):
    import torch.distributed as dist

    from megatron_gtpo.rollout.transport import broadcast_responses

    device = torch.device("cpu")
    bad_code = dataclasses.replace(Responses.from_lists([[Response([1], [-0.5], FINISH_STOP)]]),
                                   finish_R=torch.tensor([7]))
    results, stamps = [], None
    ragged = Responses.from_lists(_responses(1))
    ragged = dataclasses.replace(ragged, weight_updates_T=_stamps(ragged.num_tokens))  # a server's, mid-generation
    for outcome, seconds in [(("ok", ragged), SECONDS),
                             (("ok", Responses.from_lists([[Response([], [], FINISH_LENGTH)],
                                                           [Response([7], [-1 / 3], FINISH_STOP)]])), 0.0),
                             (("ok", Responses.empty()), 0.0),  # an engine host without prompts
                             (("error", "ValueError: out of KV cache"), 2.5),
                             (("ok", bad_code), 0.0),  # cannot be sent: an error everywhere
                             (("ok", [[Response([1], [-0.5], FINISH_STOP)]]), 0.0)]:  # no record: an error everywhere
        status, payload, generation_s = broadcast_responses(outcome if rank == src else None, src, dist.group.WORLD,
                                                            device, generation_s=seconds if rank == src else 0.0)
        results.append((status, payload.to_lists() if status == "ok" else payload,
                        [str(t.dtype) for t in payload.tensors()] if status == "ok" else None, generation_s))
        stamps = payload.weight_updates_T.tolist() if stamps is None else stamps  # the ragged record's
    return results, stamps


SECONDS = 1234.5678914  # the ragged record's generation seconds: 1234.567891 s to the microsecond


def _stamps(num_tokens: int) -> torch.Tensor:
    return torch.arange(num_tokens, dtype=torch.int32) * 3 // max(num_tokens, 1)


def test_broadcast_reaches_every_rank_exactly_and_errors_stay_errors():
    per_rank = run_distributed(_broadcast, 3, args=(1,), timeout_s=120)
    dtypes = ["torch.int64"] * 3 + ["torch.int32", "torch.float32", "torch.int32"]
    for results, stamps in per_rank:
        ragged, tiny, empty, error, bad_code, no_record = results
        assert ragged == ("ok", _responses(1), dtypes, 1234.567891)
        assert stamps == _stamps(len(stamps)).tolist() and max(stamps) == 2
        # -1/3 is not a float32: every rank, the source included, holds the same float32-rounded value.
        assert tiny == ("ok", [[Response([], [], FINISH_LENGTH)],
                               [Response([7], [float(torch.tensor(-1 / 3, dtype=torch.float32))], FINISH_STOP)]],
                        dtypes, 0.0)
        assert empty == ("ok", [], dtypes, 0.0)
        assert error == ("error", "ValueError: out of KV cache", None, 2.5)  # a failed generation took time too
        assert bad_code[0] == "error" and "finish codes outside" in bad_code[1], bad_code
        assert no_record[0] == "error" and "not a Responses record" in no_record[1], no_record


def _failing_engine(rank, world_size):
    from types import SimpleNamespace

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.server_engine import ServerEngine

    groups = initialize_parallel(1, 2)

    class Server:
        def submit(self, prompts, params, *, first_prompt=0, between_steps=None):
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

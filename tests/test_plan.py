"""The planner (megatron_gtpo.planning, tools/plan.py) against real measurements:

- parameter counts per rank equal megatron-core GPTModels built on the meta device, exactly, for tied and untied
  Qwen2.5 sizes at TP 1/2/4, PP 1/2 and an interleaved (VPP) layout;
- parameter, gradient and optimizer-state bytes equal the tensors megatron-core's DDP + Adam allocate on CPU after a
  training step (trainer's wrap_for_training: distributed optimizer, DP=4; and megatron's replicated optimizer);
- per-layer activation bytes of the "local" kernel profile (SDPA attention, a GPU's fusions) plus what only the CPU
  keeps (plan_measurements.cpu_only_norm_bytes) equal the tensors autograd saves on CPU with a GPU's fusion settings
  (fp32: TP 1/2, CP 2, with and without full recompute; bf16 at 160 and 320 tokens);
- forward FLOPs equal torch's FLOP counter on a megatron-core forward minus the upper attention triangle;
- the CLI's JSON contract and exit codes; the recipes in examples/ fit the GPUs their sbatch scripts ask for;
- the phase-time model against hand-computed times of a tiny shape, the step's staleness rule, and the split of a
  job's nodes between rollout servers and training (--disaggregated).
All measurements come from one spawn of WORLD gloo ranks (the `measurements` fixture).
"""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.models.qwen import ModelShape
from megatron_gtpo.models.presets import hf_config
from megatron_gtpo.planning import (Settings, Workload, forward_flops, generation_phase_s, layer_activation_bytes,
                                    parameter_count, plan, plan_disaggregated, settings_from_config, step_s,
                                    suggest_layouts, total_parameter_count, training_phase_s, workload_from_config)
from plan_measurements import (GPU_FUSIONS, LAYER_PROBE, PROBE_BATCH, PROBE_SEQ, cpu_only_norm_bytes,
                               saved_activation_bytes, state_bytes_after_one_step)

REPO = os.path.join(os.path.dirname(__file__), "..")
WORLD = 4  # ranks of the one spawn that measures everything (TP=4 and TP=2 x PP=2 need four)
BF16_SEQS = (160, 320)  # the bf16 probe's row lengths

# (model, TP, PP, VPP): tied (0.5B, 1.5B) and untied (7B, 32B) embeddings, TP 1/2/4, PP 1/2, interleaved.
META_LAYOUTS = [("qwen2.5-0.5b", 1, 1, None), ("qwen2.5-0.5b", 2, 2, None), ("qwen2.5-1.5b", 1, 2, None),
                ("qwen2.5-7b", 4, 1, None), ("qwen2.5-7b", 1, 2, 2), ("qwen2.5-32b", 2, 2, None)]


def _measure_all(rank, world_size):
    """On WORLD ranks: parameter counts of META_LAYOUTS on the meta device; the training-state bytes of every
    TRAINING_STATE_CASES entry (DP=WORLD); the saved bytes of a 2-layer model minus a 1-layer one (= one decoder
    layer, a GPU's fusion settings) at TP=1 and TP=2, with and without recompute, and in bf16 at BF16_SEQS; and, at
    TP=1, torch's FLOP count of a forward (megatron's unfused attention: the counter sees its matmuls). One spawn
    for all: starting ranks is the expensive part on CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model

    out = {"meta_counts": _meta_parameter_counts(META_LAYOUTS),
           "training_state": {case: _measured_training_state(*case) for case in TRAINING_STATE_CASES}}
    for tp in (1, 2):
        initialize_parallel(tp, 1)
        for recompute in (False, True):
            saved = []
            for layers in (1, 2):
                model = build_model(dict(LAYER_PROBE, num_hidden_layers=layers), tensor_parallel=tp,
                                    pipeline_parallel=1, pp_rank=0, recompute_activations=recompute,
                                    accelerator=GPU_FUSIONS)[0]
                saved.append(saved_activation_bytes(model, seq_len=PROBE_SEQ, batch=PROBE_BATCH))
            out[(tp, recompute)] = saved[1] - saved[0]
        if tp == 1:
            for seq in BF16_SEQS:
                saved = [saved_activation_bytes(build_model(dict(LAYER_PROBE, num_hidden_layers=layers),
                                                            tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                                                            params_dtype=torch.bfloat16, accelerator=GPU_FUSIONS)[0],
                                                seq_len=seq, batch=PROBE_BATCH) for layers in (1, 2)]
                out[("bf16", seq)] = saved[1] - saved[0]
            model = build_model(dict(LAYER_PROBE, num_hidden_layers=2), tensor_parallel=1, pipeline_parallel=1,
                                pp_rank=0, core_attention="unfused")[0]
            tokens = torch.randint(0, LAYER_PROBE["vocab_size"], (PROBE_BATCH, PROBE_SEQ), device="cuda")
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                model(tokens, torch.arange(PROBE_SEQ, device="cuda").expand(PROBE_BATCH, PROBE_SEQ),
                      torch.triu(torch.ones(1, 1, PROBE_SEQ, PROBE_SEQ, dtype=torch.bool, device="cuda"), 1))
            out["flops"] = counter.get_total_flops()
    groups = initialize_parallel(1, 1, context_parallel=2)  # CP = 2 x DP = 2: the all-gather attention
    for recompute in (False, True):
        saved = [saved_activation_bytes(build_model(dict(LAYER_PROBE, num_hidden_layers=layers), tensor_parallel=1,
                                                    pipeline_parallel=1, pp_rank=0, context_parallel=2,
                                                    recompute_activations=recompute, accelerator=GPU_FUSIONS)[0],
                                        seq_len=PROBE_SEQ, batch=PROBE_BATCH, context_parallel=2,
                                        cp_rank=groups.cp_rank) for layers in (1, 2)]
        out[("cp2", recompute)] = saved[1] - saved[0]
    return out


@pytest.fixture(scope="module")
def measurements():
    return run_distributed(_measure_all, WORLD, timeout_s=400)


def _meta_parameter_counts(layouts):
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model

    counts = []
    for name, tp, pp, vpp in layouts:
        groups = initialize_parallel(tp, pp, virtual_pipeline_parallel=vpp)
        chunks = build_model(hf_config(name), tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                             virtual_pipeline_parallel=vpp, meta_device=True)
        counts.append((groups.pp_rank, groups.tp_rank, sum(p.numel() for c in chunks for p in c.parameters())))
    return counts


@pytest.mark.slow
def test_parameter_counts_equal_meta_device_models(measurements):
    per_rank = [rank["meta_counts"] for rank in measurements]
    for i, (name, tp, pp, vpp) in enumerate(META_LAYOUTS):
        shape = ModelShape.from_hf(hf_config(name))
        layout = ParallelLayout(tensor=tp, pipeline=pp, data=WORLD // (tp * pp), virtual_pipeline=vpp)
        seen = set()
        for rank_counts in per_rank:
            pp_rank, tp_rank, count = rank_counts[i]
            assert count == parameter_count(shape, layout, pp_rank), (name, tp, pp, vpp, pp_rank, tp_rank)
            seen.add((pp_rank, tp_rank))
        assert {r for r, _ in seen} == set(range(pp))  # every stage was compared
        result = plan(shape, layout, settings=Settings(vllm_memory_fraction=None))
        assert result.params_per_gpu == max(c for c in (rc[i][2] for rc in per_rank))


SMALL = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5000,
         "tie_word_embeddings": False, "max_position_embeddings": 512}


def _measured_training_state(dtype_name, distributed_optimizer):
    """Build SMALL at TP=1 (DP = WORLD), run one Adam step through megatron-core's DDP, and measure the bytes
    of the parameter, gradient and optimizer-state tensors that exist afterwards."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gtpo.config import TrainConfig
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.model_setup import wrap_for_training

    initialize_parallel(1, 1)
    dtype = getattr(torch, dtype_name)
    chunks = build_model(SMALL, tensor_parallel=1, pipeline_parallel=1, pp_rank=0, params_dtype=dtype)
    if distributed_optimizer:  # the trainer's own set-up
        cfg = TrainConfig(steps=1)
        cfg.model.dtype = dtype_name
        policy = wrap_for_training(cfg, chunks)
        ddp, optimizer = policy.ddp_chunks[0], policy.optimizer
    else:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        ddp = DistributedDataParallel(config=chunks[0].config, module=chunks[0], ddp_config=ddp_config)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=dtype == torch.bfloat16,
                                                           params_dtype=dtype, use_distributed_optimizer=False), [ddp])
    return state_bytes_after_one_step(chunks, ddp, optimizer, SMALL["vocab_size"])


TRAINING_STATE_CASES = [("float32", True), ("bfloat16", True), ("bfloat16", False)]


@pytest.mark.parametrize("dtype,distributed_optimizer", TRAINING_STATE_CASES)
def test_training_state_bytes_equal_measured_tensors(measurements, dtype, distributed_optimizer):
    measured = [rank["training_state"][(dtype, distributed_optimizer)] for rank in measurements]
    shape = ModelShape.from_hf(SMALL)
    result = plan(shape, ParallelLayout(tensor=1, pipeline=1, data=WORLD),
                  Workload(prompts_per_step=WORLD, num_responses_per_prompt=2, max_prompt_tokens=16,
                           max_response_tokens=16),
                  Settings(params_dtype=dtype, distributed_optimizer=distributed_optimizer,
                           vllm_memory_fraction=None, kernels="local"))
    stage = result.stages[0]
    # Exact in both dtypes: build_model gives every parameter the model dtype (the local spec's norms included).
    rel = 0.0
    for rank in measured:
        for key in ("parameters", "gradients", "optimizer"):
            assert rank[key] == pytest.approx(getattr(stage, key), rel=rel, abs=0), key




def _cpu_only(seq_len, tensor_parallel=1, bytes_per_element=4, recompute=False):
    """What the probe layer keeps on the CPU only (none under full recompute: the layer's input alone)."""
    shape = ModelShape.from_hf(dict(LAYER_PROBE, num_hidden_layers=1))
    return 0 if recompute else cpu_only_norm_bytes(shape, seq_len=seq_len, batch=PROBE_BATCH,
                                                   tensor_parallel=tensor_parallel,
                                                   bytes_per_element=bytes_per_element)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", [False, True])
def test_local_profile_layer_activations_equal_saved_tensors(measurements, tp, recompute):
    shape = ModelShape.from_hf(dict(LAYER_PROBE, num_hidden_layers=1))
    expected = layer_activation_bytes(shape, seq_len=PROBE_SEQ, micro_batch_size=PROBE_BATCH, tensor_parallel=tp,
                                      sequence_parallel=False, kernels="local", bytes_per_element=4,
                                      recompute=recompute)
    assert all(rank[(tp, recompute)] == expected + _cpu_only(PROBE_SEQ, tp, recompute=recompute)
               for rank in measurements)


@pytest.mark.parametrize("seq", BF16_SEQS)
def test_local_profile_layer_activations_in_bf16_equal_saved_tensors(measurements, seq):
    """bf16 with a GPU's fusions: the plan is what autograd keeps less the CPU's own fp32 norm copies, which the GPU
    plan does not count."""
    shape = ModelShape.from_hf(dict(LAYER_PROBE, num_hidden_layers=1))
    expected = layer_activation_bytes(shape, seq_len=seq, micro_batch_size=PROBE_BATCH, tensor_parallel=1,
                                      sequence_parallel=False, kernels="local", bytes_per_element=2)
    assert all(rank[("bf16", seq)] == expected + _cpu_only(seq, bytes_per_element=2) for rank in measurements)


@pytest.mark.parametrize("recompute", [False, True])
def test_local_profile_layer_activations_at_cp2_equal_saved_tensors(measurements, recompute):
    """At CP = 2 a rank keeps its half of the row's tokens, and the all-gather attention the whole row's keys and
    values (native GQA), its position-order indices and its queries' mask, but not linear_qkv's output (SDPA's v is
    the gathered copy); by hand for this probe (fp32, L = 40, b = 3, q = 4 heads x 48 = 192, kv = 2 x 48 = 96): the
    measured CP = 1 layer less half of what scales with a rank's tokens, less half the q and k parts of linear_qkv's
    output (kept at CP = 1 by v, a view of it), plus the K/V of the other half of the row, plus 2 x 8 x L bytes of
    indices and the fp32 mask, (L / 2) x L x 4."""
    shape = ModelShape.from_hf(dict(LAYER_PROBE, num_hidden_layers=1))
    expected = layer_activation_bytes(shape, seq_len=PROBE_SEQ, micro_batch_size=PROBE_BATCH, tensor_parallel=1,
                                      sequence_parallel=False, kernels="local", bytes_per_element=4,
                                      recompute=recompute, context_parallel=2)
    cpu_only = _cpu_only(PROBE_SEQ // 2, recompute=recompute)
    assert [rank[("cp2", recompute)] for rank in measurements] == [expected + cpu_only] * WORLD
    if not recompute:
        cp1 = measurements[0][(1, False)]
        tokens_bytes = PROBE_SEQ * PROBE_BATCH * 4
        qk_output, kv_row = (192 + 96) * tokens_bytes, 2 * 96 * tokens_bytes
        assert expected + cpu_only == cp1 / 2 - qk_output / 2 + kv_row / 2 + 2 * 8 * PROBE_SEQ \
            + PROBE_SEQ // 2 * PROBE_SEQ * 4


def test_forward_flops_equal_torch_flop_counter_on_a_megatron_forward(measurements):
    shape = ModelShape.from_hf(dict(LAYER_PROBE, num_hidden_layers=2))
    tokens, s = PROBE_BATCH * PROBE_SEQ, PROBE_SEQ
    planned = forward_flops(shape, num_tokens=tokens, sum_squared_lengths=PROBE_BATCH * s * s)
    # megatron's unfused attention multiplies the full s x s score matrix (QK^T and AV: 2 x 2 a d s^2 per layer and
    # sequence); the planner counts the causal lower triangle only, half of that.
    full_square = 2 * 2 * shape.num_attention_heads * shape.head_dim * s * s * PROBE_BATCH * shape.num_layers
    assert planned == measurements[0]["flops"] - full_square / 2


def _load_plan_cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_cli", os.path.join(REPO, "tools", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan_cli(capsys, *args):
    """tools/plan.py as its command line runs it, in this process: (exit status, stdout, stderr)."""
    from megatron_gtpo.cli import run_cli

    with pytest.raises(SystemExit) as exited:
        run_cli("plan", lambda: _load_plan_cli().main(list(args)))
    status = exited.value.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cli_json_contract_for_the_design_example():
    # The documented command, as a real subprocess.
    res = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan.py"), "--model", "qwen2.5-32b", "--tp", "8",
                          "--pp", "2", "--dp", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    shape = ModelShape.from_hf(hf_config("qwen2.5-32b"))
    layout = ParallelLayout(tensor=8, pipeline=2, data=4)
    assert out["params_per_gpu"] == max(parameter_count(shape, layout, r) for r in range(2))
    assert out["fits"] is True and out["reasons"] == []
    mem = out["memory_gib"]
    for key in ("parameters", "gradients", "optimizer", "activations", "training_peak", "vllm_kv_cache",
                "generation_peak"):
        assert isinstance(mem[key], float) and mem[key] >= 0, key
    # bf16 weights, fp32 gradients, fp32 Adam moments + master weights sharded over DP=4
    assert mem["gradients"] == pytest.approx(2 * mem["parameters"])
    assert mem["optimizer"] == pytest.approx(mem["parameters"] * 12 / 2 / 4)
    assert out["flops_per_step"]["update"] == pytest.approx(3 * out["flops_per_step"]["old_logprob"])
    assert set(out["variants_gib"]) == {"distopt_no_recompute", "distopt_recompute", "no_distopt_no_recompute",
                                        "no_distopt_recompute"}


def test_cli_refuses_invalid_and_oversized_layouts(capsys):
    status, out, err = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "8", "--dp", "1")
    assert status == 2 and "28 attention heads are not divisible by TP=8" in err
    status, out, err = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "7")
    assert status == 2 and "4 query groups (num_key_value_heads) are not divisible by TP=7" in err
    status, out, err = _plan_cli(capsys, "--model", "qwen2.5-7b", "--pp", "3")
    assert status == 2 and "28 layers are not divisible by PP=3" in err
    status, out, err = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "4", "--nodes", "1", "--dp", "4")
    assert status == 2 and "--dp 4 contradicts --nodes 1 (DP = 2)" in err
    status, out, err = _plan_cli(capsys, "--model", "qwen2.5-32b", "--tp", "1", "--pp", "1", "--dp", "8", "--json")
    assert status == 1
    result = json.loads(out)
    assert result["fits"] is False and any("more than the 80 GiB GPU" in r for r in result["reasons"])
    assert "does not fit" in err
    # A smaller GPU flips a fitting layout, and the readable table says why.
    assert _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "4", "--dp", "2")[0] == 0
    status, out, err = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "4", "--dp", "2", "--gpu-memory-gib", "40")
    assert status == 1 and "DOES NOT FIT" in out


def test_cli_distributed_optimizer_and_recompute_variants(capsys):
    status, out, _ = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "4", "--dp", "2", "--json")
    assert status == 0
    base = json.loads(out)
    status, out, _ = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "4", "--dp", "2", "--json",
                               "--no-distributed-optimizer", "--recompute")
    assert status == 0
    other = json.loads(out)
    v = base["variants_gib"]
    assert other["variants_gib"] == v  # the 2 x 2 table does not depend on the chosen variant
    assert base["memory_gib"]["training_peak"] == pytest.approx(v["distopt_no_recompute"])
    assert other["memory_gib"]["training_peak"] == pytest.approx(v["no_distopt_recompute"])
    # replicating the optimizer costs the other (DP-1)/DP of its state; recompute only ever saves memory
    assert other["memory_gib"]["optimizer"] == pytest.approx(2 * base["memory_gib"]["optimizer"])
    assert v["distopt_recompute"] < v["distopt_no_recompute"]


def test_cli_takes_a_config_json_or_model_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen2.5-1.5b")))
    by_dir = _plan_cli(capsys, "--model", str(tmp_path), "--json", "--tp", "2")
    by_file = _plan_cli(capsys, "--model", str(tmp_path / "config.json"), "--json", "--tp", "2")
    by_name = _plan_cli(capsys, "--model", "qwen2.5-1.5b", "--json", "--tp", "2")
    assert by_dir[0] == by_file[0] == by_name[0] == 0
    assert json.loads(by_dir[1])["memory_gib"] == json.loads(by_file[1])["memory_gib"] \
        == json.loads(by_name[1])["memory_gib"]
    assert _plan_cli(capsys, "--model", str(tmp_path / "nope"))[0] == 2


# The GPUs each sbatch script in examples/slurm asks for (see examples/slurm/README.md).
RECIPE_GPUS = {"qwen2.5-0.5b": (1,), "qwen2.5-1.5b": (1,), "qwen2.5-7b": (8, 16), "qwen2.5-32b": (32, 64)}


@pytest.mark.parametrize("path", sorted(p for p in os.listdir(os.path.join(REPO, "examples"))
                                        if p.startswith("qwen2.5-") and p.endswith(".yaml")))
def test_recipes_fit_an_80gib_gpu_at_their_node_counts(path):
    from megatron_gtpo.config import load_config

    cfg = load_config(os.path.join(REPO, "examples", path))
    model = next(m for m in RECIPE_GPUS if path.startswith(m + "-"))
    shape = ModelShape.from_hf(hf_config(model))
    for gpus in RECIPE_GPUS[model]:
        tp, pp, cp = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.context
        layout = ParallelLayout(tensor=tp, pipeline=pp, data=gpus // (tp * pp * cp), context=cp,
                                virtual_pipeline=cfg.parallel.virtual_pipeline,
                                sequence_parallel=cfg.parallel.sequence_parallel)
        result = plan(shape, layout, workload_from_config(cfg), settings_from_config(cfg))
        assert result.fits, (path, gpus, result.reasons)


def test_the_local_profile_refuses_the_unfused_attention():
    from megatron_gtpo.config import TrainConfig

    cfg = TrainConfig()
    assert settings_from_config(cfg, kernels="local").kernels == "local"
    cfg.model.core_attention = "unfused"
    with pytest.raises(ValueError, match="model.core_attention=unfused keeps every head's"):
        settings_from_config(cfg, kernels="local")
    assert settings_from_config(cfg).kernels == "te"  # Transformer Engine's attention ignores the setting


def test_routing_replay_record_is_counted_on_every_rank_of_its_stage():
    """model.moe.routing_replay: rollout keeps the record on the GPU from generation (the built-in engine) or from the
    step batch (vLLM's, on the host while vLLM generates) to the end of the update: per rank, its replica's sequences
    x fed tokens (prompt + response - 1) x the stage's MoE layers x top-k expert indices, stored as int16
    (models/moe_routing.EXPERT_INDEX_DTYPE)."""
    from megatron_gtpo.config import load_config

    cfg = load_config(os.path.join(REPO, "examples", "qwen3-30b-a3b-gtpo.yaml"))
    shape = ModelShape.from_hf(hf_config("qwen3-30b-a3b"))
    workload, settings = workload_from_config(cfg), settings_from_config(cfg)
    assert settings.routing_replay
    # The recipe on 16 GPUs (DP = 8): 128 prompts x 16 responses / 8 = 256 sequences per replica, each 2048 + 4096 - 1
    # fed tokens, 48 MoE layers, 8 experts per token, 2 bytes each: 1,207,762,944 bytes (1.12 GiB) on every rank.
    expected = 256 * 6143 * 48 * 8 * 2
    layout = ParallelLayout(tensor=2, data=8, expert=8, expert_tensor=2, sequence_parallel=True)
    assert settings.vllm_memory_fraction is not None  # the recipe generates on colocated vLLM engines
    builtin = replace(settings, vllm_memory_fraction=None)
    for engine_settings, peaks in ((settings, ("training_peak",)), (builtin, ("training_peak", "generation_peak"))):
        replayed = plan(shape, layout, workload, engine_settings)
        unreplayed = plan(shape, layout, workload, replace(engine_settings, routing_replay=False))
        assert replayed.stages[0].routing_record == expected
        assert replayed.memory_gib["routing_record"] == expected / 2**30
        for peak in ("training_peak", "generation_peak"):
            assert replayed.memory_gib[peak] - unreplayed.memory_gib[peak] == pytest.approx(
                expected / 2**30 if peak in peaks else 0.0, rel=1e-9, abs=1e-12), peak
    # Two pipeline stages hold 24 MoE layers each; a dense model records nothing.
    staged = plan(shape, ParallelLayout(tensor=2, pipeline=2, data=4, expert=8, expert_tensor=1,
                                        sequence_parallel=True), workload, settings)
    assert [st.routing_record for st in staged.stages] == [256 * 2 * 6143 * 24 * 8 * 2] * 2
    dense = plan(ModelShape.from_hf(hf_config("qwen2.5-7b")), ParallelLayout(tensor=4, data=4), workload, settings)
    assert dense.memory_gib["routing_record"] == 0


def test_logprob_workspaces_equal_what_the_vocab_parallel_op_allocates():
    """The planner's logprob_workspaces term against the op itself: the fp32 [chunk, V/TP] tensors its forward and
    its backward allocate (seen through torch's dispatcher), at the chunk the trainer derives from the budget."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_gtpo.distributed.vocab_parallel import chunk_tokens_for_budget, vocab_parallel_logprobs_and_entropy
    from megatron_gtpo.models.qwen import padded_vocab_size

    shape = ModelShape.from_hf(SMALL)
    vocab_local = padded_vocab_size(shape.vocab_size, 1)
    workload = Workload(prompts_per_step=1, num_responses_per_prompt=2, max_prompt_tokens=16, max_response_tokens=16)
    budget_mib = 8 * 2 * vocab_local * 4 / 2**20  # an 8-token chunk: smaller than the 32-token micro-batch
    planned = plan(shape, ParallelLayout(), workload, Settings(vllm_memory_fraction=None, kernels="local",
                                                       logprob_workspace_mib=budget_mib)).stages[0]

    class Workspaces(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format and out.dtype == torch.float32 and out.dim() == 2 \
                    and out.shape[1] == vocab_local:
                self.shapes.append(tuple(out.shape))
            return out

    tokens = workload.max_sequence_tokens
    logits = torch.randn(tokens, vocab_local, requires_grad=True)
    targets = torch.randint(0, shape.vocab_size, (tokens,))
    seen = Workspaces()
    with seen:
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(
            logits, targets, tp_group=None, vocab_size=vocab_local,
            chunk_size=chunk_tokens_for_budget(budget_mib * 2**20, vocab_local))
        (logprobs.sum() + entropy.sum()).backward()
    assert seen.shapes == [(8, vocab_local)] * 4  # two in forward, two in backward
    assert planned.logprob_workspaces == 2 * 8 * vocab_local * 4
    with pytest.raises(ValueError, match="budget must be positive"):
        chunk_tokens_for_budget(0, vocab_local)


def test_rollout_layout_and_kv_cache_per_gpu_for_32b_at_tp8_pp2_dp2():
    """The colocated rollout of a 32B TP8 PP2 DP2 job (rollout/placement.py): an engine per pipeline stage of each
    replica, 4 engines on all 32 GPUs, each holding the whole model over its 8 GPUs; the KV cache per GPU is vLLM's
    share of the GPU less its weights and overhead, worked out here by hand."""
    shape = ModelShape.from_hf(hf_config("qwen2.5-32b"))
    settings = Settings(vllm_memory_fraction=0.5, vllm_tensor_parallel=8)
    result = plan(shape, ParallelLayout(tensor=8, pipeline=2, data=2), Workload(), settings)
    kv = result.kv_cache
    assert (kv["engines"], kv["engines_per_replica"], kv["gpus_generating"]) == (4, 2, 32)
    # vLLM's half of an 80 GiB GPU less the whole model in bf16 over the engine's 8 GPUs, less its overhead.
    kv_gib = 0.5 * 80 - result.params_total * 2 / 8 / 2**30 - settings.vllm_overhead_gib
    assert kv["kv_cache_gib_per_gpu"] == pytest.approx(kv_gib)
    per_token = 2 * 64 * 1 * 128 * 2  # K and V, 64 layers, 8 KV heads / 8 GPUs, head_dim 128, bf16
    assert kv["bytes_per_token"] == per_token
    assert kv["tokens"] == int(kv_gib * 2**30 // per_token)
    assert kv["sequences_per_engine"] == 128 * 16 // 4


def test_default_vllm_tp_tiles_every_gpu_and_bad_ones_are_refused():
    shape = ModelShape.from_hf(hf_config("qwen2.5-7b"))
    kv = plan(shape, ParallelLayout(tensor=4, pipeline=2, data=1), Workload(), Settings()).kv_cache
    assert (kv["vllm_tensor_parallel"], kv["engines"], kv["gpus_generating"]) == (4, 2, 8)
    kv = plan(shape, ParallelLayout(tensor=1, pipeline=1, data=8), Workload(), Settings()).kv_cache
    assert (kv["vllm_tensor_parallel"], kv["engines"], kv["gpus_generating"]) == (1, 8, 8)
    with pytest.raises(ValueError, match="spans pipeline stages"):
        plan(shape, ParallelLayout(tensor=2, pipeline=2, data=2), Workload(), Settings(vllm_tensor_parallel=4))
    with pytest.raises(ValueError, match="must divide the training tensor parallel size 4"):
        plan(shape, ParallelLayout(tensor=4, pipeline=1, data=2), Workload(), Settings(vllm_tensor_parallel=7))


# A two-layer Qwen2 whose vocabulary needs no padding (5120 = 5 x 1024) and whose matmul weights are easy to count.
TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5120,
        "tie_word_embeddings": False, "max_position_embeddings": 512}
# 2 prompts x 2 responses, prompts of 8 tokens, responses of 4 on average and 8 at most.
TINY_WORK = Workload(prompts_per_step=2, num_responses_per_prompt=2, max_prompt_tokens=8, max_response_tokens=8,
                     mean_response_tokens=4)
# Per layer: q, k, v (4 + 2 + 2 heads of 64) and the output projection, gate, up and down; then the output layer.
TINY_MATMUL_WEIGHTS = 2 * (8 * 64 * 256 + 256 * 256 + 3 * 512 * 256) + 5120 * 256
TINY_ATTENTION = 4 * 64 * 2  # heads x head_dim x layers


def test_training_phase_times_by_hand():
    """4 sequences of 8 + 4 tokens: forward = 2 x weights x tokens + 2 a d layers x length^2 each, on 2 GPUs of
    1e12 FLOP/s at MFU 0.5; update = 3 forwards, 4 with recompute."""
    shape = ModelShape.from_hf(TINY)
    forward = 4 * (2 * TINY_MATMUL_WEIGHTS * 12 + 2 * TINY_ATTENTION * 12 ** 2)
    settings = Settings(peak_flops_per_s=1e12, training_mfu=0.5)
    times = training_phase_s(shape, TINY_WORK, settings, gpus=2, tensor_parallel=1)
    assert times["old_logprob_s"] == pytest.approx(forward / 1e12)
    assert times["update_s"] == pytest.approx(3 * forward / 1e12)
    assert times["train_s"] == pytest.approx(4 * forward / 1e12)
    recompute = training_phase_s(shape, TINY_WORK, Settings(peak_flops_per_s=1e12, training_mfu=0.5,
                                                            recompute_activations=True), gpus=2, tensor_parallel=1)
    assert recompute["update_s"] == pytest.approx(4 * forward / 1e12)
    # No forward-only pass (the update's forward gives the old log-probs), or the old policy's and a KL reference's.
    for passes in (0, 2):
        times = training_phase_s(shape, replace(TINY_WORK, old_logprob_passes=passes), settings, gpus=2,
                                 tensor_parallel=1)
        assert times["old_logprob_s"] == pytest.approx(passes * forward / 1e12)
        assert times["train_s"] == pytest.approx((3 + passes) * forward / 1e12)


def test_generation_phase_times_by_hand_bandwidth_and_compute_bound():
    """One engine of one GPU (and of two), 4 sequences (2 prompts x 2), a KV cache of 16 tokens: each sequence
    takes its 4 response tokens plus half its prompt's 8 (the prefix cache shares it), so 2 run at once: two waves
    of 2 decoding 4 steps at contexts 8..11, then one straggler at contexts 12..15 up to the maximum of 8."""
    shape = ModelShape.from_hf(TINY)
    weight_bytes = 2 * TINY_MATMUL_WEIGHTS
    kv_bytes_per_token = 2 * 2 * 2 * 64 * 2  # K and V x layers x KV heads x head_dim x bf16
    # Bandwidth bound (compute nearly free): bytes / (1e9 B/s x 0.5).
    reads = 2 * (4 * weight_bytes + 2 * kv_bytes_per_token * (8 + 9 + 10 + 11)) \
        + 4 * weight_bytes + kv_bytes_per_token * (12 + 13 + 14 + 15)
    settings = Settings(peak_flops_per_s=1e30, hbm_bytes_per_s=1e9, decode_bandwidth_efficiency=0.5)
    times = generation_phase_s(shape, TINY_WORK, settings, engines=1, vllm_tp=1, kv_tokens_per_engine=16)
    assert (times["sequences_per_engine"], times["running_per_engine"], times["waves"]) == (4, 2, 2)
    assert times["decode_s"] == pytest.approx(reads / 5e8)
    # The same engine on 2 GPUs: each reads half the weights and one of the 2 KV heads.
    reads_per_gpu = 2 * (4 * weight_bytes / 2 + 2 * kv_bytes_per_token / 2 * (8 + 9 + 10 + 11)) \
        + 4 * weight_bytes / 2 + kv_bytes_per_token / 2 * (12 + 13 + 14 + 15)
    times = generation_phase_s(shape, TINY_WORK, settings, engines=1, vllm_tp=2, kv_tokens_per_engine=16)
    assert times["decode_s"] == pytest.approx(reads_per_gpu / 5e8)
    # Compute bound (reads nearly free): per sequence and step 2 x weights + 4 a d layers x context, at 1e12 x 0.5;
    # prefill: each of the 2 prompts once, 2 x weights x 8 + 2 a d layers x 8^2.
    flops = 2 * sum(2 * (2 * TINY_MATMUL_WEIGHTS + 4 * TINY_ATTENTION * c) for c in (8, 9, 10, 11)) \
        + sum(2 * TINY_MATMUL_WEIGHTS + 4 * TINY_ATTENTION * c for c in (12, 13, 14, 15))
    prefill = 2 * (2 * TINY_MATMUL_WEIGHTS * 8 + 2 * TINY_ATTENTION * 64)
    settings = Settings(peak_flops_per_s=1e12, generation_mfu=0.5, hbm_bytes_per_s=1e30)
    times = generation_phase_s(shape, TINY_WORK, settings, engines=1, vllm_tp=1, kv_tokens_per_engine=16)
    assert times["decode_s"] == pytest.approx(flops / 5e11)
    assert times["prefill_s"] == pytest.approx(prefill / 5e11)
    assert times["generate_s"] == pytest.approx((flops + prefill) / 5e11)


def test_mean_response_length_defaults_to_half_the_maximum_and_is_checked():
    assert Workload().expected_response_tokens == 2048
    assert Workload(mean_response_tokens=3000).expected_response_tokens == 3000
    shape = ModelShape.from_hf(hf_config("qwen2.5-7b"))
    with pytest.raises(ValueError, match="mean_response_tokens must be in"):
        plan(shape, ParallelLayout(tensor=4), Workload(mean_response_tokens=5000))


@pytest.mark.parametrize("generate,train,staleness,expected", [
    (10.0, 4.0, 0, 15.0),  # on-policy: generation, training, sync in turn
    (10.0, 4.0, 1, 11.0),  # generation-bound: the trainer waits 6 s
    (10.0, 4.0, 3, 11.0),  # a larger N cannot hide it: the sync waits for the generation before it
    (3.0, 4.0, 1, 5.0),  # training-bound
])
def test_step_time_staleness_rule(generate, train, staleness, expected):
    assert step_s(generate, train, 1.0, staleness) == expected


def test_split_of_three_nodes_for_7b_at_tp4_is_two_training_nodes_and_one_rollout_node():
    """3 nodes, TP=4, servers of TP=2, 96 prompts: DP=4 on 2 nodes with its 4 servers on the third, DP=3 likewise
    (12 GPUs, 2 nodes), or DP=2 or 1 on 1 node with its servers on another. Each larger DP trains on more GPUs and
    gives each server fewer sequences, so the step shortens with DP and DP=4 wins."""
    shape = ModelShape.from_hf(hf_config("qwen2.5-7b"))
    layout = ParallelLayout(tensor=4, data=6)
    workload = Workload(prompts_per_step=96, micro_batch_size=2, mini_batches_per_step=4)  # DP=6 divides 96 x 4
    result = plan_disaggregated(shape, layout, workload, Settings(), nodes=3, server_tp=2)
    train, rollout, phases = result["training"], result["rollout"], result["phases_s"]
    assert (train["nodes"], train["gpus"], train["layout"]["data"]) == (2, 16, 4)
    assert (rollout["nodes"], rollout["servers"], rollout["servers_per_node"], rollout["gpus"]) == (1, 4, 4, 8)
    others = result["alternatives"]
    assert [(o["training"]["layout"]["data"], o["rollout"]["nodes"]) for o in others] == [(3, 1), (2, 1), (1, 1)]
    assert phases["step_s"] == pytest.approx(max(phases["generate_s"], phases["train_s"]) + phases["weight_sync_s"])
    steps = [phases["step_s"]] + [o["phases_s"]["step_s"] for o in others]
    assert steps == sorted(steps) and len(set(steps)) == 4
    # 7.6e9 parameters in bf16 at 25 GB/s
    assert phases["weight_sync_s"] == pytest.approx(total_parameter_count(shape) * 2 / 25e9)
    # The colocated comparison: the layout on all 24 GPUs, generation then training.
    colocated = result["colocated"]["phases_s"]
    assert colocated["step_s"] == pytest.approx(colocated["generate_s"] + colocated["train_s"])
    assert result["colocated"]["gpus"] == 24 and result["staleness_needed"] == 1
    on_policy = plan_disaggregated(shape, layout, workload, Settings(), nodes=3, server_tp=2, max_staleness=0)
    assert on_policy["phases_s"]["step_s"] == pytest.approx(
        phases["generate_s"] + phases["train_s"] + phases["weight_sync_s"])
    # 128 prompts do not split over 6 replicas x 4 mini-batches: no colocated comparison, the reason said.
    result = plan_disaggregated(shape, layout, replace(workload, prompts_per_step=128), Settings(), nodes=3,
                                server_tp=2)
    assert result["colocated"]["phases_s"] is None and "must be divisible" in result["colocated"]["reasons"][0]
    assert result["training"]["layout"]["data"] == 4


def test_cli_disaggregated_prints_the_split_and_refuses_too_few_nodes(capsys):
    args = ("--model", "qwen2.5-7b", "--tp", "4", "--nodes", "3", "--server-tp", "2", "--micro-batch-size", "2",
            "--mini-batches", "4", "--disaggregated")
    status, out, _ = _plan_cli(capsys, *args)
    assert status == 0
    assert "training: 2 node(s), TP=4 PP=1 DP=4 (16 GPUs)" in out
    assert "ROLLOUT_NODES=1 SERVER_TP=2 SERVERS_PER_NODE=4 MAX_STALENESS=1" in out
    assert "staleness needed: 1" in out and "training MFU 0.4" in out
    status, out, _ = _plan_cli(capsys, *args, "--json", "--training-mfu", "0.2")
    result = json.loads(out)
    assert status == 0 and result["assumptions"]["training_mfu"] == 0.2
    assert (result["rollout"]["servers"], result["training"]["layout"]["data"]) == (4, 4)
    status, _, err = _plan_cli(capsys, "--model", "qwen2.5-7b", "--tp", "4", "--nodes", "1", "--disaggregated")
    assert status == 2 and "one training replica (TP x PP x CP = 4 GPUs) and one rollout server" in err


def test_split_of_a_moe_layout_starts_at_the_fewest_replicas_that_hold_its_experts():
    """The 30B-A3B recipe's layout (TP=2, EP=8: EP x ETP = 16 needs TP x DP >= 16, so DP >= 8) on 4 nodes: the
    engine's rules were checked at DP=1 and refused every split; now the splits start at DP=8, and a DP that cannot
    hold the experts is a reason, not the answer."""
    shape = ModelShape.from_hf(hf_config("qwen3-30b-a3b"))
    layout = ParallelLayout(tensor=2, expert=8, sequence_parallel=True, data=None)
    result = plan_disaggregated(shape, layout, Workload(prompts_per_step=128, mini_batches_per_step=4), Settings(),
                                nodes=4)
    dps = [result["training"]["layout"]["data"]] + [o["training"]["layout"]["data"] for o in result["alternatives"]]
    assert dps and all(dp % 8 == 0 for dp in dps)


# The Qwen2.5-32B paper-length workload (examples/qwen2.5-32b-dapo-20k.yaml): 2048 + 20480 tokens per sequence.
LONG = Workload(max_prompt_tokens=2048, max_response_tokens=20480, mini_batches_per_step=4)


def test_context_parallelism_splits_a_gpus_share_of_each_sequence_by_hand():
    """At CP = 2 a GPU holds 11,264 of a sequence's 22,528 tokens: the "te" profile's activations (every term per
    local token) and the logits halve exactly, the log-prob workspaces stay at their chunk (the budget, not the
    sequence, sets it), the optimizer state shards over DP x CP, and Transformer Engine's ring adds its K/V blocks
    in flight: 4 blocks of K and V, 2 x 8 KV heads x 128 / TP 8 per local token, bf16 (by hand: 23,068,672 bytes)."""
    from megatron_gtpo.planning.memory import stage_memory

    shape = ModelShape.from_hf(hf_config("qwen2.5-32b"))
    settings = Settings(vllm_memory_fraction=0.5, vllm_tensor_parallel=8)
    cp1 = ParallelLayout(tensor=8, pipeline=2, data=2, sequence_parallel=True)
    cp2 = replace(cp1, data=1, context=2)
    one, two = (plan(shape, layout, LONG, settings).stages for layout in (cp1, cp2))
    for a, b in zip(one, two):  # per pipeline stage
        assert b.activations == a.activations / 2
        assert b.logits == a.logits / 2
        assert b.logprob_workspaces == a.logprob_workspaces
        assert (b.parameters, b.gradients, b.optimizer) == (a.parameters, a.gradients, a.optimizer)
        assert (a.context_kv, b.context_kv) == (0, 4 * 2 * 128 * 11264 * 2)
    # 1 micro-batch in flight on the last stage: 32 layers x 11,264 tokens x (4 h / 8 + 2 q / 8 + 2 kv / 8 + 3 f / 8)
    h, q, kv, f = 5120, 5120, 1024, 27648
    assert two[1].activations == 32 * 11264 * (4 * h + 2 * q + 2 * kv + 3 * f) / 8 * 2
    # The distributed optimizer: 12 bytes per parameter over DP x CP = 2 in both layouts
    assert two[0].optimizer == two[0].params * 12 / 2
    half = stage_memory(shape, replace(cp2, data=2), LONG, settings, 0, distributed_optimizer=True, recompute=False)
    assert half.optimizer == two[0].optimizer / 2
    # Recompute keeps each layer's input (its half of the row, split over TP by SP) plus one layer's whole set.
    layer = 11264 * (4 * h + 2 * q + 2 * kv + 3 * f) / 8 * 2
    recomputed = plan(shape, cp2, LONG, replace(settings, recompute_activations=True)).stages[1]
    assert recomputed.activations == 32 * 11264 * h / 8 * 2 + layer
    # The all-gather attention (kernels "local") holds the whole row's K and V, as gathered and in position order.
    local = plan(shape, cp2, LONG, replace(settings, kernels="local")).stages[1]
    assert local.context_kv == 2 * 2 * 128 * 22528 * 2


def test_suggest_takes_context_parallelism_where_a_long_sequence_does_not_fit_otherwise():
    """Qwen2.5-7B at 2048 + 40960 tokens on 8 GPUs: without recompute, only CP fits replicas of fewer than 8 GPUs, so
    the best suggestion is TP = 4 with CP = 2 (recompute would cost a third more compute); with the built-in engine
    (no colocated vLLM) CP is not proposed (it does not generate under CP)."""
    shape = ModelShape.from_hf(hf_config("qwen2.5-7b"))
    settings = Settings(vllm_memory_fraction=0.5)
    longer = replace(LONG, max_response_tokens=40960)
    plans = suggest_layouts(shape, 8, longer, settings)
    assert all(p.fits and p.layout.world_size == 8 for p in plans)
    # Without recompute and without CP, only replicas of all 8 GPUs fit (TP 4 x PP 2): CP = 2 halves them
    assert all(p.layout.tensor * p.layout.pipeline == 8 for p in plans
               if p.layout.context == 1 and not p.settings.recompute_activations)
    assert (plans[0].layout.tensor, plans[0].layout.context, plans[0].layout.data) == (4, 2, 1)
    assert not plans[0].settings.recompute_activations
    builtin = suggest_layouts(shape, 8, longer, replace(settings, vllm_memory_fraction=None))
    assert all(p.layout.context == 1 for p in builtin)


def test_cli_takes_the_context_parallel_size(capsys):
    status, out, _ = _plan_cli(capsys, "--model", "qwen2.5-32b", "--tp", "8", "--pp", "2", "--cp", "2", "--nodes", "4",
                               "--max-response-tokens", "20480", "--sp", "--json")
    result = json.loads(out)
    assert status == 0 and result["layout"]["context"] == 2 and result["layout"]["data"] == 1
    assert result["memory_gib"]["context_kv"] == pytest.approx(4 * 2 * 128 * 11264 * 2 / 2**30)
    status, _, err = _plan_cli(capsys, "--model", "qwen2.5-32b", "--tp", "8", "--pp", "2", "--cp", "3", "--nodes", "4")
    assert status == 2 and "not divisible by TP x PP x CP = 8 x 2 x 3" in err
    status, out, _ = _plan_cli(capsys, "--model", "qwen2.5-32b", "--tp", "8", "--pp", "2", "--cp", "2", "--nodes", "4",
                               "--max-response-tokens", "20480", "--sp")
    assert "TP=8 PP=2 CP=2 DP=1" in out and "context_kv" in out

"""Every model configuration a user can choose on a GPU, built on a CPU with the GPU's settings forced on.

The settings that switch on only with CUDA (the fusion switches, the layer spec) are decided from an `Accelerator`
(models/accelerator.py). Here each kind of GPU machine is forced in turn, and the model the trainer would build there
is built through the trainer's own path (config validation, then training/model_setup.build_chunks) on the meta
device at TP=2, for every Qwen2.5, Qwen3 and Qwen3-MoE preset's structure (shrunk), bf16 and fp32, sequence
parallelism, packing and recompute on and off. Checked:
- the config validation accepts every one of them (sequence parallelism included: the local spec runs it too),
  except Qwen3-MoE without sequence parallelism (megatron-core's MoE layer trains at TP > 1 only with it), which it
  refuses with that rule's message;
- megatron-core's constructors accept what is built (they assert on settings they cannot run);
- every fusion switch that is on has the kernel it needs on that machine (REQUIRES below, read from megatron-core
  0.16.1's sources, not from the project's decision code).
The Transformer Engine spec cannot be built without TE: for it, the TransformerConfig the trainer would hand TE's spec
is built and checked (megatron-core's own validation, the kernel table); the module constructors are not run.
"""
import dataclasses
import itertools

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.config import ConfigError, TrainConfig, validate_layout
from megatron_gtpo.models.accelerator import Accelerator
from megatron_gtpo.models.presets import FAMILY_PRESETS, hf_config

# What each TransformerConfig fusion switch needs where it runs, from megatron-core 0.16.1:
# - masked_softmax_fusion: fusions/fused_softmax.py imports scaled_(upper_triang_)masked_softmax_cuda or
#   scaled_softmax_cuda whenever the shape passes is_kernel_available (bf16, 16 < sk <= 4096, ...);
# - bias_activation_fusion, bias_dropout_fusion: fusions/fused_bias_swiglu.py and fused_bias_dropout.py go through
#   megatron.core.jit.jit_fuser = torch.compile, whose GPU backend is triton;
# - persist_layer_norm: apex's persistent LayerNorm (fusions/fused_layer_norm.py), and the local spec's
#   WrappedTorchNorm asserts it off; apply_rope_fusion: TE / apex rotary kernels; gradient_accumulation_fusion:
#   fused_weight_gradient_mlp_cuda. The project's GPU set provides none of these three.
REQUIRES = {"masked_softmax_fusion": "fused_softmax", "bias_activation_fusion": "triton",
            "bias_dropout_fusion": "triton", "persist_layer_norm": None, "apply_rope_fusion": None,
            "gradient_accumulation_fusion": None}

MACHINES = {
    "gpu": Accelerator(cuda=True, triton=True),  # the project's GPU set without Transformer Engine
    "gpu+te": Accelerator(cuda=True, transformer_engine=True, triton=True),
    "gpu+apex-softmax": Accelerator(cuda=True, fused_softmax=True, triton=True),
    "gpu+te+apex-softmax": Accelerator(cuda=True, transformer_engine=True, fused_softmax=True, triton=True),
    "cpu": Accelerator(cuda=False),
}
TP = 2
PRESET_NAMES = FAMILY_PRESETS["qwen2"] + FAMILY_PRESETS["qwen3"] + FAMILY_PRESETS["qwen3_moe"]
MOE_PRESETS = set(FAMILY_PRESETS["qwen3_moe"])


def shrunk_preset(name: str) -> dict:
    """A preset's structure (family, heads, KV heads, tied embeddings, norm eps; Qwen3-MoE: experts per token) at a
    small width: head_dim 8; 16 experts, 16 wide."""
    hf = hf_config(name)
    heads = hf["num_attention_heads"]
    moe = {"num_experts": 16, "moe_intermediate_size": 16} if name in MOE_PRESETS else {}
    return dict(hf, hidden_size=8 * heads, head_dim=8, intermediate_size=16 * heads, num_hidden_layers=2,
                vocab_size=1000, **moe)


def config_for(*, dtype: str, sequence_parallel: bool, pack: bool, recompute: bool) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.dtype, cfg.model.recompute_activations = dtype, recompute
    cfg.parallel.tensor, cfg.parallel.sequence_parallel = TP, sequence_parallel
    cfg.data.pack_sequences, cfg.data.max_tokens_per_micro_batch = pack, 256
    cfg.data.prompts_per_step = 8
    return cfg


CHOICES = list(itertools.product(("bfloat16", "float32"), (False, True), (False, True), (False, True)))


def fusion_violations(config, machine: Accelerator) -> list[str]:
    """The fusion switches of a TransformerConfig that are on without their kernel on `machine`."""
    bad = []
    for switch, needs in REQUIRES.items():
        if getattr(config, switch) and (needs is None or not getattr(machine, needs)):
            bad.append(f"{switch} is on, but {needs or 'its kernel'} is not available")
    return bad


def _build_every_configuration(rank, world_size, machines):
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import ModelShape, transformer_config_from_hf
    from megatron_gtpo.training.model_setup import build_chunks

    parallel = initialize_parallel(TP, 1)
    outcome = {}
    for (machine_name, machine), name, choice in itertools.product(machines.items(), PRESET_NAMES, CHOICES):
        dtype, sequence_parallel, pack, recompute = choice
        cfg = config_for(dtype=dtype, sequence_parallel=sequence_parallel, pack=pack, recompute=recompute)
        hf = shrunk_preset(name)
        key = (machine_name, name, *choice)
        try:
            validate_layout(cfg, world_size=world_size, shape=ModelShape.from_hf(hf))
        except ConfigError as e:
            outcome[key] = ("refused", str(e))
            continue
        if machine.transformer_engine:  # TE's modules cannot be built here: the config TE's spec would get
            config = transformer_config_from_hf(
                hf, tensor_parallel=TP, sequence_parallel=sequence_parallel, recompute_activations=recompute,
                params_dtype=getattr(torch, dtype), accelerator=machine, transformer_engine=True,
                packed_sequences=pack)
            outcome[key] = ("config", fusion_violations(config, machine))
            continue
        chunks = build_chunks(cfg, hf, parallel, meta_device=True, accelerator=machine)
        config = chunks[0].config
        assert {p.device.type for p in chunks[0].parameters()} == {"meta"}
        outcome[key] = ("built", fusion_violations(config, machine))
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(_build_every_configuration, TP, args=(MACHINES,), timeout_s=600)[0]


@pytest.mark.slow
def test_every_gpu_configuration_builds_with_only_available_fusions(outcomes):
    assert len(outcomes) == len(MACHINES) * len(PRESET_NAMES) * len(CHOICES)
    refused = {key: detail for key, (status, detail) in outcomes.items() if status == "refused"}
    moe_without_sp = {key for key in outcomes if key[1] in MOE_PRESETS and not key[3]}
    assert refused.keys() == moe_without_sp, refused
    assert all(detail.startswith("parallel.sequence_parallel: a mixture-of-experts model trains at TP > 1 only")
               for detail in refused.values()), refused
    violations = {key: bad for key, (status, bad) in outcomes.items() if status != "refused" and bad}
    assert not violations, violations
    built = [key for key, (status, _) in outcomes.items() if status == "built"]
    assert {key[0] for key in built} == {"gpu", "gpu+apex-softmax", "cpu"}


def test_fused_softmax_only_for_the_unfused_attention_of_unpacked_rows():
    """Where the fused softmax kernels exist, the local spec's unfused attention uses them, except for packed rows
    (the fused causal kernel ignores the block-diagonal mask); the SDPA attention (the default) and TE's spec have
    their own softmax."""
    from megatron_gtpo.models.accelerator import fusion_settings

    machine = MACHINES["gpu+apex-softmax"]
    assert fusion_settings(machine, transformer_engine=False, packed_sequences=False,
                           core_attention="unfused")["masked_softmax_fusion"]
    assert not fusion_settings(machine, transformer_engine=False, packed_sequences=True,
                               core_attention="unfused")["masked_softmax_fusion"]
    assert not fusion_settings(machine, transformer_engine=False, packed_sequences=False)["masked_softmax_fusion"]
    assert not fusion_settings(dataclasses.replace(machine, transformer_engine=True), transformer_engine=True,
                               packed_sequences=False, core_attention="unfused")["masked_softmax_fusion"]
    assert not fusion_settings(machine, transformer_engine=False, packed_sequences=True)["masked_softmax_fusion"]
    assert not fusion_settings(dataclasses.replace(machine, transformer_engine=True), transformer_engine=True,
                               packed_sequences=False)["masked_softmax_fusion"]

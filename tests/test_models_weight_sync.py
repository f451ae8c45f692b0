"""The weight sync of every Qwen3 family, dense and mixture-of-experts: after every parameter is perturbed, the HF
tensors hf_weight_buckets delivers to its destination (gathered over TP and PP; for Qwen3-MoE at EP 2 from the EP
rank holding each expert, and from its expert-TP shards), loaded into transformers' model of the family, give the
tokens and log-probs the built-in engine served at that layout. Qwen2's sync, bucket by bucket, is in
test_rollout_weight_sync.py."""
import zlib

import pytest
import torch

from distributed_harness import results_by_world_size
from tiny_models import FAMILY_CLASSES, TINY_QWEN3, make_tiny_model

PROMPTS = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500]]
NEW_TOKENS = 6
# (family, tied, TP, PP, EP, ETP, DP)
CASES = [("qwen3", False, 2, 1, 1, None, 1), ("qwen3", True, 1, 2, 1, None, 1),
         ("qwen3_moe", False, 1, 1, 2, None, 2), ("qwen3_moe", False, 2, 1, 2, 1, 1),
         ("qwen3_moe", False, 2, 1, 2, None, 2),  # each expert split over ETP = TP = 2
         ("qwen3_moe", False, 1, 2, 2, None, 2)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(family, tied) -> the directory of a tiny model (built when first asked for)."""
    built = {}

    def model_dir(family, tied):
        if (family, tied) not in built:
            path = tmp_path_factory.mktemp(f"{family}_{'tied' if tied else 'untied'}")
            make_tiny_model(path, family, tie=tied, seed=(11 if family == "qwen3" else 31) + tied, **TINY_QWEN3)
            built[family, tied] = path
        return built[family, tied]
    return model_dir


@pytest.fixture(scope="module")
def served(model_dirs):
    """case of CASES -> each rank's `_sync_and_serve`; the cases of one world size in one set of ranks."""
    return results_by_world_size(_sync_and_serve, CASES, world_size=lambda c: c[2] * c[3] * c[6],
                                 args=lambda c: (str(model_dirs(c[0], c[1])), *c[2:6]), timeout_s=600)


def _perturb(chunks, groups, shape) -> None:
    """Noise on every parameter, seeded by its canonical name (global layer and expert) and, for a split one, its
    (expert-)TP rank: replicas of a tensor stay equal (the q/k norms too, and the last stage's copy of tied embeddings
    equal to the embedding), shards differ, as training keeps them."""
    from megatron_gtpo.models.hf_checkpoint import layer_offset
    from megatron_gtpo.models.hf_mapping import ShardCoordinates, canonical_name

    offset = ShardCoordinates.of(groups).expert_offset(shape)
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                key = canonical_name(name, layer_offset(chunk), offset).replace("output_layer",
                                                                                 "embedding.word_embeddings")
                split = getattr(p, "tensor_model_parallel", False)
                rank = (groups.etp_rank if ".experts." in key else groups.tp_rank) if split else 0
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + rank)
                p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.device))


def _sync_and_serve(rank, world_size, model_dir, tp, pp, ep, etp):
    """The built-in engine's greedy responses after the perturbation, and the HF tensors the sync delivers to its
    destination (TP rank 0 of the first stage of each replica); None elsewhere."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.rollout.weight_sync import hf_weight_buckets, is_sync_destination

    groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                             expert_parallel=ep, expert_tensor_parallel=etp)
        load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
        shape = ckpt.shape
    _perturb(chunks, groups, shape)
    # Each replica its own prompts (different responses and lengths): the engine keeps the EP group in lockstep.
    prompts = PROMPTS[groups.dp_rank:] + PROMPTS[:groups.dp_rank]
    responses = BuiltinEngine(chunks, groups, TINY_QWEN3["vocab_size"]).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)).to_lists()
    received = {name: t.clone() for bucket in hf_weight_buckets(chunks, groups, shape) for name, t in bucket}
    return (received, prompts, responses) if is_sync_destination(groups) else None


@pytest.mark.parametrize("family,tied,tp,pp,ep,etp,dp", CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-tp{tp}-pp{pp}-ep{ep}-etp{etp or tp}-dp{dp}"
                              for f, t, tp, pp, ep, etp, dp in CASES])
def test_weight_sync_serves_the_built_in_engines_logprobs(model_dirs, served, tmp_path, family, tied, tp, pp, ep, etp,
                                                          dp):
    import transformers
    from safetensors.torch import load_file, save_file

    path = model_dirs(family, tied)
    destinations = [r for r in served((family, tied, tp, pp, ep, etp, dp)) if r is not None]
    assert len(destinations) == dp
    checkpoint = load_file(str(path / "model.safetensors"))
    for received, prompts, responses in destinations:
        # every expert of every layer and the routers; the q/k norms; no biases; lm_head only if untied
        assert sorted(received) == sorted(checkpoint)
        assert all(not torch.equal(received[name], tensor) for name, tensor in checkpoint.items())  # all perturbed
        # Loaded as a HF checkpoint: transformers maps the per-expert tensors onto its own layout of the experts.
        served_dir = tmp_path / "served"
        served_dir.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in received.items()}, str(served_dir / "model.safetensors"))
        (served_dir / "config.json").write_text((path / "config.json").read_text())
        model = getattr(transformers, FAMILY_CLASSES[family][1]).from_pretrained(str(served_dir)).eval()
        _assert_serves_the_responses(model, prompts, responses, f"TP={tp} PP={pp} EP={ep}")


def _assert_serves_the_responses(served, prompts, responses, where: str) -> None:
    """The transformers model `served` gives each greedy response (one per prompt) and its log-probs (1e-4)."""
    for prompt, (response,) in zip(prompts, responses):
        with torch.no_grad():
            logits_LV = served(torch.tensor([prompt + response.token_ids])).logits[0, len(prompt) - 1:-1]
        assert response.token_ids == logits_LV.argmax(-1).tolist()  # greedy
        tokens_L = torch.tensor(response.token_ids)
        logprobs_L = torch.log_softmax(logits_LV.double(), -1)[torch.arange(len(tokens_L)), tokens_L]
        err = (torch.tensor(response.logprobs, dtype=torch.float64) - logprobs_L).abs().max().item()
        assert err < 1e-4, f"{where}: served log-probs differ from the synced weights' by {err:.2e}"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_every_rmsnorm_weight_of_the_family_is_checksummed(family):
    """The checksums that identify a policy version after a sync cover every RMSNorm of transformers' model of the
    family: Qwen3's per-head q/k norms (self_attn.q_norm / k_norm) included."""
    import transformers

    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.rollout.weight_sync import policy_checksum_names
    from tiny_models import tiny_config

    config = tiny_config(family, **({} if family == "qwen2" else TINY_QWEN3))
    with torch.device("meta"):
        model = getattr(transformers, FAMILY_CLASSES[family][1])(config)
    norms = [f"{name}.weight" for name, module in model.named_modules() if type(module).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * config.num_hidden_layers + 1 + (0 if family == "qwen2" else 2 * config.num_hidden_layers)
    assert sorted(policy_checksum_names(ModelShape.from_hf(config.to_dict()))) == sorted(norms)


def _sync_with_a_corrupted_q_norm(rank, world_size, model_dir):
    """A trainer's Qwen3 model and a built-in rollout server in one process: a sync of perturbed weights, then one
    whose bucket carries a q_norm changed after its checksum was taken (on the wire), then a clean one. What each
    reports, and whether the server holds the trainer's q_norm after the first."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout.builtin_server import BuiltinServer
    from megatron_gtpo.rollout.server_engine import ServerEngine

    groups = initialize_parallel(1, 1)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0)
        load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
        shape = ckpt.shape
    server = BuiltinServer(str(model_dir))
    engine = ServerEngine(server, groups, shape)
    _perturb(chunks, groups, shape)

    def q_norm(model_chunks):
        return dict(model_chunks[0].named_parameters())["decoder.layers.1.self_attention.q_layernorm.weight"]

    engine.sync_weights(chunks, groups)
    out = {"synced": torch.equal(q_norm(server.chunks), q_norm(chunks)), "version_1": engine.policy_version}
    honest_load = server.load_bucket
    server.load_bucket = lambda bucket: honest_load(
        [(n, t + 1e-3 if n == "model.layers.1.self_attn.q_norm.weight" else t) for n, t in bucket])
    try:
        engine.sync_weights(chunks, groups)
        out["corrupt"] = None
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        out["corrupt"] = f"{type(e).__name__}: {e}"
    out["version_after_corrupt"] = engine.policy_version
    server.load_bucket = honest_load
    engine.sync_weights(chunks, groups)  # a clean sync repairs it
    out["version_3"] = engine.policy_version
    return out


def test_a_q_norm_corrupted_in_a_sync_is_caught(model_dirs):
    """Qwen3's q/k norms are in the sync's checksums: a q_norm that reaches the rollout server other than it was
    sent fails that sync, naming it, and the policy version does not advance."""
    from distributed_harness import run_distributed

    (out,) = run_distributed(_sync_with_a_corrupted_q_norm, 1, args=(str(model_dirs("qwen3", False)),),
                             timeout_s=300)
    assert out["synced"] and out["version_1"] == 1
    assert out["corrupt"] is not None and "model.layers.1.self_attn.q_norm.weight" in out["corrupt"], out["corrupt"]
    assert out["version_after_corrupt"] == 1 and out["version_3"] == 2

"""One policy-update step on a fixed batch gives the same loss and the same updated weights at TP=1 vs 2,
PP=1 vs 2, DP=1 vs 2 and micro-batch size 4 vs 1 (the loss contract, end to end through megatron's schedule,
DDP and the DistributedOptimizer), for the token-level loss (GTPO / DAPO / GRPO) and the sequence-level one
(GRPO-S, one advantage per sequence, mean over sequences)."""
import pytest
import torch

from distributed_harness import run_distributed
from tiny_models import make_tiny_qwen2

NUM_SEQUENCES = 8
LOSS_LEVELS = ("token", "sequence")


def _fixed_batch(seed=0):
    """Sequences with prompts and responses of different lengths; old log-probs and per-token advantages drawn
    so that some ratios fall outside the clip range."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(NUM_SEQUENCES):
        prompt_len = 2 + i % 3
        response_len = 1 + (5 * i) % 6
        tokens = torch.randint(0, 1000, (prompt_len + response_len,), generator=g).tolist()
        old = -7.0 + 1.5 * torch.rand(response_len, generator=g)
        adv = torch.randn(response_len, generator=g)
        batch.append((tokens, prompt_len, old, adv, torch.randn((), generator=g)))
    return batch


def _gather_hf(chunks, groups, shape):
    import torch.distributed as dist

    from megatron_gtpo.models.hf_checkpoint import layer_offset
    from megatron_gtpo.models.hf_mapping import canonical_name, megatron_shards_to_hf, tensor_mappings

    by_name = {m.megatron_name: m for m in tensor_mappings(shape)}
    out = {}
    for chunk in chunks:
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            mapping = by_name[canonical_name(name, offset)]
            shards = [torch.empty_like(param) for _ in range(groups.tp_size)]
            dist.all_gather(shards, param.detach().contiguous(), group=groups.tp_group)
            for hf_name, tensor in zip(mapping.hf_names, megatron_shards_to_hf(mapping, shards, shape)):
                out[hf_name] = tensor.clone()
    return out


def _one_step(rank, world_size, model_dir, tp, pp, micro_batch_sizes):
    import torch.distributed as dist

    from megatron_gtpo.algorithms import local_loss_normalizer, sequence_policy_loss, token_policy_loss
    from megatron_gtpo.config import load_config
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen2 import build_model
    from megatron_gtpo.training.model_setup import wrap_for_training
    from megatron_gtpo.distributed.platform import device_audit
    from megatron_gtpo.training.train_step import build_update_micro_batch, run_train_step

    groups = initialize_parallel(tp, pp)
    # adam_eps well above float32 noise: the key bias has an analytically zero gradient (softmax ignores a shift
    # shared by all keys), and Adam with a tiny eps would blow its ~1e-9 rounding noise up to +-lr.
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "optim.lr=0.01",
                             "optim.adam_eps=1e-4", "optim.grad_clip=1000.0"])
    batch = _fixed_batch()
    per_rank = NUM_SEQUENCES // groups.dp_size
    mine = batch[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
    results = {}
    for level, mbs in ((level, mbs) for level in LOSS_LEVELS for mbs in micro_batch_sizes):
        sequence_level = level == "sequence"
        with HFCheckpoint(model_dir) as ckpt:
            chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank)
            load_hf_weights(chunks, ckpt, tp_rank=groups.tp_rank, tp_size=tp)
            shape = ckpt.shape
        policy = wrap_for_training(cfg, chunks, train_steps=1)
        micro_batches = [build_update_micro_batch([s[0] for s in part], [s[1] for s in part], device=groups.device,
                                                  old_logprobs=[s[2] for s in part],
                                                  advantages=[s[4] if sequence_level else s[3] for s in part])
                         for part in (mine[i:i + mbs] for i in range(0, len(mine), mbs))]
        mode = "seq-mean-token-mean" if sequence_level else "token-mean"
        normalizer = torch.stack([local_loss_normalizer(m.loss_mask_BL, mode) for m in micro_batches]).sum().double()
        dist.all_reduce(normalizer, group=groups.dp_group)
        policy_loss = sequence_policy_loss if sequence_level else token_policy_loss

        def loss_fn(mb, logprobs_BL, entropy_BL):
            return policy_loss(logprobs_BL, mb.old_logprobs_BL, mb.advantages, mb.loss_mask_BL,
                               loss_normalizer=normalizer, eps_low=0.2, eps_high=0.28)

        syncs = device_audit().host_syncs
        result = run_train_step(policy, micro_batches, groups, loss_fn, vocab_size=shape.vocab_size, temperature=0.9)
        syncs = device_audit().host_syncs - syncs
        loss = torch.tensor([sum(float(m["pg_loss"]) for m in result["micro_batch_metrics"])]
                            if groups.is_last_stage else [0.0], dtype=torch.float64)
        dist.all_reduce(loss, group=groups.dp_group)
        clip = sum(float(m["clip_frac_low"] + m["clip_frac_high"]) for m in result["micro_batch_metrics"])
        weights = _gather_hf(policy.chunks, groups, shape)
        results[level, mbs] = {"loss": loss.item() if groups.is_last_stage else None, "grad_norm": result["grad_norm"],
                        "weights": weights if groups.tp_rank == 0 and groups.dp_rank == 0 else {},
                        "clipped": clip > 0 if groups.is_last_stage else None, "host_syncs": syncs}
    return results


def _merge(rank_results, key):
    loss = next(r[key]["loss"] for r in rank_results if r[key]["loss"] is not None)
    weights = {}
    for r in rank_results:
        weights.update(r[key]["weights"])
    return loss, rank_results[0][key]["grad_norm"], weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("inv")
    make_tiny_qwen2(path, tie=False, vocab_size=1000, num_layers=4, num_heads=4, num_kv_heads=2)
    results = run_distributed(_one_step, 1, args=(str(path), 1, 1, [4, 1]), timeout_s=300)
    return path, results


def _assert_same(a, b, what):
    (loss_a, norm_a, w_a), (loss_b, norm_b, w_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-5), what
    assert norm_a == pytest.approx(norm_b, rel=1e-5), what
    assert w_a.keys() == w_b.keys() and len(w_a) > 0
    for name in w_a:
        assert torch.allclose(w_a[name], w_b[name], rtol=1e-5, atol=1e-5), f"{what}: {name}"


@pytest.mark.parametrize("level", LOSS_LEVELS)
def test_micro_batch_size_4_vs_1(reference, level):
    _, results = reference
    assert results[0][level, 4]["clipped"]  # the batch really exercises the clip
    _assert_same(_merge(results, (level, 4)), _merge(results, (level, 1)), f"{level} loss, micro-batch 4 vs 1")
    # The device audit counts device -> host reads: a step's must not grow with its number of micro-batches
    # (here 2 micro-batches of 4 vs 8 of 1; what remains is the optimizer's grad-norm reads).
    assert results[0][level, 4]["host_syncs"] == results[0][level, 1]["host_syncs"]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_layouts_match_single_process(reference, tp, pp):
    path, base = reference
    world = 2  # (1, 1) on two processes is DP=2
    results = run_distributed(_one_step, world, args=(str(path), tp, pp, [2]), timeout_s=300)
    for level in LOSS_LEVELS:
        _assert_same(_merge(base, (level, 4)), _merge(results, (level, 2)),
                     f"{level} loss, TP={tp} PP={pp} DP={world // (tp * pp)}")

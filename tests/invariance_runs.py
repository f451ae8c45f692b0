"""One policy-update step on a fixed batch, run in spawned ranks, and what its results are compared by: the loss
contract's end-to-end check (test_parallel_invariance.py), reused for Qwen3 (test_models_qwen3.py), expert parallelism
(test_parallel_invariance_moe.py) and the Transformer Engine spec (test_te_spec.py)."""
import pytest
import torch

from megatron_gtpo.config import ClipCovOptions, KLCovOptions

NUM_GROUPS, G = 4, 2
LOSS_LEVELS = ("token", "sequence")
# The token selections (Clip-Cov, KL-Cov, the high-entropy fraction) on the token-level loss, with settings that make
# them act on this small batch: their statistics span the whole mini-batch, so the split must not change them.
SELECTIONS = {
    "clip_cov": dict(name="clip_cov", clip_cov=ClipCovOptions(ratio=0.3, lb=0.05)),
    "kl_cov": dict(name="kl_cov", kl_cov=KLCovOptions(ratio=0.3)),
    "entropy_fraction": dict(name="dapo", entropy_token_fraction=0.5),
}
# Micro-batch plans: (sequences, max tokens, packed)
BY_COUNT, ONE_BY_ONE = (4, None, False), (1, None, False)
BUDGETS = [(8, 12, False), (8, 21, False)]  # max tokens per micro-batch (padded): 1 to 3 sequences each
PACKED = [(8, 12, True), (8, 21, True)]  # one row of at most that many tokens per micro-batch, 1 to 4 sequences


def fixed_batch(seed=0):
    """NUM_GROUPS prompt groups of G responses of different lengths (whole sequences 3 to 10 tokens), with old
    log-probs, per-token advantages and per-sequence advantages drawn so that some ratios fall outside the clip
    range."""
    from hand_built import rewarded_groups
    from megatron_gtpo.rollout.responses import Response, Responses

    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(0, 1000, (2 + n % 3,), generator=g).tolist()) for n in range(NUM_GROUPS)]
    lengths = [[1 + (5 * (G * n + j)) % 6 for j in range(G)] for n in range(NUM_GROUPS)]
    responses = Responses.from_lists([[Response(torch.randint(0, 1000, (length,), generator=g).tolist(),
                                                [0.0] * length, "stop") for length in group] for group in lengths])
    correct = torch.zeros(NUM_GROUPS, G)
    T = max(map(max, lengths))
    old_ST = -7.0 + 1.5 * torch.rand(NUM_GROUPS * G, T, generator=g)
    return (rewarded_groups(prompts, responses, correct), old_ST, torch.randn(old_ST.shape, generator=g),
            torch.randn(NUM_GROUPS * G, generator=g))


def gather_hf(chunks, groups, shape):
    """This stage's HF tensors: TP shards gathered (an expert's over its expert-TP group), and with expert
    parallelism every EP rank's experts."""
    import torch.distributed as dist

    from megatron_gtpo.models.hf_checkpoint import layer_offset
    from megatron_gtpo.models.hf_mapping import ShardCoordinates, canonical_name, megatron_shards_to_hf, tensor_mappings

    by_name = {m.megatron_name: m for m in tensor_mappings(shape)}
    expert_offset = ShardCoordinates.of(groups).expert_offset(shape)
    out = {}
    for chunk in chunks:
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            mapping = by_name[canonical_name(name, offset, expert_offset)]
            group, size = (groups.tp_group, groups.tp_size) if mapping.expert is None else \
                (groups.etp_group, groups.etp_size)
            shards = [torch.empty_like(param) for _ in range(size)]
            dist.all_gather(shards, param.detach().contiguous(), group=group)
            for hf_name, tensor in zip(mapping.hf_names, megatron_shards_to_hf(mapping, shards, shape)):
                out[hf_name] = tensor.clone()
    if groups.ep_size > 1:
        every_rank = [None] * groups.ep_size
        dist.all_gather_object(every_rank, out, group=groups.ep_group)
        for part in every_rank:
            out.update(part)
    return out


def _replayed_routes(kept, shape, first_sequence: int):
    """Arbitrary expert choices for every fed token of the `kept` groups' sequences (k distinct experts per token and
    layer, drawn from the global sequence index), attached as recorded routing; the ReplayPlan that replays them."""
    from megatron_gtpo.training.step_batch import ReplayPlan

    layers = tuple(range(1, shape.num_layers + 1))
    routes = []
    for s, length in enumerate(kept.groups.responses.lengths_R.tolist()):
        g = torch.Generator().manual_seed(1000 + first_sequence + s)
        fed = len(kept.groups.prompts[s // kept.group_size].prompt_token_ids) + length - 1
        experts = torch.stack([torch.randperm(shape.moe.num_experts, generator=g)[:shape.moe.topk]
                               for _ in range(fed * len(layers))]).view(fed, len(layers), -1)
        routes.append(experts.to(torch.int16))
    kept.groups.routed_experts = routes  # per response, rank-local (what the built-in engine records)
    return ReplayPlan(layers, shape.moe.topk)


def one_step(rank, world_size, model_dir, tp, pp, plans, ep=1, etp=None, replay=False, sp=False, recompute=False,
             cp=1, selection_plans=()):
    """One update per (loss level, plan), plan = (max sequences, max tokens per micro-batch, pack), through the
    trainer's own step batch and update_policy, with sequence parallelism if `sp`, full activation recompute
    (model.recompute_activations) if `recompute` and context parallel size `cp`; a mixture-of-experts model's experts
    at EP `ep` and ETP `etp`, with `replay` routing every token to arbitrary recorded experts (`_replayed_routes`).
    Also one per (SELECTIONS level, plan of `selection_plans`), through the trainer's token-selection phase on fixed
    old-policy entropies."""
    import dataclasses

    from megatron_gtpo.algorithms import configure_algorithm
    from megatron_gtpo.config import load_config
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.model_setup import wrap_for_training
    from megatron_gtpo.distributed.platform import device_audit
    from megatron_gtpo.training.old_policy import old_policy_pass
    from megatron_gtpo.training.reduction import MetricReducer
    from megatron_gtpo.training.update import update_policy
    from megatron_gtpo.training.step_batch import build_step_batch
    from megatron_gtpo.training.token_selection import global_token_selection

    groups = initialize_parallel(tp, pp, sequence_parallel=sp, expert_parallel=ep, expert_tensor_parallel=etp,
                                 context_parallel=cp)
    # adam_eps well above float32 noise: the key bias has an analytically zero gradient (softmax ignores a shift
    # shared by all keys), and Adam with a tiny eps would blow its ~1e-9 rounding noise up to +-lr.
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "optim.lr=0.01", "steps=1",
                             "optim.adam_eps=1e-4", "optim.grad_clip=1000.0", "rollout.temperature=0.9"])
    every, old_ST, token_adv_ST, sequence_adv_S = fixed_batch()
    per_rank = NUM_GROUPS // groups.dp_size
    mine = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    rows = slice(mine.start * G, mine.stop * G)
    kept = every.select(torch.arange(mine.start, mine.stop))
    results = {}
    runs = [(level, plan) for level in LOSS_LEVELS for plan in plans]
    runs += [(level, plan) for level in SELECTIONS for plan in selection_plans]
    for level, plan in runs:
        sequence_level = level == "sequence"
        with HFCheckpoint(model_dir) as ckpt:
            chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                                 sequence_parallel=sp, expert_parallel=ep, expert_tensor_parallel=etp,
                                 recompute_activations=recompute, context_parallel=cp)
            load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
            shape = ckpt.shape
        policy = wrap_for_training(cfg, chunks)
        replay_plan = _replayed_routes(kept, shape, rows.start) if replay else None
        batch = build_step_batch(kept, groups, mini_batches=[list(range(per_rank))], max_sequences=plan[0],
                                 max_tokens=plan[1], pack=plan[2], replay=replay_plan)
        old_policy_pass(policy.chunks, batch, groups, vocab_size=shape.vocab_size, temperature=0.9)
        scored = batch.old_logprobs_ST.cpu() if groups.is_last_stage else None  # [S, T] of this DP rank
        if groups.is_last_stage:
            T = batch.mask_ST.shape[1]
            batch.old_logprobs_ST = old_ST[rows, :T].to(groups.device)
            batch.advantages = (sequence_adv_S[rows] if sequence_level else token_adv_ST[rows, :T]).to(groups.device)
        settings = SELECTIONS.get(level, {"name": "grpo_s" if sequence_level else "dapo"})  # dapo: 0.2 / 0.28
        algorithm = configure_algorithm(dataclasses.replace(cfg.algorithm, **settings),
                                        max_new_tokens=cfg.rollout.max_new_tokens)
        syncs = device_audit().host_syncs
        metrics = MetricReducer(groups.device)
        if level in SELECTIONS and groups.is_last_stage:
            # fixed per token (whatever the layout), spread over [0, 3), no ties
            batch.entropy_ST = (3 * torch.frac(37 * old_ST[rows, :T]).abs()).to(groups.device)
            global_token_selection(algorithm.select_tokens, batch, groups, metrics, seed=0, step=0)
        update_policy(policy, batch, groups, algorithm, metrics, epochs=1, vocab_size=shape.vocab_size,
                      temperature=0.9, chunk_tokens=None)
        update = metrics.reduce(groups.dp_group)
        syncs = device_audit().host_syncs - syncs
        assert [len(mini) for mini in batch.plan] == [len(batch.micro_batches())]  # one mini-batch, no padding one
        weights = gather_hf(policy.chunks, groups, shape)
        results[level, plan] = {"loss": update["pg_loss"] if groups.is_last_stage else None,
                                "grad_norm": update["grad_norm"],
                                "weights": weights if groups.tp_rank == 0 and groups.dp_rank == 0 else {},
                                "clipped": update["clip_frac_low"] + update["clip_frac_high"] > 0
                                if groups.is_last_stage else None,
                                "selected": {k: update[k] for k in ("clip_cov_fraction", "kl_cov_fraction",
                                                                    "entropy_kept_fraction") if k in update},
                                "micro_batches": len(batch.plan[0]),
                                "largest": max(mb.inputs.tokens_BL.numel() for mb in batch.plan[0]),
                                "most_per_row": max(len(mb.rows) // mb.inputs.tokens_BL.shape[0]
                                                    for mb in batch.plan[0]),
                                "host_syncs": syncs, "scored": scored, "dp_rank": groups.dp_rank}
    return results


def merge(rank_results, key):
    loss = next(r[key]["loss"] for r in rank_results if r[key]["loss"] is not None)
    weights = {}
    for r in rank_results:
        weights.update(r[key]["weights"])
    return loss, rank_results[0][key]["grad_norm"], weights


def assert_same(a, b, what):
    (loss_a, norm_a, w_a), (loss_b, norm_b, w_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-5), what
    assert norm_a == pytest.approx(norm_b, rel=1e-5), what
    assert w_a.keys() == w_b.keys() and len(w_a) > 0
    for name in w_a:
        assert torch.allclose(w_a[name], w_b[name], rtol=1e-5, atol=1e-5), f"{what}: {name}"

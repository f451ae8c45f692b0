"""Experience collection with dynamic sampling (training/experience.collect_experience) on 2 data-parallel gloo
ranks, with scripted rewards: which groups are kept, how many rounds run (the same on every rank, so their data
loaders stay aligned), the bound on extra rounds, and length penalties that shape rewards but not the filter.
Then advantages over the global batch (global_advantages), a rank without groups included."""
import pytest
import torch

from distributed_harness import run_cases

G = 2
TARGET_GROUPS = 2
PROMPTS_PER_ROUND = 3
# Per scenario, rank and round: the verifier's rewards of the round's 3 groups of 2 responses.
SCRIPTS = {
    # Rank 0 has 2 informative groups after round 0; rank 1 needs a second round (1 + 2 informative).
    "fills": {0: [[[1, 0], [1, 1], [0, 1]]],
              1: [[[1, 1], [0, 0], [1, 0]], [[0, 0], [0, 1], [1, 0]]]},
    # Rank 1 never sees an informative group: the bound (max_extra_rounds = 2) ends the collection.
    "bounded": {0: [[[1, 0], [0, 1], [1, 0]]],
                1: [[[1, 1], [0, 0], [1, 1]]] * 3},
}


def _collect(rank, world_size, scenario, dynamic_sampling, carried_groups=0, ahead_rounds=1):
    """Rounds below `ahead_rounds` were asked for ahead (round 0 always; rollout.schedule.rounds_ahead further ones)."""
    import torch.distributed as dist

    from hand_built import prompt_samples
    from megatron_gtpo.distributed import ParallelGroups
    from megatron_gtpo.rollout.engine import Rollout
    from megatron_gtpo.rollout.responses import Response, Responses
    from megatron_gtpo.training.experience import GroupSelection, RewardedGroups, collect_experience
    from megatron_gtpo.training.sampled_groups import SampledGroups

    script = SCRIPTS[scenario][rank]
    calls = {"prompts": 0, "generate": [], "stand_by": 0}

    def sample_round(round_index):
        base = 100 * rank + 10 * calls["prompts"]
        calls["prompts"] += 1
        prompts = prompt_samples([(base + i,) for i in range(PROMPTS_PER_ROUND)])

        def generate():
            calls["generate"].append(round_index)
            # Response lengths 1 and 3: the length penalty below tells them apart.
            return Responses.from_lists([[Response([p.prompt_token_ids[0]] * (1 + 2 * j), [-0.1] * (1 + 2 * j),
                                                   "stop") for j in range(G)] for p in prompts])

        # The round index stands in for the policy version that sampled the round.
        return lambda: SampledGroups.sampled(prompts, Rollout(generate()), round_index), round_index < ahead_rounds

    def reward_groups(prompts, responses):
        return torch.tensor(script[min(len(calls["generate"]) - 1, len(script) - 1)], dtype=torch.float32)

    # Groups carried over from an earlier step (prompts 900, 901, ...), sampled by version 7, rewarded then.
    old = prompt_samples([(900 + i,) for i in range(carried_groups)])
    carried = RewardedGroups(SampledGroups.sampled(old, Rollout(Responses.from_lists(
        [[Response([5], [-0.5], "stop")] * G for _ in old])), 7), torch.tensor([[0.0, 1.0]] * len(old)),
        torch.tensor([[-0.1, 0.9]] * len(old))) if carried_groups else None
    selection = GroupSelection(TARGET_GROUPS, dynamic_sampling, max_extra_rounds=2,
                               length_penalty=lambda lengths_NG, correct_NG: -0.1 * lengths_NG)
    exp, surplus = collect_experience(sample_round, reward_groups, selection,
                                      ParallelGroups.data_parallel_rank(dist.group.WORLD, torch.device("cpu")),
                                      stand_by=lambda: calls.update(stand_by=calls["stand_by"] + 1), carried=carried)
    kept = exp.kept.groups
    return {"prompts": [p.prompt_token_ids[0] for p in kept.prompts], "correct": exp.kept.correct_NG.tolist(),
            "surplus": [p.prompt_token_ids[0] for p in surplus.groups.prompts],
            "surplus_correct": surplus.correct_NG.tolist(),
            "versions": kept.start_versions_R.view(-1, G)[:, 0].tolist(),
            "token_versions": kept.versions_T.tolist(), "continued": kept.continued_R().tolist(),
            "rewards": exp.kept.rewards_NG.tolist(), "stats": exp.stats, "generate_rounds": calls["generate"],
            "prompt_draws": calls["prompts"], "stand_by": calls["stand_by"]}


@pytest.fixture(scope="module")
def collected():
    """(scenario, dynamic sampling) -> each rank's `_collect`, all in one set of 2 ranks."""
    return run_cases(_collect, 2, [("fills", True), ("bounded", True), ("bounded", False), ("fills", True, 1),
                                   ("fills", True, 3), ("fills", True, 0, 2)], timeout_s=180)


def test_dynamic_sampling_fills_the_batch_in_lockstep_over_data_parallel_ranks(collected):
    rank0, rank1 = collected["fills", True]
    # Both ranks run 2 rounds and draw prompts twice; rank 0 generates only in the round it needed.
    assert rank0["stats"]["sampling_rounds"] == rank1["stats"]["sampling_rounds"] == 2
    assert rank0["prompt_draws"] == rank1["prompt_draws"] == 2
    assert rank0["generate_rounds"] == [0] and rank1["generate_rounds"] == [0, 1]
    assert (rank0["stand_by"], rank1["stand_by"]) == (1, 0)  # rank 0 takes part in rank 1's round 1
    # Kept: the informative groups in order, up to the target (rank 1: round 0's third, round 1's second).
    assert rank0["prompts"] == [0, 2] and rank0["correct"] == [[1, 0], [0, 1]]
    assert rank1["prompts"] == [102, 111] and rank1["correct"] == [[1, 0], [0, 1]]
    # Each kept group carries the policy version of its round (here the round index stands in for it).
    assert rank0["versions"] == [0, 0] and rank1["versions"] == [0, 1]
    assert rank1["token_versions"] == [0] * 4 + [1] * 4 and rank1["continued"] == [False] * 4
    assert (rank1["stats"]["groups_generated"], rank1["stats"]["groups_kept"]) == (6, 2)
    # Rewards = correctness + the length penalty (-0.1 x length, lengths 1 and 3).
    assert torch.allclose(torch.tensor(rank0["rewards"]), torch.tensor([[0.9, -0.3], [-0.1, 0.7]]))
    # Statistics cover every generated response, kept or not: rank 1 saw 12 responses, 5 correct.
    assert rank1["stats"]["accuracy"] == pytest.approx(5 / 12) and rank1["stats"]["response_length_mean"] == 2.0
    # The informative groups beyond the need are the surplus (rank 1: round 1's third); uninformative ones are not.
    assert rank0["surplus"] == [] and rank1["surplus"] == [112] and rank1["surplus_correct"] == [[1, 0]]


def test_carried_groups_are_kept_first_and_round_0_is_never_lost(collected):
    """One carried group per rank: it is kept first, and rank 1 then needs no further round. Three (more than the
    target of 2): two are kept, and round 0, generated ahead, is rewarded all the same; every informative group not
    kept is surplus, the carried ones first. The step's statistics cover the groups rewarded in it only."""
    rank0, rank1 = collected["fills", True, 1]
    assert rank0["prompts"] == [900, 0] and rank0["surplus"] == [2]
    assert rank1["prompts"] == [900, 102] and rank1["surplus"] == []
    assert rank0["stats"]["sampling_rounds"] == rank1["stats"]["sampling_rounds"] == 1
    assert rank1["generate_rounds"] == [0] and rank0["versions"] == [7, 0]
    assert rank0["correct"] == [[0, 1], [1, 0]] and rank0["rewards"][0] == pytest.approx([-0.1, 0.9])
    assert rank0["stats"]["groups_from_carry"] == 1 and rank0["stats"]["groups_generated"] == 3
    assert rank0["stats"]["accuracy"] == pytest.approx(4 / 6)  # round 0 only: the carried group counted before
    for rank, out in enumerate(collected["fills", True, 3]):
        assert out["prompts"] == [900, 901] and out["generate_rounds"] == [0]
        assert out["surplus"] == [902, *([0, 2] if rank == 0 else [102])]
        assert out["stats"]["groups_from_carry"] == 2 and out["stats"]["groups_generated"] == 3


def test_a_round_asked_for_ahead_is_rewarded_by_a_rank_that_needs_it_not(collected):
    """Round 1 asked for ahead (rollout.schedule.rounds_ahead): rank 0, full after round 0, rewards it all the same
    rather than standing by, and its informative groups (prompts 10, 12) are surplus for the next step."""
    rank0, rank1 = collected["fills", True, 0, 2]
    assert rank0["generate_rounds"] == rank1["generate_rounds"] == [0, 1] and rank0["stand_by"] == 0
    assert rank0["prompts"] == [0, 2] and rank0["surplus"] == [10, 12]
    assert rank0["stats"]["groups_generated"] == 6


def test_dynamic_sampling_stops_after_the_extra_round_bound(collected):
    rank0, rank1 = collected["bounded", True]
    assert rank0["stats"]["sampling_rounds"] == rank1["stats"]["sampling_rounds"] == 3  # 1 + max_extra_rounds
    assert rank1["generate_rounds"] == [0, 1, 2] and rank1["prompts"] == [] and rank1["correct"] == []
    assert rank1["stats"]["groups_kept"] == 0 and rank1["stats"]["groups_generated"] == 9
    assert len(rank0["prompts"]) == TARGET_GROUPS


def test_without_dynamic_sampling_one_round_keeps_uninformative_groups(collected):
    rank0, rank1 = collected["bounded", False]
    for out in (rank0, rank1):
        assert out["stats"]["sampling_rounds"] == 1 and out["generate_rounds"] == [0]
        assert len(out["prompts"]) == TARGET_GROUPS
    assert rank1["correct"] == [[1, 1], [0, 0]]  # kept although they carry no group-relative signal


# Per rank: the groups it kept, as (rewards of its G=3 responses, their lengths).
GLOBAL_BATCHES = {
    "both": {0: [([1, 0, 0], [4, 2, 5]), ([0, 1, 1], [1, 3, 3])], 1: [([1, 1, 0], [6, 2, 1])]},
    "rank 1 kept none": {0: [([1, 0, 0], [4, 2, 5]), ([0, 1, 1], [1, 3, 3])], 1: []},
}


def _step_batch(kept, seed, groups, max_sequences=8):
    """A rank's step batch with the old log-probs and entropies the old-policy pass would add (random; zeros of the
    mask's shape without groups), micro-batches of at most `max_sequences` sequences."""
    from hand_built import rewarded_groups
    from megatron_gtpo.rollout.responses import Response, Responses
    from megatron_gtpo.training.step_batch import build_step_batch

    generator = torch.Generator().manual_seed(seed)
    responses = Responses.from_lists([[Response([7] * n, [-0.5] * n, "stop") for n in lengths] for _, lengths in kept])
    correct_NG = torch.tensor([r for r, _ in kept], dtype=torch.float32) if kept else torch.zeros(0, 3)
    batch = build_step_batch(rewarded_groups([(1, 2)] * len(kept), responses, correct_NG), groups,
                             mini_batches=[list(range(len(kept)))], max_sequences=max_sequences, max_tokens=None)
    batch.entropy_ST = torch.rand(batch.mask_ST.shape, generator=generator) * 2
    batch.old_logprobs_ST = -3 * torch.rand(batch.mask_ST.shape, generator=generator)
    return batch


# The token selections' settings (acting on these few tokens), by algorithm: gtpo with the high-entropy fraction.
SELECTION_SETTINGS = {"clip_cov": ["algorithm.clip_cov.lb=0.0", "algorithm.clip_cov.ratio=0.3"],
                      "kl_cov": ["algorithm.kl_cov.ratio=0.3"], "gtpo": ["algorithm.entropy_token_fraction=0.4"]}


def _global_advantages(rank, world_size, scenario, algorithm):
    import torch.distributed as dist

    from megatron_gtpo.algorithms.registry import ALGORITHMS, configure_algorithm, resolve_algorithm
    from megatron_gtpo.config import load_config
    from megatron_gtpo.training.advantages import global_advantages
    from megatron_gtpo.training.reduction import MetricReducer
    from megatron_gtpo.training.token_selection import global_token_selection

    entry = ALGORITHMS[resolve_algorithm(algorithm)]
    from megatron_gtpo.distributed import ParallelGroups

    parallel = ParallelGroups.data_parallel_rank(dist.group.WORLD, torch.device("cpu"))
    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", f"algorithm.name={algorithm}",
                             *SELECTION_SETTINGS.get(algorithm, [])])
    configured = configure_algorithm(cfg.algorithm, max_new_tokens=8)
    batches = {r: _step_batch(GLOBAL_BATCHES[scenario][r], r, parallel) for r in range(world_size)}
    selected = {}
    for max_sequences in (8, 1):  # the advantages and the selection, whatever the micro-batch size
        batch = _step_batch(GLOBAL_BATCHES[scenario][rank], rank, parallel, max_sequences)
        global_advantages(entry.advantages, entry.uses_entropy, batch, parallel)
        if configured.select_tokens is not None:
            global_token_selection(configured.select_tokens, batch, parallel, MetricReducer(parallel.device),
                                   seed=cfg.seed, step=3)
            penalty = batch.kl_penalty_ST  # KL-Cov's only
            selected[max_sequences] = (batch.pg_weights.tolist(), None if penalty is None else penalty.tolist(),
                                       batch.advantages.tolist())
        else:
            selected[max_sequences] = batch.advantages.tolist()
    assert selected[8] == selected[1], "the micro-batch size changed the advantages or the selection"
    mine = batch.advantages
    # Reference: the whole batch in one process (every rank's batch is rebuilt here from the same seeds), its
    # group-major rows reshaped to [n, G, T] (independently of the group index the trainer reads them through).
    kept = [b for b in batches.values() if b.num_prompt_groups]
    T = max(b.mask_ST.shape[-1] for b in kept)
    rewards_NG = torch.cat([b.rewards_NG for b in kept])

    def per_group(b, values_ST):
        return torch.nn.functional.pad(values_ST, (0, T - values_ST.shape[-1])).view(b.num_prompt_groups, 3, T)

    if entry.uses_entropy:
        entropy_NGT = torch.cat([per_group(b, b.entropy_ST) for b in kept])
        mask_NGT = torch.cat([per_group(b, b.mask_ST) for b in kept])
        whole = entry.advantages(rewards_NG, entropy_NGT, mask_NGT)
    else:
        whole = entry.advantages(rewards_NG)
    start = sum(batches[r].num_prompt_groups for r in range(rank))
    own = batches[rank]
    expected = whole[start:start + own.num_prompt_groups]
    if expected.ndim == 3:
        expected = expected[..., :own.mask_ST.shape[-1]]
    expected = expected.reshape(own.num_sequences, *expected.shape[2:])
    out = {"mine": None if mine is None else mine.tolist(), "expected": expected.tolist(),
           "shape": None if mine is None else list(mine.shape)}
    if configured.select_tokens is not None:  # each rank's valid tokens in sequence order, for the reference
        pg_weights_ST, kl_penalty_ST, _ = (None if v is None else torch.tensor(v) for v in selected[8])

        def flat(values):
            return (values if values.ndim == 2 else values[:, None].expand(own.mask_ST.shape))[own.mask_ST]

        out["tokens"] = {"advantages": flat(mine).tolist(), "old_logprobs": flat(own.old_logprobs_ST).tolist(),
                         "entropy": flat(own.entropy_ST).tolist(), "keep": flat(pg_weights_ST > 0).tolist(),
                         "penalise": None if kl_penalty_ST is None else flat(kl_penalty_ST).tolist()}
    return out


ADVANTAGE_CASES = [(scenario, algorithm) for scenario in GLOBAL_BATCHES
                   for algorithm in ("gtpo", "grpo_s", "dapo", "clip_cov", "kl_cov")]


@pytest.fixture(scope="module")
def advantages():
    """(scenario, algorithm) -> each rank's `_global_advantages`, all in one set of 2 ranks."""
    return run_cases(_global_advantages, 2, ADVANTAGE_CASES, timeout_s=180)


@pytest.mark.parametrize("scenario,algorithm", ADVANTAGE_CASES)
def test_global_advantages_span_every_data_parallel_rank(advantages, scenario, algorithm):
    results = advantages[scenario, algorithm]
    for rank, out in enumerate(results):
        sequences = 3 * len(GLOBAL_BATCHES[scenario][rank])
        assert out["shape"][0] == sequences, (rank, out["shape"])
        assert torch.allclose(torch.tensor(out["mine"]).reshape(out["shape"]),
                              torch.tensor(out["expected"]).reshape(out["shape"]), atol=1e-6)
    assert any(abs(v) > 0.1 for v in torch.tensor(results[0]["mine"]).flatten().tolist())


@pytest.mark.parametrize("scenario", GLOBAL_BATCHES)
@pytest.mark.parametrize("algorithm", SELECTION_SETTINGS)
def test_token_selection_spans_every_data_parallel_rank(advantages, scenario, algorithm):
    """Each rank's selection (micro-batches of 8 or 1 sequences alike, checked in the ranks) is the selection over
    the whole batch's tokens in rank order, with the step's keys, cut back to the rank's tokens."""
    from megatron_gtpo.algorithms import configure_algorithm
    from megatron_gtpo.config import load_config
    from megatron_gtpo.training.token_selection import selection_seed

    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", f"algorithm.name={algorithm}",
                             *SELECTION_SETTINGS[algorithm]])
    select = configure_algorithm(cfg.algorithm, max_new_tokens=8).select_tokens
    ranks = [out["tokens"] for out in advantages[scenario, algorithm]]
    inputs = [torch.tensor(sum((r[name] for r in ranks), [])) for name in ("advantages", "old_logprobs", "entropy")]
    K = len(inputs[0])
    keys = torch.rand(K, generator=torch.Generator().manual_seed(selection_seed(cfg.seed, 3, 0)), dtype=torch.float64)
    whole = select(*inputs, keys)
    penalised = 0 if whole.penalise_K is None else int(whole.penalise_K.sum())
    assert 0 < int((~whole.keep_K).sum()) + penalised < K  # the selection acts on this batch
    assert sum((r["keep"] for r in ranks), []) == whole.keep_K.tolist()
    if whole.penalise_K is None:  # KL-Cov's only
        assert all(r["penalise"] is None for r in ranks)
    else:
        assert sum((r["penalise"] for r in ranks), []) == whole.penalise_K.tolist()

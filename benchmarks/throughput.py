"""Throughput of the RL trainer per phase, GRPO against GTPO and GRPO-S: N steps of one config, each algorithm in
its own torchrun launch with the same seed, and the cost of entropy shaping relative to GRPO's step time.

    .venv/bin/python benchmarks/throughput.py --config examples/cpu_demo.yaml --nproc 2 --steps 12 --skip 2 \\
        --repeats 3 --output benchmarks/results/throughput.md
    # GPU (H100): a random-weight Qwen2.5-0.5B-shaped model on the synthetic task (it almost never samples EOS, so
    # responses are max_new_tokens long), built-in generation, peak detected (989 TFLOPs bf16)
    python benchmarks/throughput.py --config examples/cpu_demo.yaml --nproc 1 --random-model qwen2.5-0.5b \\
        --work-dir /tmp/bench --set parallel.tensor=1 --set model.dtype=bfloat16 --set warm_start.steps=0 \\
        --set rollout.max_new_tokens=1024 --set data.micro_batch_size=8 --output benchmarks/results/throughput_h100.md

The trainer runs unchanged (python -m megatron_gtpo.train's main) inside an instrumented torchrun worker (this file
with --worker-record-dir) that only observes: it wraps the run's old-policy scoring to record the scored sequences'
lengths (the same sequences the update trains on) and times the fused vocab-parallel log-prob + entropy op inside
that pass (with CUDA synchronisation around it on GPUs); unless --no-logprob-reference, it also times megatron-core's
log-prob-only vocab_parallel_cross_entropy on the same logits, and takes that added time out of the phase again.
Each run writes its log (stdout and stderr, as they come) and its metrics.jsonl into --log-dir (default: the work
directory) as it goes, and saves no checkpoint (checkpoint.save_every=-1); the report gives each run's time to its
first RL step. Per-phase times come from the trainer's own metrics.jsonl (time_generate_s, time_step_batch_s,
time_old_logprob_s, time_advantages_s, time_update_s, time_sync_s). The first --skip steps of each run are warm-up
and not counted; the tables give medians over the remaining steps.

Derived figures:
- tokens/s/GPU: prompt + response tokens of the step's scored sequences / step time / GPUs; response tokens/s/GPU
  from the trainer's tokens_per_s.
- MFU of the update and of the old-log-prob pass: model FLOPs (megatron_gtpo.planning.forward_flops on the actual
  sequence lengths: forward for the log-prob pass, 3 x forward x epochs_per_step for the update; padding and
  recompute not counted) / (phase time x GPUs x peak). Peak: --peak-tflops, else detected from the CUDA device
  name (H100/H200 SXM 989, H100 PCIe 756, A100 312 bf16 dense TFLOPs), else not reported.
- Entropy-shaping overhead of GTPO / GRPO-S against GRPO's median step time: the difference of the advantage
  phases (shaping, including the data-parallel gather of entropies) plus the entropy part of the old-log-prob pass.
  The trainer computes the fused op for every algorithm (GRPO's logs report entropy too). Upper bound: all of the
  fused op's time (log-probs need the same logsumexp sweep). Marginal: fused op - log-prob-only op.
Dynamic sampling is switched off for all algorithms by default (--set algorithm.dynamic_sampling=false) so that
every step generates the same number of groups; pass --keep-dynamic-sampling to keep each algorithm's default.
--dry-run runs nothing: it prints each algorithm's trainer command, its config loaded and checked as the trainer
checks it before building anything (benchmarks/gpu_step.sh's DRY_RUN; tests/test_scripts.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
PHASES = ("generate", "step_batch", "old_logprob", "advantages", "update", "sync")


# ---------------------------------------------------------------------------------------------- worker side


def _worker(record_dir: str, logprob_reference: bool, train_argv: list[str]) -> int:
    """Run the trainer's main with the old-policy pass observed; write this rank's record."""
    import torch

    import megatron_gtpo.training.forward as forward
    from megatron_gtpo.train import main
    from megatron_gtpo.training.trainer import Trainer

    op = forward.vocab_parallel_logprobs_and_entropy
    state = {"scoring": False, "op_s": 0.0, "reference_s": 0.0, "added_s": 0.0, "run": None}
    steps = []

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed_op(logits, targets, **kwargs):
        if not state["scoring"]:
            return op(logits, targets, **kwargs)
        sync()
        start = time.perf_counter()
        out = op(logits, targets, **kwargs)
        sync()
        state["op_s"] += time.perf_counter() - start
        if logprob_reference:
            # megatron-core's log-prob-only op (it overwrites its input: a scaled copy, made off the clock) on the
            # same logits; everything this adds to the phase's wall time is recorded and taken out again.
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            added = time.perf_counter()
            scaled = logits.detach().float() / kwargs.get("temperature", 1.0)
            sync()
            start = time.perf_counter()
            vocab_parallel_cross_entropy(scaled, targets)
            sync()
            state["reference_s"] += time.perf_counter() - start
            del scaled
            state["added_s"] += time.perf_counter() - added
        return out

    old_policy_pass = Trainer.old_policy_pass

    def observed_score(trainer, batch, *args, **kwargs):
        state.update(scoring=True, op_s=0.0, reference_s=0.0, added_s=0.0, run=trainer)
        try:
            old_policy_pass(trainer, batch, *args, **kwargs)
        finally:
            state["scoring"] = False
        lengths = batch.sequence_lengths
        steps.append({"tokens": sum(lengths), "sum_squared_lengths": sum(n * n for n in lengths),
                      "sequences": len(lengths), "entropy_op_s": state["op_s"],
                      "reference_op_s": state["reference_s"], "added_s": state["added_s"]})

    forward.vocab_parallel_logprobs_and_entropy = timed_op  # the one place logits become log-probs
    Trainer.old_policy_pass = observed_score
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    status = main(train_argv)
    run = state["run"]
    if run is not None:
        g = run.parallel
        record = {"world_rank": g.world_rank, "world_size": g.world_size, "tp_rank": g.tp_rank, "pp_rank": g.pp_rank,
                  "dp_rank": g.dp_rank, "is_logging_rank": run.is_logging_rank, "tp_size": g.tp_size,
                  "hf_config": run.task.hf_config, "epochs_per_step": run.cfg.data.epochs_per_step, "steps": steps}
        if torch.cuda.is_available():
            record.update(max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                          max_memory_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                          plan_memory_gib=_planned_memory_gib(run.cfg, run.task.hf_config, g))
        with open(os.path.join(record_dir, f"rank_{g.world_rank:05d}.json"), "w", encoding="utf-8") as f:
            json.dump(record, f)
    return status


def _planned_memory_gib(cfg, hf_config: dict, parallel) -> dict:
    """The planner's memory parts (GiB) for this run's model, layout and workload on this GPU: what the measured peak
    is held against."""
    import torch

    from megatron_gtpo.layout import ParallelLayout
    from megatron_gtpo.models.accelerator import Accelerator
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import plan, settings_from_config, workload_from_config

    settings = settings_from_config(cfg, kernels=Accelerator.probe().layer_spec,
                                    gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    layout = ParallelLayout(tensor=parallel.tp_size, pipeline=parallel.pp_size, data=parallel.dp_size,
                            virtual_pipeline=parallel.vpp_size, sequence_parallel=cfg.parallel.sequence_parallel)
    return plan(ModelShape.from_hf(hf_config), layout, workload_from_config(cfg), settings).memory_gib


# ---------------------------------------------------------------------------------------------- driver side


def trainer_runs_parser(description: str, *, steps: int, repeats_help: str, algorithms: list[str],
                        algorithms_help: str | None = None) -> argparse.ArgumentParser:
    """The options of a benchmark that runs the trainer per algorithm under torchrun (this one, old_policy_bench.py):
    the config, ranks, steps and warm-up steps, repeats, algorithms and config overrides."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="trainer config (YAML)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--steps", type=int, default=steps, help="RL steps per run, warm-up included")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the statistics (per run)")
    p.add_argument("--repeats", type=int, default=1, help=repeats_help)
    p.add_argument("--algorithms", nargs="+", default=algorithms, help=algorithms_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="trainer config override for every run (repeatable)")
    return p


def parse_args(argv=None):
    p = trainer_runs_parser(__doc__.split("\n\n")[0], steps=10, algorithms=["grpo", "gtpo", "grpo_s"],
                            repeats_help="runs per algorithm, interleaved (A B C, B C A, ...) so that load drifts hit "
                                         "all alike; the statistics pool their steps",
                            algorithms_help="the first is the baseline of the overhead figures")
    p.add_argument("--keep-dynamic-sampling", action="store_true")
    p.add_argument("--no-logprob-reference", action="store_true",
                   help="do not time megatron-core's log-prob-only cross entropy on the old-policy pass's logits "
                        "(it needs an fp32 copy of one micro-batch's logits shard)")
    p.add_argument("--random-model", help="qwen2.5-<size>: train a random-weight model of that shape (created under "
                                          "--work-dir with transformers) on the config's task")
    p.add_argument("--peak-tflops", type=float, help="peak FLOPs per GPU in TFLOPs (default: detected on GPUs)")
    p.add_argument("--work-dir", help="run directories (default: a temporary directory, removed afterwards)")
    p.add_argument("--log-dir", help="each run's log and metrics.jsonl, written as the run goes (default: the work "
                                     "directory)")
    p.add_argument("--output", help="write the results as markdown here (also printed)")
    p.add_argument("--note", action="append", default=[], help="a line for the results file's notes (repeatable)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per algorithm run")
    p.add_argument("--dry-run", action="store_true",
                   help="run nothing: print each algorithm's trainer command with its config checked")
    return p.parse_args(argv)


def detect_peak_tflops() -> tuple[float | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, f"CPU ({platform.processor() or platform.machine()}), no GPU"
    name = torch.cuda.get_device_name(0)
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak, name
    return None, name


def random_model_dir(name: str, directory: str) -> str:
    return os.path.join(directory, f"{name}-random")


def random_model_settings(name: str, directory: str) -> list[str]:
    """The trainer settings of a run on the random model `name` (make_random_model) in `directory`."""
    return [f"model.hf_dir={random_model_dir(name, directory)}", "model.tiny_synthetic=false"]


def make_random_model(name: str, directory: str) -> str:
    """A Hugging Face directory with random weights of a published Qwen2.5 shape (bf16 safetensors), initialised on
    the GPU in bf16 where there is one (a 7B shape in fp32 on the host takes minutes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_gtpo.models.presets import hf_config

    path = random_model_dir(name, directory)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config = {k: v for k, v in hf_config(name).items() if k not in ("architectures", "model_type")}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2ForCausalLM(Qwen2Config(**config, architectures=["Qwen2ForCausalLM"]))
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def trainer_argv(args, algorithm: str, out_dir: str, extra: list[str]) -> list[str]:
    """The trainer's command line (python -m megatron_gtpo.train's) of one algorithm's run writing to `out_dir`;
    `extra`: the random model's settings."""
    sets = [f"algorithm.name={algorithm}", f"steps={args.steps}", f"logging.output_dir={out_dir}",
            "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=-1",
            "checkpoint.resume=false", *([] if args.keep_dynamic_sampling else ["algorithm.dynamic_sampling=false"]),
            *extra, *args.overrides]
    return ["--config", args.config, *sum((["--set", s] for s in sets), [])]


def check_trainer_config(train_argv: list[str], *, world_size: int, hf_config: dict | None = None):
    """The config of a trainer command line (`trainer_argv`'s form: --config FILE, then --set pairs), loaded and
    checked as the trainer checks it before it builds anything: the config's own rules, then the model's and the
    layout's at `world_size` ranks for the model `hf_config` (None: the config's tiny synthetic one; the task's
    prompts are not read), and the planner's inputs made of it. ConfigError / ValueError naming the problem; the
    config else."""
    from megatron_gtpo.config import load_config, validate_for_model, validate_layout
    from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import settings_from_config, workload_from_config

    if train_argv[:1] != ["--config"] or train_argv[2::2] != ["--set"] * (len(train_argv) // 2 - 1):
        raise ValueError(f"not a trainer command line of --config FILE and --set pairs: {train_argv}")
    cfg = load_config(train_argv[1], train_argv[3::2])
    if hf_config is None and not cfg.model.tiny_synthetic:
        raise ValueError("check_trainer_config: the config trains a model of its own: give its hf_config")
    shape = ModelShape.from_hf(hf_config or SYNTHETIC_TASKS[cfg.data.task].tiny_model_hf_config())
    validate_for_model(cfg, shape)
    validate_layout(cfg, world_size=world_size, shape=shape)
    settings_from_config(cfg, kernels="local")
    workload_from_config(cfg)
    return cfg


def dry_run(args) -> int:
    """--dry-run: each algorithm's trainer command line, its config checked (check_trainer_config) against the model
    the run would train; nothing is run or written."""
    from megatron_gtpo.models.presets import hf_config

    work_dir = args.work_dir or "<a temporary directory>"
    extra = random_model_settings(args.random_model, work_dir) if args.random_model else []
    for algorithm in args.algorithms:
        argv = trainer_argv(args, algorithm, os.path.join(args.log_dir or work_dir, f"{algorithm}-0"), extra)
        check_trainer_config(argv, world_size=args.nproc,
                             hf_config=hf_config(args.random_model) if args.random_model else None)
        print(f"{algorithm}: config ok: python -m megatron_gtpo.train {shlex.join(argv)}", flush=True)
    return 0


def run_algorithm(args, algorithm: str, work_dir: str, extra: list[str], repeat: int) -> dict:
    """One trainer run. Its output goes to `<log dir>/<algorithm>-<repeat>.log` as it is written, and its metrics to
    `<log dir>/<algorithm>-<repeat>/metrics.jsonl` (the trainer's own file, a line per step), so a run cut short by
    a time limit leaves both behind (log dir: --log-dir, else the work dir). Also returns the seconds from the
    launch to the first RL step's metrics line."""
    out_dir = os.path.join(args.log_dir or work_dir, f"{algorithm}-{repeat}")
    os.makedirs(out_dir, exist_ok=True)
    record_dir = os.path.join(work_dir, f"{algorithm}-{repeat}-records")
    os.makedirs(record_dir, exist_ok=True)
    train_argv = trainer_argv(args, algorithm, out_dir, extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), WORKER_FLAG, record_dir, "0" if args.no_logprob_reference else "1", *train_argv]
    env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if "PYTHONPATH" in os.environ
                                               else ""), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path, metrics_path = f"{out_dir}.log", os.path.join(out_dir, "metrics.jsonl")
    started, first_step_s = time.monotonic(), None
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while process.poll() is None:
                if first_step_s is None and _rl_steps_logged(metrics_path):
                    first_step_s = time.monotonic() - started
                if time.monotonic() - started > args.timeout:
                    raise RuntimeError(f"{algorithm}: the trainer ran past --timeout {args.timeout:g} s ({log_path})")
                time.sleep(0.25)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if process.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        first_error = max(text.find("Traceback"), 0)  # the failing rank's, before torchrun's summary
        raise RuntimeError(f"{algorithm}: the trainer failed ({process.returncode}; log {log_path}):\n"
                           f"{text[first_error:first_error + 6000]}")
    records = []
    for name in sorted(os.listdir(record_dir)):
        with open(os.path.join(record_dir, name), encoding="utf-8") as f:
            records.append(json.load(f))
    with open(metrics_path, encoding="utf-8") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    return {"records": records, "metrics": [m for m in metrics if m["step"] >= 0],
            "first_step_s": first_step_s if first_step_s is not None else time.monotonic() - started}


def _rl_steps_logged(metrics_path: str) -> bool:
    """Whether the trainer's metrics file holds an RL step's line yet (warm-up lines have negative steps)."""
    if not os.path.exists(metrics_path):
        return False
    with open(metrics_path, encoding="utf-8") as f:
        return any(line.endswith("\n") and json.loads(line)["step"] >= 0 for line in f)


def step_rows(run: dict, skip: int, peak_tflops: float | None) -> list[dict]:
    """Per measured step of one run: phase times, throughput, FLOPs and MFU."""
    from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size
    from megatron_gtpo.planning import forward_flops

    records, metrics = run["records"], run["metrics"]
    world = records[0]["world_size"]
    shape = ModelShape.from_hf(records[0]["hf_config"])
    vocab = padded_vocab_size(shape.vocab_size, records[0]["tp_size"])
    replicas = [r for r in records if r["tp_rank"] == 0 and r["pp_rank"] == 0]  # one per data-parallel rank
    logger = next(r for r in records if r["is_logging_rank"])  # the rank whose clock metrics.jsonl has
    rows = []
    for i, m in enumerate(metrics):
        if m["step"] < skip:
            continue
        tokens = sum(r["steps"][i]["tokens"] for r in replicas)
        squares = sum(r["steps"][i]["sum_squared_lengths"] for r in replicas)
        logprob_flops = forward_flops(shape, num_tokens=tokens, sum_squared_lengths=squares, padded_vocab=vocab)
        row = {f"{p}_s": m[f"time_{p}_s"] for p in PHASES}
        row["old_logprob_s"] -= logger["steps"][i]["added_s"]  # the reference timing is not the trainer's work
        step_s = sum(row[f"{p}_s"] for p in PHASES)
        row.update(step_s=step_s, entropy_op_s=max(r["steps"][i]["entropy_op_s"] for r in records),
                   reference_op_s=max(r["steps"][i]["reference_op_s"] for r in records),
                   tokens_per_s_per_gpu=tokens / step_s / world,
                   # the trainer's response tokens / its own (unadjusted) step time, rescaled to ours
                   response_tokens_per_s_per_gpu=m["tokens_per_s"] * sum(m[f"time_{p}_s"] for p in PHASES)
                   / step_s / world,
                   logprob_tflops=logprob_flops / 1e12,
                   update_tflops=3 * logprob_flops * records[0]["epochs_per_step"] / 1e12)
        if peak_tflops:
            row["mfu_update"] = row["update_tflops"] / (row["update_s"] * world * peak_tflops)
            # no old-policy pass (the update's forward gave its values): no MFU of one
            row["mfu_logprob"] = row["logprob_tflops"] / (row["old_logprob_s"] * world * peak_tflops) \
                if row["old_logprob_s"] > 0 else float("nan")
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians over the measured steps of one algorithm (all its runs pooled)."""
    if not rows:
        raise ValueError("no measured steps: run more --steps than --skip")
    return {"steps": len(rows), **{k: statistics.median(r[k] for r in rows) for k in rows[0]},
            "step_s_min": min(r["step_s"] for r in rows), "step_s_max": max(r["step_s"] for r in rows)}


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    try:
        load = open("/proc/loadavg", encoding="utf-8").read().split()[0]
    except OSError:
        load = "n/a"
    return (f"{cpu}, {os.cpu_count()} cores, GPU: {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}; 1-minute load average at the end: {load}")


def model_description(record: dict) -> str:
    from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size

    shape = ModelShape.from_hf(record["hf_config"])
    padded = padded_vocab_size(shape.vocab_size, record["tp_size"])
    return (f"hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_attention_heads} heads "
            f"({shape.num_query_groups} KV groups), FFN {shape.ffn_hidden_size}, vocabulary {shape.vocab_size} padded "
            f"to {padded} (megatron-core's log-prob-only op works on all {padded} ids, the fused op on the "
            f"{shape.vocab_size} real ones)")


def memory_lines(records_by_algorithm: dict) -> list[str]:
    """The measured CUDA peak (the worst rank) against the planner's peaks for the same shape, layout and workload
    (GPU runs only)."""
    rows = {name: records for name, records in records_by_algorithm.items()
            if records and all("max_memory_allocated_gib" in r for r in records)}
    if not rows:
        return []
    lines = ["", "## Peak GPU memory against the planner (GiB)", "",
             "| algorithm | max_memory_allocated (worst rank) | max_memory_reserved | plan: training peak | "
             "plan: generation peak | plan: training peak without framework overhead | measured / planned training "
             "peak |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, records in rows.items():
        worst = max(records, key=lambda r: r["max_memory_allocated_gib"])
        planned = worst["plan_memory_gib"]
        bare = planned["training_peak"] - planned["framework_overhead"]
        lines.append(f"| {name} | {worst['max_memory_allocated_gib']:.2f} | {worst['max_memory_reserved_gib']:.2f} | "
                     f"{planned['training_peak']:.2f} | {planned['generation_peak']:.2f} | {bare:.2f} | "
                     f"{worst['max_memory_allocated_gib'] / planned['training_peak']:.3f} |")
    lines += ["", "The measured peak spans the whole run (generation with the built-in engine included); "
                  "max_memory_allocated does not see the CUDA context and NCCL buffers that the plan's framework "
                  "overhead stands for."]
    return lines


def format_report(args, summaries: dict, peak: float | None, device: str, command: str, model: str,
                  records_by_algorithm: dict, first_step_s: dict, runs_left: int = 0) -> str:
    base_name = args.algorithms[0]
    base = summaries[base_name]
    fmt_ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    lines = ["# Trainer throughput: GRPO vs GTPO vs GRPO-S", "",
             "Command (from the repository root):", "", f"    {command}", "",
             f"Machine: {machine_description()}.", "",
             *([f"PARTIAL: {runs_left} run(s) still to come; this file is rewritten after each run.", ""]
               if runs_left else []),
             f"{args.repeats} run(s) per algorithm, interleaved, of {args.steps} steps each, the first {args.skip} of "
             f"each run left out; medians over the remaining {base['steps']} steps. {args.nproc} rank(s). "
             f"Config {args.config} with "
             f"{' '.join(args.overrides) or 'no overrides'}"
             f"{'' if args.keep_dynamic_sampling else ', dynamic sampling off for every algorithm'}"
             f"{f', random-weight {args.random_model} model' if args.random_model else ''}.", "",
             f"Model: {model}.", "",
             "Time to the first step (launch to its metrics line; model build, weight load, first generation and "
             "update): " + ", ".join(f"{a} {', '.join(f'{t:.1f}' for t in ts)} s" for a, ts in first_step_s.items()
                                     if ts) + ".", ""]
    lines += ["## Per-phase time (ms, median per step)", "",
              "| algorithm | step | generate | old log-prob | (in it: fused log-prob+entropy op) | (reference: "
              "log-prob-only op) | advantages | update | weight sync | step min-max |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        lines.append(f"| {name} | {fmt_ms(s['step_s'])} | {fmt_ms(s['generate_s'])} | {fmt_ms(s['old_logprob_s'])} | "
                     f"{fmt_ms(s['entropy_op_s'])} | {fmt_ms(s['reference_op_s'])} | {fmt_ms(s['advantages_s'])} | "
                     f"{fmt_ms(s['update_s'])} | {fmt_ms(s['sync_s'])} | "
                     f"{fmt_ms(s['step_s_min'])}-{fmt_ms(s['step_s_max'])} |")
    lines += ["", "## Throughput and model FLOPs utilisation", "",
              "Peak: " + (f"{peak:g} TFLOPs per GPU" if peak else "unknown (no --peak-tflops, no known GPU): MFU not "
                                                                  "reported") + f" ({device}).", "",
              "| algorithm | tokens/s/GPU | response tokens/s/GPU | log-prob pass TFLOP | update TFLOP | MFU update | "
              "MFU log-prob |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        mfu = (f"{100 * s['mfu_update']:.2f}% | {100 * s['mfu_logprob']:.2f}%" if "mfu_update" in s else "n/a | n/a")
        lines.append(f"| {name} | {s['tokens_per_s_per_gpu']:.0f} | {s['response_tokens_per_s_per_gpu']:.0f} | "
                     f"{s['logprob_tflops']:.4g} | {s['update_tflops']:.4g} | {mfu} |")
    lines += ["", f"## Entropy-shaping overhead against {base_name}'s step time ({fmt_ms(base['step_s'])} ms)", "",
              "| algorithm | shaping: advantages - baseline's (ms) | entropy, upper bound: the whole fused op (ms) | "
              "entropy, marginal: fused op - log-prob-only op (ms) | shaping + upper bound, % of baseline step | "
              "shaping + marginal, % of baseline step | step time / baseline's |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        if name == base_name:
            continue
        shaping = s["advantages_s"] - base["advantages_s"]
        marginal = s["entropy_op_s"] - s["reference_op_s"]
        upper, estimate = shaping + s["entropy_op_s"], shaping + max(marginal, 0.0)
        percent = lambda seconds: f"{100 * seconds / base['step_s']:.2f}%"  # noqa: E731
        measured = not args.no_logprob_reference
        lines.append(f"| {name} | {fmt_ms(shaping)} | {fmt_ms(s['entropy_op_s'])} | "
                     f"{fmt_ms(marginal) if measured else 'n/a'} | {percent(upper)} | "
                     f"{percent(estimate) if measured else 'n/a'} | {s['step_s'] / base['step_s']:.3f} |")
    lines += ["", "Shaping = the algorithm's advantage phase minus the baseline's (GTPO/GRPO-S also all-gather the "
                  "token entropies over data-parallel ranks there). Entropy: the old-policy pass computes log-probs "
                  "and entropies in one fused vocab-parallel op, which every algorithm runs (the trainer logs "
                  "entropy for GRPO too), so the entropy's cost is not a difference between the rows. Upper bound: "
                  "all of the fused op's time. Marginal: the fused op minus megatron-core's log-prob-only "
                  "vocab_parallel_cross_entropy timed on the same logits in the same pass (its time, and the copy it "
                  "needs, are taken out of the old-log-prob phase and the step); a negative marginal (the fused op "
                  "is faster than the log-prob-only one) counts as 0 in the percentage. The step-time ratio mixes in "
                  "generation, whose response lengths differ between algorithms after the first update; it is not "
                  "the overhead."]
    lines += memory_lines(records_by_algorithm)
    if args.note:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in args.note]
    return "\n".join(lines) + "\n"


WORKER_FLAG = "--worker-record-dir"  # torchrun runs this file as: throughput.py --worker-record-dir DIR 0|1 ARGV...


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER_FLAG]:
        return _worker(argv[1], argv[2] == "1", argv[3:])
    from megatron_gtpo.atomic_files import write_atomically

    args = parse_args(argv)
    if args.skip >= args.steps or args.repeats < 1:
        print(f"throughput: need --skip ({args.skip}) < --steps ({args.steps}) and --repeats >= 1", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args)
    peak, device = detect_peak_tflops()
    peak = args.peak_tflops or peak
    command = "python benchmarks/throughput.py " + " ".join(shlex.quote(a) for a in argv)
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = args.work_dir or tmp
        os.makedirs(work_dir, exist_ok=True)
        extra = []
        if args.random_model:
            make_random_model(args.random_model, work_dir)
            extra = random_model_settings(args.random_model, work_dir)
        rows = {algorithm: [] for algorithm in args.algorithms}
        records = {algorithm: [] for algorithm in args.algorithms}
        first_step_s = {algorithm: [] for algorithm in args.algorithms}
        runs_left = args.repeats * len(args.algorithms)
        for repeat in range(args.repeats):
            k = repeat % len(args.algorithms)
            for algorithm in args.algorithms[k:] + args.algorithms[:k]:
                print(f"run {repeat + 1}/{args.repeats}: {algorithm} ...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                run = run_algorithm(args, algorithm, work_dir, extra, repeat)
                print(f"run {repeat + 1}/{args.repeats}: {algorithm} took {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
                rows[algorithm] += step_rows(run, args.skip, peak)
                records[algorithm] += run["records"]
                first_step_s[algorithm].append(run["first_step_s"])
                runs_left -= 1
                # Rewritten after every run: a run cut short by a time limit (a GPU lease) keeps what finished.
                finished = [a for a in args.algorithms if rows[a]]
                if args.output and runs_left and finished[:1] == args.algorithms[:1]:
                    summaries = {a: summarize(rows[a]) for a in finished}
                    write_atomically(args.output, format_report(
                        args, summaries, peak, device, command, model_description(run["records"][0]), records,
                        first_step_s, runs_left=runs_left))
        summaries = {algorithm: summarize(rows[algorithm]) for algorithm in args.algorithms}
    report = format_report(args, summaries, peak, device, command, model_description(run["records"][0]), records,
                           first_step_s)
    print(report)
    if args.output:
        write_atomically(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

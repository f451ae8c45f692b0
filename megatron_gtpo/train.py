"""Entry point: python -m megatron_gtpo.train --config FILE.yaml [--set key=value ...] (alone, under
python -m megatron_gtpo.launch (torchrun's options), torchrun or srun).

Writes <logging.output_dir>/metrics.jsonl (one JSON object per step), TensorBoard logs, and checkpoints under
<checkpoint.dir> (default <output_dir>/checkpoints); resumes from the newest checkpoint automatically.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from megatron_gtpo.cli import ArgumentParser, run_cli, say_once
from megatron_gtpo.config import load_config


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m megatron_gtpo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config file (see examples/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=1e-6 (repeatable)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    from megatron_gtpo.distributed import destroy_parallel
    from megatron_gtpo.training.checkpointing import relaunch_check
    from megatron_gtpo.training.trainer import Trainer

    check_launch(cfg, argv if argv is not None else sys.argv[1:])
    check_installed(cfg)
    finished = relaunch_check(cfg)  # a relaunch that changes what the run trains fails here, before any build
    if finished is not None:
        say_once(finished)
        return 0
    try:
        trainer = Trainer(cfg)
        trainer.train()
        if trainer.is_logging_rank:
            print(run_summary(cfg), file=sys.stderr)
    finally:
        destroy_parallel()
    return 0


def check_launch(cfg, argv: list[str]) -> None:
    """ConfigError saying how to launch a layout of several processes started as one (no torchrun, no srun)."""
    from megatron_gtpo.config import ConfigError
    from megatron_gtpo.distributed import read_launch_env

    p = cfg.parallel
    needed = p.tensor * p.pipeline * p.context
    if needed > 1 and read_launch_env().launcher == "single":
        raise ConfigError(f"parallel: tensor x pipeline x context = {p.tensor} x {p.pipeline} x {p.context} needs "
                          f"{needed} processes (or a multiple), and this is one: launch it with python -m "
                          f"megatron_gtpo.launch --nproc_per_node {needed} -m megatron_gtpo.train {' '.join(argv)}")


def check_installed(cfg) -> None:
    """ConfigError naming the setting whose optional package this Python lacks, on every rank before anything is
    built (not a traceback after the model, or on one rank while the others wait in a collective)."""
    from megatron_gtpo.config import ConfigError
    from megatron_gtpo.engine_table import ENGINES
    from megatron_gtpo.rollout import vllm_missing

    package = ENGINES[cfg.rollout.engine].package
    missing = vllm_missing(f"rollout.engine: {cfg.rollout.engine}", "rollout.engine: builtin") if package == "vllm" \
        else None
    if missing:
        raise ConfigError(missing)
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb_project: {cfg.logging.wandb_project!r} logs to Weights & Biases, whose "
                          f"package is not installed in {sys.executable}: pip install wandb, or unset "
                          f"logging.wandb_project")


def run_summary(cfg) -> str:
    """How a finished (or stopped) run went, in one line (reporting.run_summary_line), then what it wrote and where,
    and how to plot it."""
    from megatron_gtpo.reporting import METRICS_FILE, read_rl_metrics, run_summary_line
    from megatron_gtpo.training.checkpointing import resume_candidates

    out = cfg.logging.output_dir
    metrics = os.path.join(out, METRICS_FILE)
    written = [f"metrics {metrics}"]
    if cfg.logging.tensorboard:
        written.append(f"TensorBoard logs {os.path.join(out, 'tensorboard')}")
    latest = resume_candidates(cfg.checkpoint_dir)
    if latest:
        written.append(f"checkpoints in {cfg.checkpoint_dir} (the newest: {latest[0]})")
    summary = f"run: {run_summary_line(read_rl_metrics(out))}\n" if os.path.isfile(metrics) else ""
    return f"{summary}wrote {', '.join(written)}; plot it: python -m megatron_gtpo.plot {out}"


if __name__ == "__main__":
    run_cli("megatron_gtpo.train", main)

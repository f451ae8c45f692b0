"""Entry point: python -m megatron_gtpo.train --config FILE.yaml [--set key=value ...] (under torchrun or srun).

Writes <logging.output_dir>/metrics.jsonl (one JSON object per step), TensorBoard logs, and checkpoints under
<checkpoint.dir> (default <output_dir>/checkpoints); resumes from the newest checkpoint automatically.
"""
from __future__ import annotations


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

    finished = relaunch_check(cfg)  # a relaunch that changes what the run trains fails here, before any build
    if finished is not None:
        say_once(finished)
        return 0

    try:
        Trainer(cfg).train()
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    run_cli("megatron_gtpo.train", main)

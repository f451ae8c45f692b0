"""torchrun, ending as the package's commands end: python -m megatron_gtpo.launch [torchrun's options] -m MODULE ARGS

    python -m megatron_gtpo.launch --nproc_per_node 2 -m megatron_gtpo.train --config examples/cpu_demo.yaml

The options are torchrun's (torch.distributed.run parses them; `--nnodes`, `--node_rank`, `--master_addr`, rendezvous,
`--log-dir`, ...) and the agent is torch's: only how a launch ends differs. When a rank fails, each rank of the
package has printed its one line (cli.py), and the launch ends with the exit status of the first rank that failed (2
for a user error, as the command alone) instead of torchrun's summary of the same line inside ~40 lines of its own and
status 1. A rank that ends without a line of its own (killed by a signal, a crash before it got going) gets one here:
which rank, its pid, its status or the signal that killed it (its output is above, or in --log-dir's files).
torchrun's notices (OMP_NUM_THREADS set to 1 for each rank, the agent's log of every rank's exit) stay off the
console; the agent's own failures (a rendezvous that times out, say) are raised as they are.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from megatron_gtpo.cli import run_cli

PROG = "megatron_gtpo.launch"


def main(argv=None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    for name in ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if not os.path.isfile(failure.error_file):  # a rank of ours writes its line there too (cli._report)
            print(f"{PROG}: rank {rank} (pid {failure.pid}) {_how_it_ended(failure.exitcode)}", file=sys.stderr)
        return _exit_status(failure.exitcode)
    except SignalException as stopped:  # the agent was signalled: it stopped the ranks, as torchrun does
        print(f"{PROG}: stopped by {stopped.sigval.name}", file=sys.stderr)
        return 128 + stopped.sigval.value
    return 0


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode} without a message"


def _exit_status(exitcode: int) -> int:
    """A shell's status for a rank's exit code: its own, or 128 + the signal that killed it."""
    return 128 - exitcode if exitcode < 0 else exitcode or 1


if __name__ == "__main__":
    run_cli(PROG, main)

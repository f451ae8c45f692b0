"""Every process a run starts ends with it, even when the run is killed with SIGKILL, which no exit handler sees: a
node failure or a job kill takes torchrun and its ranks, the OOM killer takes one rank.

The mechanism is the kernel's parent-death signal (Linux prctl PR_SET_PDEATHSIG): a process that asks for it gets
SIGKILL when the thread that started it ends, however that thread ends. Off Linux nothing is tied.

- `die_with_parent(parent_pid)`: called first thing in a child; it is killed when its parent ends, and exits at once
  if `parent_pid`, the process that started it, ended before the request (checked after it, so no death slips
  between the two). The kernel watches the starting THREAD: a parent must start such children from a thread that
  outlives them (its main thread, or one it joins only after the children ended).
- `end_with_the_run()`: a rank's start-up calls it (distributed.initialize_parallel), once or more. Afterwards
  - a rank launched by torchrun dies with torchrun's agent, its parent: torchrun gives every rank a session of its
    own, so a signal to torchrun's process group does not reach the ranks, which would otherwise train on. A rank
    whose agent died before this call is not caught here (it then waits on the agent's store until its timeout);
  - megatron-core's checkpoint writer keeps no process between saves: it gets its write results through a queue
    that it otherwise serves from a `multiprocessing.Manager` (a spawned server process with a whole interpreter,
    plus a resource tracker, both outliving a killed rank), and that queue becomes an in-process one. That is all a
    synchronous save needs (dist_checkpointing.save writes and reads the results in the calling process);
    megatron's asynchronous save, whose background process would put to it, fails after this ("results_queue
    should not be empty");
  - the writer processes that megatron forks for every save die with their rank.
The reward reward_pool's workers tie themselves with `die_with_parent` (rewards/pool.py). This module sits outside
distributed/, whose package imports torch, because those workers import it and must stay light.
"""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import queue
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent ends; exit now if `parent_pid` is no longer the parent."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request: this process was handed to a reaper
        os._exit(1)


def end_with_the_run() -> None:
    """Tie this rank to its torchrun agent and megatron-core's checkpoint writers to this rank (see the module)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent started this rank, from its main thread
        die_with_parent(os.getppid())
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    writer = filesystem_async.FileSystemWriterAsync
    if not getattr(writer.write_preloaded_data, "dies_with_its_rank", False):
        writer.write_preloaded_data = staticmethod(_dying_with_the_forking_process(writer.write_preloaded_data))


def _dying_with_the_forking_process(write):
    """megatron's writer-process entry point, tied first to the process that forked it (the rank, from the thread
    that waits for the writers)."""

    @functools.wraps(write)
    def write_and_die_with_parent(*args, **kwargs):
        die_with_parent(multiprocessing.parent_process().pid)
        return write(*args, **kwargs)

    write_and_die_with_parent.dies_with_its_rank = True
    return write_and_die_with_parent

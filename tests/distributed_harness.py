"""Run a function on N gloo ranks in fresh processes and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...,), timeout_s=300)

`fn(rank, world_size, *args, **kwargs)` must be a module-level function (it is pickled by reference into the
new processes, forked from a server that has imported torch and megatron.core once: `_context`). Before calling it,
each rank has the caller's environment of the call, MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set and,
unless `init_process_group=False`, a gloo default process group. The return values (picklable; tensors
are fine) come back as a list indexed by rank. A rank that raises makes the whole call raise with that rank's
traceback; a rank that hangs makes it raise TimeoutError after `timeout_s`, naming the ranks that never
reported. Every child is terminated before the call returns or raises, so a failing test cannot leak ranks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback


def share_of_cores() -> int:
    """The cores this test process may use: all of them, or its share under pytest-xdist's N workers (the ranks
    this harness starts have the caller's environment, PYTEST_XDIST_WORKER_COUNT included)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, kwargs, init_process_group, result_queue, environ):
    os.environ.clear()  # the caller's environment of now, not the fork server's of its start
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    # Oversubscribing a 2-core machine with 4 ranks x N threads makes gloo collectives crawl.
    torch.set_num_threads(max(1, share_of_cores() // world_size))
    try:
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle to bytes: torch's queue reducers would share tensors through file descriptors that die
        # with this process before the parent reads them.
        result_queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit, to the parent
        result_queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args=(), kwargs=None, *, timeout_s: float = 300.0,
                    init_process_group: bool = True, fresh_interpreter: bool = False) -> list:
    """(Module doc.) `fresh_interpreter`: ranks that import everything themselves (spawned), for a test whose ranks
    must set something up before megatron-core is imported (the TE stand-in)."""
    attempt = 1
    while True:
        try:
            return _run_once(fn, world_size, args, kwargs, timeout_s, init_process_group, free_port(),
                             fresh_interpreter)
        except (RuntimeError, TimeoutError) as error:
            # The port was free when chosen and taken by another process before rank 0 bound it (other tests or
            # jobs on the machine): a race of the harness, not of the code under test. Again on a new port.
            if "EADDRINUSE" not in str(error) or attempt == 3:
                raise
            attempt += 1


def run_cases(fn, world_size: int, cases: list, *, timeout_s: float = 300.0) -> dict:
    """`fn(rank, world_size, *case)` for each of `cases`, one after the other in one set of `world_size` ranks (a
    process start and the imports once per rank, not per case): {case: [each rank's result]}."""
    per_rank = run_distributed(_each_case, world_size, args=(fn, list(cases)), timeout_s=timeout_s)
    return {case: [results[i] for results in per_rank] for i, case in enumerate(cases)}


def results_by_world_size(fn, cases: list, *, world_size, args, timeout_s: float = 300.0):
    """case -> [each rank's `fn(rank, world_size, *args(case))`] for `cases`: every case of one world size
    (`world_size(case)`) runs in one set of ranks (run_cases) when the first of them is asked for."""
    results = {}

    def of(case):
        if case not in results:
            world = world_size(case)
            same_world = [c for c in cases if world_size(c) == world]
            per_case = run_cases(fn, world, [args(c) for c in same_world], timeout_s=timeout_s)
            results.update({c: per_case[args(c)] for c in same_world})
        return results[case]
    return of


def _each_case(rank, world_size, fn, cases):
    return [fn(rank, world_size, *case) for case in cases]


def _context():
    """Fresh processes forked from a server that has imported torch and megatron.core once (multiprocessing's
    forkserver), not spawned interpreters that each import them again (3 s a rank on 2 cores): a 4-rank test starts
    in about a second. The package first, as in every process of the project: it decides megatron-core's fusion
    decorator before megatron-core is imported (megatron_gtpo/_megatron_jit.py). The server is started by the first
    call; no import starts a thread, so none runs in it when it forks. What a test changes in its own process
    (monkeypatch) reaches no rank, as with spawn; its environment does (`_worker`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_gtpo", "torch", "megatron.core"])
    return ctx


def _run_once(fn, world_size: int, args, kwargs, timeout_s: float, init_process_group: bool, port: int,
              fresh_interpreter: bool) -> list:
    ctx = mp.get_context("spawn") if fresh_interpreter else _context()
    result_queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, kwargs or {},
                                          init_process_group, result_queue, dict(os.environ)), daemon=False)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items())
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s{detail}")
            try:
                rank, status, payload = result_queue.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in results and i not in errors]
                if dead:
                    # A rank that died without reporting (segfault, os._exit) would otherwise wait out the timeout.
                    time.sleep(1.0)  # give the queue feeder of a dying rank a moment
                    if result_queue.empty():
                        raise RuntimeError(f"ranks {dead} exited with codes "
                                           f"{[procs[i].exitcode for i in dead]} without reporting")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # The other ranks are probably blocked in a collective with the failed one: stop waiting soon.
                deadline = min(deadline, time.monotonic() + 10.0)
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:{detail}")
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(results) == world_size else 0.5)  # a rank that failed or hangs: at once
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()

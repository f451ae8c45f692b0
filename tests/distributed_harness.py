"""Run a function on N gloo ranks in fresh processes and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...,), timeout_s=300)

`fn(rank, world_size, *args, **kwargs)` must be a module-level function (it is pickled by reference into the
new processes, forked from a server that has imported torch and megatron.core once: `_context`). Before calling it,
each rank has the caller's environment of the call, MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set and,
unless `init_process_group=False`, a gloo default process group. The return values (picklable; tensors
are fine) come back as a list indexed by rank. A rank that raises makes the whole call raise with that rank's
traceback; a rank that hangs makes it raise TimeoutError after `timeout_s`, naming the ranks that never
reported. Every child is terminated before the call returns or raises, so a failing test cannot leak ranks.

`run_module(module, argv, nproc)` starts a command's ranks the same way, as torchrun would start `python -m module`
on each, and returns what subprocess.run would.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import subprocess
import time
import traceback


def share_of_cores() -> int:
    """The cores this test process may use: all of them, or its share under pytest-xdist's N workers (the ranks
    this harness starts have the caller's environment, PYTEST_XDIST_WORKER_COUNT included)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now, drawn below the kernel's ephemeral range. A port of that
    range (what binding port 0 gives) is also what the kernel hands out as the source port of outgoing connections,
    so in a busy suite (every gloo rank opens many) another process could take it before the test's server bound it
    (seen once: a launcher test's rendezvous failed with EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            ephemeral_low = int(f.read().split()[0])
    except OSError:
        ephemeral_low = 32768  # Linux's default
    draw = random.SystemRandom()  # not the global stream, which tests seed alike in every worker
    for _ in range(100):
        port = draw.randrange(10000, max(10001, ephemeral_low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found between 10000 and {ephemeral_low}")


def _rank_environment(environ: dict, rank: int, world_size: int, port: int, **extra: str) -> None:
    """This rank's environment: the caller's of now (not the fork server's of its start), torchrun's variables for
    the rank, and `extra`."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), **extra)


def _worker(rank, world_size, port, fn, args, kwargs, init_process_group, result_queue, environ):
    _rank_environment(environ, rank, world_size, port)
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
    """Fresh processes forked from a server that has imported torch, megatron.core and the package's commands once
    (multiprocessing's forkserver), not spawned interpreters that each import them again (4 CPU-s a rank on 2
    cores): a 4-rank test starts in about a second. The package first, as in every process of the project: it
    decides megatron-core's fusion decorator before megatron-core is imported (megatron_gtpo/_megatron_jit.py).
    torch._dynamo is what a trainer rank imports at run time (0.6 s). The server is started by the first call; no
    import starts a thread, so none runs in it when it forks. What a test changes in its own process (monkeypatch)
    reaches no rank, as with spawn; its environment does (`_worker`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_gtpo", "torch", "megatron.core", "torch._dynamo", "megatron_gtpo.train",
                                "megatron_gtpo.training.trainer", "megatron_gtpo.score"])
    return ctx


def run_module(module: str, argv: list[str], nproc: int, *, env: dict | None = None, timeout_s: float = 600.0,
               grace_s: float = 10.0) -> subprocess.CompletedProcess:
    """`python -m module *argv` on `nproc` ranks with the variables torchrun gives them (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), `env` (default: this process's) and this process's
    working directory (multiprocessing gives it to each child), each rank forked from the server of `_context`
    rather than started by torchrun's agent: a short training run costs about a third of the CPU time (no agent, no
    imports per rank). What it returns is what subprocess.run returns for the torchrun command: the stdout and stderr
    of rank 0, then rank 1, ..., and the exit status of the first rank that failed (0 if none did), as
    megatron_gtpo.launch ends. Once a rank has failed, the others get `grace_s` to end and are then stopped (torchrun
    stops them at once). subprocess.TimeoutExpired after `timeout_s`. The tests of what a launcher does (signals, a
    killed rank, torchrun's own output) start the real one."""
    env = dict(os.environ if env is None else env)
    for attempt in range(3):
        res = _run_module_once(module, argv, nproc, env, timeout_s, grace_s, free_port())
        # The port was free when chosen and taken by another process before rank 0 bound it (other tests or jobs on
        # the machine): a race of the harness, not of the code under test. Again on a new port.
        if res.returncode == 0 or "EADDRINUSE" not in res.stderr or attempt == 2:
            return res


def _run_module_once(module: str, argv: list[str], nproc: int, env: dict, timeout_s: float, grace_s: float,
                     port: int) -> subprocess.CompletedProcess:
    import tempfile

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="gtpo-ranks-") as out_dir:
        os.mkdir(os.path.join(out_dir, "tmp"))
        procs = [ctx.Process(target=_module_rank, args=(rank, nproc, port, module, argv, env, out_dir))
                 for rank in range(nproc)]
        for p in procs:
            p.start()
        failed, deadline, stop_at = None, time.monotonic() + timeout_s, None
        try:
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if failed is None:
                    failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
                    stop_at = None if failed is None else now + grace_s
                if stop_at is not None and now > stop_at:
                    break  # the others are stopped below
                if now > deadline:
                    raise subprocess.TimeoutExpired([module, *argv], timeout_s, *_outputs(out_dir, nproc))
                time.sleep(0.05)
            failed = failed or next((p for p in procs if p.exitcode != 0), None)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
        status = 0 if failed is None else 128 - failed.exitcode if failed.exitcode < 0 else failed.exitcode
        return subprocess.CompletedProcess([module, *argv], status, *_outputs(out_dir, nproc))


def _module_rank(rank, world_size, port, module, argv, environ, out_dir):
    """A rank of `run_module`: its stdout and stderr (the file descriptors, so that C libraries' output goes there
    too) to files of `out_dir`, then the module as `python -m` runs it (its SystemExit is the process's status)."""
    import runpy
    import sys

    for fd, stream in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(out_dir, f"{stream}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    _rank_environment(environ, rank, world_size, port, TMPDIR=os.path.join(out_dir, "tmp"))
    import tempfile

    # The ranks' temporary files (cli.say_once's claims, named by the launcher's pid: here the long-lived fork
    # server's) in one directory of the run's, removed with it.
    tempfile.tempdir = None
    import torch

    # What OMP_NUM_THREADS would have set at torch's import, which happened in the server.
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS") or max(1, share_of_cores() // world_size)))
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _outputs(out_dir: str, nproc: int) -> tuple[str, str]:
    """(stdout, stderr) of the ranks of `run_module`, rank by rank."""
    def read(stream):
        text = []
        for rank in range(nproc):
            path = os.path.join(out_dir, f"{stream}.{rank}")
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    text.append(f.read())
        return "".join(text)
    return read("stdout"), read("stderr")


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

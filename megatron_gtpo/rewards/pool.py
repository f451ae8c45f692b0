"""Score (response, reference) pairs with any reward function in worker processes, under a per-item time limit.

Why worker processes: a reward such as math verification can run for minutes on a pathological answer
(sympy evaluating `9^{9^{9^{9}}}`), and Python cannot interrupt a thread. math-verify's own timeout uses
SIGALRM, which works only in the main thread of a process, and not at all inside long C calls.

How the limit is enforced, in two layers:
1. soft: each worker arms a SIGALRM timer (setitimer, sub-second resolution) around every item; when it fires
   the item gets reward 0.0 and the worker carries on;
2. hard: the parent kills (SIGKILL) a worker whose current item has run `timeout_s + kill_grace_s`
   (the soft timer was blocked, e.g. inside one long C call); that item gets reward 0.0, the rest of its chunk goes
   back to the queue and a fresh worker starts.
So every item's reward is known within `timeout_s + kill_grace_s` of the moment its worker started it.

Workers are fresh interpreters started with subprocess (not multiprocessing's fork/spawn): fork is unsafe in a
process with threads (torch, NCCL), and spawn would re-import the trainer's `__main__` module (torch,
megatron) into every reward worker. A worker imports only the reward function's module. The reward function
is pickled by reference, so it must be a module-level function (or a picklable callable object).

Workers end with the process that started them, even one killed with SIGKILL: between items a worker exits when
its inbox pipe closes; one started from the parent's main thread is also killed with the parent mid-item (the
kernel's parent-death signal, process_lifetime.die_with_parent), where its own timer may never fire. The signal
follows the thread that started the worker, so a worker started from another thread has the pipe alone.

Exceptions raised by the reward function are NOT turned into 0.0: they point at a bug (the math verifier
catches parse failures itself), so `rewards` raises RuntimeError with the worker's traceback.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Protocol, Sequence

from megatron_gtpo.process_lifetime import die_with_parent
from megatron_gtpo.progress import progress_bar

logger = logging.getLogger(__name__)

_PACKAGE_PARENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# os._exit skips interpreter teardown (sympy's module graph makes it take most of a second).
_WORKER_BOOTSTRAP = (
    "import os, sys; from megatron_gtpo.rewards.pool import _worker_main; "
    "_worker_main(*map(int, sys.argv[1:4])); sys.stdout.flush(); sys.stderr.flush(); os._exit(0)"
)
_STATUS_OK, _STATUS_TIMEOUT, _STATUS_ERROR = "ok", "timeout", "error"


class RewardFn(Protocol):
    """A reward: the response text and the reference answer in, a float reward out."""

    def __call__(self, response: str, reference: str) -> float: ...


@dataclasses.dataclass
class RewardStats:
    """Cumulative counters of a RewardPool (every timed-out or killed item got reward 0.0)."""

    num_rewarded: int = 0
    num_soft_timeouts: int = 0  # the worker's own timer stopped the item
    num_killed: int = 0  # the parent killed the worker (hard deadline) or the worker died on the item


class _SoftTimeout(BaseException):
    """Raised by the worker's SIGALRM handler; a BaseException so `except Exception` in rewards cannot eat it."""


def _raise_soft_timeout(signum, frame):
    raise _SoftTimeout()


def _reward_one(reward_fn: RewardFn, response: str, reference: str, timeout_s: float) -> tuple[str, object]:
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            reward = float(reward_fn(response, reference))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
        return _STATUS_TIMEOUT, 0.0
    except Exception:
        return _STATUS_ERROR, traceback.format_exc()
    return _STATUS_OK, reward


def _worker_main(inbox_fd: int, outbox_fd: int, parent_pid: int) -> None:
    """Worker process: receive the set-up message, then reward chunks, sending one result per item. `parent_pid`: the
    process whose death kills this one (0: none)."""
    if parent_pid:
        die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    inbox = Connection(inbox_fd, writable=False)
    outbox = Connection(outbox_fd, readable=False)
    try:
        parent_sys_path, pickled_reward_fn, timeout_s = inbox.recv()
        sys.path[:] = parent_sys_path
        reward_fn = pickle.loads(pickled_reward_fn)
    except BaseException:
        outbox.send(("failed", traceback.format_exc()))
        return
    signal.signal(signal.SIGALRM, _raise_soft_timeout)
    outbox.send(("ready", None))
    while True:
        try:
            chunk = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if chunk is None:
            return
        for response, reference in chunk:
            outbox.send(_reward_one(reward_fn, response, reference, timeout_s))


class _Worker:
    """Parent-side handle of one worker process and the chunk it is working on."""

    def __init__(self, setup_message: bytes):
        inbox_read, inbox_write = os.pipe()
        outbox_read, outbox_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT_DIR, env.get("PYTHONPATH")]))
        # The parent-death signal fires when the starting thread ends: tie the worker to this process only from the
        # main thread, which ends with it.
        parent_pid = os.getpid() if threading.current_thread() is threading.main_thread() else 0
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOTSTRAP, str(inbox_read), str(outbox_write), str(parent_pid)],
                pass_fds=(inbox_read, outbox_write),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(inbox_read)
            os.close(outbox_write)
        self.to_worker = Connection(inbox_write, readable=False)
        self.from_worker = Connection(outbox_read, writable=False)
        self.to_worker.send_bytes(setup_message)
        self.started_at = time.monotonic()
        self.ready = False
        self.chunk: collections.deque[int] = collections.deque()  # item indices not yet answered, in order
        self.item_started_at = 0.0

    def assign(self, chunk: list[int], payload: list[tuple[str, str]]) -> None:
        self.chunk = collections.deque(chunk)
        self.to_worker.send(payload)
        self.item_started_at = time.monotonic()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.to_worker.close()
        self.from_worker.close()

    def request_stop(self) -> None:
        try:
            self.to_worker.send(None)
        except OSError:  # already dead: its pipe is closed
            pass


def _stop_workers(workers: list[_Worker], grace_s: float = 5.0) -> None:
    """Ask every worker to exit, give them `grace_s` in all, then kill what is left."""
    for worker in workers:
        worker.request_stop()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        worker.kill()
    workers.clear()


class RewardPool:
    """Scores (response, reference) pairs with `reward_fn` in `num_workers` processes; one item at most
    `timeout_s` (+ `kill_grace_s` if the worker must be killed), a timed-out item gets reward 0.0.

    Items are sent in chunks of `chunk_size` to cut pipe round trips; results come back one by one, so the
    time limit is per item. Workers start at construction (about a second each, importing the reward's
    module) and live until `close()` (or garbage collection / interpreter exit). `rewards` is thread-safe
    (calls are serialised). Use as a context manager to close deterministically.
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        *,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        chunk_size: int = 16,
        kill_grace_s: float = 0.5,
        startup_timeout_s: float = 120.0,
    ):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        for name, value in (("timeout_s", timeout_s), ("kill_grace_s", kill_grace_s),
                            ("startup_timeout_s", startup_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        try:
            pickled_reward_fn = pickle.dumps(reward_fn)
        except Exception as err:
            raise ValueError(
                f"reward_fn must be picklable (a module-level function), got {reward_fn!r}: {err}"
            ) from err
        self.timeout_s = float(timeout_s)
        self.kill_grace_s = float(kill_grace_s)
        self.chunk_size = chunk_size
        self.startup_timeout_s = float(startup_timeout_s)
        self.stats = RewardStats()
        self._setup_message = pickle.dumps((list(sys.path), pickled_reward_fn, self.timeout_s))
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._workers.extend(_Worker(self._setup_message) for _ in range(num_workers))
        try:
            self._wait_until_ready()
        except BaseException:
            self._finalizer()
            raise

    def _wait_until_ready(self) -> None:
        """Block until every worker has loaded the reward function; a worker that cannot is an error here."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(worker.ready for worker in self._workers):
            starting = [worker for worker in self._workers if not worker.ready]
            readable = wait([worker.from_worker for worker in starting], timeout=max(0.0, deadline - time.monotonic()))
            if not readable:
                raise RuntimeError(f"reward workers did not start within {self.startup_timeout_s} s")
            for worker in starting:
                if worker.from_worker in readable:
                    self._receive_startup_message(worker)

    @staticmethod
    def _receive_startup_message(worker: _Worker) -> None:
        try:
            kind, value = worker.from_worker.recv()
        except (EOFError, OSError):
            raise RuntimeError(
                f"a reward worker exited while starting (exit code {worker.process.wait()})"
            ) from None
        if kind != "ready":
            raise RuntimeError(f"a reward worker failed to start:\n{value}")
        worker.ready = True

    def close(self) -> None:
        """Stop the worker processes. The reward_pool cannot be used afterwards."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def rewards(self, responses: Sequence[str], references: Sequence[str], *, progress: bool = False) -> list[float]:
        """Rewards of the pairs (responses[i], references[i]), in order. `progress` shows a progress display
        (progress.py)."""
        if len(responses) != len(references):
            raise ValueError(
                f"responses and references must have the same length, got {len(responses)} and {len(references)}"
            )
        for name, texts in (("responses", responses), ("references", references)):
            bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
            if bad is not None:
                raise ValueError(f"{name}[{bad}] must be a str, got {type(texts[bad]).__name__}")
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("this RewardPool is closed")
            with progress_bar(total=len(responses), desc="rewards", disable=not progress) as bar:
                return self._rewards_locked(responses, references, bar)

    def _rewards_locked(self, responses, references, bar) -> list[float]:
        rewards: list[float | None] = [None] * len(responses)
        pending = collections.deque(
            list(range(start, min(start + self.chunk_size, len(responses))))
            for start in range(0, len(responses), self.chunk_size)
        )
        first_error: str | None = None
        try:
            while pending or any(worker.chunk for worker in self._workers):
                for worker in self._workers:
                    if worker.ready and not worker.chunk and pending:
                        chunk = pending.popleft()
                        worker.assign(chunk, [(responses[i], references[i]) for i in chunk])
                readable = wait([worker.from_worker for worker in self._workers], timeout=self._wait_timeout())
                for index, worker in enumerate(list(self._workers)):
                    if worker.from_worker in readable:
                        error = self._receive(index, worker, rewards, pending, bar)
                        if error is not None and first_error is None:
                            first_error = error
                            pending.clear()  # finish what is in flight, so no stale result outlives this call
                self._enforce_deadlines(rewards, pending, bar)
        except BaseException:
            # Interrupted mid-batch: results still in flight would be read by the next call; drop those workers.
            for index, worker in enumerate(self._workers):
                if worker.chunk:
                    worker.kill()
                    self._workers[index] = _Worker(self._setup_message)
            raise
        if first_error is not None:
            raise RuntimeError(f"the reward function raised in a worker process:\n{first_error}")
        return rewards  # every entry is a float here: the loop ends when no chunk is pending or in flight

    def _wait_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [self._item_deadline(worker) for worker in self._workers if worker.chunk]
        deadlines += [worker.started_at + self.startup_timeout_s for worker in self._workers if not worker.ready]
        return max(0.0, min(deadlines) - now) if deadlines else 1.0

    def _item_deadline(self, worker: _Worker) -> float:
        return worker.item_started_at + self.timeout_s + self.kill_grace_s

    def _receive(self, index, worker, rewards, pending, bar) -> str | None:
        """Handle one message from a worker; returns the traceback if the reward function raised."""
        if not worker.ready:  # a replacement worker reporting that it started
            self._receive_startup_message(worker)
            return None
        try:
            kind, value = worker.from_worker.recv()
        except (EOFError, OSError):
            self._replace_dead_worker(index, rewards, pending, bar, reason="died")
            return None
        item = worker.chunk.popleft()
        worker.item_started_at = time.monotonic()
        bar.update(1)
        self.stats.num_rewarded += 1
        if kind == _STATUS_ERROR:
            rewards[item] = 0.0
            return f"item {item}: {value}"
        if kind == _STATUS_TIMEOUT:
            self.stats.num_soft_timeouts += 1
            logger.debug("reward of item %d timed out after %.1f s; reward 0.0", item, self.timeout_s)
        rewards[item] = value
        return None

    def _enforce_deadlines(self, rewards, pending, bar) -> None:
        now = time.monotonic()
        for index, worker in enumerate(list(self._workers)):
            if worker.chunk and now >= self._item_deadline(worker):
                self._replace_dead_worker(index, rewards, pending, bar, reason="killed at the hard deadline")
            elif not worker.ready and now >= worker.started_at + self.startup_timeout_s:
                raise RuntimeError(f"a reward worker did not start within {self.startup_timeout_s} s")

    def _replace_dead_worker(self, index, rewards, pending, bar, *, reason: str) -> None:
        """Kill worker `index`, give its current item reward 0.0, requeue the rest of its chunk, start a new one."""
        worker = self._workers[index]
        worker.kill()
        if worker.chunk:
            item = worker.chunk.popleft()
            rewards[item] = 0.0
            bar.update(1)
            self.stats.num_rewarded += 1
            self.stats.num_killed += 1
            logger.warning("reward worker %s while rewarding item %d; reward 0.0", reason, item)
            if worker.chunk:
                pending.appendleft(list(worker.chunk))
        self._workers[index] = _Worker(self._setup_message)

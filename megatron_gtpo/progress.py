"""Progress of long work: tqdm's bar on a terminal, plain lines in a log file.

tqdm redraws its bar with carriage returns, which a log file (SLURM, CI, `> run.log`) keeps: one line of tens of
thousands of characters. Where its stream is not a terminal, `progress_bar` gives a `PlainProgress` instead: one
line at most every `interval_s` seconds (default PROGRESS_INTERVAL_S, or the environment's
MEGATRON_GTPO_PROGRESS_INTERVAL_S), each complete, and one when the work starts and one when it ends where it is
kept (`leave`, as tqdm's: the RL steps) or took long enough for a periodic line (a transient bar: a generation's):

    RL steps: 40/250 (16%), 2.1 s/it, 7m21s left; reward_mean=0.312, entropy_mean=1.98

It takes the part of tqdm's interface the package uses: iteration, `update`, `set_postfix`, `close`, `with`.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Iterable

from tqdm import tqdm

PROGRESS_INTERVAL_S = 30.0


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None, initial: int = 0,
                 unit: str = "it", leave: bool = True, disable: bool = False, file=None):
    """A tqdm bar on a terminal, a `PlainProgress` elsewhere (module doc); a silent tqdm when `disable`."""
    file = file or sys.stderr
    if disable or _is_terminal(file):
        return tqdm(iterable, desc=desc, total=total, initial=initial, unit=unit, leave=leave, disable=disable,
                    dynamic_ncols=True, file=file)
    interval_s = float(os.environ.get("MEGATRON_GTPO_PROGRESS_INTERVAL_S", PROGRESS_INTERVAL_S))
    return PlainProgress(iterable, desc=desc, total=total, initial=initial, unit=unit, leave=leave, file=file,
                         interval_s=interval_s)


def _is_terminal(file) -> bool:
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty())


class PlainProgress:
    """Progress as complete lines (module doc). `clock`: seconds, monotonic (tests pass their own)."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str, total: int | None = None, initial: int = 0,
                 unit: str = "it", leave: bool = True, file=None, interval_s: float = PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.iterable, self.desc, self.unit, self.file = iterable, desc, unit, file or sys.stderr
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.n = self._start_n = initial
        self.interval_s, self._clock = interval_s, clock
        self._start = self._last = clock()
        self._postfix = ""
        self._closed = False
        self._said = leave  # a kept bar's first line now; a transient one's once it has run interval_s
        if leave:
            self._say()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.total or 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._clock() - self._last >= self.interval_s:
            self._said = True
            self._say()

    def set_postfix(self, values: dict | None = None, **more) -> None:
        self._postfix = ", ".join(f"{k}={v}" for k, v in {**(values or {}), **more}.items())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._said:
                self._say(done=True)

    def _say(self, done: bool = False) -> None:
        self._last = now = self._clock()
        elapsed, count = now - self._start, self.n - self._start_n
        parts = [f"{self.n}/{self.total} ({100 * self.n // self.total}%)" if self.total else f"{self.n}"]
        if count and elapsed > 0:
            seconds_per = elapsed / count
            parts.append(f"{seconds_per:.3g} s/{self.unit}" if seconds_per >= 1 else f"{1 / seconds_per:.3g} "
                                                                                       f"{self.unit}/s")
            if self.total and not done:
                parts.append(f"{format_duration(seconds_per * (self.total - self.n))} left")
        if done:
            parts.append(f"done in {format_duration(elapsed)}")
        line = f"{self.desc}: {', '.join(parts)}" + (f"; {self._postfix}" if self._postfix else "")
        print(line, file=self.file, flush=True)


def format_duration(seconds: float) -> str:
    """4m05s, 1h02m, 37s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"

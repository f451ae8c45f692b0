"""A trainer's connection to a rollout server's TCPStore (remote_client.py) that reports the server's death in the
project's own words only.

torch's C++ store client logs every failed call to a store whose server died, or that it cannot reach, as a [c10d]
warning or error line followed by its C++ stack (15 to 25 lines, one or more per call, and one per retry while it
connects, a connection that succeeds at a later try included), and then raises `DistNetworkError`, which the client
reports in one line naming the server. Each call of a `ServerStore` runs with the process's stderr (file descriptor
2, where torch's C++ logging writes) going to a file, and what was written meanwhile is passed on after the call:
all of it, but where the call succeeded or raised `DistNetworkError` without torch's [c10d] lines and the stacks that
follow them (`without_c10d_reports`). Anything else (another thread's output, other warnings) is passed on
unchanged, and so is everything a call that failed otherwise printed. The calls are serialised process-wide:
descriptor 2 is the process's.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from datetime import timedelta

import torch.distributed as dist

# torch's C++ log line of a c10d failure (prefixed with the rank where torchrun set RANK), and its stack's lines
_C10D_REPORT = re.compile(r"(\[rank\d+\]:)?\[[WE]\d{4} [\d:.]+ \w+\.cpp:\d+\] \[c10d\] ")
_STACK_LINE = re.compile(r"(\[rank\d+\]:)?(Exception raised from |frame #\d+: |<omitting python frames>)")
_redirected = threading.Lock()  # one call at a time redirects the process's stderr
_capture = None  # _capture_file's, made at the first call


def without_c10d_reports(text: str) -> str:
    """`text` without torch's [c10d] log lines, each with the C++ stack and the blank line that follow it."""
    kept, in_report = [], False
    for line in text.splitlines(keepends=True):
        if _C10D_REPORT.match(line):
            in_report = True
        elif not (in_report and (_STACK_LINE.match(line) or not line.strip())):
            in_report = False
            kept.append(line)
    return "".join(kept)


def _capture_file():
    """The one file the calls' stderr goes to, emptied after each (a poll of the store is a call: no file per call)."""
    global _capture
    if _capture is None:
        _capture = tempfile.TemporaryFile()
    return _capture


def quietly(call):
    """`call()`, without torch's reports of failed connections in what it prints unless it fails otherwise than with
    `DistNetworkError` (module doc)."""
    with _redirected:
        capture = _capture_file()
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        failed_otherwise = False
        try:
            return call()
        except dist.DistNetworkError:
            raise
        except BaseException:
            failed_otherwise = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            printed = capture.read()
            capture.seek(0)
            capture.truncate()
            if not failed_otherwise:
                printed = without_c10d_reports(printed.decode(errors="replace")).encode()
            while printed:
                printed = printed[os.write(2, printed):]


class ServerStore:
    """A client of the TCPStore at HOST:PORT (waiting at most `timeout_s` for it to answer), whose calls print none
    of torch's own reports of a server that died or cannot be reached (module doc); `store` is the TCPStore itself
    (what a process group is built over)."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.store = quietly(lambda: dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s)))

    def set(self, key: str, value) -> None:
        quietly(lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        return quietly(lambda: self.store.get(key))

    def add(self, key: str, amount: int) -> int:
        return quietly(lambda: self.store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return quietly(lambda: self.store.check(keys))

    def delete_key(self, key: str) -> bool:
        return quietly(lambda: self.store.delete_key(key))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        quietly(lambda: self.store.wait(keys, timeout))

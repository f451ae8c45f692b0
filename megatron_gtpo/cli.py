"""How every command-line entry point (train, score, evaluate, tools/) runs and ends, alone or under torchrun / srun.

    if __name__ == "__main__":
        run_cli("python -m megatron_gtpo.score", main)

- A user error (a bad config key or value, a missing or unreadable file, a model that cannot be split at the asked
  layout, a damaged checkpoint: ValueError, OSError and KeyError, ConfigError included) ends the process with exit
  status 2 and one line `PROG: error: MESSAGE`, without a traceback. MEGATRON_GTPO_TRACEBACK=1 (when the message
  alone does not tell where the input went wrong) re-raises it instead: Python prints the traceback, on every rank
  that meets it (not once per node), and the process ends with status 1.
- Any other exception is unexpected: its traceback is printed, and the process ends with status 1.
- Ctrl-C (KeyboardInterrupt) ends it with one line `PROG: interrupted` and status 130 (the trainer takes a first
  Ctrl-C as "checkpoint after this step and exit": training/checkpointing.StopSignal).
- Argument errors (`ArgumentParser`, argparse's with errors raised as `UsageError`) are user errors: the usage line
  and the error, once, status 2.
- Under torchrun the line (or traceback) also goes to the rank's $TORCHELASTIC_ERROR_FILE, so that torchrun's
  failure summary ends with it.
- Under a launcher every rank usually meets the same error at the same line. Each distinct message (or traceback)
  is printed once per node, by the first local rank that meets it; a message of a rank's own (its own file, its own
  rank number) is still printed by that rank.

`check_conversion_paths` is what the converters (tools/convert_*) check before their slow imports (torch, megatron).

`say_once(text)` is that de-duplicated printing; `run_cli` routes Python warnings and log records (WARNING and up)
through it too, so that what every rank warns alike reaches the console once.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable

from megatron_gtpo.notices import ignore_optional_kernel_notices

USER_ERRORS = (ValueError, OSError, KeyError)


def _launch_key() -> str | None:
    """Identifies this launch among others on the node (None when not started by a launcher): the launcher's run id
    and rendezvous address, and the launcher process that all local ranks share."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" not in env:
        return None
    parts = (env.get("TORCHELASTIC_RUN_ID", ""), env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", ""),
             env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""), str(os.getppid()))
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


def say_once(text: str, file=None) -> bool:
    """Print `text` unless another rank of this launch on this node printed the same text first. Returns whether
    this process printed it. The claim is an exclusively created file under the temporary directory."""
    file = file or sys.stderr
    key = _launch_key()
    if key is not None:
        claim = os.path.join(_claims(key), hashlib.sha1(text.encode()).hexdigest())
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
    print(text, file=file, flush=True)
    return True


@functools.cache
def _claims(key: str) -> str:
    """The directory of launch `key`'s claims, named with the launcher's pid: made by the first rank to say
    something, and removed by a later launch's first one once that launcher is gone (the claims only matter while
    the launch runs)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        match = _CLAIMS.fullmatch(name)
        if match and not _alive(int(match[1])):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    directory = os.path.join(tmp, f"megatron_gtpo-said-{os.getppid()}-{key}")
    os.makedirs(directory, exist_ok=True)
    return directory


_CLAIMS = re.compile(r"megatron_gtpo-said-(\d+)-[0-9a-f]{16}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _message(error: BaseException) -> str:
    if isinstance(error, KeyError) and len(error.args) == 1:  # str(KeyError) is the repr of its key
        return f"missing key {error.args[0]!r}"
    if isinstance(error, OSError) and error.filename and str(error.filename) not in str(error):
        return f"{error}: {error.filename}"
    return str(error) or type(error).__name__


class _SaidOnce(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say_once(self.format(record))


def _show_warning_once(message, category, filename, lineno, file=None, line=None) -> None:
    say_once(warnings.formatwarning(message, category, filename, lineno, line).rstrip(), file=file)


def run_cli(prog: str, main: Callable[[], int | None]) -> None:
    """Run `main()` and exit with its status (None: 0), or as described above when it raises."""
    warnings.showwarning = _show_warning_once
    ignore_optional_kernel_notices()
    handler = _SaidOnce()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        status = main() or 0
    except USER_ERRORS as e:
        if os.environ.get("MEGATRON_GTPO_TRACEBACK", "") not in ("", "0"):
            raise
        _report((e.usage if isinstance(e, UsageError) else "") + f"{prog}: error: {_message(e)}")
        status = 2
    except KeyboardInterrupt:  # Ctrl-C (the trainer's second one): every rank stops, with one line and no traceback
        _report(f"{prog}: interrupted")
        status = 130
    except Exception:
        _report(traceback.format_exc().rstrip())
        status = 1
    sys.stdout.flush()
    sys.exit(status)


def _report(text: str) -> None:
    """Print how the process ends (once, say_once) and, under torchrun, leave it in this rank's error file: torchrun's
    failure summary then ends with it, the root cause, instead of a link to its docs."""
    say_once(text)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        from megatron_gtpo.atomic_files import write_atomically

        # torch's ErrorHandler format, whose py_callstack torchrun shows. It takes the failure of the earliest
        # timestamp as the root cause, in whole seconds, and stamps a rank it stopped (no error file) with the second
        # it noticed: one second back keeps this one first in a tie.
        stamp = str(int(time.time()) - 1)
        write_atomically(path, json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": text,
                                                                                       "timestamp": stamp}}}))


class UsageError(ValueError):
    """A command-line argument error (`ArgumentParser.error`), with the usage line to print before it."""

    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.usage = usage


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors end the process through run_cli (printed once however many ranks meet them,
    status 2) rather than by printing and exiting in every rank."""

    def error(self, message: str):
        raise UsageError(message, self.format_usage())


def check_conversion_paths(source_flag: str, source: str, output_dir: str, *, force: bool) -> None:
    """A converter's paths, checked in a second rather than after its imports: its input directory exists, its
    output does not unless `force` (--force); the output's parent folder is created."""
    if not os.path.isdir(source):
        problem = "is not a directory" if os.path.exists(source) else "does not exist"
        raise FileNotFoundError(f"{source_flag}: {source!r} {problem}")
    if os.path.exists(output_dir) and not force:
        raise FileExistsError(f"--output-dir: {output_dir!r} already exists; use --force to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)

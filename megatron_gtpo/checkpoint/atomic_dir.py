"""Output directories that appear under their final name only once complete.

Everything is written into `<directory>.tmp-<pid>-<random>` next to the target, which is renamed into place at the
end; an interrupted run leaves at most a `.tmp-` directory behind, never one that looks complete. An existing target
is replaced only with `force`: it is renamed aside, the new directory renamed in, and the old one then deleted.
"""
from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager


def begin_output_dir(directory: str, *, force: bool) -> str:
    """Check that `directory` may be written and create its temporary twin; returns the temporary path."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory {parent!r} of output {directory!r} does not exist")
    if os.path.lexists(directory) and not force:
        raise FileExistsError(f"output directory {directory!r} already exists; use force (--force) to replace it")
    tmp = f"{directory}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    return tmp


def commit_output_dir(tmp: str, directory: str, *, force: bool) -> None:
    """Rename the finished temporary directory to `directory` (replacing an existing one only with `force`)."""
    directory = os.path.abspath(directory)
    if not os.path.lexists(directory):
        os.rename(tmp, directory)
        return
    if not force:
        raise FileExistsError(f"output directory {directory!r} appeared while it was being written; the result is "
                              f"left in {tmp!r}")
    old = f"{directory}.old-{uuid.uuid4().hex[:8]}"
    os.rename(directory, old)
    os.rename(tmp, directory)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    else:
        os.remove(old)


@contextmanager
def atomic_output_dir(directory: str, *, force: bool, inputs: tuple[str, ...] = ()):
    """`with atomic_output_dir(out, force=f) as tmp:` write into tmp; it becomes `out` when the block succeeds and is
    deleted when it raises. `inputs` are directories the block reads, which the output must not replace."""
    target = os.path.realpath(directory)
    for path in inputs:
        if os.path.realpath(path) == target:
            raise ValueError(f"output directory {directory!r} is the input directory; choose another output")
    tmp = begin_output_dir(directory, force=force)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_output_dir(tmp, directory, force=force)

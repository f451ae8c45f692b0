"""Files written whole or not at all: `write_atomically` is the one place the project replaces a file.

The content goes to a temporary file in the target's directory (the same file system, so the rename is atomic),
is flushed to disk, and is renamed over the target, with the permissions the umask gives a new file: a reader, or a
run resumed after a crash, sees the old file or the new one, never a part. A failure removes the temporary file
and re-raises. Directories (checkpoints) are written the same way by checkpoint/atomic_dir.py.
"""
from __future__ import annotations

import os
import uuid
from typing import Callable


def write_atomically(path: str, content: str | bytes | Callable[[str], None]) -> None:
    """Replace `path` with `content`: text (UTF-8), bytes, or a function that writes the file at the temporary path
    it is given (for writers that take a path, such as matplotlib's savefig: pass the format explicitly, the
    temporary name has no extension of the target's)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    # Created as open() creates files, 0o666 less the umask (tempfile.mkstemp's would be 0o600 whatever the umask:
    # teammates on a shared cluster could not read the results).
    handle = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if callable(content):
            os.close(handle)
            content(tmp)
            handle = os.open(tmp, os.O_RDWR)
        with os.fdopen(handle, "r+b") as f:
            if not callable(content):
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
                f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise

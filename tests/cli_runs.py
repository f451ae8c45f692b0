"""What a failed command-line run must look like: a non-zero exit and one message, without a traceback of ours."""
from __future__ import annotations

import subprocess


def worker_frames(output: str) -> list[str]:
    """Traceback frames in the project's code (torchrun's own ChildFailedError report is torch's frames only)."""
    return [line for line in output.splitlines() if line.lstrip().startswith('File "') and "megatron_gtpo" in line]


def assert_one_clean_error(res: subprocess.CompletedProcess, message: str) -> None:
    output = res.stdout + res.stderr
    assert res.returncode != 0, output[-3000:]
    assert output.count(message) == 1, output[-3000:]
    assert not worker_frames(output), output[-3000:]

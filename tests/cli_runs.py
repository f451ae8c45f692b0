"""What a failed command-line run must look like: a non-zero exit and one message, without a traceback of ours."""
from __future__ import annotations

import os
import subprocess

import megatron_gtpo

PACKAGE_DIR = os.path.dirname(os.path.abspath(megatron_gtpo.__file__)) + os.sep


def worker_frames(output: str) -> list[str]:
    """Traceback frames in the package's files (torchrun's own ChildFailedError report is torch's frames only; a
    checkout named megatron_gtpo holds torch's files too, in its .venv, so the match is on the package's folder)."""
    return [line for line in output.splitlines() if line.lstrip().startswith(f'File "{PACKAGE_DIR}')]


ROOT_CAUSE = "Root Cause (first observed failure):"


def assert_one_clean_error(res: subprocess.CompletedProcess, message: str) -> None:
    """...printed once by the ranks; under torchrun, its failure summary ends with it too (the rank's error file)
    rather than with a link to torch's docs."""
    output = res.stdout + res.stderr
    assert res.returncode != 0, output[-3000:]
    assert sum(line.startswith(message) for line in output.splitlines()) == 1, output[-3000:]
    assert not worker_frames(output), output[-3000:]
    if "ChildFailedError" in output:
        assert f"traceback : {message}" in output.split(ROOT_CAUSE)[1], output[-3000:]

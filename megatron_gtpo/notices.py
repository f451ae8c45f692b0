"""Warnings of megatron-core that name no problem of a megatron_gtpo run, ignored where a run starts (cli.run_cli,
distributed/platform.activate_cpu_platform): the optional kernels megatron-core looks for at import. Transformer
Engine is optional, and whether a process uses it is models/accelerator.py's decision; NVIDIA apex is never a
dependency (README, "GPU installation"). Otherwise every rank prints four of them on import, before any error line.
Imports nothing heavy: the converters load it before their path checks."""
from __future__ import annotations

import warnings

OPTIONAL_KERNEL_NOTICES = (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*")


def ignore_optional_kernel_notices() -> None:
    for message in OPTIONAL_KERNEL_NOTICES:
        warnings.filterwarnings("ignore", message=message)

"""What every GPU test module starts with: the `gpu` marker, and a module-level skip (with the reason) without CUDA.

    from cuda_only import pytestmark, skip_without_cuda
    skip_without_cuda()
"""
import pytest
import torch

pytestmark = pytest.mark.gpu


def skip_without_cuda() -> None:
    """Skip on a machine without GPUs; fail on one whose GPUs torch cannot use (an old driver, a CPU build of torch),
    where a skip would pass for a GPU run."""
    from megatron_gtpo.distributed.platform import check_gpus_are_usable

    check_gpus_are_usable()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False); run on a GPU with `make test-gpu`",
                    allow_module_level=True)


def skip_without(module: str, why: str) -> None:
    """Skip the calling test (or module) when an optional GPU dependency does not import."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as err:
        pytest.skip(f"{module} does not import ({err}); {why}")

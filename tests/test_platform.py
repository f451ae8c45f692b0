"""The CPU platform layer: megatron-core's CUDA assumptions are mapped onto the CPU, only when CUDA is absent."""
import subprocess
import sys

import pytest
import torch

from distributed_harness import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform layer is for CUDA-less machines")


def _platform_checks(rank, world_size):
    from megatron_gtpo.distributed import activate_cpu_platform

    assert activate_cpu_platform() is True
    assert activate_cpu_platform() is True  # idempotent
    out = {}
    # Tensors asked for on CUDA live in host memory and report the logical device (the device audit's).
    made = [torch.empty(3, device="cuda"), torch.zeros(2, device=torch.cuda.current_device()),
            torch.ones(2, device=torch.device("cuda", 0))]
    out["made_devices"] = {str(t.device) for t in made}
    out["made_storage"] = {t.untyped_storage().device.type for t in made}
    t = torch.randn(4)
    moved = t.cuda()
    out["cuda_copies"] = moved is not t and torch.equal(moved.cpu(), t) and moved.is_cuda and not t.is_cuda
    out["to_cuda"] = str(t.to("cuda").device), t.to("cuda").untyped_storage().device.type
    out["type_name"] = t.type()
    out["type_cast"] = t.type(torch.float64).dtype == torch.float64  # the conversion form is left alone
    out["cuda_available"] = torch.cuda.is_available()

    # megatron's model-parallel RNG tracker forks and restores the (CPU) generator like the CUDA one
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        forked_a = torch.rand(3)
    out["default_state_restored"] = torch.equal(before, torch.get_rng_state())
    model_parallel_cuda_manual_seed(123)
    with get_cuda_rng_tracker().fork():
        forked_b = torch.rand(3)
    out["fork_reproducible"] = torch.equal(forked_a, forked_b)
    out["fork_differs_from_default"] = not torch.equal(forked_a, torch.rand(3))
    return out


def test_cuda_requests_land_on_cpu_and_rng_tracker_works():
    out = run_distributed(_platform_checks, 1, timeout_s=120)[0]
    assert out["made_devices"] == {"cuda:0"} and out["made_storage"] == {"cpu"}
    assert out["to_cuda"] == ("cuda:0", "cpu")
    assert out["cuda_copies"] and out["type_cast"]
    assert out["type_name"] == "torch.cuda.FloatTensor"
    assert out["cuda_available"] is False
    assert out["default_state_restored"] and out["fork_reproducible"] and out["fork_differs_from_default"]


def test_inactive_when_cuda_is_present():
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from megatron_gtpo.distributed import platform\n"
            "assert platform.activate_cpu_platform() is False\n"
            "assert not platform.is_cpu_platform_active()\n"
            "assert torch.empty(1).device.type == 'cpu'\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_bare_package_import_is_light():
    code = ("import sys, megatron_gtpo, megatron_gtpo.algorithms\n"
            "print(' '.join(m for m in ('megatron', 'vllm', 'transformer_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""

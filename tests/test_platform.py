"""The CPU platform layer: megatron-core's CUDA assumptions are mapped onto the CPU, only when CUDA is absent."""
import os
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


@pytest.mark.slow
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
    assert _python(code) == ["ok"]


def _python(code: str) -> list[str]:
    """The lines `code` prints in a fresh interpreter (which must exit 0)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_bare_package_import_is_light():
    code = ("import sys, megatron_gtpo\n"
            "print(' '.join(m for m in ('torch', 'megatron', 'vllm', 'transformer_engine') if m in sys.modules))\n"
            "import megatron_gtpo.algorithms\n"
            "print(' '.join(m for m in ('megatron', 'vllm', 'transformer_engine') if m in sys.modules))")
    assert _python(code) == ["", ""]


def test_without_triton_megatron_decorates_its_fusions_without_importing_the_compiler():
    """This machine has no triton (the CPU build of torch): megatron-core, imported after the package, gets the
    identity as its fusion decorator, so neither dynamo nor inductor is imported, and its fusions are the plain
    functions."""
    code = ("import sys, inspect, megatron_gtpo\n"
            "from megatron.core.fusions import fused_bias_swiglu\n"
            "print(inspect.isfunction(fused_bias_swiglu.swiglu), fused_bias_swiglu.swiglu.__code__.co_name,\n"
            "      [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules])")
    assert _python(code) == ["True swiglu []"]


def test_with_triton_or_megatron_imported_its_fusion_decorator_stays_torch_compile(monkeypatch):
    from megatron_gtpo import _megatron_jit

    real_find_spec = _megatron_jit.importlib.util.find_spec
    monkeypatch.setattr(_megatron_jit.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    jit = sys.modules.get("megatron.core.jit")
    assert _megatron_jit.skip_megatron_jit_without_triton() is False
    assert sys.modules.get("megatron.core.jit") is jit
    monkeypatch.undo()
    import megatron.core  # noqa: F401

    assert _megatron_jit.skip_megatron_jit_without_triton() is False


def _fake_dev(directory, *names):
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).touch()
    return str(directory)


def test_gpus_are_found_by_their_device_nodes(tmp_path):
    from megatron_gtpo.distributed.platform import visible_nvidia_gpus

    dev = _fake_dev(tmp_path / "dev", "nvidia10", "nvidia2", "nvidiactl", "nvidia-uvm", "null")
    assert visible_nvidia_gpus(dev) == ["nvidia2", "nvidia10"]
    assert visible_nvidia_gpus(str(tmp_path / "absent")) == []


def test_gpus_that_torch_cannot_use_are_refused_unless_hidden_or_allowed(tmp_path):
    from megatron_gtpo.distributed.platform import GpuWithoutCuda, check_gpus_are_usable

    dev = _fake_dev(tmp_path / "dev", "nvidia0", "nvidia1", "nvidiactl")
    with pytest.raises(GpuWithoutCuda, match=r"2 NVIDIA GPU\(s\) \(nvidia0, nvidia1\) but torch .* cannot use them: "
                                             r"it is a CPU-only build\. .* MEGATRON_GTPO_ALLOW_CPU=1"):
        check_gpus_are_usable(dev, environ={})
    check_gpus_are_usable(dev, environ={"MEGATRON_GTPO_ALLOW_CPU": "1"})
    check_gpus_are_usable(dev, environ={"CUDA_VISIBLE_DEVICES": ""})
    check_gpus_are_usable(_fake_dev(tmp_path / "driver-only", "nvidiactl"), environ={})  # no GPU node: no GPU


def test_the_cpu_platform_does_not_start_on_gpus_torch_cannot_use(tmp_path):
    """What a run on an old driver meets: the trainer's first distributed call refuses, naming the cause."""
    dev = _fake_dev(tmp_path / "dev", "nvidia0")
    code = ("from megatron_gtpo.distributed import platform\n"
            "try:\n"
            f"    platform.activate_cpu_platform(dev={dev!r})\n"
            "except platform.GpuWithoutCuda as e:\n"
            "    print('refused' if not platform.is_cpu_platform_active() else 'active')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_GTPO_ALLOW_CPU", "CUDA_VISIBLE_DEVICES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "refused", out.stderr

"""The GPU trainer tests' runs (tests/gpu_trainer_runs.py, which tests/gpu/test_gpu_trainer.py runs on CUDA) on the
CPU: each run's config loaded and checked as benchmarks/gpu_step.sh's dry run checks the throughput part's
(throughput.check_trainer_config: the config's rules, the model's, the layout's at one rank, the planner's inputs),
the planner's memory the peak-memory test compares with, and the peak-memory run itself for its one step. A key
renamed or a rule added since the last GPU run fails here."""
import importlib.util
from pathlib import Path

import pytest

from gpu_trainer_runs import PEAK_MEMORY_RUN, RESUME_RUNS, peak_memory_plan, resume_run, vllm_model, vllm_run
from tiny_models import tiny_config
from trainer_runs import DEMO_CONFIG, read_metrics, run_train

REPO = Path(__file__).resolve().parents[1]


def _throughput():
    spec = importlib.util.spec_from_file_location("throughput", REPO / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _argv(overrides: list[str]) -> list[str]:
    return ["--config", DEMO_CONFIG, *sum((["--set", s] for s in overrides), [])]


RUNS = {"peak_memory": (PEAK_MEMORY_RUN, None),
        **{f"resume_{out}_{steps}": (resume_run(steps), None) for out, steps in RESUME_RUNS},
        "colocated_vllm": (vllm_run("/nonexistent/hf"), "vllm")}


@pytest.mark.parametrize("name", RUNS)
def test_each_gpu_trainer_run_passes_the_trainers_checks(name):
    from megatron_gtpo.config import ConfigError
    from megatron_gtpo.train import check_installed, check_launch

    overrides, model = RUNS[name]
    hf = None if model is None else tiny_config(**{k: v for k, v in vllm_model().items() if k != "dtype"}).to_dict()
    cfg = _throughput().check_trainer_config(_argv(overrides), world_size=1, hf_config=hf)
    check_launch(cfg, [])
    assert cfg.model.dtype == "bfloat16" and cfg.parallel.tensor == 1
    if model == "vllm":
        assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.gpu_memory_utilization == 0.3
        if importlib.util.find_spec("vllm") is None:  # the GPU test skips then; the check names the package
            with pytest.raises(ConfigError, match="vllm"):
                check_installed(cfg)
            return
    check_installed(cfg)


@pytest.mark.parametrize("transformer_engine", [False, True])
def test_the_peak_memory_plan_is_made_of_the_runs_config(transformer_engine):
    """The plan the GPU test compares with, of the layer spec the trainer takes on a GPU without and with TE."""
    from megatron_gtpo.config import load_config
    from megatron_gtpo.models.accelerator import Accelerator

    cfg = load_config(DEMO_CONFIG, PEAK_MEMORY_RUN)
    kernels = Accelerator(cuda=True, transformer_engine=transformer_engine, triton=True).layer_spec
    memory_gib = peak_memory_plan(cfg, kernels=kernels, gpu_memory_gib=141.0).memory_gib
    assert memory_gib["training_peak"] > memory_gib["framework_overhead"] > 0
    assert memory_gib["activations"] > 0 and memory_gib["gpu"] == 141.0


def test_the_peak_memory_run_trains_one_step_on_the_cpu(tmp_path):
    """The GPU test's run as it is (bf16, one rank), on this CPU: one RL step logged."""
    res = run_train(tmp_path, 1, PEAK_MEMORY_RUN)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path) if r["step"] >= 0] == [0]

"""The smaller things a new user meets (in process): "did you mean" for a misspelled config key, how to launch a
layout of several processes started as one, the summary a training run ends with, megatron-core's notices about
kernels the package does not use kept off the console."""
from __future__ import annotations

import os
import re
import warnings

import pytest

from megatron_gtpo.cli import run_cli
from megatron_gtpo.config import ConfigError, load_config
from megatron_gtpo.train import check_launch, run_summary

DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "cpu_demo.yaml")


@pytest.mark.parametrize("sets,message", [
    (["algorithm.gtpo.alpah2=0.2"], "unknown config key algorithm.gtpo.alpah2 (did you mean algorithm.gtpo.alpha2?); "
                                    "valid keys here: alpha1, alpha2,"),
    (["optim.lr_decay=cosine", "optim.warmup=3"], "unknown config keys optim.lr_decay (did you mean "
                                                  "optim.lr_decay_style?), optim.warmup (did you mean "
                                                  "optim.warmup_steps?); valid keys here: adam_beta1,"),
    (["optim.learning_rate=1"], "unknown config key optim.learning_rate; valid keys here: adam_beta1,"),
    (["rollut.engine=vllm"], "unknown config key rollut (did you mean rollout?); valid keys here: algorithm,"),
])
def test_a_misspelled_key_gets_the_closest_one(sets, message):
    with pytest.raises(ConfigError) as error:
        load_config(DEMO_CONFIG, sets)
    assert str(error.value).startswith(message)


def test_a_layout_of_two_processes_started_as_one_says_how_to_launch_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(DEMO_CONFIG)  # TP = 2
    with pytest.raises(ConfigError, match="^parallel: tensor x pipeline x context = 2 x 1 x 1 needs 2 processes "
                                          r"\(or a multiple\), and this is one: launch it with python -m "
                                          "megatron_gtpo.launch --nproc_per_node 2 -m megatron_gtpo.train --config "
                                          "demo.yaml --set a=1$"):
        check_launch(cfg, ["--config", "demo.yaml", "--set", "a=1"])
    check_launch(load_config(DEMO_CONFIG, ["parallel.tensor=1"]), [])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(cfg, [])  # under torchrun: the layout's own checks follow


def test_a_run_ends_saying_what_it_wrote_and_where(tmp_path):
    cfg = load_config(DEMO_CONFIG, [f"logging.output_dir={tmp_path}"])
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000250\n")
    assert run_summary(cfg) == (f"wrote metrics {tmp_path}/metrics.jsonl, TensorBoard logs {tmp_path}/tensorboard, "
                                f"checkpoints in {tmp_path}/checkpoints (the newest: "
                                f"{tmp_path}/checkpoints/step_00000250)")
    cfg = load_config(DEMO_CONFIG, [f"logging.output_dir={tmp_path}/other", "logging.tensorboard=false"])
    assert run_summary(cfg) == f"wrote metrics {tmp_path}/other/metrics.jsonl"


def test_notices_of_kernels_the_package_does_not_use_stay_off_the_console(capsys):
    """megatron-core warns on import that Transformer Engine and Apex are not installed (four per rank on an error
    path that imports it before the CPU platform starts)."""
    def main():
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("something else")

    with warnings.catch_warnings(), pytest.raises(SystemExit):
        warnings.simplefilter("always")
        run_cli("prog", main)
    err = capsys.readouterr().err
    assert "not installed" not in err and "UserWarning: something else" in err


def test_the_warm_start_has_a_progress_bar_on_the_logging_rank(tmp_path, capsys):
    from megatron_gtpo.training.metrics import MetricsLogger

    def logger(enabled, progress_bar):
        return MetricsLogger(str(tmp_path), enabled=enabled, start_step=0, total_steps=5, tensorboard=False,
                             wandb_project=None, progress_bar=progress_bar, run_config={})

    capsys.readouterr()
    assert list(logger(True, True).progress(range(3), "warm start steps")) == [0, 1, 2]
    assert "warm start steps:   0%|          | 0/3" in capsys.readouterr().err
    for enabled, progress_bar in ((False, True), (True, False)):
        assert logger(enabled, progress_bar).progress(range(3), "warm start steps") == range(3)


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  tiny_synthetic: true\ndata:\n  source: synthetic\n  task: [addition\nsteps: 3\n")
    message = f"{bad}:6:6: expected ',' or ']', but got ':' (while parsing a flow sequence that starts at 5:9)"
    with pytest.raises(ConfigError) as error:
        load_config(str(bad))
    assert str(error.value) == message
    with pytest.raises(ConfigError) as error:
        load_config(None, ["rollout.engine=[builtin,"])
    assert str(error.value).startswith("--set 'rollout.engine=[builtin,': the value is not YAML: expected the node "
                                       "content")
    from megatron_gtpo.train import main

    with pytest.raises(SystemExit) as exit_status:
        run_cli("megatron_gtpo.train", lambda: main(["--config", str(bad)]))
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == f"megatron_gtpo.train: error: {message}\n"


def test_score_names_the_flag_a_checkpoint_or_a_hf_directory_needs(tmp_path):
    import argparse

    from megatron_gtpo.checkpoint.megatron_checkpoint import METADATA_FILE
    from megatron_gtpo.score import _model_source

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / METADATA_FILE).write_text("{}")
    with pytest.raises(ValueError) as error:
        _model_source(argparse.Namespace(hf=str(tmp_path / "ckpt"), load=None))
    assert str(error.value) == (f"--hf: '{tmp_path / 'ckpt'}' is a megatron_gtpo checkpoint: pass it with --load "
                                f"instead (--load {tmp_path / 'ckpt'})")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="^--load: .* is a Hugging Face directory: pass it with --hf instead"):
        _model_source(argparse.Namespace(hf=None, load=str(tmp_path / "hf")))


def test_a_package_a_setting_needs_is_named_before_anything_is_built(monkeypatch):
    """logging.wandb_project without wandb, rollout.engine: vllm without vLLM: one line naming the setting, on every
    rank before any process group or model (not a traceback after the model is built, or on the logging rank while
    the others wait in a collective); the import of an installed but broken vLLM, where it happens, says the same."""
    import importlib.util
    import sys

    from megatron_gtpo.rollout import import_vllm_engine
    from megatron_gtpo.train import check_installed

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "vllm") else real_find_spec(name, *a))
    check_installed(load_config(DEMO_CONFIG))
    with pytest.raises(ConfigError) as error:
        check_installed(load_config(DEMO_CONFIG, ["logging.wandb_project=demo"]))
    assert str(error.value) == (f"logging.wandb_project: 'demo' logs to Weights & Biases, whose package is not "
                                f"installed in {sys.executable}: pip install wandb, or unset logging.wandb_project")
    vllm = load_config(os.path.join(os.path.dirname(DEMO_CONFIG), "qwen2.5-0.5b-gtpo.yaml"))
    with pytest.raises(ConfigError) as error:
        check_installed(vllm)
    assert str(error.value) == (f"rollout.engine: vllm needs vLLM, which is not installed in {sys.executable}: "
                                f"install it with pip install -e '.[vllm]' (make setup-gpu installs the whole GPU "
                                f"set) or use rollout.engine: builtin")
    monkeypatch.setitem(sys.modules, "vllm", None)  # installed, but its import fails
    monkeypatch.delitem(sys.modules, "megatron_gtpo.rollout.vllm_engine", raising=False)
    with pytest.raises(ValueError, match=r"^--engine vllm needs vLLM, which does not import \(.*\) in .*: install it "
                                         r"with pip install -e '.\[vllm\]' .* or use --engine builtin$"):
        import_vllm_engine("--engine vllm", "--engine builtin")


@pytest.mark.slow
def test_the_launcher_ends_a_failed_launch_with_the_ranks_one_line_and_status(tmp_path):
    """python -m megatron_gtpo.launch is torchrun ending as the package's commands end: a user error of the ranks is
    their one line and status 2 (torchrun: the line inside ~40 of its own, status 1); a rank killed by a signal is
    one line of the launcher and the shell's status 128 + signal; a launch that succeeds says nothing of its own."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text("import os, signal, sys\nfrom megatron_gtpo.cli import run_cli\n\n"
                      "def main():\n    if sys.argv[1] == 'kill' and os.environ['RANK'] == '1':\n"
                      "        os.kill(os.getpid(), signal.SIGKILL)\n"
                      "    if sys.argv[1] == 'error':\n        raise ValueError('optim.lr: must be > 0, got -1.0')\n\n"
                      "run_cli('rank.py', main)\n")

    def launch(mode):
        return subprocess.run([sys.executable, "-m", "megatron_gtpo.launch", "--nproc_per_node", "2", str(script),
                               mode], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))

    res = launch("error")
    assert (res.returncode, res.stdout, res.stderr) == (2, "", "rank.py: error: optim.lr: must be > 0, got -1.0\n")
    res = launch("kill")
    assert res.returncode == 128 + 9, res.stderr
    assert re.fullmatch(r"megatron_gtpo.launch: rank 1 \(pid \d+\) was killed by SIGKILL\n", res.stderr), res.stderr
    res = launch("ok")
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")

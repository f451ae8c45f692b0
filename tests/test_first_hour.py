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


def test_a_run_ends_with_how_it_went_what_it_wrote_and_where(tmp_path):
    """The last lines of a run: its RL steps, their time and how reward, accuracy, entropy and length moved (the
    means of the first and last 10 steps, by hand below), then what it wrote and how to plot it."""
    import json

    cfg = load_config(DEMO_CONFIG, [f"logging.output_dir={tmp_path}"])
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000250\n")
    rows = [{"step": -1, "warm_start_steps": 30}] + [
        {"step": k, "reward_mean": k / 100, "accuracy": k / 200, "entropy_mean": 2 - k / 100,
         "response_length_mean": 4.0, "time_generate_s": 0.5, "time_update_s": 1.0} for k in range(40)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 40, "rew')
    # reward: steps 0-9 mean 0.045, steps 30-39 mean 0.345; step time 1.5 s x 40 = 60 s (the unfinished row left out)
    assert run_summary(cfg) == (
        "run: 40 RL steps (0-39) in 1m00s (1.5 s/step); reward 0.045 -> 0.345, accuracy 0.0225 -> 0.173, entropy "
        "1.96 -> 1.66, response length 4 -> 4 (mean of the first -> last 10 steps)\n"
        f"wrote metrics {tmp_path}/metrics.jsonl, TensorBoard logs {tmp_path}/tensorboard, checkpoints in "
        f"{tmp_path}/checkpoints (the newest: {tmp_path}/checkpoints/step_00000250); plot it: python -m "
        f"megatron_gtpo.plot {tmp_path}")
    cfg = load_config(DEMO_CONFIG, [f"logging.output_dir={tmp_path}/other", "logging.tensorboard=false"])
    assert run_summary(cfg) == (f"wrote metrics {tmp_path}/other/metrics.jsonl; plot it: python -m "
                                f"megatron_gtpo.plot {tmp_path}/other")


@pytest.mark.slow  # matplotlib's import and two figures: over 2 s of CPU (make test runs it)
def test_the_plot_command_draws_and_summarises_one_or_several_runs(tmp_path, capsys):
    import json

    from megatron_gtpo.plot import main

    for name, scale in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        rows = [{"step": k, "reward_mean": scale * k / 10, "accuracy": k / 10, "entropy_mean": 1.0,
                 "response_length_mean": 3.0, "time_update_s": 2.0} for k in range(4)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out == (
        "a: 4 RL steps (0-3) in 8s (2 s/step); reward 0.05 -> 0.25, accuracy 0.05 -> 0.25, entropy 1 -> 1, response "
        f"length 3 -> 3 (mean of the first -> last 2 steps)\nwrote {tmp_path / 'a' / 'metrics.png'}\n")
    assert (tmp_path / "a" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(tmp_path / "a" / "metrics.jsonl"), str(tmp_path / "b"), "--output", str(tmp_path / "ab.png"),
                 "--window", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("b: 4 RL steps (0-3) in 8s (2 s/step); reward 0 -> 0.6,")
    assert (tmp_path / "ab.png").is_file()
    with pytest.raises(FileNotFoundError, match="holds no metrics.jsonl: give a run's output directory"):
        main([str(tmp_path)])


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


def test_the_warm_start_and_the_rl_steps_show_progress_on_the_logging_rank(tmp_path, capsys, monkeypatch):
    """On a terminal, tqdm's bars; in a log file (stderr not a terminal), complete lines: the RL steps' when they
    start and end (with the step's metrics), never a bar redrawn with carriage returns."""
    import sys

    from megatron_gtpo.training.metrics import MetricsLogger

    def logger(enabled, progress_bar, total_steps=5):
        return MetricsLogger(str(tmp_path), enabled=enabled, start_step=0, total_steps=total_steps,
                             tensorboard=False, wandb_project=None, progress_bar=progress_bar, run_config={})

    capsys.readouterr()
    rl = logger(True, True, total_steps=2)
    for step in range(2):
        rl.log(step, {"reward_mean": 0.25 * step, "entropy_mean": 2.0})
    rl.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "RL steps: 0/2 (0%)" and "\r" not in "".join(lines)
    assert re.fullmatch(r"RL steps: 2/2 \(100%\), .* done in \d+s; reward_mean=0.25, entropy_mean=2", lines[-1])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(logger(True, True).progress(range(3), "warm start steps")) == [0, 1, 2]
    assert "warm start steps:   0%|          | 0/3" in capsys.readouterr().err
    for enabled, progress_bar in ((False, True), (True, False)):
        assert logger(enabled, progress_bar).progress(range(3), "warm start steps") == range(3)


def test_progress_in_a_log_file_is_a_line_per_interval():
    """PlainProgress: a kept display says when it starts, then at most once per interval (position, speed, time
    left, the latest postfix), and when it ends; a transient one only once it has run an interval."""
    import io

    from megatron_gtpo.progress import PlainProgress

    now = [0.0]
    out = io.StringIO()
    bar = PlainProgress(desc="RL steps", total=100, unit="step", file=out, interval_s=30, clock=lambda: now[0])
    for step in range(100):
        now[0] += 2.0
        bar.set_postfix({"reward_mean": f"{step / 100:.3g}"})
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "RL steps: 0/100 (0%)"
    assert lines[1] == "RL steps: 15/100 (15%), 2 s/step, 2m50s left; reward_mean=0.14"
    assert len(lines) == 1 + 200 // 30 + 1 and lines[-1] == "RL steps: 100/100 (100%), 2 s/step, done in 3m20s; " \
                                                            "reward_mean=0.99"
    quick = io.StringIO()
    with PlainProgress(desc="decoding", total=8, leave=False, file=quick, interval_s=30, clock=lambda: now[0]) as bar:
        bar.update(8)
    assert quick.getvalue() == ""


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

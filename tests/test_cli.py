"""The command lines under torchrun (2 ranks) with bad inputs: a non-zero exit and the one message naming the cause,
printed once, without a traceback; an unexpected error keeps its traceback, printed once (megatron_gtpo/cli.py)."""
import os
import subprocess
import sys

import pytest

from cli_runs import ROOT_CAUSE, assert_one_clean_error, worker_frames
from tiny_models import make_tiny_qwen2
from tokenizer_dirs import build_hf_tokenizer_dir
from trainer_runs import train_command


def _torchrun(args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_train_with_a_misspelled_config_key(tmp_path):
    res = subprocess.run(train_command(tmp_path, 2, ["optim.learning_rate=1"]), capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert_one_clean_error(res, "megatron_gtpo.train: error: unknown config key optim.learning_rate")


@pytest.mark.slow
def test_evaluate_with_a_missing_data_file(tmp_path):
    make_tiny_qwen2(tmp_path / "model", num_layers=1)
    tokenizer_dir = build_hf_tokenizer_dir(str(tmp_path / "tok"))  # the model directory has none
    res = _torchrun(["-m", "megatron_gtpo.evaluate", "--model", str(tmp_path / "model"), "--tokenizer", tokenizer_dir,
                     "--datasets",
                     f"mine={tmp_path / 'missing.jsonl'}", "--output-dir", str(tmp_path / "out")])
    assert_one_clean_error(res, f"megatron_gtpo.evaluate: error: dataset source must be one of ('aime24', 'aime25', "
                                f"'math500') or an existing file, got '{tmp_path / 'missing.jsonl'}'")


@pytest.mark.slow
def test_score_with_kv_heads_that_do_not_divide_tp(tmp_path):
    make_tiny_qwen2(tmp_path / "model", num_layers=1, num_kv_heads=1)
    tokens = tmp_path / "in.jsonl"
    tokens.write_text('{"token_ids": [1, 2, 3]}\n')
    res = _torchrun(["-m", "megatron_gtpo.score", "--hf", str(tmp_path / "model"), "--tp", "2", "--input",
                     str(tokens), "--output", str(tmp_path / "out.jsonl")])
    assert_one_clean_error(res, "megatron_gtpo.score: error: parallel.tensor / parallel.pipeline: the model cannot be "
                                "split so: 1 query groups (num_key_value_heads) are not divisible "
                                "by TP=2")


@pytest.mark.slow
def test_an_unexpected_error_keeps_one_traceback(tmp_path):
    """...and a warning or log record that every rank emits alike is printed once."""
    script = tmp_path / "fails.py"
    # The barrier: both ranks have warned and both raise (torchrun ends the other ranks when one fails).
    script.write_text("import logging\nimport warnings\n\nimport torch.distributed as dist\n\n"
                      "from megatron_gtpo.cli import run_cli\n\n\n"
                      "def main():\n    dist.init_process_group('gloo')\n"
                      "    warnings.warn('the same on every rank')\n"
                      "    logging.getLogger('demo').warning('logged by every rank')\n"
                      "    dist.barrier()\n"
                      "    raise RuntimeError('an internal error')\n\n\n"
                      "run_cli('fails', main)\n")
    res = _torchrun([str(script)])
    output = res.stdout + res.stderr
    assert res.returncode != 0
    # What the ranks printed, then torchrun's summary, whose root cause ends with the traceback (the error file).
    ranks, summary = output.split("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    assert ranks.count("UserWarning: the same on every rank") == 1, output[-3000:]
    assert ranks.count("WARNING demo: logged by every rank") == 1, output[-3000:]
    assert ranks.count("RuntimeError: an internal error") == 1, output[-3000:]
    assert len(worker_frames(ranks)) == 1 and "megatron_gtpo/cli.py" in worker_frames(ranks)[0], output[-3000:]
    assert ranks.count(f'File "{script}", line 14, in main') == 1, output[-3000:]
    assert summary.split(ROOT_CAUSE)[1].rstrip(" =\n").endswith("RuntimeError: an internal error"), output[-3000:]


def test_ranks_of_a_launch_say_a_line_once_and_a_later_launch_removes_the_claims_of_finished_ones(
        tmp_path, monkeypatch, capsys):
    import tempfile

    from megatron_gtpo import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    finished = subprocess.Popen(["true"])
    finished.wait()  # a launcher that is gone (its pid unused again: nothing runs long enough to take it)
    for pid in (finished.pid, os.getpid()):
        (tmp_path / f"megatron_gtpo-said-{pid}-{'0' * 16}").mkdir()
    monkeypatch.setenv("RANK", "0")
    cli._claims.cache_clear()
    try:
        assert cli.say_once("a warning") and not cli.say_once("a warning")  # the second as another local rank would
        assert capsys.readouterr().err == "a warning\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"megatron_gtpo-said-{os.getpid()}-{'0' * 16}",
             f"megatron_gtpo-said-{os.getppid()}-{cli._launch_key()}"])
    finally:
        cli._claims.cache_clear()  # no later test of this process claims in this test's directory

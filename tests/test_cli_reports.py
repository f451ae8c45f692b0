"""How a command ends, in process (cli.run_cli): an argument error as usage + one line, status 2; and the line
left in torchrun's per-rank error file, read back by torchrun's own reader as the failure's message."""
from __future__ import annotations

import uuid

import pytest

from megatron_gtpo.cli import ArgumentParser, run_cli


def _torchrun_summary(error_file, exitcode: int) -> str:
    """torchrun's failure summary (its own formatting) for one failed rank that left `error_file`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("prog", {0: failure}).format_msg()


def _ended(main) -> int:
    with pytest.raises(SystemExit) as exited:
        run_cli("prog", main)
    return exited.value.code


def test_an_argument_error_is_the_usage_and_one_line_once_per_launch(capsys, monkeypatch):
    """Two ranks of one launch on this node (the same launcher process and run id) meet the same error: one prints."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{uuid.uuid4().hex}")
    parser = ArgumentParser(prog="prog")
    parser.add_argument("--model", required=True)
    assert _ended(lambda: parser.parse_args([])) == 2
    assert _ended(lambda: parser.parse_args([])) == 2  # the second rank
    assert capsys.readouterr().err == "usage: prog [-h] --model MODEL\nprog: error: the following arguments are " \
                                      "required: --model\n"


@pytest.mark.parametrize("error,status,message", [
    (ValueError("model.load: 'x' does not exist"), 2, "prog: error: model.load: 'x' does not exist"),
    (KeyboardInterrupt(), 130, "prog: interrupted"),
])
def test_under_torchrun_the_line_goes_to_the_rank_error_file(tmp_path, monkeypatch, capsys, error, status, message):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def main():
        raise error

    assert _ended(main) == status
    assert capsys.readouterr().err == message + "\n"
    # What torchrun's ChildFailedError summary shows for this rank: the message instead of a link to its docs.
    assert f"traceback : {message}\n" in _torchrun_summary(error_file, status)


def test_an_unexpected_error_leaves_its_traceback_there(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))

    def main():
        raise RuntimeError("an internal error")

    assert _ended(main) == 1
    traceback = capsys.readouterr().err.rstrip()
    assert traceback.startswith("Traceback") and traceback.endswith("RuntimeError: an internal error")
    assert "traceback : " + traceback.replace("\n", "\n  ") + "\n" in _torchrun_summary(tmp_path / "error.json", 1)

"""Ctrl-C and the scheduler's signals in one process: the first SIGINT (or a SIGTERM / SIGUSR1) asks the training
loop to checkpoint after the step in progress and exit, said in one line; a second Ctrl-C aborts with one line and
status 130, without a traceback (training/checkpointing.StopSignal, cli.run_cli)."""
from __future__ import annotations

import os
import signal

import pytest

from megatron_gtpo.cli import run_cli
from megatron_gtpo.training.checkpointing import StopSignal


@pytest.fixture
def handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig,line", [
    (signal.SIGINT, "received SIGINT: will checkpoint after this step and exit; Ctrl-C again to abort"),
    (signal.SIGTERM, "received SIGTERM: will checkpoint after this step and exit"),
    (signal.SIGUSR1, "received SIGUSR1: will checkpoint after this step and exit"),
])
def test_a_first_signal_asks_for_a_checkpoint_and_says_so_in_one_line(handlers, capsys, sig, line):
    stop = StopSignal.install()
    assert not stop.requested
    try:
        os.kill(os.getpid(), sig)
    except KeyboardInterrupt:
        pytest.fail("the first Ctrl-C interrupted the step")
    assert stop.requested
    assert capsys.readouterr().err == line + "\n"


def test_a_run_that_saves_no_checkpoint_says_it_only_exits(handlers, capsys):
    stop = StopSignal.install(saves=False)  # checkpoint.save_every -1
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested
    assert capsys.readouterr().err == "received SIGTERM: will exit after this step (checkpoint.save_every -1)\n"


def test_a_second_ctrl_c_aborts_with_one_line(handlers, capsys):
    stop = StopSignal.install()

    def training():
        os.kill(os.getpid(), signal.SIGINT)  # the first: the loop would checkpoint after its step
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # the second: abort now
        raise AssertionError("not interrupted")

    try:
        run_cli("megatron_gtpo.train", training)
    except SystemExit as exited:
        assert exited.code == 130
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt went past run_cli (a traceback on every rank)")
    assert capsys.readouterr().err.splitlines() == [
        "received SIGINT: will checkpoint after this step and exit; Ctrl-C again to abort",
        "megatron_gtpo.train: interrupted"]

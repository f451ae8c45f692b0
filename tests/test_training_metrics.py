"""The per-step metrics logger (training/metrics.MetricsLogger): metrics.jsonl rows (NaN as null, a resumed run
rewriting the steps it redoes), the console progress bar, and what reaches Weights & Biases (a recording stand-in
for the wandb module: the real one drops history rows below step 0, so the warm start's row goes to the summary)."""
import json
import math
import sys
import time
from types import SimpleNamespace

from megatron_gtpo.training.metrics import MetricsLogger, PhaseTimer
from megatron_gtpo.training.trainer import Trainer

WARM_START = {"warm_start_steps": 5, "sft_loss": 1.5}


def _logger(tmp_path, **kwargs):
    options = dict(enabled=True, start_step=0, total_steps=3, tensorboard=False, wandb_project=None,
                   progress_bar=False, run_config={"seed": 1})
    return MetricsLogger(str(tmp_path), **{**options, **kwargs})


def _rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_rows_nan_as_null_and_a_resume_rewrites_the_steps_it_redoes(tmp_path):
    logger = _logger(tmp_path)
    logger.log(-1, WARM_START)
    for step in range(3):
        logger.log(step, {"reward_mean": 0.1 * step, "entropy_mean": math.nan if step == 1 else 1.0})
    logger.close()
    assert [r["step"] for r in _rows(tmp_path)] == [-1, 0, 1, 2]
    assert _rows(tmp_path)[2]["entropy_mean"] is None and _rows(tmp_path)[3]["entropy_mean"] == 1.0
    # Resumed from a checkpoint at step 1: the rows of steps 1 and 2 (logged after it) are dropped, then redone.
    logger = _logger(tmp_path, start_step=1)
    assert [r["step"] for r in _rows(tmp_path)] == [-1, 0]
    logger.log(1, {"reward_mean": 0.7})
    logger.close()
    assert [(r["step"], r["reward_mean"]) for r in _rows(tmp_path)[1:]] == [(0, 0.0), (1, 0.7)]


def test_a_disabled_logger_writes_nothing(tmp_path):
    logger = _logger(tmp_path / "out", enabled=False)
    logger.log(0, {"reward_mean": 1.0})
    logger.close()
    assert not (tmp_path / "out").exists()


def test_progress_bar_counts_rl_steps_and_shows_the_reward(tmp_path, capsys):
    logger = _logger(tmp_path, progress_bar=True, start_step=1)
    logger.log(-1, WARM_START)  # not an RL step
    logger.log(1, {"reward_mean": 0.25, "entropy_mean": 1.5, "response_length_mean": 4.0})
    logger.close()
    err = capsys.readouterr().err
    assert "RL steps" in err and "2/3" in err and "reward_mean=0.25" in err and "3/3" not in err


def test_a_step_that_kept_no_group_says_so_instead_of_showing_nan(tmp_path, capsys):
    logger = _logger(tmp_path, progress_bar=True)
    logger.log(0, {"reward_mean": 1.0, "entropy_mean": math.nan, "groups_kept": 0, "no_group_kept": 1,
                   "sampling_rounds": 3})
    logger.log(1, {"reward_mean": 0.5, "entropy_mean": 1.5, "groups_kept": 4, "no_group_kept": 0})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("dynamic sampling kept no group") == 1
    assert ("step 0: dynamic sampling kept no group (every prompt's responses were all right or all wrong, in 3 "
            "sampling rounds): no entropy, ratio or loss statistics this step") in err
    assert "nan" not in err and "entropy_mean=1.5" in err
    assert [(r["no_group_kept"], r["entropy_mean"]) for r in _rows(tmp_path)] == [(1, None), (0, 1.5)]


class _RecordingWandb:
    def __init__(self):
        self.init_kwargs, self.history, self.summary, self.finished = None, [], {}, False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return SimpleNamespace(log=lambda row, step: self.history.append((step, row)), summary=self.summary,
                               finish=lambda: setattr(self, "finished", True))


def test_weights_and_biases_gets_rl_steps_as_history_and_the_warm_start_in_the_summary(tmp_path, monkeypatch):
    wandb = _RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    logger = _logger(tmp_path, wandb_project="gtpo-test")
    logger.log(-1, WARM_START)
    logger.log(0, {"reward_mean": 0.5, "update_successful": True, "note": "text"})
    logger.close()
    assert wandb.init_kwargs == {"project": "gtpo-test", "config": {"seed": 1}, "dir": str(tmp_path)}
    assert wandb.history == [(0, {"reward_mean": 0.5})]  # numbers only, steps >= 0
    assert wandb.summary == {"warm_start/warm_start_steps": 5, "warm_start/sft_loss": 1.5}
    assert wandb.finished


def test_a_phase_ends_with_one_device_synchronisation_and_its_time_counts_in_it():
    waits = []

    def synchronize():  # stands for a GPU finishing the kernels the phase queued: 50 ms of device time
        waits.append(None)
        time.sleep(0.05)

    timer = PhaseTimer(synchronize)
    with timer("generate"):
        pass
    with timer("update"):
        pass
    assert len(waits) == 2 and timer.seconds["generate"] >= 0.05 and timer.seconds["update"] >= 0.05


def test_checkpoints_are_due_by_save_every(monkeypatch):
    """save_every N: every N steps and at the end; 0: at the end; -1: never; a stop signal saves unless -1."""
    import torch

    import megatron_gtpo.training.trainer as trainer_module
    from megatron_gtpo.distributed import ParallelGroups

    saved = []
    monkeypatch.setattr(trainer_module.checkpointing, "save", lambda state, step: saved.append(step))
    for every, stopping, expected in ((2, False, [2, 4, 5]), (0, False, [5]), (-1, False, []), (0, True, [1, 2]),
                                      (-1, True, [])):
        saved.clear()
        trainer = SimpleNamespace(cfg=SimpleNamespace(steps=5, checkpoint=SimpleNamespace(save_every=every)),
                                  stop=SimpleNamespace(agreed=lambda device: stopping),
                                  parallel=ParallelGroups.data_parallel_rank(None, torch.device("cpu")),
                                  checkpoint_state=lambda: None)
        for step in range(1, 6 if not stopping else 3):
            assert Trainer.checkpoint_if_due(trainer, step) == stopping
        assert saved == expected, (every, stopping, saved)

"""The whole RL step under context parallelism (parallel.context: 2) on CPU: the trainer at CP = 2 generates on a
built-in rollout server (rollout.engine: builtin_remote; the built-in engine in the trainer's processes is refused at
CP > 1) and logs the metrics of the same run at CP = 1 (rewards, response lengths and prompts exactly, losses and
gradient norms to float32 rounding); its checkpoint resumes exactly at CP = 2, and at CP = 1 it resumes where the
CP = 1 run is."""
import os
import signal
import subprocess
import sys

import pytest

from distributed_harness import free_port
from trainer_runs import assert_resumed_run_equals, comparable, copy_checkpoint, read_metrics, run_train

pytestmark = pytest.mark.slow

EXACT = ("reward_mean", "accuracy", "response_length_mean", "response_length_max", "groups_kept", "sampling_rounds",
         "trained_prompt_ids", "optimizer_steps")
# A warm start (so that groups hold both outcomes and the update has advantages to train on), GTPO (entropy-shaped
# advantages over whole responses) on packed rows, two mini-batches: two optimizer steps per RL step.
COMMON = ["parallel.tensor=1", "warm_start.steps=20", "data.prompts_per_step=8", "data.pack_sequences=true",
          "data.max_tokens_per_micro_batch=64", "steps=2", "checkpoint.save_every=1", "rollout.engine=builtin_remote",
          "rollout.remote.connect_timeout_s=120"]


@pytest.fixture
def server_address(tmp_path):
    """A built-in rollout server (one for the test's runs, a trainer session each), started from the tiny model's
    HF directory (the trainer's first weight sync replaces its weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    model_dir = tmp_path / "server_model"
    Qwen2ForCausalLM(Qwen2Config(**tiny_model_hf_config())).save_pretrained(str(model_dir))
    address = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "megatron_gtpo.rollout.remote_server", "--engine", "builtin",
                                   "--hf-dir", str(model_dir), "--listen", address], stdout=log,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                  start_new_session=True)
    yield address
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _train(out, context: int, address: str, *extra) -> str:
    res = run_train(out, context, [*COMMON, f"parallel.context={context}", f"rollout.remote.addresses=[{address}]",
                                   *extra])
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stderr


def _assert_same_run(reference: list[dict], rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for a, b in zip(reference, rows):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        # Rows are padded to a multiple of 2 x CP: the padding is the one thing the layout may change.
        differ = [k for k in a if k != "padding_fraction" and b[k] != (
            a[k] if k in EXACT or not isinstance(a[k], float) else pytest.approx(a[k], rel=1e-4, abs=1e-6))]
        assert not differ, (a["step"], {k: (a[k], b[k]) for k in differ})


def test_the_rl_step_at_cp2_equals_cp1_and_resumes_at_cp2_and_at_cp1(tmp_path, server_address):
    _train(tmp_path / "cp1", 1, server_address)
    _train(tmp_path / "cp2", 2, server_address)
    cp1, cp2 = read_metrics(tmp_path / "cp1"), read_metrics(tmp_path / "cp2")
    assert [r["step"] for r in cp2] == [-1, 0, 1]
    assert all(r["groups_kept"] > 0 and r["grad_norm"] > 0 for r in cp2[1:])  # the steps trained
    _assert_same_run(cp1, cp2)
    # Exact resume at CP = 2: the step-1 checkpoint, resumed in another directory, gives the uninterrupted run.
    copy_checkpoint(tmp_path / "cp2", tmp_path / "resumed_cp2", "step_00000001")
    assert "resumed from" in _train(tmp_path / "resumed_cp2", 2, server_address)
    assert_resumed_run_equals(tmp_path / "cp2", tmp_path / "resumed_cp2", "step_00000002", resumed_at=1)
    # The CP = 2 checkpoint resumed at CP = 1 goes on as the CP = 1 run did.
    copy_checkpoint(tmp_path / "cp2", tmp_path / "resumed_cp1", "step_00000001")
    assert "resumed from" in _train(tmp_path / "resumed_cp1", 1, server_address)
    _assert_same_run([r for r in cp1 if r["step"] >= 1], read_metrics(tmp_path / "resumed_cp1"))


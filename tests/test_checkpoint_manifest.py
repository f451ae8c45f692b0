"""Checkpoints record what they hold (manifest.json); a resume checks it, names a damaged checkpoint and file, and
falls back to the newest intact checkpoint, or stops with that message when none is intact (or when the damaged one
was asked for by name)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from cli_runs import assert_one_clean_error
from trainer_runs import read_metrics, run_train

from megatron_gtpo.checkpoint.manifest import MANIFEST, find_damage, write_manifest


def _truncate(path, keep_bytes=1000):
    with open(path, "r+b") as f:
        f.truncate(keep_bytes)


def _flip_byte(path, offset=2000):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_manifest_names_the_missing_truncated_or_corrupted_file(tmp_path):
    (tmp_path / "rng").mkdir()
    (tmp_path / "a.distcp").write_bytes(os.urandom(5000))
    (tmp_path / "rng" / "rank_0.pt").write_bytes(os.urandom(3000))
    write_manifest(str(tmp_path))
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["a.distcp", os.path.join("rng", "rank_0.pt")] and files["a.distcp"]["bytes"] == 5000
    assert find_damage(str(tmp_path)) is None
    original = (tmp_path / "a.distcp").read_bytes()

    _flip_byte(tmp_path / "a.distcp")  # same size, other bytes
    assert find_damage(str(tmp_path)) == (f"checkpoint {tmp_path} is damaged: a.distcp does not match the checksum "
                                          f"it was written with (corrupted)")
    _truncate(tmp_path / "a.distcp")
    assert "a.distcp has 1,000 bytes where 5,000 were written (truncated" in find_damage(str(tmp_path))
    (tmp_path / "a.distcp").write_bytes(original)
    os.remove(tmp_path / "rng" / "rank_0.pt")
    assert find_damage(str(tmp_path)).endswith(f"{os.path.join('rng', 'rank_0.pt')} is missing")


@pytest.mark.slow
def test_resume_passes_over_a_damaged_checkpoint_or_stops_when_none_is_intact(tmp_path):
    """A real trainer checkpoint (TP=2, two ranks): a truncated shard of the newest checkpoint makes the relaunch
    resume from the one before it, saying so; with every checkpoint damaged it stops with one message."""
    first = tmp_path / "first"
    common = ["parallel.tensor=2", "warm_start.steps=0", "data.prompts_per_step=8", "checkpoint.save_every=1",
              "checkpoint.keep_last=3"]
    res = run_train(first, 2, [*common, "steps=2"])
    assert res.returncode == 0, res.stderr[-3000:]
    # Nor does a training run print warnings that mean nothing to a user (CUDA advice on the CPU, megatron's
    # optimizer reading .grad of non-leaf views).
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in res.stderr and "not a leaf Tensor" not in res.stderr
    ckpts = first / "checkpoints"
    assert find_damage(str(ckpts / "step_00000002")) is None
    assert (ckpts / "step_00000002" / MANIFEST).is_file()
    second = tmp_path / "second"
    shutil.copytree(first, second)

    _truncate(ckpts / "step_00000002" / "__0_0.distcp")
    res = run_train(first, 2, [*common, "steps=3"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (f"warning: checkpoint {ckpts / 'step_00000002'} is damaged: __0_0.distcp has 1,000 bytes where"
            in res.stderr), res.stderr[-3000:]
    assert f"resuming from {ckpts / 'step_00000001'} instead, the newest intact checkpoint" in res.stderr
    assert [row["step"] for row in read_metrics(first)] == [0, 1, 2]  # steps 1 and 2 redone after step 1's save
    assert find_damage(str(ckpts / "step_00000002")) is None  # rewritten by the resumed run

    _flip_byte(second / "checkpoints" / "step_00000002" / "__1_1.distcp")
    _truncate(second / "checkpoints" / "step_00000001" / "common.pt", keep_bytes=10)
    res = run_train(second, 2, [*common, "steps=3"])
    assert_one_clean_error(res, f"megatron_gtpo.train: error: no intact checkpoint to resume from in "
                                f"{second / 'checkpoints'}: checkpoint {second / 'checkpoints' / 'step_00000002'} "
                                f"is damaged: __1_1.distcp does not match the checksum")

    # Asked for by name, a damaged checkpoint is not replaced by another one: the command stops, naming it.
    tokens = tmp_path / "in.jsonl"
    tokens.write_text('{"token_ids": [1, 2, 3]}\n')
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.score", "--load",
                          str(second / "checkpoints" / "step_00000001"), "--input", str(tokens), "--output",
                          str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert_one_clean_error(res, f"megatron_gtpo.score: error: checkpoint {second / 'checkpoints' / 'step_00000001'} "
                                f"is damaged: common.pt has 10 bytes")

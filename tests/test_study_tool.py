"""tools/compare_algorithms.py, in this process: study v3's shipped warm start is checked by the SHA-256 of its files
before anything runs, and another warm start (a damaged copy, an extra or a missing file, an output directory that
holds runs from another one) is refused in one line; the pre-registered analysis (`hypothesis_tests`) decides its
verdicts by the rule on a hand-built set of results."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("compare_algorithms", os.path.join(REPO, "tools",
                                                                                     "compare_algorithms.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture
def nothing_runs(tool, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started before the warm start was checked")

    monkeypatch.setattr(tool, "_run", refuse)


def test_the_shipped_warm_start_has_its_pinned_checksums_and_loads_as_a_hf_directory(tool):
    shipped = tool.STUDIES["v3"].warm_start
    path = os.path.join(REPO, shipped.path)
    tool.verify_warm_start(path, shipped)
    for name, digest in shipped.sha256:  # hashlib over the bytes, independently of the tool's helper
        with open(os.path.join(path, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name
    from megatron_gtpo.checkpoint.sources import ModelSource
    from megatron_gtpo.data.arithmetic_target import tiny_model_hf_config

    source = ModelSource.detect(path)
    assert not source.is_megatron_checkpoint
    assert {k: source.hf_config()[k] for k in tiny_model_hf_config()} == tiny_model_hf_config()


def _refusal(tool, argv) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as raised:
        tool.main(argv)
    message = str(raised.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "extra file", "missing file", "other config"])
def test_another_warm_start_is_refused_before_any_run(tool, nothing_runs, tmp_path, damage):
    shipped = tool.STUDIES["v3"].warm_start
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(REPO, shipped.path), copy)
    weights = copy / "model.safetensors"
    if damage == "flipped byte":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 1
        weights.write_bytes(bytes(data))
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-4])
    elif damage == "extra file":
        (copy / "tokenizer.json").write_text("{}")
    elif damage == "missing file":
        weights.unlink()
    else:
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    out = tmp_path / "out"
    message = _refusal(tool, ["--study", "v3", "--warm-start", str(copy), "--output-dir", str(out)])
    assert "refusing to go on from another one" in message and str(copy) in message, message
    expected = "model.safetensors has SHA-256" if damage in ("flipped byte", "truncated") else \
        "config.json has SHA-256" if damage == "other config" else "not the files"
    assert expected in message, message
    assert not out.exists()  # nothing was run or written


def test_an_output_directory_with_runs_from_another_warm_start_is_refused(tool, nothing_runs, tmp_path):
    (tmp_path / "warm_start").mkdir()
    (tmp_path / "warm_start" / "run.json").write_text(json.dumps({"train_s": 350.0, "eval_s": 89.0}))  # v2-style
    message = _refusal(tool, ["--study", "v3", "--output-dir", str(tmp_path)])
    assert "holds runs from another warm start" in message, message
    with pytest.raises(SystemExit):  # only a study with a shipped warm start takes one
        tool.main(["--study", "v2", "--warm-start", str(tmp_path)])


def _args(tool, seeds):
    study = tool.STUDIES["v3"]
    return argparse.Namespace(study=study, reference=study.reference, eval_samples=64, seeds=seeds)


def test_the_pre_registered_verdicts_follow_the_rule(tool):
    """Ten seeds: GRPO-S far above the control on Pass@64 (supported) and barely on Mean@64; GTPO below on Pass@64
    (its interval under 0) and level on Mean@64. Holm within each family at 0.05, one-sided."""
    seeds = list(range(11, 21))
    wobble = [0.010, -0.008, 0.004, -0.002, 0.006, -0.010, 0.003, 0.007, -0.005, -0.004]

    def runs(pass64, mean64):
        return [{"after": {"pass@64": p, "mean@64": m}} for p, m in zip(pass64, mean64)]

    control_pass = [0.70 + w for w in wobble]
    control_mean = [0.15 + w / 2 for w in wobble]
    scalars = {"dapo-no-overlong": runs(control_pass, control_mean),
               "gtpo": runs([p - 0.05 + w for p, w in zip(control_pass, reversed(wobble))], control_mean),
               "grpo_s": runs([p + 0.06 + w / 3 for p, w in zip(control_pass, wobble)],
                              [m + 0.001 + w for m, w in zip(control_mean, reversed(wobble))])}
    text = tool.hypothesis_tests(_args(tool, seeds), scalars)
    verdicts = [line for line in text.splitlines() if line.startswith("- H")]
    assert verdicts == [
        "- H1 (primary, grpo_s - dapo-no-overlong on Pass@64 > 0): **supported**.",
        "- H2 (primary, grpo_s - dapo-no-overlong on Mean@64 > 0): **not supported**.",
        "- H3 (secondary, gtpo - dapo-no-overlong on Pass@64 > 0): **not supported; the reference is better (95% "
        "interval below 0)**.",
        "- H4 (secondary, gtpo - dapo-no-overlong on Mean@64 > 0): **not supported**."], text
    h1 = next(line for line in text.splitlines() if line.startswith("| H1 |"))
    assert "| 10 | +0.0600 [" in h1 and "| 0.0250 |" in h1, h1  # the smaller p of its family: Holm's 0.05 / 2
    # The per-seed differences, as written
    row = next(line for line in text.splitlines() if line.startswith("| H1 | +"))
    assert row.split(" | ")[1:3] == [f"{0.06 + wobble[0] / 3:+.3f}", f"{0.06 + wobble[1] / 3:+.3f}"]


def test_holm_can_reject_both_primary_hypotheses_or_neither(tool):
    seeds = list(range(11, 21))
    wobble = [0.010, -0.008, 0.004, -0.002, 0.006, -0.010, 0.003, 0.007, -0.005, -0.004]
    control = [{"after": {"pass@64": 0.7 + w, "mean@64": 0.15 + w}} for w in wobble]

    def verdicts(shift_pass, shift_mean):
        grpo_s = [{"after": {"pass@64": 0.7 + shift_pass + w * 0.9, "mean@64": 0.15 + shift_mean + w * 0.9}}
                  for w in reversed(wobble)]
        text = tool.hypothesis_tests(_args(tool, seeds), {"dapo-no-overlong": control, "grpo_s": grpo_s})
        return [line.split("**")[1] for line in text.splitlines() if line.startswith("- H")]

    # GTPO did not run: its hypotheses are listed as not tested, the primary family is tested on its own
    assert verdicts(0.02, 0.02) == ["supported", "supported"]
    assert verdicts(0.0, 0.0) == ["not supported", "not supported"]
    # one-sided p 0.016 and 0.045: Holm rejects both (0.016 <= 0.05 / 2, then 0.045 <= 0.05; Bonferroni one)
    assert verdicts(0.008, 0.006) == ["supported", "supported"]
    # p 0.027 and 0.045: the smaller fails 0.025, so neither (uncorrected, both would pass 0.05)
    assert verdicts(0.007, 0.006) == ["not supported", "not supported"]

"""`python -m megatron_gtpo.score` end to end on ranks as torchrun starts them (distributed_harness.run_module), and
alone, against a float64 reference from transformers."""
import json
import os
import subprocess
import sys

import pytest
import torch

from distributed_harness import run_module
from megatron_gtpo.checkpoint import convert_hf_to_megatron
from tiny_models import make_tiny_qwen2

SEQUENCES = [[5, 17, 250, 999, 3, 42, 7], [1, 2], [900, 800, 700, 600, 500, 400, 300, 200, 100, 0], [4]]


def _run_score(args, nproc=1, timeout=300):
    return run_module("megatron_gtpo.score", args, nproc, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout_s=timeout)


@pytest.fixture(scope="module")
def model_and_input(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    hf = make_tiny_qwen2(root / "hf", tie=True, vocab_size=1000, num_layers=2)
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in SEQUENCES))
    return root, hf, inp


def _reference(hf, seq, temperature):
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(seq[1:])
    lp = logp[:-1].gather(-1, target[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)[:-1]
    return lp, ent


# The model from its HF directory (with sequence parallelism: odd lengths padded), or from the converter's Megatron
# checkpoint written at another TP than the one it is scored at; tied and untied embeddings.
@pytest.mark.slow
@pytest.mark.parametrize("tie,convert_tp,flags", [(True, None, ["--tp", "2", "--sequence-parallel"]),
                                                  (False, 1, ["--tp", "2"]), (True, 2, ["--pp", "2"])],
                         ids=["hf-tied-tp2-sp", "untied-converted-tp1-scored-tp2", "tied-converted-tp2-scored-pp2"])
def test_score_matches_float64_reference(tmp_path, tie, convert_tp, flags):
    hf = make_tiny_qwen2(tmp_path / "hf", tie=tie, vocab_size=1000, num_layers=4, seed=7 + tie)
    source = ["--hf", str(tmp_path / "hf")]
    if convert_tp is not None:
        convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tensor_parallel=convert_tp,
                               progress=False)
        source = ["--load", str(tmp_path / "mg")]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in SEQUENCES))
    res = _run_score([*source, "--input", str(inp), "--output", str(out), "--temperature", "0.7",
                      "--micro-batch-size", "3", *flags], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    # The closing summary, once: what it wrote and where.
    assert res.stderr.count(f"wrote {out}: per-token log-probs and entropies of {len(SEQUENCES)} sequences\n") == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(SEQUENCES)
    for seq, row in zip(SEQUENCES, rows):
        assert len(row["logprobs"]) == len(row["entropy"]) == len(seq) - 1
        if len(seq) == 1:
            continue
        lp, ent = _reference(hf, seq, 0.7)
        assert torch.allclose(torch.tensor(row["logprobs"], dtype=torch.float64), lp, rtol=1e-4, atol=1e-5)
        assert torch.allclose(torch.tensor(row["entropy"], dtype=torch.float64), ent, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_score_with_context_parallelism_equals_cp1(model_and_input, tmp_path):
    """--cp 2 (every sequence split over 2 ranks, padded to a multiple of 4) scores what --cp 1 scores, to float32
    rounding, and both match the float64 reference."""
    root, hf, inp = model_and_input
    rows = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}.jsonl"
        res = _run_score(["--hf", str(root / "hf"), "--input", str(inp), "--output", str(out), "--cp", str(cp),
                          "--micro-batch-size", "3"], nproc=cp)
        assert res.returncode == 0, res.stderr[-3000:]
        rows[cp] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows[2]) == len(SEQUENCES)
    for seq, one, two in zip(SEQUENCES, rows[1], rows[2]):
        for key in ("logprobs", "entropy"):
            assert len(two[key]) == len(seq) - 1
            torch.testing.assert_close(torch.tensor(two[key]), torch.tensor(one[key]), rtol=1e-5, atol=1e-6)
        if len(seq) > 1:
            lp, ent = _reference(hf, seq, 1.0)
            assert torch.allclose(torch.tensor(two["logprobs"], dtype=torch.float64), lp, rtol=1e-4, atol=1e-5)
            assert torch.allclose(torch.tensor(two["entropy"], dtype=torch.float64), ent, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lines,message", [
    (['{"token_ids": [1, 2, 1000]}'], "outside the vocabulary"),
    (['{"token_ids": [1, 2]}', "not json"], "in.jsonl:2: expected a JSON object"),
    (['{"ids": [1]}'], "expected a JSON object with a 'token_ids' list"),
    ([json.dumps({"token_ids": [1] * 257})], "exceed the model's max positions 256"),
])
def test_bad_input_fails_cleanly_without_output(model_and_input, tmp_path, lines, message):
    root, _, _ = model_and_input
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.score", "--hf", str(root / "hf"), "--input", str(inp),
                          "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert message in res.stderr
    assert not out.exists() and os.listdir(tmp_path) == ["in.jsonl"]


def test_missing_model_dir_is_named(tmp_path):
    res = subprocess.run([sys.executable, "-m", "megatron_gtpo.score", "--hf", str(tmp_path / "nope"),
                          "--input", "x.jsonl", "--output", str(tmp_path / "o.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"--hf: '{tmp_path / 'nope'}' does not exist" in res.stderr, res.stderr

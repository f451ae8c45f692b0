"""`python -m megatron_gtpo.score --load MG` on converter output, at a TP/PP other than the one it was converted at,
against the float64 reference from transformers on the original HF checkpoint (as in test_score.py)."""
import json

import pytest
import torch

from megatron_gtpo.checkpoint import convert_hf_to_megatron
from test_score import SEQUENCES, _reference, _run_score
from tiny_models import make_tiny_qwen2


@pytest.mark.parametrize("tie,convert_tp,flags", [(False, 1, ["--tp", "2"]), (True, 2, ["--pp", "2"])],
                         ids=["untied-converted-tp1-scored-tp2", "tied-converted-tp2-scored-pp2"])
def test_score_load_matches_float64_reference(tmp_path, tie, convert_tp, flags):
    hf = make_tiny_qwen2(tmp_path / "hf", tie=tie, vocab_size=1000, num_layers=4, seed=7 + tie)
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tensor_parallel=convert_tp, progress=False)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": s}) + "\n" for s in SEQUENCES))
    res = _run_score(["--load", str(tmp_path / "mg"), "--input", str(inp), "--output", str(out),
                      "--temperature", "0.7", "--micro-batch-size", "3", *flags], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(SEQUENCES)
    for seq, row in zip(SEQUENCES, rows):
        assert len(row["logprobs"]) == len(seq) - 1
        if len(seq) == 1:
            continue
        logprobs, entropy = _reference(hf, seq, 0.7)
        assert torch.allclose(torch.tensor(row["logprobs"], dtype=torch.float64), logprobs, rtol=1e-4, atol=1e-5)
        assert torch.allclose(torch.tensor(row["entropy"], dtype=torch.float64), entropy, rtol=1e-4, atol=1e-5)

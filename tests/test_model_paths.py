"""A wrong model path is named as such, first: missing, a file, a directory of neither kind, a Hugging Face
directory given as a checkpoint (and back), a model without tokenizer files; a trainer's checkpoints folder or its
`latest` stands for the checkpoint `latest` names (checkpoint/sources.py, data/tokenizer.py, training/task.py,
evaluate.py; in process)."""
from __future__ import annotations

import json
import os
import re

import pytest

from megatron_gtpo import evaluate
from megatron_gtpo.checkpoint.megatron_checkpoint import HF_FILES_DIR, METADATA_FILE
from megatron_gtpo.checkpoint.sources import ModelSource
from megatron_gtpo.config import ConfigError, TrainConfig
from megatron_gtpo.data import load_tokenizer
from megatron_gtpo.training.task import model_source
from tokenizer_dirs import build_hf_tokenizer_dir


def _trainer_checkpoints(root) -> str:
    """A trainer's checkpoints folder as far as a model path goes: two step directories (their metadata, no
    tensors) and `latest`."""
    from megatron_gtpo.checkpoint.megatron_checkpoint import CheckpointMetadata, write_checkpoint_metadata
    from megatron_gtpo.data.synthetic import tiny_model_hf_config

    for step in (10, 20):
        checkpoint = root / "checkpoints" / f"step_{step:08d}"
        checkpoint.mkdir(parents=True)
        write_checkpoint_metadata(str(checkpoint), CheckpointMetadata(tiny_model_hf_config(), "float32", 1, 1))
        assert (checkpoint / METADATA_FILE).is_file()
    (root / "checkpoints" / "latest").write_text("step_00000020\n")
    return str(root / "checkpoints")


def test_a_checkpoints_folder_or_latest_is_the_checkpoint_latest_names(tmp_path):
    folder = _trainer_checkpoints(tmp_path)
    newest = os.path.join(folder, "step_00000020")
    for path in (folder, folder + "/", os.path.join(folder, "latest")):
        assert ModelSource.detect(path) == ModelSource(newest, True)
    assert ModelSource.detect(newest).tokenizer_dir == os.path.join(newest, HF_FILES_DIR)
    assert ModelSource.detect(os.path.join(folder, "step_00000010")).path == os.path.join(folder, "step_00000010")


def _file(directory):
    (directory / "weights.bin").write_text("")
    return directory / "weights.bin"


def _empty_dir(directory):
    (directory / "hf_files").mkdir()
    return directory / "hf_files"


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing", "--model: '{path}' does not exist"),
    (_file, "--model: '{path}' is a file, not a model directory (a Hugging Face directory or a megatron_gtpo "
            "checkpoint)"),
    (_empty_dir, "--model: '{path}' is neither a Hugging Face model directory (no config.json) nor a megatron_gtpo "
                 "checkpoint (no megatron_gtpo_checkpoint.json)"),
])
def test_a_path_that_is_no_model_is_named_as_such(tmp_path, make, message):
    path = str(make(tmp_path))
    with pytest.raises(FileNotFoundError, match="^" + re.escape(message.format(path=path)) + "$"):
        ModelSource.detect(path, what="--model")


def test_a_model_given_under_the_other_key_names_the_right_one(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    folder = _trainer_checkpoints(tmp_path)
    cfg = TrainConfig()
    cfg.model.load = str(hf)
    with pytest.raises(ConfigError, match=f"^model.load: {hf} is a Hugging Face directory; set model.hf_dir={hf} "
                                          "instead$"):
        model_source(cfg)
    cfg.model.load, cfg.model.hf_dir = None, folder
    newest = os.path.join(folder, "step_00000020")
    with pytest.raises(ConfigError, match=f"^model.hf_dir: {newest} is a megatron_gtpo checkpoint; set "
                                          f"model.load={newest} instead$"):
        model_source(cfg)


def test_a_model_without_tokenizer_files_says_no_tokenizer(tmp_path):
    """transformers would ask to install sentencepiece or tiktoken instead."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match=f"^no tokenizer in {tmp_path} \\(none of tokenizer.json, vocab.json, "
                                         "tokenizer.model, vocab.txt, spiece.model\\): copy the tokenizer files of "
                                         "the Hugging Face model it comes from into it$"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=f"^no tokenizer in {tmp_path}/{HF_FILES_DIR}: no such directory"):
        load_tokenizer(str(tmp_path / HF_FILES_DIR))  # a checkpoint converted from a model without them


def test_evaluate_checks_the_model_first_and_reads_a_checkpoints_folder(tmp_path):
    def replica_factory(args, tokenizer):
        raise AssertionError(f"built a replica for {args.model} with {tokenizer}")

    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"^--model: '{missing}' does not exist$"):
        evaluate.main(["--model", missing, "--datasets", "no_such_set", "--output-dir", str(tmp_path / "o")],
                      replica_factory=replica_factory)
    folder = _trainer_checkpoints(tmp_path)
    build_hf_tokenizer_dir(os.path.join(folder, "step_00000020", HF_FILES_DIR))
    seen = []

    def record(args, tokenizer):
        seen.append((args.model, tokenizer.eos_token_id))
        raise KeyboardInterrupt  # stop before generating

    with pytest.raises(KeyboardInterrupt):
        evaluate.main(["--model", folder, "--datasets", "aime24", "--output-dir", str(tmp_path / "o")],
                      replica_factory=record)
    assert seen and seen[0][0] == os.path.join(folder, "step_00000020")

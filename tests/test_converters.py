"""HF <-> Megatron checkpoint converters in one process: bit-exact round trips, dtypes, tied embeddings, sharding,
side files, atomic output and error messages. Loading the result with megatron at other TP/PP layouts is in
test_converters_megatron.py, scoring it in test_score.py."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from megatron_gtpo.checkpoint import (convert_hf_to_megatron, convert_megatron_to_hf, read_checkpoint_metadata)
from megatron_gtpo.checkpoint.hf_export import TorchDistReader, parse_size
from megatron_gtpo.checkpoint.manifest import write_manifest
from checkpoint_checks import SIDE_FILES, assert_bit_exact, read_safetensors_dir
from tiny_models import make_tiny_qwen2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random Qwen2 models: vocab 1000 (padded to 1024), 4 layers; 2 query groups except `groups4` (TP=4)."""
    root = tmp_path_factory.mktemp("hf")
    specs = {
        "untied": dict(tie=False, seed=1),
        "tied": dict(tie=True, seed=2),
        "groups4": dict(tie=False, num_heads=8, num_kv_heads=4, seed=3),
        "tied_bf16": dict(tie=True, dtype=torch.bfloat16, seed=4),
    }
    out = {}
    for name, kwargs in specs.items():
        kwargs = {"vocab_size": 1000, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, **kwargs}
        make_tiny_qwen2(root / name, **kwargs)
        for fname, text in SIDE_FILES.items():
            (root / name / fname).write_text(text)
        (root / name / "README.md").write_text("not a tokenizer file")
        out[name] = root / name
    return out


ROUND_TRIPS = [(m, tp, pp) for m in ("untied", "tied") for tp in (1, 2) for pp in (1, 2)] + \
    [("groups4", 4, 1), ("groups4", 4, 2)]


@pytest.mark.parametrize("model,tp,pp", ROUND_TRIPS, ids=[f"{m}-tp{tp}-pp{pp}" for m, tp, pp in ROUND_TRIPS])
def test_round_trip_is_bit_exact(models, tmp_path, model, tp, pp):
    meta = convert_hf_to_megatron(str(models[model]), str(tmp_path / "mg"), tensor_parallel=tp,
                                  pipeline_parallel=pp, progress=False)
    assert (meta.tensor_parallel, meta.pipeline_parallel, meta.dtype) == (tp, pp, "float32")
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf2"), progress=False)
    original = read_safetensors_dir(models[model])
    assert_bit_exact(original, read_safetensors_dir(tmp_path / "hf2"))
    assert ("lm_head.weight" in original) == (model != "tied")


def test_checkpoint_layout_is_megatrons_global_view(models, tmp_path):
    """Stored keys, global shapes and chunking of a TP=2 conversion, computed here by hand from the HF tensors."""
    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), tensor_parallel=2, progress=False)
    hf = read_safetensors_dir(models["untied"])
    reader = TorchDistReader(str(tmp_path / "mg"))
    keys = set(reader.metadata.state_dict_metadata)
    assert keys == {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
                    *(f"decoder.layers.{k}" for k in (
                        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                        "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"))}
    embedding = reader.read("embedding.word_embeddings.weight", (0, 0), (1024, 64))
    assert torch.equal(embedding[:1000], hf["model.embed_tokens.weight"]) and not embedding[1000:].any()
    # fc1 of layer 2: [gate; up] with two chunks per TP rank (megatron's swiglu factory).
    fc1 = reader.tensor_metadata("decoder.layers.mlp.linear_fc1.weight")
    assert tuple(fc1.size) == (4, 256, 64)
    assert sorted(tuple(c.offsets) for c in fc1.chunks if c.offsets[0] == 2) == [(2, 0, 0), (2, 64, 0), (2, 128, 0),
                                                                                 (2, 192, 0)]
    fc1_layer2 = reader.read("decoder.layers.mlp.linear_fc1.weight", (2, 0, 0), (1, 256, 64))[0]
    assert torch.equal(fc1_layer2, torch.cat([hf["model.layers.2.mlp.gate_proj.weight"],
                                              hf["model.layers.2.mlp.up_proj.weight"]]))
    # qkv of layer 1, per query group g: [q heads of g (2 x 16 rows); k_g; v_g] (head_dim 16).
    qkv = reader.read("decoder.layers.self_attention.linear_qkv.weight", (1, 0, 0), (1, 128, 64))[0]
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    expected = torch.cat([torch.cat([q[32 * g:32 * g + 32], k[16 * g:16 * g + 16], v[16 * g:16 * g + 16]])
                          for g in range(2)])
    assert torch.equal(qkv, expected)
    norm = reader.read("decoder.layers.mlp.linear_fc1.layer_norm_weight", (3, 0), (1, 64))[0]
    assert torch.equal(norm, hf["model.layers.3.post_attention_layernorm.weight"])


def test_bf16_is_preserved_and_tied_model_loads_in_transformers(models, tmp_path):
    from transformers import AutoModelForCausalLM

    convert_hf_to_megatron(str(models["tied_bf16"]), str(tmp_path / "mg"), tensor_parallel=2, progress=False)
    meta = read_checkpoint_metadata(str(tmp_path / "mg"))
    assert (meta.dtype, meta.vocab_size, meta.padded_vocab_size) == ("bfloat16", 1000, 1024)
    reader = TorchDistReader(str(tmp_path / "mg"))
    assert {md.properties.dtype for md in reader.metadata.state_dict_metadata.values()} == {torch.bfloat16}
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf2"), progress=False)
    original = read_safetensors_dir(models["tied_bf16"])
    assert_bit_exact(original, read_safetensors_dir(tmp_path / "hf2"))
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["dtype"] == "bfloat16"

    ids = torch.tensor([[5, 17, 250, 999, 3, 42]])
    reference = AutoModelForCausalLM.from_pretrained(str(models["tied_bf16"]), dtype=torch.bfloat16).eval()
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    assert exported.dtype == torch.bfloat16
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


def test_dtype_casts_both_ways(models, tmp_path):
    original = read_safetensors_dir(models["untied"])
    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg16"), dtype=torch.bfloat16, progress=False)
    assert read_checkpoint_metadata(str(tmp_path / "mg16")).dtype == "bfloat16"
    convert_megatron_to_hf(str(tmp_path / "mg16"), str(tmp_path / "hf16"), progress=False)
    assert_bit_exact({k: t.to(torch.bfloat16) for k, t in original.items()}, read_safetensors_dir(tmp_path / "hf16"))

    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg32"), progress=False)
    convert_megatron_to_hf(str(tmp_path / "mg32"), str(tmp_path / "hf16b"), dtype=torch.bfloat16, progress=False)
    assert_bit_exact({k: t.to(torch.bfloat16) for k, t in original.items()}, read_safetensors_dir(tmp_path / "hf16b"))


def test_sharded_export_with_index_and_side_files(models, tmp_path):
    from transformers import AutoModelForCausalLM

    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), progress=False)
    assert sorted(os.listdir(tmp_path / "mg" / "hf_files")) == sorted([*SIDE_FILES, "generation_config.json"])
    files = convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf2"), max_shard_bytes=200_000,
                                   progress=False)
    out = tmp_path / "hf2"
    assert len(files) > 2 and all((out / f).stat().st_size <= 200_000 + 100_000 for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = read_safetensors_dir(out)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, fname in index["weight_map"].items():
        with safe_open(str(out / fname), framework="pt") as f:
            assert name in f.keys()
    for fname, text in SIDE_FILES.items():
        assert (out / fname).read_text() == text
    assert (out / "generation_config.json").read_bytes() == (models["untied"] / "generation_config.json").read_bytes()
    assert not (out / "README.md").exists()
    ids = torch.tensor([[1, 2, 3, 400, 999]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(models["untied"])).eval()(ids).logits
        assert torch.equal(AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits, expected)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 parsecs")


# ---------------------------------------------------------------------------------------------------- errors


def _copy_model(src, dst, edit_config=None):
    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unsupported_architecture_is_named(models, tmp_path):
    def llama(c):
        c.update(model_type="llama", architectures=["LlamaForCausalLM"])

    src = _copy_model(models["untied"], tmp_path / "llama", llama)
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        convert_hf_to_megatron(str(src), str(tmp_path / "mg"), progress=False)


def test_shape_mismatch_against_config_is_named_before_writing(models, tmp_path):
    src = _copy_model(models["untied"], tmp_path / "bad", lambda c: c.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"gate_proj.weight: shape \(128, 64\).*\(96, 64\).*config.json"):
        convert_hf_to_megatron(str(src), str(tmp_path / "mg"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # no output, no temporary directory left behind


def test_missing_shard_and_missing_tensor_are_named(models, tmp_path):
    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), progress=False)
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "sharded"), max_shard_bytes=200_000, progress=False)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / "sharded" / victim)
    with pytest.raises(FileNotFoundError, match=f"shard '{victim}' listed in model.safetensors.index.json is missing"):
        convert_hf_to_megatron(str(tmp_path / "sharded"), str(tmp_path / "mg2"), progress=False)

    from safetensors.torch import save_file

    tensors = read_safetensors_dir(models["untied"])
    del tensors["model.layers.3.mlp.down_proj.weight"]
    src = _copy_model(models["untied"], tmp_path / "incomplete")
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.3.mlp.down_proj.weight.*missing"):
        convert_hf_to_megatron(str(src), str(tmp_path / "mg3"), progress=False)
    assert not (tmp_path / "mg2").exists() and not (tmp_path / "mg3").exists()


def test_tp_that_does_not_divide_query_groups_is_named(models, tmp_path):
    with pytest.raises(ValueError, match="2 query groups .* not divisible by TP=4"):
        convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), tensor_parallel=4, progress=False)
    with pytest.raises(ValueError, match="4 layers are not divisible by PP=3"):
        convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), pipeline_parallel=3, progress=False)


def test_export_errors_are_named(models, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a megatron_gtpo checkpoint"):
        convert_megatron_to_hf(str(models["untied"]), str(tmp_path / "hf2"), progress=False)
    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), progress=False)
    meta_path = tmp_path / "mg" / "megatron_gtpo_checkpoint.json"
    record = json.loads(meta_path.read_text())
    record["hf_config"]["num_hidden_layers"] = 5
    meta_path.write_text(json.dumps(record))
    write_manifest(str(tmp_path / "mg"))  # as if written so (a changed file is otherwise reported as damaged)
    with pytest.raises(ValueError, match=r"stored shape \(4, 64\) is not \[5 layers"):
        convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf2"), progress=False)
    record["hf_config"]["num_hidden_layers"], record["hf_config"]["vocab_size"] = 4, 1500
    record["vocab_size"] = 1500
    meta_path.write_text(json.dumps(record))
    write_manifest(str(tmp_path / "mg"))
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight"):
        convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "hf2"), progress=False)
    assert not (tmp_path / "hf2").exists()


def test_output_is_atomic_and_refuses_to_overwrite(models, tmp_path, monkeypatch):
    from megatron_gtpo.checkpoint import hf_import

    out = tmp_path / "mg"
    convert_hf_to_megatron(str(models["untied"]), str(out), progress=False)
    with pytest.raises(FileExistsError, match="already exists; use force"):
        convert_hf_to_megatron(str(models["tied"]), str(out), progress=False)
    assert read_checkpoint_metadata(str(out)).shape.tie_word_embeddings is False  # untouched

    # An interruption half way leaves the old checkpoint as it was and no temporary directory.
    calls = []

    def interrupted(self, chunk):
        calls.append(chunk)
        if len(calls) == 10:
            raise RuntimeError("simulated crash")
        return original_chunk_data(self, chunk)

    original_chunk_data = hf_import._Importer.chunk_data
    monkeypatch.setattr(hf_import._Importer, "chunk_data", interrupted)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_hf_to_megatron(str(models["tied"]), str(out), force=True, progress=False)
    monkeypatch.setattr(hf_import._Importer, "chunk_data", original_chunk_data)
    assert len(calls) == 10 and sorted(os.listdir(tmp_path)) == ["mg"]
    assert read_checkpoint_metadata(str(out)).shape.tie_word_embeddings is False

    convert_hf_to_megatron(str(models["tied"]), str(out), force=True, progress=False)
    assert read_checkpoint_metadata(str(out)).shape.tie_word_embeddings is True
    assert sorted(os.listdir(tmp_path)) == ["mg"]
    with pytest.raises(ValueError, match="is the input directory"):
        convert_megatron_to_hf(str(out), str(out), force=True, progress=False)


# ---------------------------------------------------------------------------------------------------- CLIs


def _tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_command_line_tools(models, tmp_path):
    mg, hf2 = str(tmp_path / "mg"), str(tmp_path / "hf2")
    res = _tool("convert_hf_to_megatron.py", "--hf-dir", str(models["tied"]), "--output-dir", mg, "--tp", "2",
                "--dtype", "bfloat16")
    assert res.returncode == 0, res.stderr
    assert "megatron chunks" in res.stderr  # the progress bar
    res = _tool("convert_megatron_to_hf.py", "--megatron-dir", mg, "--output-dir", hf2, "--max-shard-size", "100KB",
                "--quiet")
    assert res.returncode == 0, res.stderr
    expected = {k: t.to(torch.bfloat16) for k, t in read_safetensors_dir(models["tied"]).items()}
    assert_bit_exact(expected, read_safetensors_dir(hf2))
    res = _tool("convert_hf_to_megatron.py", "--hf-dir", str(models["tied"]), "--output-dir", mg, "--quiet")
    assert res.returncode == 2 and "already exists; use --force to replace it" in res.stderr


def _tool_main(name):
    """A tools/ script's main, imported in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_converter_checks_paths_first_creates_the_parent_and_says_what_it_wrote(models, tmp_path, capsys):
    """Paths are checked before the conversion starts; a model without tokenizer files gets a warning; the summary
    names the family and the --tp / --pp given."""
    to_megatron, to_hf = _tool_main("convert_hf_to_megatron"), _tool_main("convert_megatron_to_hf")
    with pytest.raises(FileNotFoundError, match=f"^--hf-dir: '{tmp_path}/nope' does not exist$"):
        to_megatron(["--hf-dir", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "mg")])
    with pytest.raises(FileNotFoundError, match=f"^--megatron-dir: '{tmp_path}/nope' does not exist$"):
        to_hf(["--megatron-dir", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "hf")])
    with pytest.raises(FileExistsError, match=f"^--output-dir: '{tmp_path}' already exists; use --force to replace"):
        to_megatron(["--hf-dir", str(models["tied"]), "--output-dir", str(tmp_path)])
    bare = _copy_model(models["tied"], tmp_path / "bare")
    for name in SIDE_FILES:
        os.remove(bare / name)
    out = tmp_path / "new" / "folder" / "mg"  # its parent does not exist yet
    assert to_megatron(["--hf-dir", str(bare), "--output-dir", str(out), "--tp", "2", "--pp", "2", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"warning: {bare} has no tokenizer files (tokenizer.json, vocab.json, "
                                   f"tokenizer.model, vocab.txt, spiece.model), so neither has {out}: copy the "
                                   f"model's tokenizer files into {out}/hf_files")
    assert captured.out == (f"wrote {out}: qwen2, 4 layers, vocab 1000 (padded 1024), float32, checked and chunked "
                            "for --tp 2 --pp 2 (it loads at any TP/PP)\n")
    assert to_megatron(["--hf-dir", str(models["tied"]), "--output-dir", str(tmp_path / "mg2"), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_damaged_checkpoint_without_its_manifest_is_named_not_met_as_a_readers_error(models, tmp_path):
    """A checkpoint that lost its manifest.json: a missing or truncated data file is named from its torch_dist index
    (.metadata) before anything is read; bytes changed inside a file, which only a manifest would catch, make the
    read fail as the checkpoint's error (DamagedCheckpoint, a user error: one line), not as torch's EOFError."""
    from megatron_gtpo.checkpoint.manifest import MANIFEST, DamagedCheckpoint, find_damage

    convert_hf_to_megatron(str(models["untied"]), str(tmp_path / "mg"), progress=False)
    mg = tmp_path / "mg"
    os.remove(mg / MANIFEST)
    assert find_damage(str(mg)) is None
    data = sorted(p.name for p in mg.glob("*.distcp"))[0]
    original = (mg / data).read_bytes()
    (mg / data).write_bytes(original[:100])
    message = f"checkpoint {mg} is damaged: {data} has 100 bytes where its .metadata places data up to byte "
    with pytest.raises(DamagedCheckpoint, match=re.escape(message)):
        convert_megatron_to_hf(str(mg), str(tmp_path / "hf2"), progress=False)
    os.remove(mg / data)
    assert find_damage(str(mg)) == f"checkpoint {mg} is damaged: {data} is missing (its .metadata places data in " \
                                   f"it) (it has no {MANIFEST})"
    (mg / data).write_bytes(original[:64] + b"\0" * 64 + original[128:])  # a torch.save header overwritten
    with pytest.raises(DamagedCheckpoint, match=f"checkpoint {re.escape(str(mg))} could not be read .*: it has no "
                                                f"{MANIFEST} to check its files against"):
        convert_megatron_to_hf(str(mg), str(tmp_path / "hf2"), progress=False)
    assert not (tmp_path / "hf2").exists()

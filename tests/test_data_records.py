"""Prompt records: jsonl/parquet reading with field mappings and strict errors, bundled eval sets, DAPO repair,
prompt templates and prompt tokenization."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

from megatron_gtpo.data import (
    BOXED_TEMPLATE,
    DAPO_TEMPLATE,
    EVAL_SETS_DIR,
    FieldMapping,
    PromptRecord,
    PromptTemplate,
    load_dataset,
    load_prompt_records,
    load_tokenizer,
    repair_control_characters,
    tokenize_prompts,
)
from tokenizer_dirs import QWEN_DEFAULT_SYSTEM, build_hf_tokenizer_dir

# The full training set, where the README's "From a Hugging Face model" puts it; its test is skipped without it.
DAPO_PATH = os.path.join(os.path.dirname(__file__), "..", "data", "dapo_math_17k.jsonl")
# sha256 of the bundled copies, as listed in megatron_gtpo/data/eval_sets/README.md
EVAL_SET_SHA256 = {
    "aime24": "285e4c992b61539524776465abef981eb96e197e6e7678c03b8f42b7ea671ca6",
    "aime25": "aaf06733eb7e0ab863286969b33b491778739621d791f13cde8cfad77bf42c2a",
    "math500": "c133f2484e10b267cf82d08c343cdf82612c8a5b774d003111f926681c623c8f",
}


def _write_lines(path, lines) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_with_default_and_custom_field_mappings(tmp_path):
    path = _write_lines(tmp_path / "set.jsonl", [
        json.dumps({"id": "a", "problem": "1+1?", "answer": "2", "extra": 1}),
        "",  # blank lines are allowed
        json.dumps({"id": 7, "problem": "2+2?", "answer": 4}),
    ])
    assert load_prompt_records(path) == [PromptRecord("a", "1+1?", "2"), PromptRecord("7", "2+2?", "4")]

    nested = _write_lines(tmp_path / "verl_style.jsonl", [
        json.dumps({"prompt": [{"role": "user", "content": "Q1"}], "reward_model": {"ground_truth": " 12 "}}),
        json.dumps({"prompt": [{"role": "user", "content": "Q2"}], "reward_model": {"ground_truth": "13"}}),
    ])
    fields = FieldMapping(problem="prompt.0.content", answer="reward_model.ground_truth", id=None)
    assert load_prompt_records(nested, fields) == [
        PromptRecord("verl_style-0", "Q1", "12"), PromptRecord("verl_style-1", "Q2", "13")
    ]


def test_rows_without_ids_as_the_readme_documents_them_are_numbered(tmp_path):
    """The README's training data is one {"problem", "answer"} object per line: without ids, each row's id is the
    file's stem and its index; a file must give every row an id or none."""
    path = _write_lines(tmp_path / "dapo_math.jsonl", [json.dumps({"problem": "1+1?", "answer": "2"}), "",
                                                       json.dumps({"problem": "2+2?", "answer": 4})])
    assert load_prompt_records(path) == [PromptRecord("dapo_math-0", "1+1?", "2"),
                                         PromptRecord("dapo_math-1", "2+2?", "4")]
    for rows, which in ((({"id": "a"}, {}), "no field 'id', though the first row has one"),
                        (({}, {"id": "b"}), "a field 'id', though the first row has none")):
        path = _write_lines(tmp_path / "mixed.jsonl", [json.dumps({"problem": "p", "answer": "1", **row})
                                                       for row in rows])
        with pytest.raises(ValueError, match=rf"mixed.jsonl:2: {which}: give every row an id, or none \(then each "
                                             r"row's id is mixed-<row index>\)$"):
            load_prompt_records(path)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps({"id": "a", "problem": "p", "answer": "1"}), '{"id": "b", "problem": "p"', "{}"],
         r"bad\.jsonl:2: malformed JSON line"),
        ([json.dumps({"id": "a", "problem": "p"})], r"bad\.jsonl:1: missing field 'answer'"),
        ([json.dumps({"id": "a", "problem": "p", "answer": "  "})], r"bad\.jsonl:1: field 'answer' is empty"),
        ([json.dumps({"id": "a", "problem": ["p"], "answer": "1"})], r"bad\.jsonl:1: field 'problem' must be a string"),
        (["[1, 2]"], r"bad\.jsonl:1: a row must be a JSON object"),
        ([json.dumps({"id": "a", "problem": "p", "answer": "1"})] * 2,
         r"bad\.jsonl:2: duplicate id 'a' \(first at .*bad\.jsonl:1\)"),
        (["", "  "], r"bad\.jsonl: the dataset is empty"),
    ],
)
def test_bad_jsonl_is_reported_with_file_and_line(tmp_path, lines, message):
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        load_prompt_records(path)


def test_nested_field_missing_names_the_step(tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", [json.dumps({"problem": "p", "reward_model": {}})])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'reward_model.ground_truth' \('reward_model' "
                                         r"has no 'ground_truth'; the row's fields: problem, reward_model\)$"):
        load_prompt_records(path, FieldMapping(answer="reward_model.ground_truth", id=None))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'answer' \(the row's fields: problem, "
                                         r"reward_model\)$"):
        load_prompt_records(path)
    with pytest.raises(ValueError, match="must end in .jsonl or .parquet"):
        load_prompt_records(str(tmp_path / "set.csv"))


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="needs the `pyarrow` package: pip install pyarrow"):
        load_prompt_records(str(tmp_path / "set.parquet"))


def test_parquet_rows_with_nested_fields(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "Q1"}], "reward_model": {"ground_truth": "12"}, "uid": "u1"},
        {"prompt": [{"role": "user", "content": "Q2"}], "reward_model": {"ground_truth": "13"}, "uid": "u2"},
    ])
    path = str(tmp_path / "set.parquet")
    pq.write_table(table, path)
    fields = FieldMapping(problem="prompt.0.content", answer="reward_model.ground_truth", id="uid")
    assert load_prompt_records(path, fields) == [PromptRecord("u1", "Q1", "12"), PromptRecord("u2", "Q2", "13")]


def test_bundled_eval_sets_are_the_documented_copies():
    for name, expected_sha256 in EVAL_SET_SHA256.items():
        with open(os.path.join(EVAL_SETS_DIR, f"{name}.jsonl"), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == expected_sha256, name
    aime24, aime25, math500 = (load_dataset(name) for name in ("aime24", "aime25", "math500"))
    assert (len(aime24), len(aime25), len(math500)) == (30, 30, 500)
    # spot checks from the data README
    assert (aime24[0].id, aime24[0].answer, aime24[-1].answer) == ("2024-I-1", "204", "315")
    assert [r.answer for r in aime25[:3]] == ["70", "588", "16"]
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_repair_control_characters_on_dapo_quirks():
    assert repair_control_characters("in the form \x0crac{m}{n}") == "in the form \\frac{m}{n}"
    assert repair_control_characters("$=\x08eta$") == "$=\\beta$"
    assert (repair_control_characters("a_{2},\text{...},\triangle ABC, 2 \times 3")
            == "a_{2},\\text{...},\\triangle ABC, 2 \\times 3")
    assert repair_control_characters("$x \\le\x14 2y$ di\x0bfference \x88x") == "$x \\le 2y$ difference x"
    # real tabs and newlines stay
    for text in ("\t For each positive i", "{\n\tdraw((i,-1))", "\\begin{cases}\n\tn^n & k = 0", "plain text"):
        assert repair_control_characters(text) == text


def test_dapo_rows_are_repaired_and_wrapped_in_the_dapo_prompt(tmp_path):
    # Three rows as they are in DAPO-Math-17k (dapo-13436 abridged, dapo-14591 abridged, dapo-0 style).
    path = _write_lines(tmp_path / "dapo.jsonl", [
        json.dumps({"id": "dapo-13436", "problem": "$S=\text{...}\x0crac{a_{i}}{i}$", "answer": "2"}),
        json.dumps({"id": "dapo-14591", "problem": "$B-A_{1} P-B_{1}=\x08eta$", "answer": "5"}),
        json.dumps({"id": "dapo-0", "problem": "What is $1+1$?", "answer": "2"}),
    ])
    records = load_dataset(path)
    assert [r.problem for r in records] == ["$S=\\text{...}\\frac{a_{i}}{i}$", "$B-A_{1} P-B_{1}=\\beta$",
                                            "What is $1+1$?"]
    assert load_dataset(path, repair=False)[0].problem == "$S=\text{...}\x0crac{a_{i}}{i}$"
    # the upstream prompt of BytedTsinghua-SIA/DAPO-Math-17k, written out
    assert DAPO_TEMPLATE.user_text("What is $1+1$?") == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        "What is $1+1$?"
        "\n\nRemember to put your answer on its own line after \"Answer:\"."
    )


@pytest.mark.skipif(not os.path.exists(DAPO_PATH), reason="no data/dapo_math_17k.jsonl in the repository")
def test_full_dapo_file_has_no_control_characters_left_after_repair():
    raw = load_dataset(DAPO_PATH, repair=False)
    repaired = load_dataset(DAPO_PATH)
    assert len(repaired) == 17917
    assert sum("\x0c" in r.problem for r in raw) >= 600
    assert not any(ch in r.problem for r in repaired for ch in "\x00\x01\x08\x0b\x0c\x0e\x12\x14\x88")
    by_id = {r.id: r.problem for r in repaired}
    assert "\\frac{a_{i}}{i}" in by_id["dapo-13436"] and "\\text{...}" in by_id["dapo-13436"]
    assert "=\\beta$" in by_id["dapo-14591"]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return load_tokenizer(build_hf_tokenizer_dir(str(tmp_path_factory.mktemp("hf_tokenizer"))))


def test_templates_render_chat_and_plain_prompts(hf_tokenizer):
    problem = "Find $x$ if $\\{x\\} = 2$."
    assert BOXED_TEMPLATE.render(problem, hf_tokenizer) == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = PromptTemplate(system_prompt="Think.", suffix=" Go.")
    assert with_system.render(problem, hf_tokenizer) == (
        f"<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\n{problem} Go.<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = PromptTemplate(chat=False, plain_format="Question: {problem}\nAnswer in \\boxed{}:", suffix="!")
    assert plain.render(problem, hf_tokenizer) == f"Question: {problem}!\nAnswer in \\boxed{{}}:"
    with pytest.raises(ValueError, match="plain_format must contain"):
        PromptTemplate(chat=False, plain_format="no placeholder")
    with pytest.raises(ValueError, match="system_prompt needs chat=True"):
        PromptTemplate(chat=False, system_prompt="x")


def test_tokenize_prompts_indexes_samples_and_drops_overlong_prompts(hf_tokenizer):
    records = [PromptRecord("short", "1+1?", "2"), PromptRecord("long", "x " * 200, "0"),
               PromptRecord("mid", "2+2?", "4")]
    template = PromptTemplate(chat=False)
    samples = tokenize_prompts(records, hf_tokenizer, template, max_prompt_tokens=50)
    assert [(s.index, s.id, s.answer) for s in samples] == [(0, "short", "2"), (1, "mid", "4")]
    assert list(samples[1].prompt_token_ids) == hf_tokenizer.encode("2+2?")
    assert len(tokenize_prompts(records, hf_tokenizer, template)) == 3
    with pytest.raises(ValueError, match="no prompt left"):
        tokenize_prompts(records, hf_tokenizer, template, max_prompt_tokens=1)


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    from tiny_models import make_tiny_qwen2

    directory = tmp_path_factory.mktemp("hf_model")
    make_tiny_qwen2(directory)
    return build_hf_tokenizer_dir(str(directory))


@pytest.mark.parametrize("name", ["chat", "dapo", "plain"])
def test_data_template_is_the_prompt_the_trainer_tokenizes(tmp_path, hf_model_dir, name):
    """data.template of the training config: `plain` is the prompt field as it is, without the chat template."""
    from megatron_gtpo.config import load_config
    from megatron_gtpo.training.task import build_task

    problem = "What is $1+1$?"
    data = _write_lines(tmp_path / "set.jsonl", [json.dumps({"id": "q", "problem": problem, "answer": "2"})])
    cfg = load_config(None, [f"model.hf_dir={hf_model_dir}", f"data.path={data}", f"data.template={name}"])
    task = build_task(cfg)
    expected = {"chat": BOXED_TEMPLATE.render(problem, task.tokenizer),
                "dapo": DAPO_TEMPLATE.render(problem, task.tokenizer), "plain": problem}[name]
    assert list(task.samples[0].prompt_token_ids) == task.tokenizer.encode(expected)
    if name != "plain":
        assert expected.startswith("<|im_start|>system\n")

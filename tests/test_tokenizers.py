"""Tokenizer wrapper over a HF BPE tokenizer (tokenizer_dirs.py) and a SentencePiece model, both trained here
(nothing downloaded)."""
from __future__ import annotations

import os

import pytest

from megatron_gtpo.data import HFTokenizer, SentencePieceTokenizer, load_tokenizer, render_plain_chat
from tokenizer_dirs import CORPUS, QWEN_DEFAULT_SYSTEM, build_hf_tokenizer_dir

SAMPLE_TEXTS = [
    "What is $\\frac{3}{4} + 0.25$? Answer: 1",
    "  leading and trailing spaces, double  spaces\tand a tab\n",
    "Unicode: héllo wörld, 日本語, ∑_{i=1}^n i² = n(n+1)/2 — done.",
]


def build_sentencepiece_model(directory: str) -> str:
    """A small BPE SentencePiece model trained on a corpus file written here; byte fallback, no normalization."""
    import sentencepiece

    os.makedirs(directory, exist_ok=True)
    corpus_path = os.path.join(directory, "corpus.txt")
    with open(corpus_path, "w", encoding="utf-8") as f:
        f.write("\n".join(CORPUS * 20) + "\n")
    prefix = os.path.join(directory, "spm")
    sentencepiece.SentencePieceTrainer.train(
        input=corpus_path, model_prefix=prefix, model_type="bpe", vocab_size=400, character_coverage=1.0,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2,
    )
    return prefix + ".model"


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    return build_hf_tokenizer_dir(str(tmp_path_factory.mktemp("hf_tokenizer")))


@pytest.fixture(scope="module")
def hf_tokenizer(hf_tokenizer_dir):
    return load_tokenizer(hf_tokenizer_dir)


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    return load_tokenizer(build_sentencepiece_model(str(tmp_path_factory.mktemp("spm"))))


def test_hf_tokenizer_round_trips_and_reports_special_ids(hf_tokenizer, hf_tokenizer_dir):
    assert isinstance(hf_tokenizer, HFTokenizer)
    for text in SAMPLE_TEXTS:
        token_ids = hf_tokenizer.encode(text)
        assert all(isinstance(i, int) and 0 <= i < hf_tokenizer.vocab_size for i in token_ids)
        assert hf_tokenizer.decode(token_ids) == text
    # special tokens were registered first by the trainer, in this order
    assert hf_tokenizer.encode("<|im_end|>") == [2] and hf_tokenizer.eos_token_id == 2
    assert hf_tokenizer.pad_token_id == 0
    from tokenizers import Tokenizer

    trained = Tokenizer.from_file(os.path.join(hf_tokenizer_dir, "tokenizer.json"))
    assert hf_tokenizer.vocab_size == trained.get_vocab_size(with_added_tokens=True) > 256
    assert hf_tokenizer.decode(hf_tokenizer.encode("x = 1<|im_end|>"), skip_special_tokens=True) == "x = 1"


def test_hf_chat_template_is_applied(hf_tokenizer):
    user_only = hf_tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+1?"}])
    assert user_only == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    token_ids = hf_tokenizer.encode(user_only)
    assert token_ids[0] == 1 and token_ids.count(2) == 2  # <|im_start|>, and two <|im_end|> as single tokens
    assert hf_tokenizer.decode(token_ids) == user_only


def test_hf_tokenizer_without_pad_or_chat_template(tmp_path):
    tokenizer = load_tokenizer(build_hf_tokenizer_dir(str(tmp_path), with_pad=False, with_chat_template=False))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    with pytest.raises(ValueError, match=r"has no chat template: use a plain prompt \(data.template: plain in a "
                                         r"training config, --plain for megatron_gtpo.evaluate\)$"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_sentencepiece_round_trips_and_uses_the_plain_chat_template(sp_tokenizer):
    assert isinstance(sp_tokenizer, SentencePieceTokenizer)
    for text in SAMPLE_TEXTS:
        token_ids = sp_tokenizer.encode(text)
        assert all(0 <= i < sp_tokenizer.vocab_size for i in token_ids)
        assert sp_tokenizer.decode(token_ids) == text
    assert (sp_tokenizer.eos_token_id, sp_tokenizer.pad_token_id, sp_tokenizer.vocab_size) == (2, 3, 400)
    assert sp_tokenizer.decode(sp_tokenizer.encode("x = 1") + [sp_tokenizer.eos_token_id]) == "x = 1"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]
    expected = "System: Be brief.\n\nUser: What is 1+1?\n\nAssistant:"
    assert sp_tokenizer.apply_chat_template(messages) == expected == render_plain_chat(messages)
    assert sp_tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False) == "User: What is 1+1?"


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(ValueError, match="model directory or a SentencePiece .model file"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="model_file must be an existing"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="no tokenizer in .*nowhere"):
        HFTokenizer(str(tmp_path / "nowhere"))

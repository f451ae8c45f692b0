"""One tokenizer interface over Hugging Face tokenizers (a model directory) and SentencePiece (.model files).

    tokenizer = load_tokenizer("/models/Qwen2.5-7B-Instruct")      # or "/models/spm.model"
    ids = tokenizer.encode(text); text = tokenizer.decode(ids)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "..."}])

`encode` never adds special tokens (BOS/EOS): prompt text from a chat template already carries its markup,
so adding them would double them. `vocab_size` is the number of ids the tokenizer can produce (HF: base
vocabulary plus added tokens), not the model's padded embedding size.
"""
from __future__ import annotations

import os
from typing import Mapping, Protocol, Sequence


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str: ...


# One of these makes a directory a Hugging Face tokenizer's (transformers otherwise asks for sentencepiece or
# tiktoken, the formats it would fall back to).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from the Hub).

    pad_token_id falls back to eos_token_id when the tokenizer defines no pad token (padding is masked anyway).
    """

    def __init__(self, model_dir: str):
        if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer in {model_dir} (none of {', '.join(TOKENIZER_FILES)}): copy the "
                             f"tokenizer files of the Hugging Face model it comes from into it")
        from transformers import AutoTokenizer  # heavy import, only for HF tokenizers

        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer in {model_dir} defines no eos token")
        self.eos_token_id: int = self._tokenizer.eos_token_id
        pad_token_id = self._tokenizer.pad_token_id
        self.pad_token_id: int = self.eos_token_id if pad_token_id is None else pad_token_id
        self.vocab_size: int = len(self._tokenizer)
        self._model_dir = model_dir

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        if not self._tokenizer.chat_template:
            raise ValueError(
                f"the tokenizer in {self._model_dir} has no chat template: use a plain prompt (data.template: plain "
                f"in a training config, --plain for megatron_gtpo.evaluate)"
            )
        return self._tokenizer.apply_chat_template(
            [dict(message) for message in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )


def render_plain_chat(messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Chat turns as plain text for tokenizers without a chat template:
    "System: ...\\n\\nUser: ...\\n\\nAssistant:" (the last part only with add_generation_prompt)."""
    turns = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    if add_generation_prompt:
        turns.append("Assistant:")
    return "\n\n".join(turns)


class SentencePieceTokenizer:
    """A SentencePiece model file. Its chat template is the plain one of `render_plain_chat`.

    `decode` always drops control pieces (BOS/EOS), whatever skip_special_tokens says: SentencePiece cannot
    render them as text.
    """

    def __init__(self, model_file: str):
        if not os.path.isfile(model_file):
            raise ValueError(f"model_file must be an existing SentencePiece .model file, got {model_file!r}")
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        if self._processor.eos_id() < 0:
            raise ValueError(f"the SentencePiece model {model_file} defines no eos piece")
        self.eos_token_id: int = self._processor.eos_id()
        pad_token_id = self._processor.pad_id()
        self.pad_token_id: int = self.eos_token_id if pad_token_id < 0 else pad_token_id
        self.vocab_size: int = self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return list(self._processor.encode(text))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._processor.decode(list(token_ids))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        return render_plain_chat(messages, add_generation_prompt=add_generation_prompt)


def load_tokenizer(path: str) -> HFTokenizer | SentencePieceTokenizer:
    """A *.model file loads as SentencePiece, a directory as a Hugging Face tokenizer (ValueError "no tokenizer in
    PATH" when it holds none)."""
    if path.endswith(".model") and os.path.isfile(path):
        return SentencePieceTokenizer(path)
    if not os.path.isdir(path):
        raise ValueError(f"no tokenizer in {path}: no such directory (a tokenizer is a Hugging Face model directory "
                         f"or a SentencePiece .model file)")
    return HFTokenizer(path)

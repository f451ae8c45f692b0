"""Prompt records read from jsonl or parquet files, with a configurable field mapping.

A record is one problem: a stable id, the problem text and the reference answer. Reading is strict: a
malformed jsonl line is reported with its file and line number, a missing or empty field is named, and an
empty dataset is refused, because a silently skipped row changes what a run trains or evaluates on.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One problem. `problem` is the bare problem text; templates add instructions and chat markup."""

    id: str
    problem: str
    answer: str


@dataclasses.dataclass(frozen=True)
class PromptSample:
    """A tokenized prompt: `index` is its position in the dataset (the unit shuffled and sharded)."""

    index: int
    id: str
    prompt_token_ids: tuple[int, ...]
    answer: str


@dataclasses.dataclass(frozen=True)
class FieldMapping:
    """Where the problem, answer and id live in a row. A dotted path reaches into nested values:
    "reward_model.ground_truth", "prompt.0.content" (an integer indexes a list). A file whose rows have no `id`
    field (the README's {"problem", "answer"} rows) takes "<file stem>-<row index>" as each row's id, as does
    `id=None` for any file; the first row decides, and every other row must then have an id too, or none."""

    problem: str = "problem"
    answer: str = "answer"
    id: str | None = "id"


def _lookup(row: Any, path: str) -> Any:
    """Value at a dotted path, or raise KeyError(the part of the path that exists, the step it lacks)."""
    value = row
    steps = path.split(".")
    for i, step in enumerate(steps):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            raise KeyError(".".join(steps[:i]), step)
    return value


def _has_field(row: dict, path: str) -> bool:
    try:
        _lookup(row, path)
    except KeyError:
        return False
    return True


def _text_field(row: Any, path: str, where: str, *, allow_number: bool) -> str:
    try:
        value = _lookup(row, path)
    except KeyError as err:
        found, lacking = err.args
        inside = f"{found!r} has no {lacking!r}; " if found else ""
        raise ValueError(f"{where}: missing field {path!r} ({inside}the row's fields: {', '.join(sorted(row))})") \
            from None
    if allow_number and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {path!r} must be a string, got {type(value).__name__}: {value!r:.80}")
    if not value.strip():
        raise ValueError(f"{where}: field {path!r} is empty")
    return value


def _iter_jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: malformed JSON line ({err.msg} at column {err.colno})") from None


def _iter_parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq  # optional: only parquet input needs it
    except ImportError as err:
        raise ImportError(f"reading {path} needs the `pyarrow` package: pip install pyarrow") from err
    for row_index, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path}: row {row_index}", row


def load_prompt_records(path: str, fields: FieldMapping = FieldMapping()) -> list[PromptRecord]:
    """Records of a .jsonl or .parquet file, in file order. Numeric answers become strings ("17"); rows without ids
    are numbered (FieldMapping).

    Raises ValueError for malformed lines, missing/empty/non-string fields, duplicate ids, ids in some rows only
    and empty files.
    """
    if path.endswith(".jsonl"):
        rows = _iter_jsonl_rows(path)
    elif path.endswith(".parquet"):
        rows = _iter_parquet_rows(path)
    else:
        raise ValueError(f"path must end in .jsonl or .parquet, got {path!r}")
    stem = os.path.splitext(os.path.basename(path))[0]
    records: list[PromptRecord] = []
    seen_ids: dict[str, str] = {}
    ids_in_rows = None  # whether the rows carry their ids: the first row decides (FieldMapping)
    for row_index, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        has_id = fields.id is not None and _has_field(row, fields.id)
        ids_in_rows = has_id if ids_in_rows is None else ids_in_rows
        if has_id != ids_in_rows:
            which = "no field {!r}, though the first row has one" if ids_in_rows else \
                "a field {!r}, though the first row has none"
            raise ValueError(f"{where}: {which.format(fields.id)}: give every row an id, or none (then each row's "
                             f"id is {stem}-<row index>)")
        record_id = _text_field(row, fields.id, where, allow_number=True) if has_id else f"{stem}-{row_index}"
        if record_id in seen_ids:
            raise ValueError(f"{where}: duplicate id {record_id!r} (first at {seen_ids[record_id]})")
        seen_ids[record_id] = where
        records.append(
            PromptRecord(
                id=record_id,
                problem=_text_field(row, fields.problem, where, allow_number=False),
                answer=_text_field(row, fields.answer, where, allow_number=True).strip(),
            )
        )
    if not records:
        raise ValueError(f"{path}: the dataset is empty")
    return records

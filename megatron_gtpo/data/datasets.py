"""Named datasets: the bundled evaluation sets, and any jsonl/parquet file with control-character repair.

The bundled copies (eval_sets/, sources and licenses in eval_sets/README.md) are AIME 2024, AIME 2025 and
MATH-500 in the common {"id", "problem", "answer", ...} schema; DAPO-Math-17k and GSM8K use it too.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re

from megatron_gtpo.data.records import FieldMapping, PromptRecord, load_prompt_records

logger = logging.getLogger(__name__)

EVAL_SETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_sets")
EVAL_SET_NAMES = ("aime24", "aime25", "math500")

# A tab that stands for the "\t" of a LaTeX command lost to JSON escaping ("\text" -> TAB + "ext").
_TAB_FOR_LATEX_COMMAND_RE = re.compile(r"\t(?=(?:ext|extbf|extrm|imes|riangle|heta|frac)(?![A-Za-z]))")
# Control characters that never belong in a problem: C0 except tab/newline/carriage return, DEL, C1.
_STRAY_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f]")


def repair_control_characters(text: str) -> str:
    """Undo the mis-escaping found in DAPO-Math-17k (listed below) and drop stray controls.

    - form feed -> "\\f" ("\\x0crac{m}{n}" was "\\frac{m}{n}"), backspace -> "\\b" ("\\x08eta" was "\\beta");
    - a tab directly followed by the rest of \\text, \\textbf, \\textrm, \\times, \\triangle, \\theta or \\tfrac
      -> "\\t" (real tabs, before spaces or code, are kept);
    - any other C0/C1 control character except tab, newline and carriage return is removed (PDF residue such
      as "\\le\\x14 2y").
    Text without control characters is returned unchanged.
    """
    text = text.replace("\x0c", "\\f").replace("\x08", "\\b")
    text = _TAB_FOR_LATEX_COMMAND_RE.sub(lambda match: "\\t", text)
    return _STRAY_CONTROL_RE.sub("", text)


def load_dataset(source: str, fields: FieldMapping = FieldMapping(), *, repair: bool = True) -> list[PromptRecord]:
    """Records of a bundled eval set (a name in EVAL_SET_NAMES) or of a .jsonl/.parquet path.

    With `repair`, problem texts go through `repair_control_characters` (the number changed is logged).
    """
    if source in EVAL_SET_NAMES:
        path = os.path.join(EVAL_SETS_DIR, f"{source}.jsonl")
    elif os.path.exists(source):
        path = source
    else:
        raise ValueError(f"dataset source must be one of {EVAL_SET_NAMES} or an existing file, got {source!r}")
    records = load_prompt_records(path, fields)
    if not repair:
        return records
    repaired = [dataclasses.replace(r, problem=repair_control_characters(r.problem)) for r in records]
    num_changed = sum(old.problem != new.problem for old, new in zip(records, repaired))
    if num_changed:
        logger.info("%s: repaired control characters in %d of %d problems", path, num_changed, len(records))
    return repaired

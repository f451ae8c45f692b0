"""The memory tables of README.md and examples/slurm/README.md are the planner's numbers (tools/memory_tables.py
writes them; a planner change that moves one fails here until they are rewritten)."""
from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_documented_memory_tables_are_the_planners():
    spec = importlib.util.spec_from_file_location("memory_tables", os.path.join(REPO, "tools", "memory_tables.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    for path, expected in tables.documents().items():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            assert f.read() == expected, f"{path}: its memory table differs from the planner's; run python " \
                                         f"tools/memory_tables.py"

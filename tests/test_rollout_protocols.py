"""The rollout protocols hold, read from the source: every member used on an object of a protocol (a rollout
server a ServerEngine or the serving loop drives, a trainer's or an evaluation's rollout engine) is declared by that
protocol (a server's IPC bucket once undeclared: `IPCRolloutServer`), and every implementation defines every member
of the protocols it implements (vllm_engine.py is read, not imported: this venv has no vLLM)."""
from __future__ import annotations

import ast
import pathlib

import pytest

import megatron_gtpo

PACKAGE = pathlib.Path(megatron_gtpo.__file__).parent


def _classes() -> dict[str, ast.ClassDef]:
    """Every class of the package by name (the names are unique where it matters here)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, node)
    return found


CLASSES = _classes()


def _own_members(cls: ast.ClassDef) -> set[str]:
    """Methods, properties and class-level names of `cls`, and the attributes its methods assign on `self`."""
    members = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.Assign):
            members |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        members.add(t.attr)
    return members


def members(name: str) -> set[str]:
    """`name`'s members with those of its bases in the package (a Protocol's: its declared interface)."""
    cls = CLASSES[name]
    bases = [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in CLASSES]
    return _own_members(cls).union(*(members(b) for b in bases)) - {"__init__"}


def used_on(path: str, expression: str) -> set[str]:
    """The attributes read off `expression` (source text, e.g. "self.server") in the package file `path`, outside a
    `hasattr(expression, ...)` guard's branch."""
    tree = ast.parse((PACKAGE / path).read_text(encoding="utf-8"))
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Call) and getattr(node.test.func, "id", "") == \
                "hasattr" and ast.unparse(node.test.args[0]) == expression:
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and id(node) not in guarded
            and ast.unparse(node.value) == expression}


# Where each protocol's objects are used: (file, the expression that holds one).
USES = {
    ("RolloutServer", "IPCRolloutServer"): [("rollout/server_engine.py", "self.server")],
    ("ServedServer",): [("rollout/remote_server.py", "server"), ("rollout/remote_server.py", "self.server")],
    ("RolloutEngine",): [("training/trainer.py", "self.engine"), ("training/rollout_source.py", "self.engine"),
                         ("training/rollout_queue.py", "self.source.engine"), ("evaluation/run.py", "replica.engine")],
}
# The implementations of each protocol.
IMPLEMENTATIONS = {
    "RolloutServer": ["VLLMServer", "RemoteClient", "BuiltinServer"],
    "IPCRolloutServer": ["VLLMServer"],
    "ServedServer": ["VLLMServer", "BuiltinServer"],
    "RolloutEngine": ["BuiltinEngine", "ServerEngine", "VLLMEngine", "RemoteEngine"],
}


@pytest.mark.parametrize("protocols", list(USES), ids=lambda p: "+".join(p))
def test_every_member_used_on_a_protocols_object_is_declared(protocols):
    declared = set().union(*(members(p) for p in protocols))
    for path, expression in USES[protocols]:
        used = used_on(path, expression)
        assert used, f"{path}: nothing read off {expression} (has the code moved?)"
        assert used <= declared, f"{path}: {sorted(used - declared)} used on {expression}, not declared by " \
                                 f"{' or '.join(protocols)}"


@pytest.mark.parametrize("protocol", list(IMPLEMENTATIONS))
def test_every_implementation_defines_its_protocols_members(protocol):
    for implementation in IMPLEMENTATIONS[protocol]:
        missing = members(protocol) - members(implementation)
        assert not missing, f"{implementation} lacks {sorted(missing)} of {protocol}"

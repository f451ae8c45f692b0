"""What a checkpoint holds: `manifest.json` lists every file of the checkpoint directory with its size in bytes and
SHA-256, written last, when everything else is on disk. Before a load, `find_damage` re-reads the files and names the
first one that is missing, of another size (truncated by a full disk or an interrupted copy) or of another checksum.

Both walk every byte once; with a process group the files are shared out over its ranks (each rank hashes every
world-th file) and the results gathered, so a large checkpoint is hashed in parallel. A checkpoint written before
manifests existed has none: there is nothing to check it against, and `find_damage` reports nothing.
"""
from __future__ import annotations

import hashlib
import json
import os

from megatron_gtpo.atomic_files import write_atomically

MANIFEST = "manifest.json"
_READ_BYTES = 16 << 20


class DamagedCheckpoint(ValueError):
    """A checkpoint's files differ from its manifest (a user error: the message names the checkpoint and file)."""


def sha256_of(path: str) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _file_entry(path: str) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}


def _listed_files(directory: str) -> list[str]:
    paths = []
    for root, _dirs, files in os.walk(directory):
        paths += [os.path.relpath(os.path.join(root, name), directory) for name in files]
    return sorted(p for p in paths if p != MANIFEST)


def _shared_out(work, items: list, group) -> list:
    """work(items[rank::world]) on each rank of `group` (all of items without one), concatenated on every rank."""
    if group is None:
        return work(items)
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, work(items[rank::world]), group=group)
    return [item for part in gathered for item in part]


def write_manifest(directory: str, *, group=None) -> None:
    """Record every file now in `directory`. Collective over `group` (None: this process alone); the group's first
    rank writes the manifest (atomically)."""
    files = _listed_files(directory)
    if group is not None:  # every rank hashes the same list: the first rank's
        import torch.distributed as dist

        listed = [files]
        dist.broadcast_object_list(listed, src=dist.get_global_rank(group, 0), group=group)
        files = listed[0]
    entries = _shared_out(lambda paths: [(p, _file_entry(os.path.join(directory, p))) for p in paths], files, group)
    if group is None or _is_first(group):
        write_atomically(os.path.join(directory, MANIFEST), json.dumps({"files": dict(entries)}, indent=1))


def _is_first(group) -> bool:
    import torch.distributed as dist

    return dist.get_rank(group) == 0


def _problem(directory: str, name: str, expected: dict) -> str | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"{name} has {size:,} bytes where {expected['bytes']:,} were written (truncated or cut short)"
    if _file_entry(path)["sha256"] != expected["sha256"]:
        return f"{name} does not match the checksum it was written with (corrupted)"
    return None


def find_damage(directory: str, *, group=None) -> str | None:
    """None when every file of `directory`'s manifest is there as written (or when it has no manifest); otherwise a
    sentence naming the checkpoint and its first damaged file. Collective over `group` (None: this process alone)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"checkpoint {directory} is damaged: its {MANIFEST} is unreadable ({e})"
    problems = _shared_out(lambda names: [p for p in (_problem(directory, n, files[n]) for n in names) if p],
                           sorted(files), group)
    return f"checkpoint {directory} is damaged: {problems[0]}" if problems else None


def check_intact(directory: str, *, group=None) -> None:
    """Raise DamagedCheckpoint naming the checkpoint and file when `find_damage` finds one. Collective."""
    problem = find_damage(directory, group=group)
    if problem:
        raise DamagedCheckpoint(problem)

"""What a checkpoint holds: `manifest.json` lists every file of the checkpoint directory with its size in bytes and
SHA-256, written last, when everything else is on disk. Before a load, `find_damage` re-reads the files and names the
first one that is missing, of another size (truncated by a full disk or an interrupted copy) or of another checksum.

Both walk every byte once; with a process group the files are shared out over its ranks (each rank hashes every
world-th file) and the results gathered, so a large checkpoint is hashed in parallel. A checkpoint without a manifest
(written before manifests existed, or lost it) is checked against its own index instead: every data file that
torch.distributed.checkpoint's `.metadata` places tensors in must be there and long enough to hold them, which names a
missing or truncated file; damage inside a file is then met when reading it, and `reading` reports it as the
checkpoint's (DamagedCheckpoint, naming the checkpoint), not as the reader's EOFError.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager

from megatron_gtpo.atomic_files import write_atomically

MANIFEST = "manifest.json"
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index: where each stored tensor lies, file and bytes
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


def _index_damage(directory: str) -> str | None:
    """Without a manifest: the first data file that the torch_dist index (`.metadata`) places tensors in and that is
    missing or shorter than they need; None when all are there (or there is no index: not a torch_dist checkpoint)."""
    if not os.path.isfile(os.path.join(directory, DCP_INDEX)):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(directory).read_metadata().storage_data or {}
    except Exception as e:  # noqa: BLE001 - whatever a damaged index makes the reader raise
        return f"its {DCP_INDEX} is unreadable ({type(e).__name__}: {e})"
    ends: dict[str, int] = {}
    for item in storage.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing (its {DCP_INDEX} places data in it)"
        if os.path.getsize(path) < end:
            return (f"{name} has {os.path.getsize(path):,} bytes where its {DCP_INDEX} places data up to byte "
                    f"{end:,} (truncated or cut short)")
    return None


def find_damage(directory: str, *, group=None) -> str | None:
    """None when every file of `directory`'s manifest is there as written; otherwise a sentence naming the checkpoint
    and its first damaged file. Without a manifest, the data files its index names (`_index_damage`). Collective
    over `group` (None: this process alone)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        problem = _index_damage(directory)
        return f"checkpoint {directory} is damaged: {problem} (it has no {MANIFEST})" if problem else None
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"checkpoint {directory} is damaged: its {MANIFEST} is unreadable ({e})"
    problems = _shared_out(lambda names: [p for p in (_problem(directory, n, files[n]) for n in names) if p],
                           sorted(files), group)
    return f"checkpoint {directory} is damaged: {problems[0]}" if problems else None


@contextmanager
def reading(directory: str):
    """Around the reads of a checkpoint's data: what a read of a checkpoint without a manifest raises (nothing checked
    its bytes before) becomes a DamagedCheckpoint naming the checkpoint; with a manifest, which `check_intact`
    checked, it stays as raised."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: a reader's failure inside

    try:
        yield
    except DamagedCheckpoint:
        raise
    except (Exception, CheckpointException) as e:
        if os.path.isfile(os.path.join(directory, MANIFEST)):
            raise
        raise DamagedCheckpoint(f"checkpoint {directory} could not be read ({_first_failure(e)}): it has no "
                                f"{MANIFEST} to check its files against, and one of them is probably damaged") from e


def _first_failure(error: BaseException) -> str:
    """`Type: first sentence` of a reader's failure (torch's CheckpointException wraps each rank's, tracebacks and
    all)."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text.split('. ')[0]}".rstrip(": ")


def check_intact(directory: str, *, group=None) -> None:
    """Raise DamagedCheckpoint naming the checkpoint and file when `find_damage` finds one. Collective."""
    problem = find_damage(directory, group=group)
    if problem:
        raise DamagedCheckpoint(problem)

"""write_atomically: the target holds the old content or the new, never a part, and no temporary file stays."""
import os

import pytest

from megatron_gtpo.atomic_files import write_atomically


def test_text_bytes_and_writer_functions_replace_the_file(tmp_path):
    path = str(tmp_path / "out.txt")
    write_atomically(path, "first\n")
    write_atomically(path, "zweite Zeile é\n")
    assert open(path, encoding="utf-8").read() == "zweite Zeile é\n"
    write_atomically(path, b"\x00\x01")
    assert open(path, "rb").read() == b"\x00\x01"
    write_atomically(path, lambda tmp: open(tmp, "w").write("from a writer"))
    assert open(path).read() == "from a writer"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "out.txt")
    write_atomically(path, "old")

    def half_then_crash(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(path, half_then_crash)
    assert open(path).read() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_the_file_has_the_permissions_the_umask_gives(tmp_path, umask, mode):
    """As open() would create it: readable by the group on a shared cluster under the usual umask."""
    previous = os.umask(umask)
    try:
        write_atomically(str(tmp_path / "text"), "x")
        write_atomically(str(tmp_path / "written"), lambda tmp: open(tmp, "w").write("y"))
    finally:
        os.umask(previous)
    assert [os.stat(tmp_path / name).st_mode & 0o777 for name in ("text", "written")] == [mode, mode]

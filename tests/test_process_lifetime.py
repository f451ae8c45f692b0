"""Nothing of a run is left behind when it is killed with SIGKILL (process_lifetime.py): not its ranks, not
megatron-core's checkpoint writer processes, not a reward worker in the middle of an item. A run's processes are
found by a marker variable in their environment (children inherit it), wherever they were re-parented to."""
import glob
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from trainer_runs import train_command

MARKER = "MEGATRON_GTPO_TEST_RUN"
GRACE_S = 10.0  # what a killed run may take to end all its processes
HERE = os.path.dirname(os.path.abspath(__file__))


def reward_blocking_its_timer(response: str, reference: str) -> float:
    """Creates the file `reference` names, then blocks SIGALRM and sleeps: only its parent can stop it."""
    open(reference, "w").close()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)
    return 0.0


def _environ(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:  # empty for a zombie, which is dead already
        entries = f.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _processes(run: str) -> dict[int, dict]:
    """{pid: {"ppid", "environ", "cmdline"}} of every live process that carries the run's marker."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = _environ(pid)
            if environ.get(MARKER) != run:
                continue
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while being read
            continue
        found[int(pid)] = {"ppid": ppid, "environ": environ, "cmdline": cmdline}
    return found


def _survivors(run: str) -> dict[int, dict]:
    """The run's processes still alive GRACE_S from now (returns as soon as none is)."""
    deadline = time.monotonic() + GRACE_S
    while (alive := _processes(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _launch(command: list[str], log_path, **kwargs) -> tuple[str, subprocess.Popen]:
    run = uuid.uuid4().hex
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: run}),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
    return run, process


def _kill_leftovers(run: str) -> None:
    """A failed test leaves nothing running either: every process left is one this test started."""
    for pid in _processes(run):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _describe(processes: dict[int, dict]) -> str:
    return "\n".join(f"  {pid} (parent {p['ppid']}): {p['cmdline'][:160]}" for pid, p in sorted(processes.items()))


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["torchrun's process group", "rank 0"])
def test_a_run_killed_mid_checkpoint_leaves_no_process(tmp_path, victim):
    """A TP=2 run that checkpoints every step is killed while its second checkpoint's shards are being written (the
    first save's helpers, if any, are up by then): SIGKILL to torchrun's process group (torchrun alone: it puts its
    ranks in sessions of their own), as a job kill does, or to one rank, as the OOM killer does."""
    out = tmp_path / "run"
    run, torchrun = _launch(train_command(out, 2, ["parallel.tensor=2", "warm_start.steps=0", "steps=50",
                                                    "data.prompts_per_step=8", "checkpoint.save_every=1"]),
                            tmp_path / "log.txt")
    try:
        shards = str(out / "checkpoints" / "step_00000002.tmp-*" / "*.distcp")
        deadline = time.monotonic() + 300
        while not glob.glob(shards):
            assert torchrun.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.01)
        at_kill = _processes(run)
        if victim == "rank 0":
            [rank0] = [pid for pid, p in at_kill.items() if p["ppid"] == torchrun.pid and p["environ"]["RANK"] == "0"]
            os.kill(rank0, signal.SIGKILL)
        else:
            os.killpg(torchrun.pid, signal.SIGKILL)
        left = _survivors(run)
        assert not left, (f"{len(left)} processes of the run alive {GRACE_S:.0f} s after it was killed:\n"
                          f"{_describe(left)}\nat the kill:\n{_describe(at_kill)}")
    finally:
        _kill_leftovers(run)
        torchrun.wait(timeout=60)


PARENT_SCRIPT = f"""
import sys
sys.path.insert(0, {HERE!r})
from megatron_gtpo.rewards import RewardPool
from test_process_lifetime import reward_blocking_its_timer

RewardPool(reward_blocking_its_timer, num_workers=1, timeout_s=300).rewards(["hang"], [sys.argv[1]])
"""


def test_a_reward_worker_dies_with_its_killed_parent_mid_item(tmp_path):
    """A worker whose item blocks its own timer, parent killed: nothing ends the item, so only the parent-death
    signal ends the worker (between items, the closed pipe would)."""
    item_started = tmp_path / "item_started"
    run, parent = _launch([sys.executable, "-c", PARENT_SCRIPT, str(item_started)], tmp_path / "log.txt")
    try:
        deadline = time.monotonic() + 120
        while not item_started.exists():
            assert parent.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()
            time.sleep(0.05)
        at_kill = _processes(run)
        assert len(at_kill) == 2, _describe(at_kill)  # the parent and its worker
        parent.kill()
        left = _survivors(run)
        assert not left, f"alive {GRACE_S:.0f} s after the parent was killed:\n{_describe(left)}"
    finally:
        _kill_leftovers(run)
        parent.wait(timeout=60)


def test_a_child_whose_parent_died_before_it_asked_exits_at_once():
    """die_with_parent's race check: tied to its parent, it lives on; told of a parent that is not its parent any more
    (here: never was, pid 1), it exits."""
    script = ("import os; from megatron_gtpo.process_lifetime import die_with_parent; "
              "die_with_parent(os.getppid()); print('tied'); die_with_parent(1); print('still alive')")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (1, "tied\n", ""), res

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from distributed_harness import free_port, run_distributed, run_module


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 blocks here forever: the harness must not wait out the full timeout
    return rank


def _hang(rank, world_size):
    import time
    time.sleep(60)


@pytest.mark.slow
def test_collects_results_by_rank():
    assert run_distributed(_allreduce_rank, 2, timeout_s=120) == [3.0, 3.0]


def test_error_on_one_rank_is_reported_with_traceback():
    with pytest.raises(RuntimeError, match="boom on rank one"):
        run_distributed(_raise_on_rank_one, 2, timeout_s=120)


@pytest.mark.slow
def test_hang_is_a_timeout_naming_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish"):
        run_distributed(_hang, 2, timeout_s=2, init_process_group=False)


def test_run_module_gives_each_ranks_output_in_order_in_the_callers_directory_and_cleans_up(tmp_path, monkeypatch):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert run_module("rank_behaviour", ["ok"], 1, env=env, timeout_s=60).returncode == 0  # the fork server runs
    monkeypatch.chdir(tmp_path)  # after the fork server started elsewhere
    res = run_module("rank_behaviour", ["ok"], 2, env=env, timeout_s=60)
    assert res.returncode == 0
    lines = res.stdout.splitlines()
    assert lines[0::2] == [f"rank {rank} of 2, 1 thread(s), in {tmp_path}" for rank in (0, 1)]
    temporary = {line.removeprefix("temporary files in ") for line in lines[1::2]}
    assert len(temporary) == 1 and not os.path.exists(temporary.pop())  # one for the ranks, gone with the run
    assert res.stderr == "rank 0 on fd 2\nrank 1 on fd 2\n"


def test_run_module_ends_with_the_failed_ranks_status_and_stops_the_others():
    start = time.monotonic()
    res = run_module("rank_behaviour", ["fail"], 2, timeout_s=60, grace_s=1)
    assert res.returncode == 3 and time.monotonic() - start < 30  # rank 0 was stopped, not waited for
    assert res.stdout.startswith("rank 0 of 2") and "rank 1 of 2" in res.stdout


def test_free_port_is_free_and_below_the_ephemeral_range():
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        ephemeral_low = int(f.read().split()[0])
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < ephemeral_low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_run_module_starts_again_on_another_port_when_its_port_was_taken(tmp_path):
    res = run_module("rank_behaviour", ["port-taken", str(tmp_path / "failed once")], 2, timeout_s=60, grace_s=1)
    assert res.returncode == 0 and "EADDRINUSE" not in res.stderr, res.stderr


def test_run_module_times_out_as_subprocess_run_does():
    with pytest.raises(subprocess.TimeoutExpired):
        run_module("rank_behaviour", ["hang"], 2, timeout_s=2)



def _runs_on_two_ranks():
    return run_distributed(_allreduce_rank, 2)


def _through_a_helper():
    return _runs_on_two_ranks()


def _runs_a_subprocess():
    import subprocess
    return subprocess.run(["true"])


# Reached through a dict, not by name: the rule follows the functions a test names, and this test starts nothing.
RULE_CASES = {"harness": (_runs_on_two_ranks, True), "through a helper": (_through_a_helper, True),
              "subprocess": (_runs_a_subprocess, True), "a rank's work": (_allreduce_rank, False),
              "sleep": (_hang, False)}


def test_tests_that_start_processes_are_marked_slow_by_rule(request):
    """tests/conftest.py's rule: a test starts processes when its code, a function of the tests it calls (however
    deep) or one of its fixtures names a process starter; such a test is marked slow without a hand-written mark."""
    from conftest import starts_processes

    for case, (fn, starts) in RULE_CASES.items():
        assert starts_processes(fn) == starts, case
    assert starts_processes(getattr(request.module, "test_error_on_one_rank_is_reported_with_traceback"))
    assert request.node.get_closest_marker("slow") is None

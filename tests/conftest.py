"""The suite's rules for every test module.

`slow` by rule: a test that starts processes (the multi-process harness, torchrun, a subprocess) is marked slow at
collection, whether it does so itself, through a helper of the tests or through a fixture; tests that take seconds
in one process, or wait seconds on purpose, carry the mark by hand. `make test-fast` (-m "not slow") is what is left.
"""
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

import megatron_gtpo  # noqa: F401  (first, as in every process of the project: megatron_gtpo/_megatron_jit.py)

# The distributed harness lives next to the tests and is imported by module name in the ranks it starts.
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

from distributed_harness import share_of_cores  # noqa: E402  (found through the path above)

# Under pytest-xdist (`make test` runs `-n auto`) N workers with a thread per core each would oversubscribe the
# machine, and torch's threads spin while they wait (a 64x64 matmul on 2 threads took 80x longer beside one busy
# process): each worker, and the trainers its tests start (OMP_NUM_THREADS), keeps to its share.
_cores = share_of_cores()
if _cores < (os.cpu_count() or 1):
    os.environ["OMP_NUM_THREADS"] = str(_cores)
    torch.set_num_threads(_cores)

# Names whose use starts a process: the multi-process harness (distributed_harness.run_distributed, run_module), the
# trainer's runs (trainer_runs), the modules that start processes themselves, and the reward pool's workers.
PROCESS_STARTERS = frozenset({"run_distributed", "run_module", "run_train", "train_command", "subprocess",
                              "multiprocessing", "RewardPool"})


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names, stack = set(), [code]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def starts_processes(fn, seen: set | None = None) -> bool:
    """Whether `fn`, or a function of the tests it calls (a method of a class of the tests it names included),
    names a process starter (PROCESS_STARTERS)."""
    if isinstance(fn, type):
        seen = set() if seen is None else seen
        return any(starts_processes(method, seen) for method in vars(fn).values())
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    seen = set() if seen is None else seen
    if code is None or code in seen or not code.co_filename.startswith(TESTS_DIR):
        return False
    seen.add(code)
    names = _names(code)
    if names & PROCESS_STARTERS:
        return True
    return any(starts_processes(fn.__globals__[name], seen) for name in names if name in fn.__globals__)


def pytest_collection_modifyitems(config, items):
    # The tests marked `first` (minutes each) run first: pytest-xdist's worksteal hands each worker a contiguous
    # share of the collection and a worker that runs out takes the end of another's queue, so a minutes-long test
    # near the end of the collection left one worker idle while the other ran it.
    items.sort(key=lambda item: item.get_closest_marker("first") is None)
    for item in items:
        if item.get_closest_marker("slow") is not None or not isinstance(item, pytest.Function):
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        if any(starts_processes(fn) for fn in (item.function, *fixtures)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def world_of_one():
    """The default process group of this process alone (gloo): a rollout queue's experience agrees on its rounds over
    the data-parallel group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()

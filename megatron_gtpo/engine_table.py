"""The rollout engines by name (`rollout.engine`) and what each can do: the one table that every decision about an
engine reads (the config's choices and rules, the layout's rules, the trainer's engine setup, the planner, the check
of the packages a launch needs) instead of comparing its name.

    engine          generates on         options          routing  MoE  updates in  at      HF dir,    the trainer's
                                                          replay        generation  CP > 1  package    model
    builtin         the trainer's ranks  rollout.builtin  yes      yes  no          no      -          yes
    vllm            the trainer's GPUs   rollout.vllm     yes      yes  no          yes     yes, vllm  no
    vllm_remote     rollout servers      rollout.remote   yes      yes  yes         yes     -          no
    builtin_remote  rollout servers      rollout.remote   no       no   yes         yes     -          no

What the engines' objects answer themselves is not a column: whether a server has answered all it was asked
(`RolloutEngine.idle`: always, for one that answers within the call), whether a request is seeded
(`SamplingParams.per_request_seeds`: the built-in engines seed every response), and whether weight buckets go by CUDA
IPC (a colocated vLLM engine on CUDA: rollout/vllm_engine.py).

Imports nothing: the config, the layout rules and the planner read it on a machine without torch's GPU stack.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    """What a rollout engine can do (module doc)."""

    # Generates on processes (nodes) of its own, rollout servers, one per data-parallel replica: while the trainer
    # trains (rollout.schedule.max_staleness), reached through rollout.remote.
    remote: bool
    section: str  # the config section of its options: rollout.<section>
    # Reports each token's experts (model.moe.routing_replay: rollout); serves a mixture-of-experts model at all.
    routing_replay: bool
    moe: bool
    # Takes a weight update between the decode steps of its generations in flight
    # (rollout.schedule.update_during_generation): a rollout server's.
    updates_during_generation: bool
    # Generates for a trainer at parallel.context > 1 (the built-in engine in the trainer's processes would have to
    # slice positions per context-parallel rank).
    context_parallel: bool
    # Starts from a Hugging Face directory in the trainer's processes (rollout.vllm.hf_dir or model.hf_dir).
    needs_hf_directory: bool
    # The optional package the trainer's processes need for it (a rollout server's is its own node's).
    package: str | None
    # Runs on the trainer's GPUs at a tensor-parallel size of its own (rollout.vllm.tensor_parallel), whose engines
    # must tile each model replica (layout.check_layout).
    engine_tensor_parallel: bool = False
    # Samples with the trainer's own model chunks at its layout and weights (and records each token's entropy, by the
    # trainer's op): those entropies are the old policy's, and GTPO / GRPO-S may skip the old-policy pass
    # (training/old_policy.py). A server's copy of the weights runs other kernels, in other processes.
    trainers_model: bool = False


ENGINES: dict[str, Engine] = {
    "builtin": Engine(remote=False, section="builtin", routing_replay=True, moe=True, updates_during_generation=False,
                      context_parallel=False, needs_hf_directory=False, package=None, trainers_model=True),
    "vllm": Engine(remote=False, section="vllm", routing_replay=True, moe=True, updates_during_generation=False,
                   context_parallel=True, needs_hf_directory=True, package="vllm", engine_tensor_parallel=True),
    "vllm_remote": Engine(remote=True, section="remote", routing_replay=True, moe=True, updates_during_generation=True,
                          context_parallel=True, needs_hf_directory=False, package=None),
    "builtin_remote": Engine(remote=True, section="remote", routing_replay=False, moe=False,
                             updates_during_generation=True, context_parallel=True, needs_hf_directory=False,
                             package=None),
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)  # the config's choices of rollout.engine


def engines_that(capability: str) -> tuple[str, ...]:
    """The names of the engines with `capability` (a field of Engine), in table order."""
    return tuple(name for name, engine in ENGINES.items() if getattr(engine, capability))


def one_of(names: tuple[str, ...]) -> str:
    """'a, b or c', for a message's alternatives."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


REMOTE_ENGINES = engines_that("remote")  # rollout.engine values whose engines are rollout servers

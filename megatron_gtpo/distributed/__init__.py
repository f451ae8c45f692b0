"""Process-group-explicit distributed code: start-up, the CPU platform layer, vocab-parallel ops.

The only package that reads megatron.core.parallel_state. Importing it does not import megatron.
"""
from .parallel import (ParallelGroups, destroy_parallel, free_local_port, initialize_parallel, read_launch_env,
                       set_nccl_environment, warm_up_communicators)
from .platform import activate_cpu_platform
from .truncation import Truncation
from .vocab_parallel import vocab_parallel_logprobs_and_entropy

__all__ = [
    "ParallelGroups", "activate_cpu_platform", "destroy_parallel", "free_local_port", "initialize_parallel",
    "Truncation", "read_launch_env", "set_nccl_environment", "vocab_parallel_logprobs_and_entropy",
    "warm_up_communicators",
]

"""Rollouts: the engine protocol, the rollout record, built-in Megatron generation, the vLLM engine and the weight
sync to it.

Importing this package imports neither megatron nor vllm; `megatron_gtpo.rollout.vllm_engine` is the only module
that imports vllm.
"""
from .builtin import BuiltinEngine
from .engine import Rollout, RolloutEngine, SamplingParams
from .responses import FINISH_LENGTH, FINISH_STOP, Response, Responses
from .sampling import sample_next_tokens, sampling_log_probs

__all__ = ["BuiltinEngine", "FINISH_LENGTH", "FINISH_STOP", "Response", "Responses", "Rollout", "RolloutEngine",
           "SamplingParams", "sample_next_tokens", "sampling_log_probs"]

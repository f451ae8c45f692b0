"""Rollouts: the engine protocol, the rollout record, built-in Megatron generation, the vLLM engine and the weight
sync to it.

Importing this package imports neither megatron nor vllm; `megatron_gtpo.rollout.vllm_engine` is the only module
that imports vllm (`import_vllm_engine`: with one line saying what to do where vLLM does not import).
"""
import importlib.util
import sys

from .builtin import BuiltinEngine
from .engine import Rollout, RolloutEngine, SamplingParams
from .responses import FINISH_LENGTH, FINISH_STOP, Response, Responses
from .sampling import sample_next_tokens, sampling_log_probs


def vllm_missing(needed_by: str, instead: str, detail: str = "is not installed") -> str | None:
    """The one line saying that `needed_by` (a setting or flag) needs vLLM, which `detail` in this Python, how to
    install it and what to use `instead`; None where vLLM is installed (its import is not tried: see
    `import_vllm_engine`)."""
    if detail == "is not installed" and importlib.util.find_spec("vllm") is not None:
        return None
    return (f"{needed_by} needs vLLM, which {detail} in {sys.executable}: install it with pip install -e '.[vllm]' "
            f"(make setup-gpu installs the whole GPU set) or use {instead}")


def import_vllm_engine(needed_by: str, instead: str):
    """megatron_gtpo.rollout.vllm_engine; ValueError (a user error: one line, `vllm_missing`) where it does not
    import."""
    try:
        from . import vllm_engine
    except ImportError as e:
        raise ValueError(vllm_missing(needed_by, instead, f"does not import ({e})")) from e
    return vllm_engine


__all__ = ["BuiltinEngine", "FINISH_LENGTH", "FINISH_STOP", "Response", "Responses", "Rollout", "RolloutEngine",
           "SamplingParams", "import_vllm_engine", "sample_next_tokens", "sampling_log_probs", "vllm_missing"]

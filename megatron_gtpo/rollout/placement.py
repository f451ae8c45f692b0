"""Where a model replica's rollout engines run and which prompts each serves: pure arithmetic on ranks and lists.

A model replica (one data-parallel rank: TP x PP training ranks) runs E server engines (colocated vLLM, or one
remote server). Each engine is hosted by one training rank (its "host": the rank that owns the engine object, gets
the full weights from the weight sync, and answers for it) and, colocated on CUDA, uses the GPUs of `engine_tp`
consecutive ranks from the host's:

- `engine_tp` divides the training TP: every pipeline stage runs TP / engine_tp engines on its own GPUs, hosted by
  TP ranks 0, engine_tp, 2 engine_tp, ...; together the replica's engines cover all of its GPUs (the default
  engine_tp = TP gives one engine per stage). This is what lets every GPU of the job generate.
- `engine_tp` a multiple m x TP with m dividing PP: one engine per m consecutive stages, hosted by TP rank 0 of its
  first stage (engine_tp = TP x PP: a single engine per replica, on TP rank 0 of stage 0). On CUDA the stages' GPUs
  are consecutive only with one data-parallel replica (megatron's rank order tp-cp-ep-dp-pp puts the DP replicas
  between two stages), which `colocated_cuda_devices` checks.

Hosts are listed as (pp_rank, tp_rank) in engine order: stage-major, then TP rank. A replica's prompts are split
into E contiguous parts in that order (`split_counts`: the first len % E engines get one prompt more), and the
responses, concatenated in engine order, are in prompt order.
"""
from __future__ import annotations

from megatron_gtpo.layout import check_engine_span, check_engine_tensor_parallel


def engine_hosts(*, tp: int, pp: int, engine_tp: int) -> list[tuple[int, int]]:
    """(pp_rank, tp_rank) of each engine's host within a replica, in engine order (module doc). LayoutError (a
    ValueError) when `engine_tp` neither divides TP nor is a multiple of TP dividing TP x PP (the layout's rule,
    layout.check_engine_tensor_parallel)."""
    check_engine_tensor_parallel(tp=tp, pp=pp, engine_tp=engine_tp)
    if tp % engine_tp == 0:
        return [(stage, rank) for stage in range(pp) for rank in range(0, tp, engine_tp)]
    return [(stage, 0) for stage in range(0, pp, engine_tp // tp)]


def engine_members(*, tp: int, pp: int, engine_tp: int) -> list[list[tuple[int, int]]]:
    """(pp_rank, tp_rank) of the ranks whose GPUs each engine of a replica uses, host first, in engine order. On
    CUDA, vLLM worker k of an engine runs on the GPU of its k-th member (consecutive devices from the host's)."""
    members = []
    for stage, first in engine_hosts(tp=tp, pp=pp, engine_tp=engine_tp):
        stages = range(stage, stage + max(1, engine_tp // tp))
        members.append([(s, first + k) for s in stages for k in range(min(engine_tp, tp))])
    return members


def split_counts(num_prompts: int, num_engines: int) -> list[int]:
    """Prompts per engine, contiguous in prompt order: as even as possible, the first engines taking the remainder."""
    if num_engines < 1 or num_prompts < 0:
        raise ValueError(f"cannot split {num_prompts} prompts across {num_engines} engines")
    base, extra = divmod(num_prompts, num_engines)
    return [base + (i < extra) for i in range(num_engines)]


def split_prompts(prompts: list, num_engines: int) -> list[list]:
    """The contiguous part of `prompts` each engine serves (`split_counts`); concatenating the parts gives them
    back in order."""
    parts, start = [], 0
    for count in split_counts(len(prompts), num_engines):
        parts.append(prompts[start:start + count])
        start += count
    return parts


def colocated_cuda_devices(*, device_index: int, device_count: int, engine_tp: int, tp: int, dp: int,
                           visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a colocated engine hosted by the process on local device `device_index` (of this
    process's `device_count` visible devices; `visible` the current CUDA_VISIBLE_DEVICES, if set): the engine's
    `engine_tp` consecutive devices from the host's. vLLM numbers its workers' devices from 0 of what it is given,
    so without this every engine on a node would share devices 0..engine_tp-1. LayoutError (a ValueError) for an
    engine spanning pipeline stages at DP > 1 (layout.check_engine_span)."""
    check_engine_span(tp=tp, engine_tp=engine_tp, dp=dp)
    if device_index + engine_tp > device_count:
        raise ValueError(f"a colocated vLLM engine at tensor parallel size {engine_tp} from GPU {device_index} needs "
                         f"more than the {device_count} GPUs of this node")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(device_count)]
    if len(ids) < device_count:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names fewer than the {device_count} visible GPUs")
    return ",".join(ids[device_index:device_index + engine_tp])

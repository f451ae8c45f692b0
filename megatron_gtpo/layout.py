"""The parallel layout and every rule it must follow, in one function.

`check_layout` is what the config validation (config.py), the process-group setup (distributed/parallel.py), the
model builder (models/qwen.py), the checkpoint tools and the planner (planning/) call: each passes what it knows
(the model's shape, the batch, the rollout engines) and gets the same rules with the same messages, named by the
config keys a user sets. Rules whose inputs a caller does not pass are not checked. rollout/placement.py, which places
the colocated engines, holds them to the same rules (`check_engine_tensor_parallel`, `check_engine_span`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.engine_table import ENGINES, engines_that, one_of


# How Transformer Engine's attention exchanges keys and values over the context-parallel ranks (megatron-core's
# cp_comm_type): a ring of point-to-point sends, one all-gather, all-to-all over heads, or both.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


class LayoutError(ValueError):
    """A parallel layout the model, megatron-core or the rollout engines cannot run; the message names the keys."""


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions. `data` is None where the world size is not known yet (a config on its
    own). `expert` (EP) and `expert_tensor` (ETP; None: TP, megatron's default) place a mixture-of-experts model's
    experts: megatron-core lays the expert part of every pipeline stage's TP x CP x DP ranks out again as ETP x EP x
    expert-DP, so each EP rank holds num_experts / EP experts, split over ETP ranks, and the tokens of its EP group
    travel to them by all-to-all (`check_layout` has the rules). `context` (CP) splits every sequence over that many
    ranks, each holding 2 of its 2 x CP chunks (megatron's load-balanced layout); the world is TP x PP x CP x DP."""

    tensor: int = 1
    pipeline: int = 1
    data: int | None = 1
    virtual_pipeline: int | None = None
    sequence_parallel: bool = False
    expert: int = 1
    expert_tensor: int | None = None
    context: int = 1

    @property
    def expert_tensor_size(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @classmethod
    def from_world_size(cls, world_size: int, *, tensor: int = 1, pipeline: int = 1, context: int = 1,
                        **rest) -> "ParallelLayout":
        """The layout whose data-parallel size fills `world_size` processes; LayoutError when TP x PP x CP does not
        divide it."""
        _check_sizes(tensor, pipeline, context)
        if world_size % (tensor * pipeline * context):
            raise LayoutError(f"parallel: world size {world_size} is not divisible by tensor x pipeline x context = "
                              f"{tensor} x {pipeline} x {context}")
        return cls(tensor=tensor, pipeline=pipeline, data=world_size // (tensor * pipeline * context),
                   context=context, **rest)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.context * (self.data or 1)


@dataclass(frozen=True)
class RolloutLayout:
    """Where the rollout engines run: `engine` as rollout.engine; `engine_tensor_parallel` is a colocated vLLM
    engine's TP size (rollout.vllm.tensor_parallel); `remote_servers` the number of rollout.remote.addresses."""

    engine: str
    engine_tensor_parallel: int = 1
    remote_servers: int = 0


def check_layout(layout: ParallelLayout, *, shape=None, prompts_per_step: int | None = None,
                 mini_batches_per_step: int = 1, rollout: RolloutLayout | None = None, training: bool = False,
                 routing_replay: bool = False) -> None:
    """LayoutError naming the problem when `layout` cannot run.

    Always: sizes >= 1 (CP included); virtual pipeline needs PP >= 2; sequence parallelism needs TP > 1; ETP divides
    TP. With `shape` (an object with num_attention_heads, num_query_groups, ffn_hidden_size, num_layers and moe:
    models.qwen.ModelShape): the heads, KV heads and FFN width divide by TP, the layers by PP x VPP; experts (EP > 1
    or an ETP of its own) need a mixture-of-experts model, whose experts divide by EP and expert width by ETP. With a
    known data size: ETP x EP divides TP x CP x DP (megatron-core's expert layout of a stage's ranks); `training` such a
    model at TP > 1 needs sequence parallelism (megatron-core's MoE layer refuses to train without). With
    `prompts_per_step`: the prompts split evenly over the mini-batches, and with a known data size over DP x
    mini-batches. With `rollout`: `routing_replay` (model.moe.routing_replay: rollout) and a mixture-of-experts
    model (`shape`'s) need an engine other than builtin_remote (whether vLLM can return its routing is checked when
    it starts: vllm_engine.routed_experts_unavailable); with a known data size, colocated vLLM engines tile the
    replica's GPUs (`check_engine_tensor_parallel`, `check_engine_span`) and, with `shape`, split the attention heads;
    remote engines have one server per data-parallel replica."""
    tp, pp, dp, vpp = layout.tensor, layout.pipeline, layout.data, layout.virtual_pipeline
    _check_sizes(tp, pp, layout.context)
    _need(dp is None or dp >= 1, f"parallel: the data-parallel size must be >= 1, got {dp}")
    _need(vpp is None or (vpp >= 1 and pp >= 2),
          f"parallel.virtual_pipeline: needs parallel.pipeline >= 2 and a value >= 1, got {vpp} with pipeline {pp}")
    _need(not layout.sequence_parallel or tp > 1, "parallel.sequence_parallel: needs parallel.tensor > 1")
    _check_experts(layout, shape, training)
    if shape is not None:
        _check_model_split(shape, tp, pp * (vpp or 1), vpp)
    if prompts_per_step is not None:
        _check_prompt_split(prompts_per_step, mini_batches_per_step, dp)
    if rollout is not None:
        _check_rollout(rollout, tp, pp, dp, shape, routing_replay, layout.context)


def check_engine_tensor_parallel(*, tp: int, pp: int, engine_tp: int) -> None:
    """LayoutError unless colocated engines of `engine_tp` GPUs each tile a replica of TP x PP ranks
    (rollout/placement.py places them): `engine_tp` divides TP (TP / engine_tp engines per pipeline stage) or is a
    multiple of TP dividing TP x PP (one engine over whole stages)."""
    _need(engine_tp >= 1, f"rollout.vllm.tensor_parallel: the engine's tensor parallel size must be >= 1, got "
                          f"{engine_tp}")
    _need(tp % engine_tp == 0 or (engine_tp % tp == 0 and pp % (engine_tp // tp) == 0),
          f"rollout.vllm.tensor_parallel: a rollout engine at tensor parallel size {engine_tp} must divide the "
          f"training tensor parallel size {tp} (engines per pipeline stage) or be a multiple of it dividing tensor x "
          f"pipeline = {tp * pp} (one engine over several whole stages)")


def check_engine_span(*, tp: int, engine_tp: int, dp: int, cp: int = 1) -> None:
    """LayoutError for an engine over several pipeline stages (`engine_tp` > TP) at DP > 1 or CP > 1: megatron's
    rank order (tp-cp-ep-dp-pp) puts the DP replicas and the CP ranks between two stages, so its GPUs would not be
    consecutive."""
    _need(engine_tp <= tp or dp * cp == 1,
          f"rollout.vllm.tensor_parallel: an engine at tensor parallel size {engine_tp} spans pipeline stages, whose "
          f"GPUs are consecutive only with one data-parallel replica and parallel.context 1 (got {dp} replicas, "
          f"context {cp}); use a divisor of parallel.tensor = {tp}")


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise LayoutError(message)


def _check_sizes(tp: int, pp: int, cp: int = 1) -> None:
    _need(tp >= 1 and pp >= 1, f"parallel.tensor / parallel.pipeline: must be >= 1, got {tp} / {pp}")
    _need(cp >= 1, f"parallel.context: must be >= 1, got {cp}")


def _check_experts(layout: ParallelLayout, shape, training: bool) -> None:
    ep, etp, tp, cp, dp = layout.expert, layout.expert_tensor_size, layout.tensor, layout.context, layout.data
    _need(ep >= 1 and etp >= 1, f"parallel.expert / parallel.expert_tensor: must be >= 1, got {ep} / {etp}")
    # Expert-TP ranks nest inside a TP group: a rank's expert shard is then a slice of its TP group's (the weight
    # sync and the converters rely on it).
    _need(tp % etp == 0, f"parallel.expert_tensor: {etp} must divide parallel.tensor = {tp}")
    if dp is not None:
        _need((tp * cp * dp) % (etp * ep) == 0,
              f"parallel.expert: expert_tensor x expert = {etp} x {ep} must divide tensor x context x data-parallel "
              f"size = {tp} x {cp} x {dp} (megatron-core lays each pipeline stage's ranks out again for the experts)")
    if shape is None:
        return
    moe = getattr(shape, "moe", None)
    if moe is None:
        _need(ep == 1 and layout.expert_tensor in (None, tp),
              f"parallel.expert / parallel.expert_tensor: the model has no experts (a dense model); got expert {ep}, "
              f"expert_tensor {layout.expert_tensor}")
        return
    _need(moe.num_experts % ep == 0,
          f"parallel.expert: the model's {moe.num_experts} experts are not divisible by EP={ep}")
    _need(moe.ffn_hidden_size % etp == 0,
          f"parallel.expert_tensor: moe_intermediate_size {moe.ffn_hidden_size} is not divisible by ETP={etp}")
    _need(not training or tp == 1 or layout.sequence_parallel,
          f"parallel.sequence_parallel: a mixture-of-experts model trains at TP > 1 only with "
          f"parallel.sequence_parallel: true (megatron-core's MoE layer refuses otherwise); got TP={tp}")


def _check_model_split(shape, tp: int, layer_chunks: int, vpp: int | None) -> None:
    where = "parallel.tensor / parallel.pipeline: the model cannot be split so"
    _need(shape.num_attention_heads % tp == 0,
          f"{where}: {shape.num_attention_heads} attention heads are not divisible by TP={tp}")
    _need(shape.num_query_groups % tp == 0,
          f"{where}: {shape.num_query_groups} query groups (num_key_value_heads) are not divisible by TP={tp}")
    # A mixture-of-experts model has no dense MLP (its experts' width is _check_experts' rule).
    _need(getattr(shape, "moe", None) is not None or shape.ffn_hidden_size % tp == 0,
          f"{where}: intermediate_size {shape.ffn_hidden_size} is not divisible by TP={tp}")
    _need(shape.num_layers % layer_chunks == 0,
          f"{where}: {shape.num_layers} layers are not divisible by "
          + (f"PP x VPP = {layer_chunks // vpp} x {vpp}" if vpp else f"PP={layer_chunks}"))


def _check_prompt_split(prompts_per_step: int, mini_batches_per_step: int, dp: int | None) -> None:
    if dp is None:
        _need(prompts_per_step % mini_batches_per_step == 0,
              f"data.prompts_per_step ({prompts_per_step}) must be divisible by data.mini_batches_per_step "
              f"({mini_batches_per_step})")
        return
    _need(prompts_per_step % (dp * mini_batches_per_step) == 0,
          f"data.prompts_per_step ({prompts_per_step}) must be divisible by data-parallel size x "
          f"mini_batches_per_step = {dp} x {mini_batches_per_step}")


def _check_rollout(rollout: RolloutLayout, tp: int, pp: int, dp: int | None, shape, routing_replay: bool,
                   cp: int) -> None:
    # The one place this is decided: which engines serve a mixture-of-experts model, and which replay its routing.
    moe = getattr(shape, "moe", None) is not None
    engine = ENGINES[rollout.engine]
    _need(not routing_replay or engine.routing_replay,
          f"rollout.engine: {rollout.engine} does not record routing for model.moe.routing_replay: rollout (the "
          f"built-in engine's routing stays on the rank that computed it); use "
          f"{one_of(engines_that('routing_replay'))}, or model.moe.routing_replay: none")
    _need(not moe or engine.moe,
          f"rollout.engine: {rollout.engine} is not supported for a mixture-of-experts model (a built-in rollout "
          f"server has not been built or tested for one); use {one_of(engines_that('moe'))}")
    if dp is None:
        return
    if engine.remote:
        _need(rollout.remote_servers == dp,
              f"rollout.remote.addresses: {rollout.remote_servers} given, but there are {dp} data-parallel "
              f"replicas (one rollout server each)")
    if not engine.engine_tensor_parallel:
        return
    vtp = rollout.engine_tensor_parallel
    _need(shape is None or (vtp >= 1 and shape.num_attention_heads % vtp == 0),
          f"rollout.vllm.tensor_parallel: {vtp} must divide the model's {getattr(shape, 'num_attention_heads', 0)} "
          f"attention heads")
    check_engine_tensor_parallel(tp=tp, pp=pp, engine_tp=vtp)
    check_engine_span(tp=tp, engine_tp=vtp, dp=dp, cp=cp)

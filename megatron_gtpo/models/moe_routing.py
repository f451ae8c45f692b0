"""The routers of a mixture-of-experts model: recording which experts each token went to, replaying recorded choices,
and measuring the routing (expert load, router entropy). One module drives megatron-core's RouterReplay hooks, which
models/moe.py builds into every router (inert until given an action here).

Token order. A router sees its layer's hidden states [L, B, H] (sequence position major) as L x B tokens: token
l * B + b is position l of row b. Recorded choices come out in that order, replay targets go in in it (with sequence
parallelism each TP rank's router sees its own 1/TP of the positions).

Experts are named by their global index; a rank's routers are its MoE layers, named by megatron's global layer
number (1-based), in increasing order: the M axis of `RoutedExperts`. Every rank of one pipeline stage has the same
routers, so choices recorded on a rank are replayed on the same rank (or one of the same stage).

Activation recompute (model.recompute_activations: megatron's full recompute) runs every layer's forward again in the
backward pass, by which time the pipeline schedule (1F1B) may have run later micro-batches' forwards. A replayed
micro-batch's choices are therefore also queued per router in forward order (megatron's `replay_backward_list`), and
a router running inside a recompute takes the oldest (megatron's REPLAY_BACKWARD): each micro-batch's backward
comes in its forward order, for every model chunk.

megatron's fused router (`moe_router_fusion`, Transformer Engine's kernel) neither records nor replays: recording and
replay refuse it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The dtype recorded choices are kept in: expert indices < 2**15.
EXPERT_INDEX_DTYPE = torch.int16


@dataclass
class RoutedExperts:
    """The experts chosen for a span of tokens at each of a rank's MoE layers: `experts` int [..., M, k] (global
    expert indices, the router's top-k order), M ordered as `layers` (megatron's global layer numbers). `recorded`
    (bool [...], optional): which tokens' choices were recorded, the others' are filler (`filler_experts`)."""

    layers: tuple[int, ...]
    experts: torch.Tensor
    recorded: torch.Tensor | None = None


def routers(model_chunks: list) -> list:
    """The TopKRouters of `model_chunks` (DDP-wrapped or not), in increasing layer number. Found once per chunk (a
    large model has many modules to walk) and remembered on it."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for chunk in model_chunks:
        if "_moe_routers" not in chunk.__dict__:
            chunk.__dict__["_moe_routers"] = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
        found += chunk.__dict__["_moe_routers"]
    return sorted(found, key=lambda router: router.layer_number)


def routed_layers(model_chunks: list) -> tuple[int, ...]:
    """The layer numbers of this rank's MoE layers (the M axis of what it records and replays)."""
    return tuple(router.layer_number for router in routers(model_chunks))


class Recorder:
    """Records the experts every router of `model_chunks` picks at each forward (megatron's RECORD action): `take()`
    after a forward gives that forward's choices as [L * B, M, k] (token order: module doc)."""

    def __init__(self, model_chunks: list):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.routers = routers(model_chunks)
        self.layers = tuple(router.layer_number for router in self.routers)
        for router in self.routers:
            _check_unfused(router)
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def take(self) -> torch.Tensor:
        chosen = [router.router_replay.get_recorded_indices() for router in self.routers]
        for router in self.routers:
            router.router_replay.clear_indices()
        return torch.stack(chosen, dim=1).to(EXPERT_INDEX_DTYPE)

    def close(self) -> None:
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


@contextlib.contextmanager
def recording(model_chunks: list, enabled: bool = True):
    """A Recorder for the duration (None when not `enabled` or the model has no experts); the routers route on
    their own again afterwards."""
    recorder = Recorder(model_chunks) if enabled and routers(model_chunks) else None
    try:
        yield recorder
    finally:
        if recorder is not None:
            recorder.close()


def filler_experts(num_tokens: int, layers: int, topk: int, device) -> torch.Tensor:
    """Expert choices [num_tokens, layers, k] for tokens nobody recorded (padding, and the last token of a sequence,
    which generation never fed back): experts 0..k-1. Their outputs are never scored (causal attention: no other
    token sees a later one, and each token's expert outputs are its own)."""
    return torch.arange(topk, dtype=EXPERT_INDEX_DTYPE, device=device).expand(num_tokens, layers, topk)


def record_from_vllm(routed_experts_NLK, *, prompt_length: int, response_length: int, layers: tuple[int, ...],
                     topk: int, device=None) -> torch.Tensor:
    """One vLLM completion's routing as the built-in engine's record (its rollouts' routing, engine.Rollout): int16
    [P + R - 1, M, k] on `device`, M ordered as `layers` (megatron's 1-based global layer numbers of this rank's MoE
    layers).

    `routed_experts_NLK` is vLLM's `CompletionOutput.routed_experts` (an engine built with
    enable_return_routed_experts; numpy uint8 [N, num_hidden_layers, k], uint16 above 256 experts): one row per
    position the engine fed, its 0-based layer axis over every decoder layer. With the request's default
    routed_experts_prompt_start = 0 those are the prompt's P positions (prefix-cached ones included: vLLM keeps
    their routing beside the KV cache) and every generated token but the last, never fed: N = P + R - 1, the
    record's positions. Neither side has padding (the built-in engine drops its left pads from the record); the
    step batch fills the positions nobody fed (`filler_experts`). ValueError when there are none, the rows are not
    those positions or the layers and top-k are not the model's."""
    if routed_experts_NLK is None:
        raise ValueError("vLLM returned no routed experts for a completion (an engine built without "
                         "enable_return_routed_experts?)")
    experts_NLK = torch.as_tensor(routed_experts_NLK)
    expected = prompt_length + response_length - 1
    if experts_NLK.dim() != 3 or experts_NLK.shape[0] != expected or experts_NLK.shape[2] != topk:
        raise ValueError(f"vLLM's routed experts {tuple(experts_NLK.shape)} are not one row per fed position of a "
                         f"{prompt_length}-token prompt and {response_length}-token response ({expected} x layers x "
                         f"top-{topk})")
    if not layers or min(layers) < 1 or max(layers) > experts_NLK.shape[1]:
        raise ValueError(f"MoE layers {layers} are not among the {experts_NLK.shape[1]} layers vLLM reports")
    index = torch.tensor([layer - 1 for layer in layers])
    return experts_NLK.index_select(1, index).to(device=device, dtype=EXPERT_INDEX_DTYPE)


def prepare_routers(model, routed: RoutedExperts | None, token_mask_LB: torch.Tensor | None) -> None:
    """Before a forward of `model` (one model chunk) on a micro-batch of L x B tokens: with `routed` (experts
    [B, L, M, k] of this rank's MoE layers), every router takes the recorded choices for its layer (megatron's
    REPLAY_FORWARD; the probabilities are the router's own, renormalised over the replayed experts as over its own
    top-k), and queues them for the layer's recompute in the backward pass when it will have one (module doc);
    without, the routers choose. `token_mask_LB` (bool [L, B]: real tokens) is what `RouterStatistics` counts, less
    the tokens replayed with filler choices."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    chunk_routers = routers([model])
    if token_mask_LB is not None and routed is not None and routed.recorded is not None:
        token_mask_LB = token_mask_LB & routed.recorded.transpose(0, 1)
    for router in chunk_routers:
        router.token_mask_T = None if token_mask_LB is None else _local_tokens(token_mask_LB.reshape(-1), router)
        replay = router.router_replay
        replay.target_topk_idx = None  # a recording (`Recorder`) goes on
        if routed is None:
            if _replaying(replay):
                replay.clear_router_replay_action()
            continue
        _check_unfused(router)
        if "replays_in_recompute" not in router.__dict__:
            router.register_forward_pre_hook(_replay_forward_or_recomputed)
            router.replays_in_recompute = True
        m = routed.layers.index(router.layer_number)
        target_TK = routed.experts[:, :, m].transpose(0, 1).reshape(-1, routed.experts.shape[-1])
        replay.target_topk_idx = _local_tokens(target_TK, router).long()
        if router.training and router.config.recompute_granularity == "full" and torch.is_grad_enabled():
            replay.replay_backward_list.append(replay.target_topk_idx)  # popped by the recompute
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _replay_forward_or_recomputed(router, inputs) -> None:
    """A forward pre-hook of every router that has replayed: inside megatron's activation recompute in the backward
    pass (its checkpoint re-running the layer with gradients on; the first run has them off), replay the oldest
    queued choices (REPLAY_BACKWARD), else the micro-batch's own (REPLAY_FORWARD). RuntimeError when the choices are
    not for the tokens the router sees (a pass that queued other micro-batches than it recomputes)."""
    from megatron.core.tensor_parallel.random import is_checkpointing
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = router.router_replay
    recomputing = is_checkpointing() and torch.is_grad_enabled()
    if recomputing and replay.replay_backward_list:
        replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        choices = replay.replay_backward_list[0]
    elif _replaying(replay):
        if recomputing:
            raise RuntimeError(f"routing replay: layer {router.layer_number} is recomputed in the backward pass, but "
                               f"its forward queued no choices for it")
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        choices = replay.target_topk_idx
    else:
        return
    tokens = inputs[0].numel() // inputs[0].shape[-1]
    if choices.shape[0] != tokens:
        raise RuntimeError(f"routing replay: layer {router.layer_number} sees {tokens} tokens but replays the "
                           f"choices of {choices.shape[0]}")


def _replaying(replay) -> bool:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return replay.router_replay_action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)


def _check_unfused(router) -> None:
    if router.config.moe_router_fusion:
        raise ValueError("routing replay and recording need moe_router_fusion off: megatron's fused router "
                         "(Transformer Engine's top-k kernel) bypasses RouterReplay, so it would neither record nor "
                         "replay")


def _local_tokens(values_T: torch.Tensor, router) -> torch.Tensor:
    """This TP rank's tokens of an [L * B, ...] tensor under sequence parallelism (a contiguous 1/TP of the
    positions); all of them otherwise."""
    if not router.config.sequence_parallel or router.tp_group.size() == 1:
        return values_T
    size = router.tp_group.size()
    per_rank = values_T.shape[0] // size
    start = router.tp_group.rank() * per_rank
    return values_T[start:start + per_rank]


class RouterStatistics:
    """Per MoE layer of `model_chunks`, while installed (a context manager): the tokens routed to each expert and
    the summed entropy of the router's distribution over all experts, over the real tokens of every forward
    (`prepare_routers`' token mask; an activation recompute in the backward pass is no new forward). On the device;
    `totals()` gives them as [M, E] counts, [M] entropy sums and [M] token counts."""

    def __init__(self, model_chunks: list):
        self.routers = routers(model_chunks)
        self.layers = tuple(router.layer_number for router in self.routers)
        self._hooks = []
        self.counts_ME = self.entropy_M = self.tokens_M = None

    def __enter__(self):
        if self.routers:
            config = self.routers[0].config
            device = self.routers[0].weight.device
            self.counts_ME = torch.zeros(len(self.routers), config.num_moe_experts, dtype=torch.float64,
                                         device=device)
            self.entropy_M = torch.zeros(len(self.routers), dtype=torch.float64, device=device)
            self.tokens_M = torch.zeros_like(self.entropy_M)
        for m, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._hook(m)))
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _hook(self, m: int):
        from megatron.core.tensor_parallel.random import is_checkpointing

        def hook(router, inputs, outputs):
            if is_checkpointing() and torch.is_grad_enabled():  # a recompute in the backward: counted in its forward
                return
            _, routing_map_TE = outputs
            with torch.no_grad():
                logits_TE = router.gating(inputs[0]).reshape(-1, router.config.num_moe_experts).float()
                logp_TE = torch.log_softmax(logits_TE, dim=-1)
                entropy_T = -(logp_TE.exp() * logp_TE).sum(-1)
                mask_T = getattr(router, "token_mask_T", None)
                if mask_T is None:
                    mask_T = torch.ones_like(entropy_T, dtype=torch.bool)
                self.counts_ME[m] += (routing_map_TE & mask_T[:, None]).sum(0).double()
                self.entropy_M[m] += torch.where(mask_T, entropy_T, 0.0).sum().double()
                self.tokens_M[m] += mask_T.sum().double()
        return hook

    def per_layer(self, dp_group, tp_group=None) -> dict[int, tuple[float, float]]:
        """{layer number: (load imbalance, mean router entropy)} over every rank's tokens: the totals are summed
        over the data-parallel group (and over `tp_group`, given under sequence parallelism, where each TP rank
        routes its own tokens), one all-reduce each and one host read. Load imbalance: the most-loaded expert's
        routed tokens over the mean expert's (1 = balanced, E / k = every token to the same k experts); entropy: of
        the router's distribution over all experts, in nats (ln E = uniform)."""
        if not self.routers:
            return {}
        totals = torch.cat([self.counts_ME, self.entropy_M[:, None], self.tokens_M[:, None]], dim=1)
        for group in (dp_group, tp_group):
            if group is not None:
                dist.all_reduce(totals, group=group)
        counts_ME, entropy_M, tokens_M = totals[:, :-2], totals[:, -2], totals[:, -1]
        imbalance_M = counts_ME.amax(1) / counts_ME.mean(1).clamp(min=1e-12)
        values = torch.stack([imbalance_M, entropy_M / tokens_M.clamp(min=1)], dim=1).tolist()
        return {layer: (imbalance, entropy) for layer, (imbalance, entropy) in zip(self.layers, values)}

"""TE's fused router kernels, imported by name by megatron-core (TE >= 2.7); the project keeps moe_router_fusion off,
so they are never called, and the stand-in does not model them."""


def _not_modelled(*args, **kwargs):
    raise NotImplementedError("TE's fused router kernels are not part of the stand-in (tests/te_standin)")


fused_topk_with_score_function = fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = _not_modelled

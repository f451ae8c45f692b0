"""The float64 references of the vocab-parallel log-prob + entropy op, by torch autograd: shared by
test_vocab_parallel.py, test_truncation.py and the GPU check tests/gpu/test_gpu_model.py."""
import math

import torch


def float64_reference(case):
    """float64 log-probs, entropies and the three gradients, on the un-padded vocabulary, by torch autograd; with
    case["truncation"] (top_k, top_p), the log-probs of the truncated distribution (`truncated_kept_mask`)."""
    logits = case["logits"].clone().requires_grad_()
    z = logits[..., : case["vocab_size"]] / case["temperature"]
    log_p = torch.log_softmax(z, dim=-1)
    entropy = -(torch.softmax(z, dim=-1) * log_p).sum(-1)
    targets_1 = case["targets"].unsqueeze(-1)
    if case.get("truncation") is None:
        logprobs = log_p.gather(-1, targets_1).squeeze(-1)
    else:  # the kept set is a selection: fixed, no gradient through it; the target is always in
        keep = truncated_kept_mask(z.detach(), *case["truncation"]).scatter(-1, targets_1, True)
        logprobs = torch.log_softmax(z.masked_fill(~keep, -math.inf), dim=-1).gather(-1, targets_1).squeeze(-1)
    grad_lp, = torch.autograd.grad((logprobs * case["weight_lp"]).sum(), logits, retain_graph=True)
    grad_ent, = torch.autograd.grad((entropy * case["weight_ent"]).sum(), logits, retain_graph=True)
    grad_mix, = torch.autograd.grad((0.3 * logprobs * case["weight_lp"] - 1.7 * entropy * case["weight_ent"]).sum(),
                                    logits)
    return dict(logprobs=logprobs.detach(), entropy=entropy.detach(), grad_lp=grad_lp, grad_ent=grad_ent,
                grad_mix=grad_mix)


def truncated_kept_mask(z, top_k, top_p):
    """bool [..., V]: the tokens top-k then top-p keep, written from the definition, one row at a time in float64:
    the tokens by decreasing z, ties by increasing id (a stable sort); the first top_k of them; then the shortest
    prefix of those whose renormalised probability reaches top_p (a token is kept iff the ones before it hold less)."""
    flat = z.double().reshape(-1, z.shape[-1])
    keep = torch.zeros(flat.shape, dtype=torch.bool)
    for i, order in enumerate(torch.sort(flat, dim=-1, descending=True, stable=True).indices):
        survivors = order[:top_k] if 0 < top_k < len(order) else order
        if top_p < 1:
            probs = torch.softmax(flat[i, survivors], 0)
            mass_before = torch.cumsum(probs, 0) - probs
            survivors = survivors[:int((mass_before < top_p).sum())]
        keep[i, survivors] = True
    return keep.view(z.shape)


def vllm_style_kept_mask(z, top_k, top_p):
    """The same selection the way vLLM's PyTorch sampler states it (an independent formulation for tie-free rows):
    ascending order, top-k drops values below the k-th largest, top-p drops the tokens whose cumulative probability
    from the smallest up is at most 1 - top_p, always keeping the largest."""
    ascending, order = torch.sort(z.double(), dim=-1)
    if 0 < top_k < z.shape[-1]:
        ascending = ascending.masked_fill(ascending < ascending[..., -top_k, None], -math.inf)
    if top_p < 1:
        dropped = torch.cumsum(torch.softmax(ascending, -1), -1) <= 1 - top_p
        dropped[..., -1] = False
        ascending = ascending.masked_fill(dropped, -math.inf)
    return torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, ascending > -math.inf)

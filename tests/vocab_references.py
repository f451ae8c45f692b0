"""The float64 reference of the vocab-parallel log-prob + entropy op, by torch autograd: shared by
test_vocab_parallel.py and the GPU check tests/gpu/test_gpu_model.py."""
import torch


def float64_reference(case):
    """float64 log-probs, entropies and the three gradients, on the un-padded vocabulary, by torch autograd."""
    logits = case["logits"].clone().requires_grad_()
    z = logits[..., : case["vocab_size"]] / case["temperature"]
    log_p = torch.log_softmax(z, dim=-1)
    logprobs = log_p.gather(-1, case["targets"].unsqueeze(-1)).squeeze(-1)
    entropy = -(torch.softmax(z, dim=-1) * log_p).sum(-1)
    grad_lp, = torch.autograd.grad((logprobs * case["weight_lp"]).sum(), logits, retain_graph=True)
    grad_ent, = torch.autograd.grad((entropy * case["weight_ent"]).sum(), logits, retain_graph=True)
    grad_mix, = torch.autograd.grad((0.3 * logprobs * case["weight_lp"] - 1.7 * entropy * case["weight_ent"]).sum(),
                                    logits)
    return dict(logprobs=logprobs.detach(), entropy=entropy.detach(), grad_lp=grad_lp, grad_ent=grad_ent,
                grad_mix=grad_mix)

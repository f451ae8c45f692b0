"""Adam's state exists before the first step (so a colocated vLLM engine sizes its KV cache with the trainer's memory
complete), and the first steps are the same as with torch's lazily created state."""
from types import SimpleNamespace

import pytest
import torch

from megatron_gtpo.training.model_setup import materialize_adam_state


@pytest.mark.parametrize("adam", [torch.optim.Adam, torch.optim.AdamW])
def test_materialized_state_steps_like_the_lazy_one(adam):
    torch.manual_seed(0)
    lazy = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in lazy]
    lazy_opt, eager_opt = (adam(ps, lr=0.1, weight_decay=0.01) for ps in (lazy, eager))
    materialize_adam_state(SimpleNamespace(optimizer=eager_opt))
    assert all(set(eager_opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in eager)
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in eager_opt.state.values()) == 2 * 19
    for _ in range(3):
        grads = [torch.randn_like(p) for p in lazy]
        for params in (lazy, eager):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        lazy_opt.step()
        eager_opt.step()
    for a, b in zip(lazy, eager):
        assert torch.equal(a, b)
    assert lazy_opt.state[lazy[0]]["step"] == eager_opt.state[eager[0]]["step"] == 3

"""The CPU platform's device audit: tensors keep the place they would have on a GPU, and a host tensor meeting a
device tensor raises, as CUDA would. The trainer, scoring, evaluation and weight-sync tests all run under it (it is
on wherever the CPU platform is); these tests pin down its rules and show it catches the bug class it exists for."""
import pytest
import torch

from distributed_harness import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the audit is part of the CPU platform layer")


def _rules(rank, world_size):
    from megatron_gtpo.distributed import activate_cpu_platform
    from megatron_gtpo.distributed.device_audit import DeviceMixError
    from megatron_gtpo.distributed.platform import device_audit

    activate_cpu_platform()
    audit = device_audit()
    out = {}

    def raises(fn):
        try:
            fn()
        except DeviceMixError:
            return True
        return False

    dev = torch.randn(3, 4, device="cuda")
    host = torch.randn(3, 4)
    out["places"] = (str(dev.device), dev.is_cuda, str(host.device), host.is_cuda)
    out["computed_on_device"] = str((dev * 2 + 1).sum(0).device)
    out["zeros_like_follows"] = str(torch.zeros_like(dev).device), str(dev.new_zeros(2).device)
    out["explicit_host_from_device"] = str(dev.new_zeros(2, device="cpu").device)
    out["mix_raises"] = raises(lambda: dev + host), raises(lambda: torch.where(host > 0, dev, 0.0)), \
        raises(lambda: torch.cat([dev, host]))
    out["host_scalar_ok"] = not raises(lambda: dev * torch.tensor(2.0))
    # Explicit transfers copy (the host original stays on the host) and are allowed.
    moved = host.to(dev.device)
    out["to_copies"] = moved is not host and not host.is_cuda and moved.is_cuda
    back = dev.cpu()
    out["cpu_copies"] = back is not dev and dev.is_cuda and not back.is_cuda
    out["copy_ok"] = not raises(lambda: host.clone().copy_(dev)) and not raises(lambda: dev.clone().copy_(host))
    # Host indices into a device tensor are fine in torch; device indices into a host tensor are not.
    index = torch.tensor([0, 2])
    out["host_index_ok"] = not raises(lambda: dev[index])
    out["device_index_into_host_raises"] = raises(lambda: host[index.cuda()])
    out["numpy_of_device_raises"] = raises(lambda: dev.numpy())
    # Modules: parameters are made on the host and follow Module.cuda(), gradients included.
    linear = torch.nn.Linear(4, 2)
    out["module_host_then_device"] = linear.weight.is_cuda, linear.cuda().weight.is_cuda
    linear(dev).sum().backward()
    out["grad_on_device"] = linear.weight.grad.is_cuda
    out["host_module_raises"] = raises(lambda: torch.nn.Linear(4, 2)(dev))
    # Module.to(device=<ordinal>, dtype=...), as build_model moves and casts its chunks.
    cast = torch.nn.Embedding(5, 3).to(device=torch.cuda.current_device(), dtype=torch.bfloat16)
    out["module_to_ordinal"] = cast.weight.is_cuda, cast.weight.dtype == torch.bfloat16
    out["int_to"] = torch.ones(2).to(0).is_cuda
    syncs = audit.host_syncs
    dev.sum().item(), dev.tolist(), dev.cpu()
    out["host_syncs_counted"] = audit.host_syncs - syncs
    out["generator"] = torch.Generator(device="cuda").manual_seed(1).device.type
    # megatron's fusions are torch.compile'd: dynamo traces the audit inside them, ops it has not seen included.
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    x, residual = torch.randn(3, 4, device="cuda"), torch.randn(3, 4, device="cuda")
    fused = bias_dropout_add_fused_train((x, None), residual, 0.0)
    out["compiled_fusion"] = fused.is_cuda, torch.equal(fused, x + residual)
    return out


@pytest.mark.slow
def test_audit_rules():
    out = run_distributed(_rules, 1, timeout_s=120)[0]
    assert out["places"] == ("cuda:0", True, "cpu", False)
    assert out["computed_on_device"] == "cuda:0"
    assert out["zeros_like_follows"] == ("cuda:0", "cuda:0")
    assert out["explicit_host_from_device"] == "cpu"
    assert out["mix_raises"] == (True, True, True)
    assert out["host_scalar_ok"] and out["to_copies"] and out["cpu_copies"] and out["copy_ok"]
    assert out["host_index_ok"] and out["device_index_into_host_raises"] and out["numpy_of_device_raises"]
    assert out["module_host_then_device"] == (False, True)
    assert out["grad_on_device"] and out["host_module_raises"]
    assert out["module_to_ordinal"] == (True, True) and out["int_to"]
    assert out["host_syncs_counted"] == 3
    assert out["generator"] == "cpu"
    assert out["compiled_fusion"] == (True, True)


def _policy_loss_with_host_tensors(rank, world_size, on_device):
    """The bug this audit was built for: the RL loss combining host-built mask / old log-probs / advantages with
    the log-probs computed from the model's logits on the device."""
    from megatron_gtpo.algorithms.losses import PPOClip, token_policy_loss
    from megatron_gtpo.distributed import activate_cpu_platform
    from megatron_gtpo.distributed.device_audit import DeviceMixError

    activate_cpu_platform()
    device = torch.device("cuda", 0) if on_device else torch.device("cpu")
    logits = torch.randn(2, 5, 7, device="cuda", requires_grad=True)
    logprobs_BT = torch.log_softmax(logits, -1)[..., 0]
    mask_BT = torch.ones(2, 5, dtype=torch.bool, device=device)
    old_BT = torch.zeros(2, 5, device=device)
    advantages_BT = torch.ones(2, 5, device=device)
    try:
        loss, _ = token_policy_loss(logprobs_BT, old_BT, advantages_BT, mask_BT, loss_normalizer=10.0,
                                    clip=PPOClip(0.2, 0.2))
        loss.backward()
    except DeviceMixError as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("on_device", [True, False], ids=["device-tensors", "host-tensors"])
def test_rl_loss_with_host_tensors_is_caught(on_device):
    error = run_distributed(_policy_loss_with_host_tensors, 1, args=(on_device,), timeout_s=120)[0]
    if on_device:
        assert error is None
    else:
        assert error is not None and "mixes host tensor(s)" in error


def _collectives_with_planted_host_tensors(rank, world_size):
    """A host tensor handed to a collective or a point-to-point op on a group that is NCCL on a GPU (the world, a
    megatron group) raises; the same on a group created as gloo, and device tensors anywhere, do not."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.distributed.device_audit import DeviceMixError

    parallel = initialize_parallel(2, 1)
    caught = {}

    def attempt(name, fn):
        try:
            fn()
            caught[name] = None
        except DeviceMixError as e:
            caught[name] = str(e)

    host, device = torch.ones(2), torch.ones(2, device=parallel.device)
    peer = 1 - rank
    attempt("all_reduce host / tp group", lambda: dist.all_reduce(host, group=parallel.tp_group))
    attempt("broadcast host / world", lambda: dist.broadcast(host, src=0))
    attempt("all_gather_into_tensor host", lambda: dist.all_gather_into_tensor(
        torch.empty(4, device=parallel.device), host, group=parallel.tp_group))
    attempt("all_to_all_single host", lambda: dist.all_to_all_single(torch.empty(2), host))
    attempt("batch_isend_irecv host", lambda: dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, host, peer), dist.P2POp(dist.irecv, torch.empty(2), peer)]))
    attempt("all_reduce device / tp group", lambda: dist.all_reduce(device, group=parallel.tp_group))
    attempt("all_reduce host / megatron's gloo group", lambda: dist.all_reduce(
        host, group=ps.get_data_parallel_group_gloo()))
    gloo = dist.new_group([0, 1], backend="gloo")
    attempt("all_reduce host / new gloo group", lambda: dist.all_reduce(host, group=gloo))
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, device, peer),
                                       dist.P2POp(dist.irecv, torch.empty(2, device=parallel.device), peer)])
    for request in requests:
        request.wait()
    caught["batch_isend_irecv device"] = None
    return caught


def test_host_tensors_in_collectives_on_nccl_groups_are_caught():
    caught = run_distributed(_collectives_with_planted_host_tensors, 2, timeout_s=120)[0]
    for name, error in caught.items():
        if "host" in name and "gloo" not in name:
            assert error is not None and "on a process group that is NCCL on a GPU" in error, name
        else:
            assert error is None, (name, error)


def _groups_of_a_training_step(rank, world_size):
    from policy_runs import policy_run, run_step, sample_experience

    from megatron_gtpo.distributed import warm_up_communicators
    from megatron_gtpo.distributed.platform import device_audit

    run = policy_run("gtpo", tp=2, pp=2, tied=True)
    warmed = warm_up_communicators()
    audit = device_audit()
    audit.collective_groups.clear()
    run_step(run, sample_experience(4))
    used = [g for g in audit.collective_groups if not any(g is h for h in audit.gloo_groups)]
    return len(used), [str(g) for g in used if not any(g is w or (g is None and w is None) for w in warmed)]


def test_engine_start_warms_every_group_a_training_step_communicates_over():
    """start_colocated_servers creates the NCCL communicators of the groups warm_up_communicators names before a
    colocated engine sizes its memory: a training step (old-policy pass, advantages, update with the distributed
    optimizer, tied embeddings across two stages) must use no other group."""
    for used, missing in run_distributed(_groups_of_a_training_step, 4, timeout_s=300):
        assert used >= 5 and missing == [], missing

"""The CUDA IPC hand-over of a weight bucket (rollout/cuda_ipc.py) between two processes on the same GPU, as a
training rank and the vLLM worker on its GPU do it: the exporter packs a bf16 bucket on the GPU and exports it; a
second process (spawned, as vLLM's workers are) imports it by GPU UUID, unpacks views and copies them into its own
"engine weights"; the result must equal the bucket bit for bit, and what the importer opened is a CUDA tensor (a
mapping of the exporter's GPU memory, no host copy on the way)."""
import multiprocessing as mp
import pickle

import pytest
import torch

from cuda_only import pytestmark, skip_without_cuda  # noqa: F401

skip_without_cuda()


def _import_and_load(handles, names, dtype_names, shapes, result_queue):
    import pickle

    import torch

    from megatron_gtpo.rollout.cuda_ipc import import_buffer
    from megatron_gtpo.rollout.weight_sync import unpack_flat

    try:
        device = torch.device("cuda", 0)
        flat = import_buffer(handles, device)
        loaded = {name: t.clone() for name, t in unpack_flat(flat, names, dtype_names, shapes)}
        # Plain pickle: torch's queue reducers would share the tensors through handles that die with this process.
        result_queue.put(("ok", pickle.dumps({name: t.cpu() for name, t in loaded.items()}), flat.is_cuda))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result_queue.put(("error", f"{type(e).__name__}: {e}", None))


def test_bucket_reaches_a_second_process_on_the_same_gpu_by_ipc():
    from megatron_gtpo.rollout.cuda_ipc import export_buffer, gpu_uuid
    from megatron_gtpo.rollout.weight_sync import pack_on_device

    gen = torch.Generator(device="cuda").manual_seed(0)
    bucket = [("model.layers.0.self_attn.q_proj.weight", torch.randn(896, 896, device="cuda", generator=gen)
               .to(torch.bfloat16)),
              ("model.layers.0.input_layernorm.weight", torch.randn(896, device="cuda", generator=gen)
               .to(torch.bfloat16)),
              ("model.layers.0.self_attn.q_proj.bias", torch.randn(896, device="cuda", generator=gen))]
    names, dtype_names, shapes, flat = pack_on_device(bucket)
    uuid, args = export_buffer(flat)
    assert uuid == gpu_uuid(0)
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    proc = ctx.Process(target=_import_and_load, args=({uuid: args}, names, dtype_names, shapes, result_queue))
    proc.start()
    status, payload, was_cuda = result_queue.get(timeout=120)
    proc.join(timeout=60)
    assert status == "ok", payload
    assert was_cuda
    payload = pickle.loads(payload)
    for name, want in bucket:
        assert payload[name].dtype == want.dtype and torch.equal(payload[name], want.cpu()), name
    del flat
    torch.cuda.ipc_collect()


def test_a_handle_for_another_gpu_is_refused():
    from megatron_gtpo.rollout.cuda_ipc import import_buffer

    with pytest.raises(ValueError, match="no IPC handle for this worker's GPU"):
        import_buffer({"GPU-not-this-one": ()}, torch.device("cuda", 0))

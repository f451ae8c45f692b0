"""The colocated CUDA weight sync's orchestration on CPU (server_engine.ServerEngine with `ipc_members`): every rank
under an engine gets every bucket, packs it on its device and exports it; each host hands its server exactly the
handles of its own members' GPUs, and every engine ends up with the whole model, bit-exact.

The CUDA IPC export itself (rollout/cuda_ipc.py) cannot run here: it is replaced by a stand-in whose "handle" is the
packed buffer itself, keyed by a per-rank GPU name, so that what each server receives can be compared with the
checkpoint. The real export and import run in tests/gpu/test_gpu_ipc.py."""
import pytest
import torch
from safetensors.torch import load_file

from distributed_harness import run_distributed
from tiny_models import make_tiny_qwen2

LAYOUTS = [(1, 2, 1), (2, 1, 2), (2, 1, 1)]  # (tp, pp, engine_tp) on 2 ranks: 2 engines; 1 engine of 2; 2 engines


def _ipc_sync(rank, world_size, model_dir):
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import cuda_ipc
    from megatron_gtpo.rollout.placement import engine_hosts, engine_members
    from megatron_gtpo.rollout.server_engine import ServerEngine
    from megatron_gtpo.rollout.weight_sync import unpack_flat

    cuda_ipc.export_buffer = lambda flat: (f"gpu-{dist.get_rank()}", flat.clone())
    cuda_ipc.collect = lambda: None

    class Server:  # records, per GPU name, the tensors its workers would have opened
        dtype = torch.float32

        def __init__(self):
            self.loaded: dict[str, dict[str, torch.Tensor]] = {}

        def begin_weight_update(self):
            pass

        def load_ipc_bucket(self, names, dtype_names, shapes, handles):
            for gpu, flat in handles.items():
                for name, tensor in unpack_flat(flat, names, dtype_names, shapes):
                    self.loaded.setdefault(gpu, {})[name] = tensor.clone()

        def finish_weight_update(self, expected):
            return 1

    out = []
    for tp, pp, engine_tp in LAYOUTS:
        groups = initialize_parallel(tp, pp)
        with HFCheckpoint(model_dir) as ckpt:
            shape = ckpt.shape
            chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank)
            load_hf_weights(chunks, ckpt, tp_rank=groups.tp_rank, tp_size=tp)
        hosts = engine_hosts(tp=tp, pp=pp, engine_tp=engine_tp)
        server = Server() if (groups.pp_rank, groups.tp_rank) in hosts else None
        engine = ServerEngine(server, groups, shape, hosts=hosts, bucket_bytes=1 << 20,
                              ipc_members=engine_members(tp=tp, pp=pp, engine_tp=engine_tp))
        engine.sync_weights(chunks, groups)
        out.append({"version": engine.policy_version, "loaded": None if server is None else server.loaded})
    return out


@pytest.mark.slow
def test_every_engine_gets_the_whole_model_from_its_own_gpus(tmp_path):
    make_tiny_qwen2(tmp_path, vocab_size=1000, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    expected = load_file(str(tmp_path / "model.safetensors"))
    per_rank = run_distributed(_ipc_sync, 2, args=(str(tmp_path),), timeout_s=300)
    for (tp, pp, engine_tp), results in zip(LAYOUTS, zip(*per_rank)):
        layout = f"TP={tp} PP={pp} engine TP={engine_tp}"
        assert [r["version"] for r in results] == [1, 1], layout
        # Rank r is "gpu-r" (both layouts put rank r at (pp, tp) = (r, 0) or (0, r)); each host got the handles of
        # its own members only: its own GPU, plus rank 1's when the engine spans both.
        loaded = [r["loaded"] for r in results]
        if engine_tp == 2:
            assert loaded[1] is None and sorted(loaded[0]) == ["gpu-0", "gpu-1"], layout
        else:
            assert [sorted(x) for x in loaded] == [["gpu-0"], ["gpu-1"]], layout
        for per_gpu in (x for x in loaded if x is not None):
            for gpu, tensors in per_gpu.items():
                assert sorted(tensors) == sorted(expected), (layout, gpu)
                for name, want in expected.items():
                    assert torch.equal(tensors[name], want), (layout, gpu, name)


def test_pack_on_device_round_trips():
    from megatron_gtpo.rollout.weight_sync import pack_on_device, unpack_flat

    bucket = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)), ("c", torch.randn(2).half())]
    names, dtype_names, shapes, flat = pack_on_device(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == 48 + 40 + 4
    for (name, want), (got_name, got) in zip(bucket, unpack_flat(flat, names, dtype_names, shapes)):
        assert name == got_name and got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="holds 91 bytes, its tensors need 92"):
        unpack_flat(flat[:-1], names, dtype_names, shapes)

"""Launch-environment parsing, the NCCL environment of the trainer and of rollout servers, layout validation and
Qwen2 config checks."""
import os
import socket

import pytest

from megatron_gtpo.distributed.parallel import (NCCL_ENVIRONMENT, _pick_backend, first_host_in_nodelist,
                                                read_launch_env)
from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size
from megatron_gtpo.models.presets import hf_config


def test_torchrun_env_wins_over_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.master_port,
            launch.launcher) == (3, 8, 1, "n1", 1234, "torchrun")


def test_slurm_env_uses_first_node_as_master():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "SLURM_JOB_NODELIST": "gpu[007-008]"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.launcher) == \
        (5, 16, 5, "gpu007", "slurm")


def test_single_process_default():
    assert read_launch_env({}).launcher == "single"
    assert read_launch_env({"MASTER_PORT": "1234"}).master_port == 1234


def test_a_single_process_without_master_port_takes_a_free_port():
    """Two single-process runs on one machine: the second must not take torch's default port from the first."""
    with socket.socket() as first_run:
        try:
            first_run.bind(("127.0.0.1", 29500))
        except OSError:  # something else holds it already: the same situation
            pass
        with socket.socket() as second_run:
            second_run.bind(("127.0.0.1", read_launch_env({}).master_port))


@pytest.mark.parametrize("nodelist,first", [
    ("node1", "node1"), ("gpu[003-005,010]", "gpu003"), ("gpu[10,3]", "gpu10"), ("a[1-2],b[3-4]", "a1"),
    ("host-7,host-8", "host-7"),
])
def test_first_host_in_nodelist(nodelist, first):
    assert first_host_in_nodelist(nodelist) == first


def test_backend_errors():
    with pytest.raises(ValueError, match="unknown distributed backend 'mpi'"):
        _pick_backend("mpi")
    with pytest.raises(ValueError, match="needs CUDA"):
        _pick_backend("nccl")
    assert _pick_backend(None) == "gloo"


def test_unsupported_architecture_and_rope_scaling():
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelShape.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    cfg = dict(hf_config("qwen2.5-0.5b"), rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE scaling"):
        ModelShape.from_hf(cfg)
    with pytest.raises(ValueError, match="lacks required keys"):
        ModelShape.from_hf({"model_type": "qwen2"})


def test_vocab_padding_is_tp_independent_up_to_8():
    for vocab in (1000, 151936, 152064):
        sizes = {padded_vocab_size(vocab, tp) for tp in (1, 2, 4, 8)}
        assert len(sizes) == 1
        size = sizes.pop()
        assert size >= vocab and all(size % (128 * tp) == 0 for tp in (1, 2, 4, 8))
    assert padded_vocab_size(1000, 1) == 1024
    assert padded_vocab_size(152064, 16) % (128 * 16) == 0


def _meta_param_counts(rank, world_size, names):
    """Parameter counts of the named presets built on the meta device, and NCCL_ENVIRONMENT's variables as the
    start-up left them."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.qwen import build_model

    initialize_parallel(1, 1)
    counts = {key: os.environ.get(key) for key in NCCL_ENVIRONMENT}
    for name in names:
        model = build_model(hf_config(name), tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                            meta_device=True)[0]
        assert {p.device.type for p in model.parameters()} == {"meta"}
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


@pytest.mark.slow
def test_real_sizes_build_on_meta_device_with_published_parameter_counts(monkeypatch):
    from distributed_harness import run_distributed

    # Parameter counts of the published checkpoints (safetensors totals), e.g. Qwen2.5-7B: 7,615,616,512.
    published = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen2.5-32b": 32_763_876_352}
    for key in NCCL_ENVIRONMENT:  # the rank inherits this process's environment: no NCCL setting of its own
        monkeypatch.delenv(key, raising=False)
    counts = run_distributed(_meta_param_counts, 1, args=(list(published),), timeout_s=180)[0]
    assert {key: counts.pop(key) for key in NCCL_ENVIRONMENT} == NCCL_ENVIRONMENT  # the trainer's start-up sets it
    for name, expected in published.items():
        cfg = hf_config(name)
        padding_rows = padded_vocab_size(cfg["vocab_size"], 1) - cfg["vocab_size"]
        tables = 1 if cfg["tie_word_embeddings"] else 2
        assert counts[name] == expected + padding_rows * cfg["hidden_size"] * tables, name


@pytest.mark.parametrize("engine", ["vllm", "builtin"])
def test_rollout_servers_start_with_the_trainers_nccl_environment(monkeypatch, engine):
    """A weight-sync group joins the trainer with a rollout server's workers, so NCCL_CUMEM_ENABLE must be the same
    on both sides: a server sets the trainer's (NCCL_ENVIRONMENT, which initialize_parallel sets: the test above)
    before its engine starts."""
    from megatron_gtpo.rollout import remote_server

    for key in [*NCCL_ENVIRONMENT, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"]:  # what main sets, restored afterwards
        # set first: monkeypatch restores only what it changed, and deleting an absent key is no change
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    seen = {}
    monkeypatch.setattr(remote_server, "serve", lambda *args, **kwargs: seen.update(os.environ))
    remote_server.main(["--hf-dir", "unused", "--listen", "127.0.0.1:1", "--engine", engine])
    assert {key: seen.get(key) for key in NCCL_ENVIRONMENT} == NCCL_ENVIRONMENT == {"NCCL_CUMEM_ENABLE": "0"}

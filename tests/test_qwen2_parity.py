"""Megatron Qwen2 logits equal transformers' Qwen2ForCausalLM logits on the same weights, at TP/PP layouts."""
import pytest
import torch

from distributed_harness import run_distributed
from tiny_models import make_tiny_qwen2


def _megatron_logits(rank, world_size, model_dirs, tp, pp, sequences, micro_batch_size, ep=1, etp=None):
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.hf_mapping import ShardCoordinates
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import make_micro_batches, run_pipeline

    groups = initialize_parallel(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp)

    def gather_vocab(mb, logits_local):
        parts = [torch.empty_like(logits_local) for _ in range(tp)]
        dist.all_gather(parts, logits_local.contiguous(), group=groups.tp_group)
        return torch.cat(parts, dim=-1)

    per_model = []
    for model_dir in model_dirs:
        with HFCheckpoint(model_dir) as ckpt:
            chunks = build_model(ckpt.config, tensor_parallel=tp, pipeline_parallel=pp, pp_rank=groups.pp_rank,
                                 expert_parallel=ep, expert_tensor_parallel=etp)
            load_hf_weights(chunks, ckpt, shard=ShardCoordinates.of(groups))
        for c in chunks:
            c.eval()
        micro_batches = make_micro_batches(sequences, micro_batch_size, device=groups.device)
        per_model.append(run_pipeline(chunks, micro_batches, gather_vocab, forward_only=True))
    return per_model if groups.is_last_stage and groups.tp_rank == 0 else None


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """An untied and a tied model; vocab 1000 needs padding to 1024; 2 query groups (GQA)."""
    models = []
    for tie in (False, True):
        path = tmp_path_factory.mktemp("qwen2_tied" if tie else "qwen2_untied")
        models.append((path, make_tiny_qwen2(path, tie=tie, vocab_size=1000, num_layers=4, num_heads=4,
                                             num_kv_heads=2, seed=int(tie))))
    return models


SEQUENCES = [[5, 17, 250, 999, 3, 42, 7], [1, 2, 3], [900, 800, 700, 600, 500, 400, 300, 200, 100, 0]]


def assert_logits_match_transformers(models, tp, pp, *, ep=1, etp=None, dp=1):
    """Megatron's logits of SEQUENCES at TP/PP (and, for a mixture-of-experts model, EP/ETP) on TP x PP x `dp` ranks
    against each transformers model of `models` ((path, model) pairs of vocabulary 1000); every data-parallel replica
    scores the same sequences, and each one's logits are checked."""
    dirs = [str(path) for path, _ in models]
    results = run_distributed(_megatron_logits, tp * pp * dp, args=(dirs, tp, pp, SEQUENCES, 2, ep, etp),
                              timeout_s=300)
    replicas = [r for r in results if r is not None]
    assert len(replicas) == dp
    for per_model in replicas:
        _assert_close(models, per_model, f"TP={tp} PP={pp} EP={ep} ETP={etp or tp}")


def _assert_close(models, per_model, where: str) -> None:
    for (path, hf), micro_batch_logits in zip(models, per_model):
        rows = [row for mb in micro_batch_logits for row in mb]
        assert len(rows) == len(SEQUENCES)
        for seq, logits in zip(SEQUENCES, rows):
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0]
            ours = logits[:len(seq), :1000]
            rel = (ours - ref).abs().max() / ref.abs().max()
            assert rel < 1e-4, f"{path.name} {where}: relative error {rel:.2e}"
            assert logits.shape[-1] == 1024  # vocabulary padded to the TP-independent multiple


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_transformers(tiny_models, tp, pp):
    assert_logits_match_transformers(tiny_models, tp, pp)

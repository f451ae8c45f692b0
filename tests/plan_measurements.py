"""What the planner's numbers are checked against, measured on real megatron-core models (on the CPU platform
layer's "cuda"): the bytes autograd saves in one forward (a probe layer's activations) and the training state's
tensors after one Adam step. Used by test_plan.py and the Qwen3 / Qwen3-MoE config tests."""
import torch

from megatron_gtpo.models.accelerator import Accelerator


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once, padding included)."""
    storages = {}
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def state_bytes_after_one_step(chunks, ddp, optimizer, vocab_size: int) -> dict:
    """One Adam step on a random batch through megatron-core's DDP and optimizer (a chained one too: each of its
    optimizers), then the bytes of the parameter, gradient and optimizer-state tensors (moments and fp32 master
    weights) that exist afterwards."""
    tokens = torch.randint(0, vocab_size, (2, 32), device="cuda")
    positions = torch.arange(32, device="cuda").expand(2, 32)
    mask = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool, device="cuda"), 1)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp(tokens, positions, mask).float().pow(2).mean().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]
    params = list(chunks[0].parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    adams = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    state = [v for adam in adams for s in adam.state.values() for v in s.values()
             if torch.is_tensor(v) and v.numel() > 1]
    masters = [p for adam in adams for g in adam.param_groups for p in g["params"]
               if p.untyped_storage().data_ptr() not in param_storages]
    return {"optimizers": len(adams), "parameters": _storage_bytes(params),
            "gradients": _storage_bytes(p.main_grad for p in params),
            "optimizer": _storage_bytes(state) + _storage_bytes(masters)}


# The fusion settings of a GPU with triton (models/accelerator.fusion_settings): the fused SwiGLU keeps what it keeps
# on a GPU (megatron's jit_fuser is torch.jit.script unless enabled, so it builds and runs on the CPU).
GPU_FUSIONS = Accelerator(cuda=True, triton=True)


def cpu_only_norm_bytes(shape, *, seq_len, batch, tensor_parallel=1, bytes_per_element) -> int:
    """What one layer's RMSNorms keep on the CPU beyond a GPU (planning/activations.py: the CPU's composite norm keeps
    an fp32 copy of its input and the fp32 normalised product, CUDA's fused one its input in the model dtype), for
    rows of `seq_len` tokens: the two hidden-size norms 8 - e bytes per element (in fp32 the copy is the input); the
    per-head q/k norms (Qwen3) 8 - e too, and 4 more in bf16 (their input is a view of linear_qkv's output, kept
    either way, so the GPU keeps nothing for it)."""
    e = bytes_per_element
    per_token = 2 * shape.hidden_size * (8 - e)
    if shape.qk_norm:
        heads = (shape.num_attention_heads + shape.num_query_groups) * shape.head_dim / tensor_parallel
        per_token += heads * (4 if e == 4 else 8)
    return round(per_token * seq_len * batch)


LAYER_PROBE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
               "intermediate_size": 320, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48,
               "vocab_size": 1000, "tie_word_embeddings": False, "max_position_embeddings": 512}
PROBE_SEQ, PROBE_BATCH = 40, 3


def saved_activation_bytes(model, *, seq_len, batch, context_parallel=1, cp_rank=0) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during one forward of rows of `seq_len` tokens,
    given no mask (causal), as training passes padded rows; under context parallelism, of this rank's load-balanced
    positions of them."""
    from megatron_gtpo.distributed.context_parallel import load_balanced_positions

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, LAYER_PROBE["vocab_size"], (batch, seq_len), device="cuda")
    positions = torch.arange(seq_len, device="cuda").expand(batch, seq_len)
    if context_parallel > 1:
        held = load_balanced_positions(seq_len, cp_rank, context_parallel, device="cuda")
        tokens, positions = tokens[:, held], positions[:, held]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, None)
    return sum(saved.values())

"""models/moe_routing.py against transformers' Qwen3MoeForCausalLM on the same weights (one process, a padded
micro-batch of two sequences):
- recording: the experts each real token goes to at each layer are transformers' top-k;
- replay: forcing other experts (each token's k least likely) gives the logits transformers gives when its routers
  are forced to the same experts (probabilities renormalised over them), not the unforced ones;
- statistics: the per-layer expert load imbalance and router entropy equal those computed in float64 from
  transformers' router logits, padding excluded;
- with megatron's fused router (moe_router_fusion), which bypasses RouterReplay, replay and recording refuse to run."""
import math

import pytest
import torch

from distributed_harness import run_distributed
from tiny_models import TINY_QWEN3, make_tiny_model

SEQUENCES = [[5, 17, 250, 999, 3, 42, 7, 8, 9], [1, 2, 3, 4]]  # one micro-batch, the second row padded
TOPK, EXPERTS = 2, 4


def _megatron_routing(rank, world_size, model_dir, forced):
    """(recorded experts [L*B, M, k], per-layer statistics, logits [B, L, V] with `forced` replayed, what replay and
    recording say with moe_router_fusion on) on one rank."""
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.moe_routing import (Recorder, RoutedExperts, RouterStatistics, recording,
                                                  routed_layers)
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.training.forward import make_micro_batches, model_forward

    groups = initialize_parallel(1, 1)
    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0)
        load_hf_weights(chunks, ckpt)
    model = chunks[0].eval()
    (mb,) = make_micro_batches(SEQUENCES, len(SEQUENCES), device=groups.device)
    with torch.no_grad(), RouterStatistics(chunks) as stats, recording(chunks) as recorder:
        model_forward(model, mb, local_attention=True)
        recorded = recorder.take()
    with torch.no_grad():
        mb.routed_experts = RoutedExperts(routed_layers(chunks), forced.to(groups.device))
        replayed_logits = model_forward(model, mb, local_attention=True)
    model.config.moe_router_fusion = True  # the fused router bypasses RouterReplay: replay and recording refuse it
    refusals = []
    for attempt in (lambda: model_forward(model, mb, local_attention=True), lambda: Recorder(chunks)):
        try:
            attempt()
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    return (recorded.cpu(), stats.per_layer(groups.dp_group), replayed_logits[..., :TINY_QWEN3["vocab_size"]].cpu(),
            refusals)


def _force_routing(hf, forced_LMK):
    """Make transformers' routers pick the given experts ([L, M, k] of the one sequence run next), with its
    probabilities renormalised over them, as Qwen3MoeTopKRouter does for its own top-k."""
    for m, layer in enumerate(hf.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, m=m):
            logits = torch.nn.functional.linear(hidden, gate.weight)
            indices = forced_LMK[:, m].long()
            scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
            return logits, (scores / scores.sum(-1, keepdim=True)).to(logits.dtype), indices

        gate.forward = forward


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_routing")
    return path, make_tiny_model(path, "qwen3_moe", seed=41, **TINY_QWEN3)


def test_recorded_replayed_and_measured_routing_is_transformers(moe):
    path, hf = moe
    L, B = max(map(len, SEQUENCES)), len(SEQUENCES)
    layers = TINY_QWEN3["num_layers"]
    with torch.no_grad():
        router_logits = [hf(torch.tensor([s]), output_router_logits=True).router_logits for s in SEQUENCES]
    # Each token's k least likely experts at every layer: [B, L, M, k] (padding positions: anything valid).
    forced_BLMK = torch.zeros(B, L, layers, TOPK, dtype=torch.int16)
    for b, per_layer in enumerate(router_logits):
        for m, logits in enumerate(per_layer):
            forced_BLMK[b, :logits.shape[0], m] = torch.topk(-logits, TOPK, dim=-1).indices.to(torch.int16)
    recorded, stats, replayed, refusals = run_distributed(_megatron_routing, 1, args=(str(path), forced_BLMK),
                                                          timeout_s=300)[0]
    for refusal in refusals:  # replay, recording: megatron's fused router would skip both
        assert refusal is not None and "need moe_router_fusion off" in refusal

    recorded_LBMK = recorded.view(L, B, layers, TOPK)
    counts_ME = torch.zeros(layers, EXPERTS, dtype=torch.float64)
    entropy_M, tokens = torch.zeros(layers, dtype=torch.float64), 0
    for b, per_layer in enumerate(router_logits):
        tokens += per_layer[0].shape[0]
        for m, logits in enumerate(per_layer):
            chosen = torch.topk(torch.softmax(logits.float(), -1), TOPK, dim=-1).indices
            for t in range(logits.shape[0]):
                assert set(recorded_LBMK[t, b, m].tolist()) == set(chosen[t].tolist()), (b, t, m)
            counts_ME[m] += torch.bincount(chosen.flatten(), minlength=EXPERTS)
            p = torch.softmax(logits.double(), -1)
            entropy_M[m] += -(p * p.log()).sum()
    for m, layer in enumerate(sorted(stats)):
        imbalance, entropy = stats[layer]
        assert imbalance == pytest.approx((counts_ME[m].max() / counts_ME[m].mean()).item(), rel=1e-12)
        assert entropy == pytest.approx((entropy_M[m] / tokens).item(), rel=1e-5)
        assert 1.0 < imbalance <= EXPERTS / TOPK and 0 < entropy < math.log(EXPERTS)

    with torch.no_grad():
        unforced_logits = [hf(torch.tensor([sequence])).logits[0] for sequence in SEQUENCES]
    for b, (sequence, unforced) in enumerate(zip(SEQUENCES, unforced_logits)):
        with torch.no_grad():
            _force_routing(hf, forced_BLMK[b, :len(sequence)])
            forced = hf(torch.tensor([sequence])).logits[0]
        ours = replayed[b, :len(sequence)]
        assert (ours - forced).abs().max() / forced.abs().max() < 1e-4, b
        assert (ours - unforced).abs().max() / unforced.abs().max() > 1e-2, b  # forcing mattered


def _builtin_route_log(true_routes, prompt_lengths, response_lengths, layers):
    """What the built-in engine records (rollout/builtin.py's _RouteLog, at the rank's MoE `layers`) for the same
    routing `true_routes` (per row [P + R - 1, all layers, k]) in one left-padded batch: a prefill over the padded
    prompts (the pads' experts are garbage, 99), then one decode column per step, of which a row's own while it
    still feeds tokens."""
    from megatron_gtpo.rollout.builtin import _RouteLog

    width = max(prompt_lengths)
    pads = [width - p for p in prompt_lengths]
    log = _RouteLog(len(true_routes), pads)
    index = [layer - 1 for layer in layers]

    def column(row, c):
        return true_routes[row][c - pads[row]][index] if c >= pads[row] else torch.full_like(
            true_routes[row][0][index], 99)

    rows = list(range(len(true_routes)))
    every_row = torch.tensor(rows)
    log.add(0, every_row, torch.ones(len(rows), dtype=torch.bool),
            torch.stack([column(b, c) for c in range(width) for b in rows]).to(torch.int16))
    for step in range(1, max(response_lengths)):
        # Every row stays in the batch (the engine keeps finished rows until a compaction pays); a finished row is
        # fed a token of no sequence (its experts garbage, 99), which the log must leave out.
        fed = torch.tensor([step <= response_lengths[b] - 1 for b in rows])
        experts = [column(b, width + step - 1) if fed[b] else torch.full_like(true_routes[b][0][index], 99)
                   for b in rows]
        log.add(width + step - 1, every_row, fed, torch.stack(experts).to(torch.int16))
    return log.per_row()


def test_vllm_routing_becomes_the_builtin_record():
    """vLLM's `routed_experts` of each completion (hand-built: uint8 [P + R - 1, all layers, k]) become exactly what
    the built-in engine records for the same routing in a left-padded batch, at a pipeline stage's MoE layers: a
    long and a short prompt (padded), the same prompt twice (n=2; vLLM serves the second from its prefix cache and
    still reports the prompt's routing), a response of one token (its only token never fed: prompt rows only). The
    last generated position is in neither; outputs with it, or cut short, are refused."""
    import numpy as np

    from megatron_gtpo.models.moe_routing import EXPERT_INDEX_DTYPE, record_from_vllm

    num_layers, layers, k = 6, (3, 4, 6), 2  # this stage's MoE layers (megatron's 1-based numbers)
    prompt_lengths, response_lengths = [7, 3, 7, 4], [4, 5, 2, 1]
    gen = torch.Generator().manual_seed(3)
    true_routes = [torch.randint(0, 8, (p + r - 1, num_layers, k), generator=gen)
                   for p, r in zip(prompt_lengths, response_lengths)]
    true_routes[2][:7] = true_routes[0][:7]  # the same prompt: its routing is the same
    vllm_outputs = [t.numpy().astype(np.uint8) for t in true_routes]
    builtin = _builtin_route_log(true_routes, prompt_lengths, response_lengths, layers)
    for out, p, r, expected in zip(vllm_outputs, prompt_lengths, response_lengths, builtin):
        record = record_from_vllm(out, prompt_length=p, response_length=r, layers=layers, topk=k)
        assert record.dtype == EXPERT_INDEX_DTYPE and record.shape == (p + r - 1, len(layers), k)
        assert torch.equal(record, expected)
    last_fed = np.concatenate([vllm_outputs[0], vllm_outputs[0][-1:]])  # one row too many: the last position
    for bad, match in ((last_fed, "not one row per fed position"), (vllm_outputs[0][2:], "not one row per fed"),
                       (vllm_outputs[0][..., :1], "top-2")):
        with pytest.raises(ValueError, match=match):
            record_from_vllm(bad, prompt_length=7, response_length=4, layers=layers, topk=k)
    with pytest.raises(ValueError, match="returned no routed experts"):
        record_from_vllm(None, prompt_length=7, response_length=4, layers=layers, topk=k)
    with pytest.raises(ValueError, match="not among the 6 layers"):
        record_from_vllm(vllm_outputs[0], prompt_length=7, response_length=4, layers=(7,), topk=k)

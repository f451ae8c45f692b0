"""The lean linears (models/lean_linears.py) against megatron-core's ColumnParallelLinear / RowParallelLinear with
the same weights: without gradients the same output bit for bit, with gradients megatron's own forward and backward;
and their oneDNN-packed weights against float64 math, in step with the weights only when repacked, loud when given
a weight they did not pack. In-process, one TP rank. That the built-in engine packs at every call (an optimizer step
between two calls is seen) and after a weight update during one is checked in test_rollout_builtin."""
import types

import pytest
import torch

IN, OUT, ROWS = 48, 40, 6


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank TP group: without torch.distributed, megatron resolves every TP group to None."""
    from megatron.core.tensor_parallel import layers, mappings

    for module in (layers, mappings):
        monkeypatch.setattr(module, "get_tensor_model_parallel_group_if_none", lambda group, **_: group)
    return types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _config(dtype=torch.float32):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, params_dtype=dtype,
                             use_cpu_initialization=True)


def _pair(kind, group, *, sizes=(IN, OUT), bias=True, skip_bias_add=False, dtype=torch.float32):
    """(megatron's linear, the lean one with the same weights), `sizes` (in, out); bias away from 0."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_gtpo.models.lean_linears import LeanColumnParallelLinear, LeanRowParallelLinear

    megatron_cls, lean_cls = {"column": (ColumnParallelLinear, LeanColumnParallelLinear),
                              "row": (RowParallelLinear, LeanRowParallelLinear)}[kind]
    extra = dict(gather_output=False) if kind == "column" else dict(input_is_parallel=True)
    torch.manual_seed(0)
    made = [cls(*sizes, config=_config(dtype), init_method=torch.nn.init.normal_, bias=bias,
                skip_bias_add=skip_bias_add, tp_group=group, **extra) for cls in (megatron_cls, lean_cls)]
    if bias:
        with torch.no_grad():
            made[0].bias.normal_()
    made[1].load_state_dict(made[0].state_dict())
    return made


CASES = [(kind, bias, skip) for kind in ("column", "row") for bias, skip in ((True, False), (True, True),
                                                                              (False, False))]


@pytest.mark.parametrize("kind,bias,skip_bias_add", CASES)
def test_lean_forward_is_megatrons(one_rank, kind, bias, skip_bias_add):
    megatron, lean = _pair(kind, one_rank, bias=bias, skip_bias_add=skip_bias_add)
    x_SBH = torch.randn(5, ROWS, IN)
    with torch.no_grad():
        (want, want_bias), (got, got_bias) = megatron(x_SBH), lean(x_SBH)
    assert torch.equal(got, want)
    assert (got_bias is None) == (want_bias is None) and (want_bias is None or torch.equal(got_bias, want_bias))
    # With gradients: megatron's forward, and its backward.
    grads = []
    for layer in (megatron, lean):
        x = x_SBH.clone().requires_grad_()
        out, out_bias = layer(x)
        (out.square().sum() + (out_bias.sum() if out_bias is not None else 0)).backward()
        grads.append([x.grad, layer.weight.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Chunk(torch.nn.Module):
    """What `packed_weights` reads of a model chunk: its config, its modules; no output layer of its own."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.config = layers[0].config
        self.post_process = False

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x


def _float64_forward(chunk, x):
    for layer in chunk.layers:
        x = x.double() @ layer.weight.double().t() + layer.bias.double()
    return x


def test_packed_weights_match_float64_and_follow_only_when_repacked(one_rank):
    from megatron_gtpo.models.lean_linears import can_pack, packed_weights

    _, column = _pair("column", one_rank)
    _, row = _pair("row", one_rank, sizes=(OUT, IN))
    chunk = _Chunk(column, row)
    assert can_pack([chunk])
    x_SBH = torch.randn(3, ROWS, IN)
    with torch.no_grad():
        plain = chunk(x_SBH)
        reference = _float64_forward(chunk, x_SBH)
        with packed_weights([chunk]) as packed:
            assert packed is not None and column.packed is not None and row.packed is not None
            packed_out = chunk(x_SBH)
            # An optimizer step's in-place update is not seen until `pack()`: the packed copy is what multiplies.
            old_reference = reference
            for layer in (column, row):
                layer.weight.mul_(0.5).add_(0.1)
            reference = _float64_forward(chunk, x_SBH)
            stale = chunk(x_SBH)
            packed.pack()
            repacked = chunk(x_SBH)
        assert column.packed is None and row.packed is None  # dropped on exit
        after = chunk(x_SBH)
    scale = old_reference.abs().max().item()
    for got, want in ((plain, old_reference), (packed_out, old_reference), (stale, old_reference),
                      (repacked, reference), (after, reference)):
        assert (got.double() - want).abs().max().item() < 1e-5 * scale
    assert (reference - old_reference).abs().max().item() > 0.1 * scale  # the update changed the outputs


def test_packed_weights_refuse_a_replaced_weight(one_rank):
    from megatron_gtpo.models.lean_linears import packed_weights

    _, column = _pair("column", one_rank)
    chunk = _Chunk(column)
    with torch.no_grad(), packed_weights([chunk]):
        column.weight = torch.nn.Parameter(column.weight.detach() + 1.0)
        with pytest.raises(RuntimeError, match="other than the one it packed"):
            chunk(torch.randn(2, ROWS, IN))


def test_what_is_packed(one_rank, monkeypatch):
    """bfloat16 stays unpacked (not measured); a torch without oneDNN says so once per call, and packs nothing."""
    from megatron_gtpo.models.lean_linears import packed_weights

    _, bf16 = _pair("column", one_rank, dtype=torch.bfloat16)
    with packed_weights([_Chunk(bf16)]) as packed:
        assert packed is None and bf16.packed is None
    _, column = _pair("column", one_rank)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="no oneDNN"), packed_weights([_Chunk(column)]) as packed:
        assert packed is None and column.packed is None

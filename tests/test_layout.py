"""layout.check_layout: the one set of parallel-layout rules, with the caller's knowledge (shape, layer spec, batch,
rollout engines) deciding which apply; hand-picked layouts on the Qwen2.5 presets."""
import pytest

from megatron_gtpo.layout import LayoutError, ParallelLayout, RolloutLayout, check_layout
from megatron_gtpo.models.qwen import ModelShape
from megatron_gtpo.models.presets import hf_config

SHAPE_7B = ModelShape.from_hf(hf_config("qwen2.5-7b"))  # 28 heads, 4 query groups, 28 layers, FFN 18944
SHAPE_05B = ModelShape.from_hf(hf_config("qwen2.5-0.5b"))  # 14 heads, 2 query groups, 24 layers


def test_the_world_size_sets_data_parallel_or_is_refused():
    assert ParallelLayout.from_world_size(8, tensor=2, pipeline=2).data == 2
    with pytest.raises(LayoutError, match="world size 6 is not divisible by tensor x pipeline x context = 2 x 2 x 1"):
        ParallelLayout.from_world_size(6, tensor=2, pipeline=2)
    with pytest.raises(LayoutError, match="parallel.tensor / parallel.pipeline: must be >= 1, got 0 / 1"):
        ParallelLayout.from_world_size(4, tensor=0)
    # Context parallelism takes its ranks out of the data-parallel ones: world = TP x PP x CP x DP.
    layout = ParallelLayout.from_world_size(16, tensor=2, pipeline=2, context=2)
    assert (layout.data, layout.world_size) == (2, 16)
    with pytest.raises(LayoutError, match="world size 8 is not divisible by tensor x pipeline x context = 1 x 1 x 3"):
        ParallelLayout.from_world_size(8, context=3)
    with pytest.raises(LayoutError, match="parallel.context: must be >= 1, got 0"):
        ParallelLayout.from_world_size(8, context=0)


@pytest.mark.parametrize("layout, kwargs, message", [
    (ParallelLayout(tensor=2, virtual_pipeline=2), {}, "parallel.virtual_pipeline: needs parallel.pipeline >= 2"),
    (ParallelLayout(sequence_parallel=True), {}, "parallel.sequence_parallel: needs parallel.tensor > 1"),
    (ParallelLayout(tensor=8), {"shape": SHAPE_7B}, "28 attention heads are not divisible by TP=8"),
    (ParallelLayout(tensor=7), {"shape": SHAPE_05B},
     r"2 query groups \(num_key_value_heads\) are not divisible by TP=7"),
    (ParallelLayout(pipeline=3), {"shape": SHAPE_7B}, "28 layers are not divisible by PP=3"),
    # VPP: 28 layers on 2 stages x 4 virtual chunks = 8 chunks do not divide (only planning checked this before).
    (ParallelLayout(pipeline=2, virtual_pipeline=4), {"shape": SHAPE_7B},
     r"28 layers are not divisible by PP x VPP = 2 x 4"),
    (ParallelLayout(data=3), {"prompts_per_step": 8},
     r"data.prompts_per_step \(8\) must be divisible by data-parallel size x mini_batches_per_step = 3 x 1"),
    (ParallelLayout(tensor=4, data=2), {"rollout": RolloutLayout("vllm", engine_tensor_parallel=3)},
     "rollout.vllm.tensor_parallel: a rollout engine at tensor parallel size 3 must divide"),
    (ParallelLayout(tensor=2, pipeline=2, data=2), {"rollout": RolloutLayout("vllm", engine_tensor_parallel=4)},
     "spans pipeline stages, whose GPUs are consecutive only with one data-parallel replica"),
    (ParallelLayout(tensor=2, pipeline=2, context=2), {"rollout": RolloutLayout("vllm", engine_tensor_parallel=4)},
     r"consecutive only with one data-parallel replica and parallel.context 1 \(got 1 replicas, context 2\)"),
    (ParallelLayout(data=2), {"rollout": RolloutLayout("vllm_remote", remote_servers=1)},
     r"rollout.remote.addresses: 1 given, but there are 2 data-parallel replicas"),
    (ParallelLayout(tensor=4), {"shape": SHAPE_7B, "rollout": RolloutLayout("vllm", engine_tensor_parallel=4)}, None),
    # Before the world size is known: the prompts over the mini-batches; replay needs an engine that records routing.
    (ParallelLayout(data=None), {"prompts_per_step": 6, "mini_batches_per_step": 4},
     r"data.prompts_per_step \(6\) must be divisible by data.mini_batches_per_step \(4\)"),
    (ParallelLayout(data=None), {"rollout": RolloutLayout("builtin_remote"), "routing_replay": True},
     "rollout.engine: builtin_remote does not record routing for model.moe.routing_replay: rollout"),
    (ParallelLayout(data=None), {"rollout": RolloutLayout("vllm"), "routing_replay": True}, None),
    (ParallelLayout(data=None), {"rollout": RolloutLayout("vllm_remote"), "routing_replay": True}, None),
    (ParallelLayout(data=None), {"rollout": RolloutLayout("builtin"), "routing_replay": True}, None),
])
def test_each_rule_names_its_keys(layout, kwargs, message):
    if message is None:
        check_layout(layout, **kwargs)
        return
    with pytest.raises(LayoutError, match=message):
        check_layout(layout, **kwargs)


def test_rules_whose_inputs_are_unknown_are_not_checked():
    check_layout(ParallelLayout(tensor=8, pipeline=3))  # no model shape
    check_layout(ParallelLayout(data=None), prompts_per_step=7)  # the world size is not known yet
    check_layout(ParallelLayout(pipeline=2, virtual_pipeline=2), shape=SHAPE_7B)  # 28 = 2 x 2 x 7


def test_layout_imports_nothing_of_the_package_but_the_engine_table():
    """layout.py is the bottom of the house with engine_table.py, which it reads and which imports nothing:
    everything that places ranks or engines imports them, never the reverse (rollout/placement.py holds its engines
    to layout's rules)."""
    import ast

    import megatron_gtpo.engine_table as engine_table
    import megatron_gtpo.layout as layout

    for module, allowed in ((layout, ["megatron_gtpo.engine_table"]), (engine_table, [])):
        with open(module.__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = ["." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
            [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert [m for m in imported if m.startswith(("megatron_gtpo", "."))] == allowed, imported

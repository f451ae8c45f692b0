"""The rollout engines' table (engine_table.py): each capability decides the rule that reads it, for every engine,
and no module compares a configured engine's name (the table is read instead)."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import megatron_gtpo
from megatron_gtpo.algorithms import configure_algorithm
from megatron_gtpo.config import ConfigError, features, load_config, parse_config, validate_layout
from megatron_gtpo.config_rules import refused_by
from megatron_gtpo.engine_table import ENGINE_NAMES, ENGINES
from megatron_gtpo.training.old_policy import pass_reason

TINY = ["model.tiny_synthetic=true", "data.source=synthetic", "rollout.remote.addresses=[h:1]"]
CORRECTION = "algorithm.rollout_correction.rollout_is=token"


def _refused(engine: str, sets: list[str]) -> set[str]:
    """The names of the cross-feature rules that refuse `sets` with rollout.engine `engine`."""
    return {rule.name for rule in refused_by(features(parse_config(None, [*TINY, f"rollout.engine={engine}",
                                                                        *sets])))}


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_each_capability_decides_its_rule_for_every_engine(engine):
    can = ENGINES[engine]
    stale = ["rollout.schedule.max_staleness=1", CORRECTION]
    assert ("staleness needs engines of their own" in _refused(engine, stale)) == (not can.remote)
    during = _refused(engine, ["rollout.schedule.update_during_generation=true", *stale])
    assert ("updates during generation need rollout servers" in during) == (not can.updates_during_generation)
    assert ("no built-in engine in the trainer at CP > 1" in _refused(engine, ["parallel.context=2"])) \
        == (not can.context_parallel)
    loads_a_checkpoint = ["model.tiny_synthetic=false", "model.load=/ckpt"]
    assert ("vllm needs a Hugging Face directory" in _refused(engine, loads_a_checkpoint)) == can.needs_hf_directory
    gtpo = parse_config(None, [*TINY, f"rollout.engine={engine}", "algorithm.name=gtpo"])
    algorithm = configure_algorithm(gtpo.algorithm, max_new_tokens=gtpo.rollout.max_new_tokens)
    assert (pass_reason(gtpo, algorithm, optimizer_steps=1) is None) == can.trainers_model  # its entropies stand in
    replay = parse_config(None, [*TINY, f"rollout.engine={engine}", "model.moe.routing_replay=rollout"])
    if can.routing_replay:
        validate_layout(replay)
    else:
        with pytest.raises(ConfigError, match=f"^rollout.engine: {engine} does not record routing"):
            validate_layout(replay)


def test_the_config_offers_the_tables_engines_and_reads_each_ones_section():
    from megatron_gtpo.config import _CHOICES, RolloutConfig

    assert _CHOICES["rollout.engine"] == ENGINE_NAMES == ("builtin", "vllm", "vllm_remote", "builtin_remote")
    sections = {f.name for f in dataclasses.fields(RolloutConfig)}
    assert {engine.section for engine in ENGINES.values()} <= sections
    cfg = load_config(None, [*TINY, "rollout.engine=builtin_remote"])
    assert cfg.rollout.remote.addresses == ["h:1"]


def _compared_engine_names(path: pathlib.Path) -> list[str]:
    """`x.engine == "vllm"`-like comparisons (an `engine` attribute or name against engine names) in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = [n for n in operands if isinstance(n, (ast.Attribute, ast.Name))
                 and (n.attr if isinstance(n, ast.Attribute) else n.id) == "engine"]
        literals = [c.value for n in operands for c in ([n] if isinstance(n, ast.Constant) else
                                                        getattr(n, "elts", [])) if isinstance(c, ast.Constant)]
        if names and set(literals) & set(ENGINE_NAMES):
            found.append(f"{path.name}:{node.lineno}")
    return found


# The command lines with an --engine flag of their own (evaluate's builtin | vllm, a rollout server's vllm | builtin)
OWN_ENGINE_FLAGS = {"evaluate.py", "replicas.py", "remote_server.py"}


def test_no_module_compares_a_configured_engines_name():
    package = pathlib.Path(megatron_gtpo.__file__).parent
    compared = [found for path in sorted(package.rglob("*.py")) if path.name not in OWN_ENGINE_FLAGS
                for found in _compared_engine_names(path)]
    assert compared == [], f"read engine_table.ENGINES instead: {compared}"

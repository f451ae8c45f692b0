"""The rules between features of a run configuration, in one table (`CROSS_FEATURE_RULES`): the rollout engine,
mixture-of-experts routing replay, bounded staleness, partial rollouts, context parallelism, the algorithms' token
selections, the data source and the warm start. Each row
has a name, when the configuration is refused, why, and the one message it gets (which starts with the key it is
about). config.validate applies them after each section's own checks (the `check` methods beside the sections in
config.py) and before the layout's rules.

The parallel layout's rules (sequence and expert parallelism, where the engines run, which engines serve a
mixture-of-experts model and which record its routing for replay) are layout.check_layout's, which the planner and
the model builder share: config.validate_layout applies them. A rule about the rollout engine reads what the engine
can do (engine_table.py), never its name. An engine's own options need no rule: each engine has a section of its own
(rollout.builtin, rollout.vllm, rollout.remote in config.py), read by that engine only; nor do the rollout schedule's
rules among its own keys (rollout.schedule's check) or an algorithm's options (its own section, read only when it is
the one chosen: AlgorithmConfig.unread_settings).

To add a rule: a row here, and its two configurations in tests/test_config_rules.py (one that triggers it, the
nearest one that does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_gtpo.engine_table import ENGINES, REMOTE_ENGINES, Engine, one_of


@dataclass(frozen=True)
class Features:
    """What the rules read: the configuration's sections and the configured algorithm's registry entry
    (algorithms/registry.py)."""

    model: object
    parallel: object
    rollout: object
    algorithm: object
    data: object
    warm_start: object
    entry: object

    @property
    def engine(self) -> Engine:
        """What the configured rollout engine can do (engine_table.py)."""
        return ENGINES[self.rollout.engine]

    @property
    def dynamic_sampling(self) -> bool:
        """algorithm.dynamic_sampling, or the algorithm's default where unset."""
        return self.algorithm.resolved_dynamic_sampling


@dataclass(frozen=True)
class Rule:
    """Row `name`: a configuration is refused when `refused(features)` holds, with `message` (a str.format template
    over the sections by name, e.g. {rollout.engine}, and {remote_engines}; it starts with the key it is about);
    `reason` says why the combination cannot run."""

    name: str
    refused: Callable[[Features], bool]
    reason: str
    message: str

    def render(self, features: Features) -> str:
        values = {name: getattr(features, name) for name in Features.__dataclass_fields__}
        return self.message.format(**values, remote_engines=one_of(REMOTE_ENGINES))


CROSS_FEATURE_RULES: tuple[Rule, ...] = (
    Rule("vllm needs a Hugging Face directory",
         lambda f: f.engine.needs_hf_directory and not (f.rollout.vllm.hf_dir or f.model.hf_dir),
         "a colocated vLLM engine loads a Hugging Face directory; model.load is a megatron_gtpo checkpoint",
         "rollout.vllm.hf_dir: the vLLM engine starts from a Hugging Face directory; set it (or model.hf_dir)"),
    Rule("staleness needs engines of their own",
         lambda f: f.rollout.schedule.max_staleness >= 1 and not f.engine.remote,
         "generating ahead needs engines that run while the trainer trains; colocated ones share its GPUs",
         "rollout.schedule.max_staleness: {rollout.schedule.max_staleness} needs engines on processes of their own "
         "that generate while the trainer trains ({remote_engines}); the {rollout.engine} engine shares the "
         "trainer's"),
    Rule("partial rollouts without routing replay",
         lambda f: f.rollout.schedule.partial_rollouts and f.model.moe.replays_routing,
         "a continued response's routing would be recorded by several engine calls, under several policies",
         "rollout.schedule.partial_rollouts: not with model.moe.routing_replay: rollout (a continued response's "
         "routing would span engine calls)"),
    Rule("partial rollouts need dynamic sampling",
         lambda f: f.rollout.schedule.partial_rollouts and not f.dynamic_sampling,
         "a step the unfinished groups leave short is filled by dynamic sampling's further rounds",
         "rollout.schedule.partial_rollouts: needs dynamic sampling (algorithm.dynamic_sampling: true), whose "
         "further rounds fill the step that unfinished groups leave short; {algorithm.name} has it off"),
    # Measured: the CPU demo at staleness 1 with partial rollouts learned +0.14 without the correction, +0.43 with
    # token weights (benchmarks/results/async.md).
    Rule("partial rollouts need the rollout correction",
         lambda f: f.rollout.schedule.partial_rollouts and f.algorithm.rollout_correction.rollout_is == "none",
         "older policies sampled a continued response's first tokens: the update needs importance weights",
         "rollout.schedule.partial_rollouts: needs the rollout correction (algorithm.rollout_correction.rollout_is: "
         "token, or geometric for grpo_s): a continued response's tokens were sampled by older policies than the one "
         "that trains them"),
    Rule("staleness needs the rollout correction",
         lambda f: f.rollout.schedule.max_staleness >= 1 and f.algorithm.rollout_correction.rollout_is == "none",
         "an older policy sampled the batch: the clipped surrogate needs importance weights from it to the one that "
         "trains",
         "rollout.schedule.max_staleness: {rollout.schedule.max_staleness} needs the rollout correction "
         "(algorithm.rollout_correction.rollout_is: token, or geometric for grpo_s): without it the clipped "
         "surrogate is anchored to a policy that did not sample"),
    Rule("updates during generation need rollout servers",
         lambda f: f.rollout.schedule.update_during_generation and not f.engine.updates_during_generation,
         "only an engine on processes of its own generates while the trainer syncs weights",
         "rollout.schedule.update_during_generation: needs engines on processes of their own ({remote_engines}); the "
         "{rollout.engine} engine generates only while the trainer waits"),
    Rule("updates during generation need staleness",
         lambda f: f.rollout.schedule.update_during_generation and f.engine.updates_during_generation
         and f.rollout.schedule.max_staleness == 0,
         "at max_staleness 0 the trainer waits for each generation before it trains, so no update meets one",
         "rollout.schedule.update_during_generation: needs rollout.schedule.max_staleness >= 1 (at 0 the trainer "
         "waits for every generation before it trains and syncs, so no update would meet one)"),
    Rule("updates during generation without routing replay",
         lambda f: f.rollout.schedule.update_during_generation and f.model.moe.replays_routing,
         "a response's routing would span the prefills of two weight versions",
         "rollout.schedule.update_during_generation: not with model.moe.routing_replay: rollout (a response's "
         "routing would span two weight versions)"),
    Rule("rounds ahead need dynamic sampling",
         lambda f: f.rollout.schedule.rounds_ahead >= 1 and not f.dynamic_sampling,
         "the rounds asked for ahead are dynamic sampling's further rounds",
         "rollout.schedule.rounds_ahead: {rollout.schedule.rounds_ahead} needs dynamic sampling "
         "(algorithm.dynamic_sampling: true), whose further rounds they are; {algorithm.name} has it off"),
    Rule("rounds ahead within the rounds a step may take",
         lambda f: f.rollout.schedule.rounds_ahead > f.algorithm.max_resample_rounds,
         "a step takes at most algorithm.max_resample_rounds further rounds; more asked ahead would be dropped",
         "rollout.schedule.rounds_ahead: {rollout.schedule.rounds_ahead} exceeds algorithm.max_resample_rounds "
         "{algorithm.max_resample_rounds}, the most further rounds a step takes"),
    Rule("routing replay needs CP = 1",
         lambda f: f.parallel.context > 1 and f.model.moe.replays_routing,
         "the routing record holds whole rows, and splitting it over the context-parallel ranks as the tokens are "
         "is not implemented (training/forward.py)",
         "model.moe.routing_replay: rollout is not supported at parallel.context {parallel.context} (the rollout's "
         "routing record is not split over the context-parallel ranks); use model.moe.routing_replay: none"),
    Rule("no built-in engine in the trainer at CP > 1",
         lambda f: f.parallel.context > 1 and not f.engine.context_parallel,
         "the built-in engine's inference path would have to slice positions per CP rank",
         "rollout.engine: {rollout.engine} does not generate in the trainer's processes at parallel.context "
         "{parallel.context} (they split every sequence over the context-parallel ranks); generate on vLLM (vllm) or "
         "on rollout servers ({remote_engines}: docs/remote_rollout.md)"),
    Rule("the high-entropy fraction needs a token-level loss",
         lambda f: f.algorithm.entropy_token_fraction is not None and f.entry.sequence_level_loss,
         "it keeps the policy gradient of single tokens; a sequence-level surrogate has no per-token term",
         "algorithm.entropy_token_fraction: needs a token-level loss; {algorithm.name}'s surrogate is one term per "
         "sequence"),
    Rule("KL-Cov has no PPO clip",
         lambda f: f.entry.covariance_selection == "kl"
         and (f.algorithm.eps_low, f.algorithm.eps_high, f.algorithm.dual_clip) != (None, None, None),
         "KL-Cov's surrogate is unclipped (arXiv 2505.22617); its penalty on the selected tokens replaces the clip",
         "algorithm.eps_low / eps_high / dual_clip: {algorithm.name} has no PPO clip (its KL penalty replaces it); "
         "unset them"),
    Rule("the tiny model needs the synthetic task",
         lambda f: f.model.tiny_synthetic and f.data.source != "synthetic",
         "the tiny model's vocabulary is the synthetic task's characters",
         "model.tiny_synthetic: the tiny model is built for the synthetic task's character vocabulary; with "
         "data.source {data.source} set model.hf_dir or model.load"),
    Rule("the warm start needs the synthetic task",
         lambda f: f.warm_start.steps != 0 and f.data.source != "synthetic",
         "the supervised warm start needs reference responses, which only the synthetic tasks have",
         "warm_start.steps: the supervised warm start trains on the synthetic task's answers; with data.source "
         "{data.source} it must be 0, got {warm_start.steps}"),
)


def refused_by(features: Features) -> list[Rule]:
    """The rows of CROSS_FEATURE_RULES that refuse `features`, in table order."""
    return [rule for rule in CROSS_FEATURE_RULES if rule.refused(features)]

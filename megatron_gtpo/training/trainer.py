"""The trainer: its components are built once from the config, its phases are methods, and `train` is the RL loop.

Read top to bottom: `__init__` builds the task, checks the parallel layout, starts the process groups, and builds the
policy (model, optimizer, LR schedule), the KL reference, the prompt loader and the configured algorithm, resumes
from the newest checkpoint, and starts the rollout engine. `train` runs the steps; each step's phases add fields to
one step batch (step_batch.py) and record metrics into one reducer (reduction.py). docs/architecture.md walks
through it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms import configure_algorithm
from megatron_gtpo.algorithms.rollout_correction import MISMATCH_METRICS, STALENESS_METRICS
from megatron_gtpo.cli import say_once
from megatron_gtpo.config import TrainConfig, to_dict, validate_for_model, validate_layout
from megatron_gtpo.distributed import Truncation, initialize_parallel, read_launch_env
from megatron_gtpo.models.moe_routing import RouterStatistics, routed_layers
from megatron_gtpo.rollout.engine import Rollout, SamplingParams
from megatron_gtpo.rollout.responses import Response, Responses

from . import checkpointing
from .advantages import global_advantages
from .checkpointing import StopSignal, TrainerState
from .engine_setup import build_engine
from .experience import Experience, GroupSelection, RewardedGroups
from .metrics import MetricsLogger, PhaseTimer
from .model_setup import PolicyModel
from .old_policy import OldPolicyFromUpdate, correct_rollout, engine_entropies, old_policy_pass, pass_reason
from .partial_rollouts import PartialRollouts, WholeResponses
from .reduction import METRICS, STEP_METRICS, WARM_START_METRICS, MetricReducer, moe_layer_values, moe_metrics
from .reference import ReferencePolicy
from .rollout_queue import RolloutQueue
from .rollout_source import RolloutSource
from .sampled_groups import SampledGroups
from .step_batch import ReplayPlan, StepBatch, build_step_batch
from .task import build_task, check_prompt_lengths
from .token_selection import global_token_selection
from .train_step import run_train_step, supervised_loss_fn, update_micro_batch
from .update import record_optimizer_step, update_policy


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from megatron_gtpo.data.loader import PromptLoader
        from megatron_gtpo.distributed.vocab_parallel import chunk_tokens_for_budget
        from megatron_gtpo.models.qwen import ModelShape, padded_vocab_size

        self.cfg = cfg
        self.task = build_task(cfg)  # prompts, tokenizer, reward, the model's HF config
        shape = ModelShape.from_hf(self.task.hf_config)
        validate_for_model(cfg, shape)
        check_prompt_lengths(self.task.samples, max_new_tokens=cfg.rollout.max_new_tokens,
                             max_positions=shape.max_position_embeddings)
        validate_layout(cfg, world_size=read_launch_env().world_size, shape=shape)  # before any process group
        p = cfg.parallel
        self.parallel = initialize_parallel(p.tensor, p.pipeline, virtual_pipeline_parallel=p.virtual_pipeline,
                                            sequence_parallel=p.sequence_parallel, expert_parallel=p.expert,
                                            expert_tensor_parallel=p.expert_tensor, context_parallel=p.context,
                                            seed=cfg.seed)
        self.vocab_size = shape.vocab_size
        # The vocab-parallel log-prob op's chunk, from model.logprob_workspace_mib.
        self.logprob_chunk_tokens = chunk_tokens_for_budget(
            cfg.model.logprob_workspace_mib * 2**20,
            padded_vocab_size(shape.vocab_size, self.parallel.tp_size) // self.parallel.tp_size)
        # The rollout's top-k / top-p: the passes' log-probs are of the truncated distribution the engines sample.
        self.truncation = Truncation(cfg.rollout.top_k, cfg.rollout.top_p)
        self.policy = PolicyModel.build(cfg, self.task.hf_config, self.parallel)
        # Routing replay: this rank's MoE layers, whose experts the rollout records and the passes replay.
        self.replay = ReplayPlan(routed_layers(self.policy.chunks), shape.moe.topk) \
            if cfg.model.moe.replays_routing else None
        # A mixture-of-experts model's per-layer routing metrics (the same names on every rank, for the reducer).
        self.moe_metrics = moe_metrics(shape.num_layers) if shape.moe else {}
        self.reference = ReferencePolicy.build(cfg, self.task.hf_config, self.parallel)  # None without a KL term
        self.loader = PromptLoader(self.task.samples, prompts_per_step=cfg.data.prompts_per_step,
                                   dp_rank=self.parallel.dp_rank, dp_size=self.parallel.dp_size, seed=cfg.data.seed)
        self.algorithm = configure_algorithm(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens)
        r, schedule = cfg.rollout, cfg.rollout.schedule
        # Whole responses, or responses generated over several steps, a segment each (partial_rollouts.py).
        requests = PartialRollouts(r.num_responses_per_prompt, r.max_new_tokens, schedule.partial_segment_tokens) \
            if schedule.partial_rollouts else WholeResponses()
        self.source = RolloutSource(lambda: self.loader.next_batch().items, requests, self.sampling_params,
                                    oversample_batches=schedule.oversample_batches)
        selection = GroupSelection(cfg.data.prompts_per_step // self.parallel.dp_size, self.algorithm.dynamic_sampling,
                                   cfg.algorithm.max_resample_rounds, self.algorithm.length_penalty)
        self.rollouts = RolloutQueue(self.source, selection, self.reward_responses, self.parallel, schedule=schedule,
                                     steps=cfg.steps)
        # Rollouts in flight between steps (bounded staleness, partial rollouts): checkpointed, and each token's
        # staleness counted in the step batch.
        self.holds_rollouts = schedule.holds_rollouts
        self.start_step = checkpointing.restore(self.checkpoint_state())  # 0 without a checkpoint
        # Last: a colocated engine sizes its memory from what the training state leaves free.
        self.engine = build_engine(cfg, self.task, shape, self.policy, self.parallel,
                                   entropies=engine_entropies(cfg, self.algorithm))
        self.source.engine = self.engine
        self.sync_weights()  # an external engine starts from the (restored) policy
        self.is_logging_rank = (self.parallel.is_last_stage and self.parallel.tp_rank == 0
                                and self.parallel.cp_rank == 0 and self.parallel.dp_rank == 0)
        os.makedirs(cfg.logging.output_dir, exist_ok=True)
        self.logger = MetricsLogger(cfg.logging.output_dir, enabled=self.is_logging_rank, start_step=self.start_step,
                                    total_steps=cfg.steps, tensorboard=cfg.logging.tensorboard,
                                    wandb_project=cfg.logging.wandb_project, progress_bar=cfg.logging.progress_bar,
                                    run_config=to_dict(cfg))

    def train(self) -> None:
        """The RL loop."""
        self.stop = StopSignal.install(saves=self.cfg.checkpoint.save_every >= 0)  # SIGTERM, SIGUSR1, Ctrl-C
        if self.start_step == 0 and self.cfg.warm_start.steps and not self.warm_start():
            self.logger.close()  # a stop signal in the warm start, which is not checkpointed
            return
        self.pin_reference()  # the KL term's reference: the policy as RL starts, or model.reference
        for step in range(self.start_step, self.cfg.steps):
            timer = PhaseTimer(after_phase=self.rollouts.poll(step))  # the schedule's polls between the phases
            metrics = MetricReducer(self.parallel.device, (*STEP_METRICS, *self.moe_metrics),
                                    {**METRICS, **self.moe_metrics})
            experience = self.collect_experience(step, timer, metrics)  # G responses per prompt, rewards
            with timer("step_batch"):
                batch = self.build_step_batch(experience, step)  # tokens, masks, group index, micro-batch plan
            self.old_policy_pass(batch, timer, metrics)  # old log-probs, entropies, correction; or in the update
            with timer("advantages"):
                self.compute_advantages(batch, step, metrics)  # over the global batch; the token selection
            with timer("update"):
                self.update(batch, metrics)
            with timer("sync"):
                self.sync_weights()
            self.log_metrics(step, experience, batch, metrics, timer)
            if self.checkpoint_if_due(step + 1):  # a stop signal: every rank stops after the same step
                break
        self.logger.close()

    # ------------------------------------------------------------------------------------------------ the phases

    def warm_start(self) -> bool:
        """Supervised warm-start on the task's reference responses (`Task.demonstration`: synthetic tasks only), each
        prompt with its reference as a group of one response, through the step batch and its micro-batch plan; its
        metrics logged as step -1, then the weights synced (an external engine generates with the warm-started policy
        from the first batch on), and a warm-start-only run (steps: 0) checkpointed (where RL runs start: model.load).
        False where a stop signal ended it (after the step in progress, said in one line: nothing of it is saved, a
        relaunch starts it over)."""
        cfg, parallel = self.cfg, self.parallel
        metrics = MetricReducer(parallel.device, WARM_START_METRICS)
        for step in self.logger.progress(range(cfg.warm_start.steps), "warm start steps"):
            prompts = self.loader.next_batch().items
            targets = [self.task.demonstration(p) for p in prompts]
            answers = Responses.from_lists([[Response(target, [0.0] * len(target), "stop")] for target in targets])
            no_reward = torch.zeros(len(prompts), 1)
            demonstrations = RewardedGroups(SampledGroups.sampled(prompts, Rollout(answers), 0), no_reward, no_reward)
            batch = build_step_batch(demonstrations, parallel, mini_batches=[list(range(len(prompts)))],
                                     max_sequences=cfg.data.micro_batch_size,
                                     max_tokens=cfg.data.max_tokens_per_micro_batch, pack=cfg.data.pack_sequences)
            micro_batches = [update_micro_batch(batch, planned) for planned in batch.plan[0]]
            tokens = batch.mask_ST.sum().double()
            metrics.add({"num_tokens": tokens.clone()})
            dist.all_reduce(tokens, group=parallel.dp_group)
            result = run_train_step(self.policy, micro_batches, parallel, supervised_loss_fn(float(tokens)),
                                    vocab_size=self.vocab_size, lr=cfg.warm_start.lr_at(step),
                                    chunk_tokens=self.logprob_chunk_tokens)
            record_optimizer_step(metrics, result, cfg.warm_start.steps)
            if self.stop.agreed(parallel.device):
                say_once(f"stopped in the warm start after {step + 1} of {cfg.warm_start.steps} steps: a warm start is "
                         "not checkpointed, so a relaunch starts it over")
                return False
        metrics.add({"optimizer_steps": cfg.warm_start.steps})
        self.policy.scheduler.step(increment=0)  # back to the schedule's learning rate for RL
        self.logger.log(-1, {"warm_start_steps": cfg.warm_start.steps, **metrics.reduce(parallel.dp_group)})
        self.sync_weights()
        if cfg.steps == 0:
            checkpointing.save(self.checkpoint_state(), 0)
        return True

    def pin_reference(self) -> None:
        if self.reference is not None:
            self.reference.pin(self.policy.chunks, self.parallel, resumed=self.start_step > 0)

    def collect_experience(self, step: int, timer: PhaseTimer, metrics: MetricReducer) -> Experience:
        """G responses to each of this rank's prompts with their rewards, dynamic sampling as the algorithm says:
        the rollout queue's experience of the step (rollout_queue.py; it times the "generate" and "reward" phases),
        whose statistics are recorded."""
        exp = self.rollouts.experience(step, timer)
        exp.record(metrics, step)
        return exp

    def build_step_batch(self, exp: Experience, step: int) -> StepBatch:
        """The step batch; when rollouts may be stale (rollout.schedule: staleness, partial rollouts), with each token's
        staleness against version `step` (for the mismatch metrics by staleness)."""
        d = self.cfg.data
        return build_step_batch(exp.kept, self.parallel,
                                mini_batches=split_evenly(list(range(exp.kept.num_groups)), d.mini_batches_per_step),
                                max_sequences=d.micro_batch_size, max_tokens=d.max_tokens_per_micro_batch,
                                pack=d.pack_sequences, replay=self.replay,
                                trained_version=step if self.holds_rollouts else None)

    def old_policy_pass(self, batch: StepBatch, timer: PhaseTimer, metrics: MetricReducer) -> None:
        """Timed as "old_logprob": adds old log-probs and entropies (and the reference's log-probs) at the training
        TP/PP, then the rollout mismatch correction's loss mask and importance weights; a mixture-of-experts model's
        routing in this pass gives the per-layer expert load imbalance and router entropy (reduction.moe_metrics).
        Where the update's own forward gives all that (old_policy.pass_reason), only the reference's pass runs, and
        without a reference nothing (0 s)."""
        scored = self.pass_reason(batch) is not None
        reads_entropies = self.algorithm.uses_entropy and batch.num_prompt_groups
        assert scored or batch.entropy_ST is not None or not reads_entropies, \
            "old_policy.engine_entropies: the engine records the entropies these advantages read"
        if not scored and self.reference is None:
            timer.skipped("old_logprob")
            return
        with timer("old_logprob"), self.routing_measured(metrics, scored):
            old_policy_pass(self.policy.chunks if scored else None, batch, self.parallel, vocab_size=self.vocab_size,
                            temperature=self.cfg.rollout.temperature, truncation=self.truncation,
                            chunk_tokens=self.logprob_chunk_tokens,
                            reference_chunks=self.reference.chunks if self.reference else None)
        correct_rollout(batch, **self.correction)

    def compute_advantages(self, batch: StepBatch, step: int, metrics: MetricReducer) -> None:
        """The configured algorithm's advantages over the global batch, then its token selection (if any) over each
        whole mini-batch (training/token_selection.py), on the last pipeline stage."""
        if self.parallel.is_last_stage:
            global_advantages(self.algorithm.advantages, self.algorithm.uses_entropy, batch, self.parallel)
            if self.algorithm.select_tokens is not None:
                global_token_selection(self.algorithm.select_tokens, batch, self.parallel, metrics,
                                       seed=self.cfg.seed, step=step)

    def update(self, batch: StepBatch, metrics: MetricReducer) -> None:
        """The update phase (update.py); where no old-policy pass ran, its forward gives the old-policy values
        (old_policy.OldPolicyFromUpdate) and the routing metrics."""
        from_update = self.pass_reason(batch) is None
        old_policy = OldPolicyFromUpdate(batch, **self.correction) \
            if from_update and self.parallel.is_last_stage and batch.micro_batches() else None
        with self.routing_measured(metrics, from_update):
            update_policy(self.policy, batch, self.parallel, self.algorithm, metrics,
                          epochs=self.cfg.data.epochs_per_step, vocab_size=self.vocab_size,
                          temperature=self.cfg.rollout.temperature, truncation=self.truncation,
                          chunk_tokens=self.logprob_chunk_tokens, old_policy=old_policy)
        if old_policy is not None:  # the mismatch metrics of the whole batch, as after the pass
            correct_rollout(batch, **self.correction)

    def sync_weights(self) -> None:
        self.engine.sync_weights(self.policy.chunks, self.parallel)

    def log_metrics(self, step: int, exp: Experience, batch: StepBatch, metrics: MetricReducer,
                    timer: PhaseTimer) -> None:
        """Records the old-policy pass's token metrics, the learning rate, the timings and the rollout engine's
        throughput and busy fraction (its generation seconds over the step's time), reduces the metrics over
        the data-parallel ranks and the timings over all ranks (reduction.py; collective over every rank) and logs
        them."""
        if batch.old_logprobs_ST is not None:  # the last pipeline stage, scored by the pass or the update
            metrics.add_totals(*_token_totals(batch))
        step_time = sum(timer.seconds.values())
        # The step's engine answers (rollout_queue.py): their tokens, and the seconds the engine spent generating them.
        generated_tokens, busy_s = exp.stats["tokens_generated"], exp.stats["rollout_busy_s"]
        busy_fraction = busy_s / step_time if step_time else float("nan")
        metrics.add({"lr": self.policy.optimizer.param_groups[0]["lr"],
                     "tokens_per_s": generated_tokens / step_time if step_time else float("nan"),
                     "rollout_busy_fraction": busy_fraction, "rollout_busy_fraction_min": busy_fraction,
                     **{f"time_{phase}_s": seconds for phase, seconds in timer.seconds.items()}},
                    {"replicas": 1})
        reduced = metrics.reduce(self.parallel.dp_group)
        reduced["no_group_kept"] = int(reduced["groups_kept"] == 0)  # then the token and update metrics are NaN
        ids = [None] * self.parallel.dp_size  # which prompts the step trained on: none twice, none skipped
        dist.all_gather_object(ids, [p.id for p in exp.kept.groups.prompts], group=self.parallel.dp_group)
        reduced["trained_prompt_ids"] = [i for rank_ids in ids for i in rank_ids]
        self.logger.log(step, reduced)

    def checkpoint_if_due(self, step: int) -> bool:
        """Checkpoint after `step` steps when due (every checkpoint.save_every, the last step, a stop signal; never
        with save_every -1); returns whether to stop."""
        stopping = self.stop.agreed(self.parallel.device)  # signals reach ranks at slightly different times
        every = self.cfg.checkpoint.save_every
        if every >= 0 and (stopping or step == self.cfg.steps or (every and step % every == 0)):
            checkpointing.save(self.checkpoint_state(), step)
        return stopping

    # ------------------------------------------------------------------------------------------------ helpers

    def pass_reason(self, batch: StepBatch) -> str | None:
        """Why this step runs the old-policy pass; None: the update's forward gives the old-policy values."""
        return pass_reason(self.cfg, self.algorithm, optimizer_steps=len(batch.plan) * self.cfg.data.epochs_per_step)

    @property
    def correction(self) -> dict:
        """The rollout mismatch correction's settings (algorithms/rollout_correction.py)."""
        return dataclasses.asdict(self.cfg.algorithm.rollout_correction)

    @contextlib.contextmanager
    def routing_measured(self, metrics: MetricReducer, measured: bool):
        """With `measured`, the routing metrics of a mixture-of-experts model (reduction.moe_metrics) over the policy's
        forwards inside (collective over the data-parallel group; a dense model has no routers: nothing)."""
        if not measured:
            yield
            return
        parallel = self.parallel
        with RouterStatistics(self.policy.chunks) as routing:
            yield
        tp_routes_own_tokens = parallel.tp_group if parallel.sequence_parallel else None
        metrics.add(moe_layer_values(routing.per_layer(parallel.dp_group, tp_routes_own_tokens)))

    def checkpoint_state(self) -> TrainerState:
        """The components a checkpoint saves and a resume restores, by name (checkpointing.TrainerState): with
        bounded staleness or partial rollouts also the rollouts asked for and not yet trained on."""
        return TrainerState(self.cfg, self.parallel, self.policy, self.task.hf_config, self.vocab_size,
                            shared={"loader": self.loader, "scheduler": self.policy.scheduler},
                            per_rank={"rollouts": self.rollouts} if self.holds_rollouts else {})

    def sampling_params(self, step: int, round_index: int) -> SamplingParams:
        r = self.cfg.rollout
        seed = (self.cfg.seed * 1_000_003 + step * 7_919 + round_index * 104_729 + self.parallel.dp_rank) % 2**31
        return SamplingParams(n=r.num_responses_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=(self.task.tokenizer.eos_token_id,),
                              seed=seed, per_request_seeds=r.seeded_sampling)

    def reward_responses(self, prompts: list, responses: Responses) -> torch.Tensor:
        """[N, G] rewards on the host, computed once per model replica (its first rank decodes the record's token ids
        there) and broadcast to the replica's ranks."""
        mp_group, device = self.parallel.mp_group, self.parallel.device
        rewards = torch.empty(responses.num_responses, dtype=torch.float32, device=device)  # NCCL: no host tensors
        if dist.get_rank(mp_group) == 0:
            counts = responses.responses_per_prompt_P.tolist()
            references = [p.answer for p, count in zip(prompts, counts) for _ in range(count)]
            texts = [self.task.tokenizer.decode(ids) for ids in responses.token_id_lists()]
            rewards = torch.tensor(self.task.rewards(texts, references), dtype=torch.float32, device=device)
        dist.broadcast(rewards, src=dist.get_global_rank(mp_group, 0), group=mp_group)
        return rewards.cpu().view(responses.num_prompts, self.cfg.rollout.num_responses_per_prompt)


def split_evenly(items: list, parts: int) -> list[list]:
    size = -(-len(items) // parts) if items else 0
    return [items[i * size:(i + 1) * size] for i in range(parts)]


def _token_totals(batch: StepBatch) -> tuple[dict, dict]:
    """The old-policy pass's token metrics as totals over the kept response tokens, and their weights (device
    tensors: no host read)."""
    mask, sums = batch.mask_ST, batch.mismatch_sums
    correct_S1 = (batch.per_sequence(batch.correct_NG) == 1)[:, None]
    correct, failed = mask & correct_S1, mask & ~correct_S1

    def total(values_ST, where_ST):
        return torch.where(where_ST, values_ST, 0.0).sum()

    by_staleness = [name for name in STALENESS_METRICS if name in sums]  # when the batch has staleness_ST
    totals = {"entropy_mean": total(batch.entropy_ST, mask), "entropy_correct_mean": total(batch.entropy_ST, correct),
              "entropy_failed_mean": total(batch.entropy_ST, failed),
              **{key: sums[key] for key in (*MISMATCH_METRICS, *by_staleness)}}
    weights = {"tokens": mask.sum(), "correct_tokens": correct.sum(), "failed_tokens": failed.sum(),
               **{STALENESS_METRICS[name]: sums[STALENESS_METRICS[name]] for name in by_staleness}}
    return totals, weights

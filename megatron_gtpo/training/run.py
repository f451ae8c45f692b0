"""Everything a run is made of, built once from the config: parallel groups, policy (DDP + optimizer + schedule),
rollout engine, data, reward, the algorithm's advantage and loss functions, metrics and checkpoints. The loop
(loop.py) only calls what is built here; every algorithm choice is made in `build_run`."""
from __future__ import annotations

import inspect
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.algorithms import informative_groups, local_loss_normalizer
from megatron_gtpo.algorithms.length_penalties import group_relative_overlong_penalty, overlong_penalty
from megatron_gtpo.algorithms.registry import resolve_algorithm
from megatron_gtpo.config import ConfigError, TrainConfig, to_dict, validate
from megatron_gtpo.distributed import ParallelGroups, initialize_parallel, read_launch_env
from megatron_gtpo.rollout.engine import SamplingParams

from .experience import Experience, collect_experience, correct_rollout, global_advantages, score_old_policy
from .metrics import MetricsLogger, PhaseTimer
from .model_setup import PolicyModel, build_chunks, load_initial_weights, wrap_for_training
from .reference import ReferencePolicy
from .step_batch import StepBatch, build_step_batch
from .train_step import run_train_step, supervised_loss_fn, update_micro_batch


@dataclass
class Task:
    """Prompts (PromptSample items), a tokenizer and a batched reward on decoded text."""

    samples: list
    tokenizer: object
    score: Callable[[list[str], list[str]], list[float]]  # (response texts, reference answers) -> rewards
    hf_config: dict


def _math_reward_pool(cfg: TrainConfig) -> Callable[[list[str], list[str]], list[float]]:
    """math-verify in a pool of worker processes with a per-item time limit (rewards.RewardScorer), started on first
    use, so only the ranks that score (one per model replica) start workers."""
    from megatron_gtpo.rewards import RewardScorer, verify_math_answer

    pool = []

    def score(texts: list[str], references: list[str]) -> list[float]:
        if not pool:
            pool.append(RewardScorer(verify_math_answer, num_workers=cfg.data.reward_workers,
                                     timeout_s=cfg.data.reward_timeout_s))
        return pool[0].score(texts, references)

    return score


def build_task(cfg: TrainConfig) -> Task:
    if cfg.data.source == "synthetic":
        from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS

        synthetic = SYNTHETIC_TASKS[cfg.data.task]
        hf_config = synthetic.tiny_model_hf_config() if cfg.model.tiny_synthetic else None
        return Task(synthetic.train_problems(), synthetic.tokenizer(),
                    lambda texts, refs: [synthetic.reward(t, r) for t, r in zip(texts, refs)],
                    hf_config or _model_hf_config(cfg))
    from megatron_gtpo.data.datasets import load_dataset
    from megatron_gtpo.data.records import FieldMapping
    from megatron_gtpo.data.templates import PROMPT_STYLES, tokenize_prompts
    from megatron_gtpo.data.tokenizer import load_tokenizer
    from megatron_gtpo.checkpoint.megatron_checkpoint import HF_FILES_DIR

    tokenizer = load_tokenizer(cfg.model.hf_dir or os.path.join(cfg.model.load, HF_FILES_DIR))
    records = load_dataset(cfg.data.path, FieldMapping(problem=cfg.data.prompt_field, answer=cfg.data.answer_field))
    template = PROMPT_STYLES["dapo" if cfg.data.template == "dapo" else "boxed"]
    samples = tokenize_prompts(records, tokenizer, template, max_prompt_tokens=cfg.data.max_prompt_tokens)
    return Task(samples, tokenizer, _math_reward_pool(cfg), _model_hf_config(cfg))


def _model_hf_config(cfg: TrainConfig) -> dict:
    from megatron_gtpo.models.sources import ModelSource

    return ModelSource.detect(cfg.model.hf_dir or cfg.model.load).hf_config()


def _accepted_kwargs(fn, candidates: dict) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in candidates.items() if k in params}


@dataclass
class Run:
    cfg: TrainConfig
    groups: ParallelGroups
    task: Task
    policy: PolicyModel
    engine: object
    loader: object
    vocab_size: int
    logprob_chunk_tokens: int  # the vocab-parallel op's chunk, from model.logprob_workspace_mib
    step_batch: Callable[[Experience], StepBatch]  # token ids, masks, group index, rollout log-probs, the plan
    score: Callable[[StepBatch], None]  # adds old log-probs, entropies (reference log-probs), the mismatch correction
    advantages: Callable[[StepBatch], None]  # adds the advantages
    policy_loss: Callable  # (logprobs, old, advantages, mask, *, loss_normalizer, ref/entropy) -> loss, metrics
    loss_agg_mode: str
    collect: Callable[[int, PhaseTimer], Experience]  # (step, timer): times its "generate" and "reward" phases
    logger: MetricsLogger
    reference: ReferencePolicy | None = None  # the KL term's frozen reference policy
    start_step: int = 0
    is_logging_rank: bool = False

    def sampling_params(self, step: int, round_index: int) -> SamplingParams:
        r = self.cfg.rollout
        seed = (self.cfg.seed * 1_000_003 + step * 7_919 + round_index * 104_729 + self.groups.dp_rank) % 2**31
        return SamplingParams(n=r.num_responses_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=(self.task.tokenizer.eos_token_id,),
                              seed=seed)


def build_run(cfg: TrainConfig) -> Run:
    validate(cfg, world_size=read_launch_env().world_size)  # layout errors name their keys, before any group exists
    groups = initialize_parallel(cfg.parallel.tensor, cfg.parallel.pipeline,
                                 virtual_pipeline_parallel=cfg.parallel.virtual_pipeline,
                                 sequence_parallel=cfg.parallel.sequence_parallel, seed=cfg.seed)
    task = build_task(cfg)
    from megatron_gtpo.models.qwen2 import Qwen2Shape

    from megatron_gtpo.distributed.vocab_parallel import chunk_tokens_for_budget
    from megatron_gtpo.models.qwen2 import padded_vocab_size

    shape = Qwen2Shape.from_hf(task.hf_config)
    chunk_tokens = chunk_tokens_for_budget(cfg.model.logprob_workspace_mib * 2**20,
                                           padded_vocab_size(shape.vocab_size, groups.tp_size) // groups.tp_size)
    try:
        shape.check_parallel(groups.tp_size, groups.pp_size)
    except ValueError as e:
        raise ConfigError(f"parallel.tensor / parallel.pipeline: the model cannot be split so: {e}") from None
    chunks = build_chunks(cfg, task.hf_config, groups)
    load_initial_weights(cfg, chunks, groups)
    policy = wrap_for_training(cfg, chunks, train_steps=cfg.steps)
    reference = ReferencePolicy.build(cfg, task.hf_config, groups)

    from megatron_gtpo.data.loader import PromptLoader
    from megatron_gtpo.rollout.builtin import BuiltinEngine

    engine = {"builtin": lambda: BuiltinEngine(policy.chunks, groups, vocab_size=shape.vocab_size),
              "vllm": lambda: _vllm_engine(cfg, task, groups),
              "vllm_remote": lambda: _vllm_remote_engine(cfg, shape, groups)}[cfg.rollout.engine]()
    r = cfg.rollout
    if r.engine != "builtin" and (r.top_k or r.top_p < 1) and groups.world_rank == 0:
        print("warning: with top_k / top_p, vLLM reports log-probs of the truncated distribution, the builtin engine "
              "and the old-policy pass those of the full one (rollout/engine.py): rollout_logprob_mismatch then "
              "includes -log(kept probability mass)", file=sys.stderr)
    loader = PromptLoader(task.samples, prompts_per_step=cfg.data.prompts_per_step, dp_rank=groups.dp_rank,
                          dp_size=groups.dp_size, seed=cfg.data.seed)

    spec = resolve_algorithm(cfg.algorithm.name)
    a = cfg.algorithm
    advantage_fn = partial(spec.advantage_fn, **_accepted_kwargs(spec.advantage_fn, dict(
        alpha1=a.alpha1, alpha2=a.alpha2, beta1=a.beta1, beta2=a.beta2, norm_scope=a.norm_scope,
        entropy_clip=a.entropy_clip)))
    loss_overrides = dict(eps_low=a.eps_low if a.eps_low is not None else spec.eps_low,
                          eps_high=a.eps_high if a.eps_high is not None else spec.eps_high,
                          dual_clip=a.dual_clip, kl_coef=a.kl_coef, entropy_coef=a.entropy_coef)
    if spec.sequence_level_loss:
        loss_overrides["sequence_ratio"] = a.sequence_ratio
    policy_loss = partial(spec.policy_loss, **loss_overrides)

    penalty_name = a.length_penalty or spec.length_penalty
    max_len = a.overlong_max_len or cfg.rollout.max_new_tokens
    length_penalty = {
        "none": None,
        "overlong": lambda lengths_NG, correct_NG: overlong_penalty(
            lengths_NG, max_len=max_len, cache_len=a.overlong_cache_len or max(1, max_len // 5)),
        "group_relative": lambda lengths_NG, correct_NG: group_relative_overlong_penalty(
            lengths_NG, correct_NG, gamma=a.group_relative_gamma),
    }[penalty_name]
    dynamic_sampling = spec.dynamic_sampling if a.dynamic_sampling is None else a.dynamic_sampling

    def score_groups(prompts: list, responses: list[list]) -> torch.Tensor:
        """[N, G] rewards, computed once per model replica (its first rank) and broadcast to the replica's ranks."""
        flat = [r for group in responses for r in group]
        rewards = torch.empty(len(flat), dtype=torch.float32, device=groups.device)  # NCCL: no host tensors
        if dist.get_rank(groups.mp_group) == 0:
            references = [p.answer for p, group in zip(prompts, responses) for _ in group]
            rewards = torch.tensor(task.score([task.tokenizer.decode(r.token_ids) for r in flat], references),
                                   dtype=torch.float32, device=groups.device)
        dist.broadcast(rewards, src=dist.get_global_rank(groups.mp_group, 0), group=groups.mp_group)
        return rewards.cpu().view(len(responses), -1)

    def score(batch: StepBatch) -> None:
        score_old_policy(policy.chunks, batch, groups, vocab_size=shape.vocab_size,
                         temperature=cfg.rollout.temperature, chunk_tokens=chunk_tokens,
                         reference_chunks=reference.chunks if reference else None)
        correct_rollout(batch, rollout_is=a.rollout_is, rollout_is_cap=a.rollout_is_cap, rollout_rs=a.rollout_rs,
                        rollout_rs_bounds=tuple(a.rollout_rs_bounds))

    run = Run(cfg=cfg, groups=groups, task=task, policy=policy, engine=engine, loader=loader,
              vocab_size=shape.vocab_size, logprob_chunk_tokens=chunk_tokens,
              step_batch=lambda exp: build_step_batch(
                  exp, groups, mini_batches=split_evenly(list(range(exp.num_groups)), cfg.data.mini_batches_per_step),
                  max_sequences=cfg.data.micro_batch_size, max_tokens=cfg.data.max_tokens_per_micro_batch,
                  pack=cfg.data.pack_sequences),
              score=score,
              advantages=lambda batch: global_advantages(advantage_fn, spec.uses_entropy, batch, groups)
              if groups.is_last_stage else None,
              policy_loss=policy_loss,
              loss_agg_mode="seq-mean-token-mean" if spec.sequence_level_loss else spec.loss_agg_mode,
              collect=None, logger=None, reference=reference,
              is_logging_rank=groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0)
    target_groups = cfg.data.prompts_per_step // groups.dp_size

    def collect(step: int, timer: PhaseTimer) -> Experience:
        def generate(prompts, round_index):  # a new seed per step, sampling round and DP replica
            with timer("generate"):
                return engine.generate(prompts, run.sampling_params(step, round_index))

        def reward(prompts, responses):
            with timer("reward"):
                return score_groups(prompts, responses)

        return collect_experience(generate, lambda: loader.next_batch().items, reward,
                                  run.sampling_params(step, 0), groups, target_groups=target_groups,
                                  dynamic_sampling=dynamic_sampling, max_extra_rounds=a.max_resample_rounds,
                                  length_penalty=length_penalty, informative=informative_groups)

    run.collect = collect
    from .checkpointing import restore_if_any

    run.start_step = restore_if_any(run)
    engine.sync_weights(policy.chunks, groups)  # an external engine starts from the (restored) policy
    os.makedirs(cfg.logging.output_dir, exist_ok=True)
    run.logger = MetricsLogger(cfg.logging.output_dir, enabled=run.is_logging_rank, start_step=run.start_step,
                               total_steps=cfg.steps, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project, progress_bar=cfg.logging.progress_bar,
                               run_config=to_dict(cfg))
    return run


def _vllm_engine(cfg: TrainConfig, task: Task, groups: ParallelGroups):
    from megatron_gtpo.rollout.vllm_engine import VLLMEngine

    r = cfg.rollout
    return VLLMEngine.create(r.vllm_hf_dir or cfg.model.hf_dir, groups, dtype=cfg.model.dtype,
                             gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                             kv_cache_memory_bytes=r.vllm_kv_cache_memory_bytes,
                             tensor_parallel_size=r.vllm_tensor_parallel, seed=cfg.seed)


def _vllm_remote_engine(cfg: TrainConfig, shape, groups: ParallelGroups):
    from megatron_gtpo.rollout.vllm_remote import VLLMRemoteEngine, parse_address

    r = cfg.rollout
    for address in r.vllm_remote_addresses:
        parse_address(address)  # every rank fails alike on a malformed address
    return VLLMRemoteEngine.connect(r.vllm_remote_addresses[groups.dp_rank], groups, shape,
                                    connect_timeout_s=r.vllm_remote_connect_timeout_s,
                                    request_timeout_s=r.vllm_remote_request_timeout_s)


def split_evenly(items: list, parts: int) -> list[list]:
    size = math.ceil(len(items) / parts) if items else 0
    return [items[i * size:(i + 1) * size] for i in range(parts)]


def update_policy(run: Run, batch: StepBatch) -> dict:
    """epochs_per_step epochs over the step batch's mini-batches, one optimizer step each, on the micro-batch plan
    the old-policy pass ran. A mini-batch without a response token on any DP rank (dynamic sampling came up short)
    takes no optimizer and no LR-schedule step: Adam would still move the weights on its momentum."""
    cfg, groups = run.cfg, run.groups
    mini_batches = [[update_micro_batch(batch, planned) for planned in mini] for mini in batch.plan]
    # Per mini-batch: [the loss normaliser (loss contract), response tokens before rejection, padded tokens, sequence
    # tokens], summed over this rank's micro-batches (a padding micro-batch adds none), then over DP ranks: one
    # all-reduce, one host sync.
    counts = torch.tensor([[0, sum(batch.response_lengths[i] for mb in planned for i in mb.rows),
                            sum(mb.inputs.tokens_BL.numel() for mb in planned if mb.rows),
                            sum(batch.sequence_lengths[i] for mb in planned for i in mb.rows)]
                           for planned in batch.plan], dtype=torch.float64, device=groups.device)
    for k, (mini, planned) in enumerate(zip(mini_batches, batch.plan)):
        for mb, plan_mb in zip(mini, planned):
            if plan_mb.rows:
                counts[k, 0] += local_loss_normalizer(mb.loss_mask_BT, run.loss_agg_mode)
    dist.all_reduce(counts, group=groups.dp_group)
    normalizers = counts[:, 0].clamp(min=1)
    response_tokens = counts[:, 1].tolist()
    results = []
    for _epoch in range(cfg.data.epochs_per_step):
        for micro_batches, normalizer, tokens in zip(mini_batches, normalizers, response_tokens):
            if tokens == 0:
                continue

            def loss_fn(mb, logprobs_BT, entropy_BT, normalizer=normalizer):
                return run.policy_loss(logprobs_BT, mb.old_logprobs_BT, mb.advantages, mb.loss_mask_BT,
                                       loss_normalizer=normalizer, entropy_BT=entropy_BT,
                                       ref_logprobs_BT=mb.ref_logprobs_BT, pg_weights=mb.pg_weights)

            results.append(run_train_step(run.policy, micro_batches, groups, loss_fn, vocab_size=run.vocab_size,
                                          temperature=cfg.rollout.temperature,
                                          chunk_tokens=run.logprob_chunk_tokens))
    metrics = combine_update_metrics(results, groups)
    padded_tokens, real_tokens = counts[:, 2:].sum(dim=0).tolist()
    # Over every data-parallel rank's micro-batches: the plan's, which the old-policy pass ran too.
    metrics["padding_fraction"] = 1.0 - real_tokens / padded_tokens if padded_tokens else 0.0
    metrics["empty_mini_batches"] = response_tokens.count(0)
    return metrics


# Losses: each micro-batch holds its share of its optimizer step's loss, so the sum over micro-batches and DP ranks
# is the steps' total, reported per step. Counts: summed. Extremes: max / min. Everything else: token-weighted mean,
# except the sequence-level loss's per-sequence fractions and ratio (it reports num_sequences): sequence-weighted.
_PER_STEP_LOSSES, _COUNTS = ("pg_loss", "sft_loss"), ("num_tokens", "num_sequences")
_MAXED, _MINNED = ("ratio_max",), ("ratio_min",)
_PER_SEQUENCE = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean")


def combine_update_metrics(results: list[dict], groups: ParallelGroups) -> dict:
    """Weighted means over micro-batches, mini-batches and DP ranks (sums / max / min where that is the meaning);
    grad_norm: the mean over the step's optimizer steps, grad_norm_max their largest."""
    keys, values = [], []  # the micro-batches' metrics stay on the device until one read for the whole step
    for result in results:
        for mb in result["micro_batch_metrics"] if groups.is_last_stage else []:
            per_sequence = "num_sequences" in mb  # the sequence-level loss
            for k, v in mb.items():
                weight = mb["num_sequences"] if per_sequence and k in _PER_SEQUENCE else mb.get("num_tokens", 0)
                keys.append(k)
                values += [torch.as_tensor(x, dtype=torch.float64, device=groups.device) for x in (v, weight)]
    flat = torch.stack(values).tolist() if values else []
    local: dict[str, list] = {}
    for i, k in enumerate(keys):
        local.setdefault(k, []).append((flat[2 * i], flat[2 * i + 1]))
    gathered = [None] * groups.dp_size
    dist.all_gather_object(gathered, local, group=groups.dp_group)
    merged: dict[str, list] = {}
    for part in gathered:
        for k, vs in part.items():
            merged.setdefault(k, []).extend(vs)
    out = {}
    for k, vs in merged.items():
        values = [v for v, _ in vs]
        if k in _PER_STEP_LOSSES:
            out[k] = sum(values) / max(1, len(results))
        elif k in _COUNTS:
            out[k] = sum(values)
        elif k in _MAXED:
            out[k] = max(values)
        elif k in _MINNED:
            out[k] = min(values)
        else:
            total = sum(w for _, w in vs)
            out[k] = sum(v * w for v, w in vs) / total if total else float("nan")
    grad_norms = [r["grad_norm"] for r in results]
    out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    out["grad_norm_max"] = max(grad_norms) if grad_norms else float("nan")
    out["update_successful"] = all(r["update_successful"] for r in results)
    out["optimizer_steps"] = len(results)
    return out


def warm_start(run: Run) -> dict:
    """Supervised warm-start on the task's reference answers (synthetic task only: it knows the answer tokens), each
    prompt with its answer as a group of one response, through the step batch and its micro-batch plan."""
    from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS
    from megatron_gtpo.rollout.engine import Response

    cfg, groups = run.cfg, run.groups
    demonstration = SYNTHETIC_TASKS[cfg.data.task].demonstration
    results = []
    for _ in range(cfg.warm_start.steps):
        prompts = run.loader.next_batch().items
        answers = [[Response(demonstration(p), [0.0] * len(demonstration(p)), "stop")] for p in prompts]
        no_reward = torch.zeros(len(prompts), 1)
        exp = Experience([p.prompt_token_ids for p in prompts], answers, no_reward, no_reward)
        batch = build_step_batch(exp, groups, mini_batches=[list(range(len(prompts)))],
                                 max_sequences=cfg.data.micro_batch_size,
                                 max_tokens=cfg.data.max_tokens_per_micro_batch, pack=cfg.data.pack_sequences)
        micro_batches = [update_micro_batch(batch, planned) for planned in batch.plan[0]]
        tokens = batch.mask_ST.sum().double()
        dist.all_reduce(tokens, group=groups.dp_group)
        results.append(run_train_step(run.policy, micro_batches, groups, supervised_loss_fn(float(tokens)),
                                      vocab_size=run.vocab_size, lr=cfg.warm_start.lr,
                                      chunk_tokens=run.logprob_chunk_tokens))
    run.policy.scheduler.step(increment=0)  # back to the schedule's learning rate for RL
    return combine_update_metrics(results, groups) if results else {}

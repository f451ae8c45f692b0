"""The RL loop. Every choice (algorithm, engine, data, parallel layout) was made when the run was built."""
from __future__ import annotations

from megatron_gtpo.config import TrainConfig

from .checkpointing import StopSignal, save_checkpoint
from .metrics import PhaseTimer
from .run import build_run, update_policy, warm_start
from .step_metrics import step_metrics


def train(cfg: TrainConfig) -> None:
    run = build_run(cfg)
    stop = StopSignal.install()  # SIGTERM / SIGUSR1 (SLURM pre-emption): checkpoint, then exit
    if run.start_step == 0 and cfg.warm_start.steps:
        run.logger.log(-1, {"warm_start_steps": cfg.warm_start.steps, **warm_start(run)})
    if run.reference is not None:  # the KL term's reference: the policy as RL starts, or model.reference
        run.reference.pin(run.policy.chunks, run.groups, resumed=run.start_step > 0)
    for step in range(run.start_step, cfg.steps):
        timer = PhaseTimer()
        experience = run.collect(step, timer)  # G responses per prompt, rewards, dynamic sampling (timed inside)
        with timer("old_logprob"):
            batch = run.step_batch(experience)  # built once: tokens, masks, group index, the micro-batch plan
            run.score(batch)  # old-policy log-probs + token entropy at the training TP/PP; rollout mismatch correction
        with timer("advantages"):
            run.advantages(batch)  # the chosen algorithm, over the global batch
        with timer("update"):
            update = update_policy(run, batch)
        with timer("sync"):
            run.engine.sync_weights(run.policy.chunks, run.groups)
        run.logger.log(step, step_metrics(run, experience, batch, update, timer))
        stopping = stop.agreed(run.groups.device)  # every rank stops after the same step
        if stopping or step + 1 == cfg.steps or (cfg.checkpoint.save_every
                                                 and (step + 1) % cfg.checkpoint.save_every == 0):
            save_checkpoint(run, step + 1)
        if stopping:
            break
    if cfg.steps == 0:  # a warm-start-only run: its checkpoint is where RL runs start from (model.load)
        save_checkpoint(run, 0)
    run.logger.close()

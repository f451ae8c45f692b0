"""Building what the update needs: model chunks wrapped in megatron-core DDP, the DistributedOptimizer, the LR
schedule. Weights come from a HF directory, a megatron_gtpo checkpoint, or a random init (the synthetic demo)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo.config import TrainConfig
from megatron_gtpo.distributed import ParallelGroups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# chained_optim_avoid_prefix: a mixture-of-experts model's optimizer is a chain of two at EP > 1 (its experts'
# gradients reduce over another group) and one at EP = 1; without megatron's chained_<i> key prefix the state's keys
# are the parameters' alone, so a checkpoint resumes at another EP (a dense model's has one optimizer either way).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


@dataclass
class PolicyModel:
    """The trained policy on this rank: DDP-wrapped chunks (for the update) and the bare GPTModels inside them
    (for generation, scoring and checkpoints)."""

    ddp_chunks: list
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: object  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler

    @property
    def chunks(self) -> list:
        return [c.module for c in self.ddp_chunks]

    @classmethod
    def build(cls, cfg: TrainConfig, hf_config: dict, parallel: ParallelGroups) -> "PolicyModel":
        """The model at this rank's layout with its initial weights (model.hf_dir / model.load, or the seeded random
        init of the tiny synthetic model), wrapped for training with the optimizer and LR schedule of `cfg`."""
        chunks = build_chunks(cfg, hf_config, parallel)
        load_initial_weights(cfg, chunks, parallel)
        return wrap_for_training(cfg, chunks)

    def sharded_state_dict(self, *, loading_from: str | None = None) -> dict:
        """The model chunks' and the optimizer's state, sharded over the ranks for megatron-core's dist_checkpointing
        (the optimizer's refers to the model's; the LR schedule's is not sharded: `scheduler.state_dict`). To be
        filled from the checkpoint `loading_from`: as much of the model's as it holds (`model_state_to_load`)."""
        from megatron_gtpo.checkpoint.megatron_checkpoint import model_sharded_state_dict, model_state_to_load

        if loading_from is not None:
            # A fresh torch Adam has no per-parameter state (no 'step'), and the DistributedOptimizer's state_dict
            # needs one; megatron-core's own loader fills it with placeholder values that the load then overwrites.
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                optimizer._init_optimizer_states_with_dummy_values()
            model = model_state_to_load(loading_from, self.chunks)
        else:
            model = model_sharded_state_dict(self.chunks)
        optimizer = self.optimizer.sharded_state_dict(
            {k: v for sd in model.values() for k, v in sd.items()} if len(model) > 1 else model["model"],
            is_loading=loading_from is not None, metadata=_OPTIMIZER_METADATA)
        return {**model, "optimizer": optimizer}

    def load_sharded_state_dict(self, loaded: dict, directory: str) -> None:
        """Put what dist_checkpointing.load returned for `sharded_state_dict(loading_from=directory)` into the
        model chunks and the optimizer."""
        from megatron_gtpo.checkpoint.megatron_checkpoint import load_model_state

        load_model_state(directory, self.chunks, loaded)
        _load_optimizer_state(self.optimizer, loaded["optimizer"])


def materialize_adam_state(optimizer) -> None:
    """Allocate Adam's moments now instead of at the first step, so that the trainer's memory is complete before a
    colocated vLLM engine (built after the policy) sizes its KV cache from the free memory. For torch's Adam the
    state is exactly the one it creates lazily (zero moments, step 0), so the first step is unchanged; other Adams
    (Transformer Engine's FusedAdam, which megatron picks when TE is installed) get megatron's own initialiser."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = opt.optimizer  # the torch optimizer inside megatron's wrapper
        if not isinstance(adam, (torch.optim.Adam, torch.optim.AdamW)):
            opt.init_state_fn(adam)
            continue
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def build_chunks(cfg: TrainConfig, hf_config: dict, parallel: ParallelGroups, *, meta_device: bool = False,
                 accelerator=None) -> list:
    """This rank's model chunks as the config describes them (weights not loaded). `meta_device` and `accelerator`
    (models/accelerator.py) build on a CPU what a GPU run builds, for the configuration tests."""
    from megatron_gtpo.models.moe import RouterLosses
    from megatron_gtpo.models.qwen import build_model

    return build_model(hf_config, tensor_parallel=parallel.tp_size, pipeline_parallel=parallel.pp_size,
                       pp_rank=parallel.pp_rank, virtual_pipeline_parallel=parallel.vpp_size,
                       sequence_parallel=parallel.sequence_parallel, expert_parallel=parallel.ep_size,
                       expert_tensor_parallel=parallel.etp_size, context_parallel=parallel.cp_size,
                       context_comm=cfg.parallel.context_comm,
                       router_losses=RouterLosses(cfg.model.moe.aux_loss_coef, cfg.model.moe.z_loss_coef),
                       params_dtype=_DTYPES[cfg.model.dtype],
                       recompute_activations=cfg.model.recompute_activations,
                       core_attention=cfg.model.core_attention,
                       packed_sequences=cfg.data.pack_sequences, meta_device=meta_device, accelerator=accelerator)


def load_initial_weights(cfg: TrainConfig, chunks: list, parallel: ParallelGroups) -> None:
    """HF directory or converter/trainer checkpoint; a tiny synthetic model keeps megatron's seeded random init."""
    from .task import model_source

    if cfg.model.hf_dir or cfg.model.load:
        model_source(cfg).load_into(chunks, parallel)


def wrap_for_training(cfg: TrainConfig, chunks: list) -> PolicyModel:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    ddp_chunks = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in chunks]
    for c in ddp_chunks:
        c.broadcast_params()  # replicas start identical even if their random inits differed
    bf16 = cfg.model.dtype == "bfloat16"
    optim = cfg.optim
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                        clip_grad=optim.grad_clip, bf16=bf16, params_dtype=_DTYPES[cfg.model.dtype],
                        use_distributed_optimizer=True),
        ddp_chunks)
    # The schedule counts optimizer steps (one per mini-batch per epoch); the config counts RL steps. On resume the
    # config's schedule wins (override): a run extended with a larger `steps` decays over the new length, while its
    # progress (the number of optimizer steps taken) comes from the checkpoint.
    updates_per_step = cfg.data.mini_batches_per_step * cfg.data.epochs_per_step
    warmup_updates, total_updates = optim.warmup_steps * updates_per_step, cfg.steps * updates_per_step
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_updates else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warmup_updates, lr_decay_steps=max(total_updates, warmup_updates + 1),
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=max(total_updates, 1), wd_incr_style="constant", override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False)
    materialize_adam_state(optimizer)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads  # DP reduce-scatter, tied-embedding grad sync
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    return PolicyModel(ddp_chunks, optimizer, scheduler)


def _load_optimizer_state(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, working around megatron-core 0.16 with torch's Adam (no Apex / Transformer
    Engine, e.g. on CPU): the fully reshardable parameter state carries no per-parameter 'step' (megatron restores it
    from the param groups first), yet `_set_main_param_and_optimizer_states` copies every key the live state has.
    We hand it the live 'step' back, so that copy is a no-op."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    # The config's hyper-parameters (max_lr / min_lr that the LR schedule reads from each param group, betas, eps,
    # weight decay) win over the checkpoint's, so a resumed run may change them: load_state_dict restores the param
    # groups as saved, so the live values are put back after it (the per-group 'step' comes from the checkpoint).
    live_hyperparameters = [[{k: v for k, v in group.items() if k not in ("params", "step")}
                             for group in opt.optimizer.param_groups] for opt in optimizers]
    patched = []
    for opt in optimizers:
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            live = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in live and "step" not in tensors:
                tensors = {**tensors, "step": live["step"]}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method
    for opt, live_groups in zip(optimizers, live_hyperparameters):
        for group, live in zip(opt.optimizer.param_groups, live_groups, strict=True):
            group.update(live)
    # megatron-core hands every parameter the SAME 'step' tensor, and torch's Adam increments each parameter's step
    # in place: without separate copies the step (and with it Adam's bias correction) races ahead after a resume.
    for opt in patched:
        for param_state in opt.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()

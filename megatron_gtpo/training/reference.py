"""The reference policy of the KL term: a frozen, forward-only copy of the model at the training TP/PP.

Where its weights come from (`model.reference`):
- a path (Hugging Face directory, converter or trainer checkpoint), loaded at this run's layout; or
- None: the policy as reinforcement learning starts (after the supervised warm start, if any). Those weights are
  written once to `<checkpoint dir>/reference` (a model-only checkpoint, atomic, readable at any TP/PP), and a
  resumed run reads them back from there, so the KL term never drifts across restarts.
It is built when `algorithm.kl_coef > 0` or `model.reference` is set (then `ref_kl` is logged even at kl_coef 0).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_gtpo.config import TrainConfig
from megatron_gtpo.distributed import ParallelGroups

REFERENCE_DIR = "reference"


class ReferencePolicy:
    def __init__(self, chunks: list, *, source: str | None, saved_dir: str, hf_config: dict):
        self.chunks = chunks
        self.source = source
        self.saved_dir = saved_dir
        self.hf_config = hf_config
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)

    @staticmethod
    def wanted(cfg: TrainConfig) -> bool:
        """Whether a run of `cfg` has a reference policy (module doc)."""
        return cfg.algorithm.kl_coef != 0 or cfg.model.reference is not None

    @classmethod
    def build(cls, cfg: TrainConfig, hf_config: dict, parallel: ParallelGroups) -> "ReferencePolicy | None":
        if not cls.wanted(cfg):
            return None
        from .model_setup import build_chunks

        return cls(build_chunks(cfg, hf_config, parallel), source=cfg.model.reference,
                   saved_dir=os.path.join(cfg.checkpoint_dir, REFERENCE_DIR), hf_config=hf_config)

    def pin(self, policy_chunks: list, parallel: ParallelGroups, *, resumed: bool) -> None:
        """Fix the reference weights before the first RL step (collective)."""
        if self.source is not None:
            from megatron_gtpo.checkpoint.sources import ModelSource

            ModelSource.detect(self.source, what="model.reference").load_into(self.chunks, parallel)
            return
        from megatron_gtpo.checkpoint.megatron_checkpoint import load_model_only, save_checkpoint

        if resumed:
            if not os.path.isdir(self.saved_dir):
                raise FileNotFoundError(
                    f"resuming with a KL term, but {self.saved_dir} (the reference policy saved when the run "
                    f"started) is missing; set model.reference to the initial model to go on")
            load_model_only(self.saved_dir, self.chunks)
            return
        with torch.no_grad():
            for ref_chunk, policy_chunk in zip(self.chunks, policy_chunks, strict=True):
                for (ref_name, ref_param), (name, param) in zip(ref_chunk.named_parameters(),
                                                                policy_chunk.named_parameters(), strict=True):
                    if ref_name != name or ref_param.shape != param.shape:
                        raise RuntimeError(f"reference parameter {ref_name} {tuple(ref_param.shape)} does not "
                                           f"match the policy's {name} {tuple(param.shape)}")
                    ref_param.copy_(param)
        if parallel.world_rank == 0:
            os.makedirs(os.path.dirname(self.saved_dir), exist_ok=True)
        dist.barrier()
        save_checkpoint(self.saved_dir, self.chunks, hf_config=self.hf_config, force=True)

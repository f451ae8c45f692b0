"""Prompt batches for RL steps: seeded per-epoch shuffling, whole prompts per data-parallel rank, resumable.

Each step takes the next `prompts_per_step` prompts (global, over all DP ranks) of the current epoch's order;
DP rank r gets the r-th contiguous slice of prompts_per_step / dp_size of them. The unit of sharding is the
prompt, so the G responses later sampled for a prompt all live on the rank that owns it (GRPO-style groups
are never split). The epoch's last partial batch is dropped (every rank must take the same number of
steps), so with N prompts an epoch has N // prompts_per_step steps and every prompt appears at most once
per epoch, exactly once when prompts_per_step divides N.

The position (epoch, batch_index) counts global batches, so it does not depend on the rank or the DP size:
`load_state_dict(state_dict())` on any rank, even under a different DP size, continues with exactly the
global batches an uninterrupted run would have produced.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Generic, Iterator, Sequence, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PromptBatch(Generic[T]):
    """This rank's prompts of one step, and where the step sits in the data order."""

    epoch: int
    batch_index: int  # position of the step within the epoch
    items: list[T]


class PromptLoader(Generic[T]):
    """Endless stream of this DP rank's prompt batches over `items` (any sequence, e.g. PromptSample)."""

    def __init__(
        self,
        items: Sequence[T],
        *,
        prompts_per_step: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}")
        if not isinstance(prompts_per_step, int) or prompts_per_step < 1 or prompts_per_step % dp_size:
            raise ValueError(
                f"prompts_per_step must be a positive multiple of dp_size={dp_size}, got {prompts_per_step!r}"
            )
        if len(items) < prompts_per_step:
            raise ValueError(f"the dataset has {len(items)} prompts, fewer than prompts_per_step={prompts_per_step}")
        self._items = items
        self.prompts_per_step = prompts_per_step
        self.prompts_per_rank = prompts_per_step // dp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.batches_per_epoch = len(items) // prompts_per_step
        self.epoch = 0
        self.batch_index = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The item indices of `epoch` in visiting order: a permutation seeded by (seed, epoch), or identity."""
        order = list(range(len(self._items)))
        if self.shuffle:
            # A str seed is hashed with SHA-512 by random.Random: the same order on every machine and Python run.
            random.Random(f"megatron_gtpo.prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> PromptBatch[T]:
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        start = self.batch_index * self.prompts_per_step + self.dp_rank * self.prompts_per_rank
        indices = self._order[start : start + self.prompts_per_rank]
        batch = PromptBatch(self.epoch, self.batch_index, [self._items[i] for i in indices])
        self.batch_index += 1
        if self.batch_index == self.batches_per_epoch:
            self.epoch += 1
            self.batch_index = 0
        return batch

    def __iter__(self) -> Iterator[PromptBatch[T]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """The position (the next batch to produce) and what it is only meaningful with."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self._items),
            "prompts_per_step": self.prompts_per_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the data, seed and step size must be the ones it was saved with."""
        for key, current in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self._items)),
                             ("prompts_per_step", self.prompts_per_step)):
            if state.get(key) != current:
                raise ValueError(f"saved loader state has {key}={state.get(key)!r} but this loader has {current!r}")
        epoch, batch_index = state.get("epoch"), state.get("batch_index")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"saved loader state has an invalid epoch {epoch!r}")
        if not isinstance(batch_index, int) or not 0 <= batch_index < self.batches_per_epoch:
            raise ValueError(
                f"saved loader state has batch_index={batch_index!r}, outside [0, {self.batches_per_epoch})"
            )
        self.epoch = epoch
        self.batch_index = batch_index

"""The device-side state of one batch of rows in the built-in engine's decode loop (builtin.py): which rows are in
the KV cache and in which order, what each has generated, and whether it is still generating; all in tensors on the
device, so that a decode step copies no host list to the device and reads back one count (`live_rows`).

Names: B indexes the batch rows in KV-cache order (it shrinks when the cache is compacted), R the rows of the batch
as given (fixed), N = max_new_tokens. A row is *live* while it still generates; a finished row stays in the KV cache,
fed a token whose output is ignored, until a compaction drops it (`compaction_pays`).
"""
from __future__ import annotations

import torch

from .responses import FINISH_LENGTH_CODE, FINISH_STOP_CODE
from .sampling import stream_keys


class DecodeRows:
    """Rows `rows` (token lists) of one batch, their sampling seeds, and what they generate.

    `left_pad`: prompts right-aligned at the longest (the batch's prompt columns end together, padding keys masked
    by `key_is_pad_BK`); else left-aligned, each row's generation starting after its own prompt (teacher forcing:
    a row inside its prompt is fed its next prompt token and draws nothing). `record_entropies`: each token's
    sampling entropy is kept too (`entropies_T`)."""

    def __init__(self, rows: list[list[int]], seeds: list[int], *, left_pad: bool, max_new_tokens: int,
                 stop_token_ids, cache_len: int, device, record_entropies: bool = False):
        width = max(len(r) for r in rows)
        lengths = [len(r) for r in rows]
        self.max_new_tokens = max_new_tokens
        self.pads = [width - n if left_pad else 0 for n in lengths]  # left pads per row (host: routing)
        self.last_prompt_end = width if left_pad else max(lengths)  # from this position on every row draws
        self.prompts_BW = torch.tensor([[0] * p + r + [0] * (width - p - len(r)) for p, r in zip(self.pads, rows)],
                                       dtype=torch.long, device=device)
        self.prompt_end_B = torch.tensor([width] * len(rows) if left_pad else lengths, dtype=torch.long,
                                         device=device)
        self.key_is_pad_BK = (torch.arange(cache_len, device=device)[None, :] <
                              torch.tensor(self.pads, device=device)[:, None]) if left_pad else None
        self.row_B = torch.arange(len(rows), device=device)
        self.live_B = torch.ones(len(rows), dtype=torch.bool, device=device)
        self.stream_keys_B = stream_keys(torch.tensor(seeds, dtype=torch.long, device=device))  # sampling's
        self.stop_ids_S = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=device)
        # Row r's k-th token, its log-prob and the weight updates before it at [r, k]; column N takes the writes of
        # rows that draw nothing at a step (no branch on the host).
        self.tokens_RN1 = torch.zeros(len(rows), max_new_tokens + 1, dtype=torch.int32, device=device)
        self.logprobs_RN1 = torch.zeros(len(rows), max_new_tokens + 1, dtype=torch.float32, device=device)
        self.updates_RN1 = torch.zeros(len(rows), max_new_tokens + 1, dtype=torch.int32, device=device)
        self.entropies_RN1 = torch.zeros_like(self.logprobs_RN1) if record_entropies else None
        self.lengths_R = torch.zeros(len(rows), dtype=torch.long, device=device)
        self.batch_rows = len(rows)  # host mirror of len(row_B)
        self.live = len(rows)  # host mirror of live_B.sum(), as of the last `live_rows`

    def prefill_tokens(self, position: int) -> torch.Tensor:
        """[B, position] the rows' tokens at columns [0, position): prompt (and pads) then generated tokens."""
        column_1C = torch.arange(position, device=self.row_B.device)[None, :]
        from_prompt_BC = self.prompts_BW.gather(1, column_1C.clamp(max=self.prompts_BW.shape[1] - 1)
                                                .expand(self.batch_rows, -1))
        generated_BC = (column_1C - self.prompt_end_B[:, None]).clamp(0, self.max_new_tokens)
        from_tokens_BC = self.tokens_RN1[self.row_B].gather(1, generated_BC).long()
        return torch.where(column_1C < self.prompt_end_B[:, None], from_prompt_BC, from_tokens_BC)

    def draws_B(self) -> torch.Tensor:
        """Each row's draw index: the index in its response of the token it samples next."""
        return self.lengths_R[self.row_B]

    def record(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor, position: int, updates: int,
               entropies_B: torch.Tensor | None = None) -> torch.Tensor:
        """Record the tokens sampled from the logits of `position` (the column they predict), with `record_entropies`
        their `entropies_B`, and return the tokens to feed next, [B, 1]: the sampled token, or a row's next prompt
        token while it is inside its prompt."""
        drawing_B = self.live_B if position >= self.last_prompt_end else \
            self.live_B & (self.prompt_end_B <= position)
        k_B = self.lengths_R[self.row_B]
        column_B = torch.where(drawing_B, k_B, self.max_new_tokens)
        self.tokens_RN1[self.row_B, column_B] = tokens_B.to(torch.int32)
        self.logprobs_RN1[self.row_B, column_B] = logprobs_B.float()
        if self.entropies_RN1 is not None:
            self.entropies_RN1[self.row_B, column_B] = entropies_B
        if updates:
            self.updates_RN1[self.row_B, column_B] = updates
        k_B = k_B + drawing_B
        self.lengths_R[self.row_B] = k_B
        ended_B = drawing_B & (torch.isin(tokens_B, self.stop_ids_S) | (k_B == self.max_new_tokens))
        self.live_B &= ~ended_B
        if position >= self.last_prompt_end:
            return tokens_B[:, None]
        next_prompt_B = self.prompts_BW[:, min(position, self.prompts_BW.shape[1] - 1)]
        return torch.where(drawing_B, tokens_B, next_prompt_B)[:, None]

    def live_rows(self) -> int:
        """How many rows still generate: the decode step's one device-to-host read."""
        self.live = int(self.live_B.sum())
        return self.live

    def compaction_pays(self) -> bool:
        """Whether to drop the finished rows from the KV cache now. A compaction copies the live rows' cache once
        (about what one decode step reads of it, and 2 kernels per layer); a finished row kept costs its share of
        every later step. Dropping them once they are a quarter of the batch rows bounds that waste to a quarter of
        a step, and keeps a small batch compact (with 4 rows or fewer every finished row is dropped at once)."""
        return 4 * (self.batch_rows - self.live) >= max(self.batch_rows, 4)

    def compact(self) -> torch.Tensor:
        """Keep the live rows only, in their order; returns their batch indices (for the KV cache)."""
        keep_B = torch.sort((~self.live_B).to(torch.uint8), stable=True).indices[:self.live]
        for name in ("prompts_BW", "prompt_end_B", "row_B", "live_B", "stream_keys_B", "key_is_pad_BK"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, keep_B))
        self.batch_rows = self.live
        return keep_B

    def results(self) -> tuple[torch.Tensor, ...]:
        """(token_ids_T, logprobs_T, weight_updates_T): the rows' tokens back to back; lengths_R; finish_R (stop if
        the last token is a stop token, else length)."""
        valid_RN = self._valid_RN()
        last_R = self.tokens_RN1.gather(1, (self.lengths_R - 1).clamp(min=0)[:, None]).squeeze(1).long()
        finish_R = torch.where(torch.isin(last_R, self.stop_ids_S), FINISH_STOP_CODE, FINISH_LENGTH_CODE)
        n = self.max_new_tokens
        return (self.tokens_RN1[:, :n][valid_RN], self.logprobs_RN1[:, :n][valid_RN],
                self.updates_RN1[:, :n][valid_RN], self.lengths_R, finish_R)

    def entropies_T(self) -> torch.Tensor | None:
        """With `record_entropies`, the rows' token entropies back to back (as `results`' tokens), else None."""
        if self.entropies_RN1 is None:
            return None
        return self.entropies_RN1[:, :self.max_new_tokens][self._valid_RN()]

    def _valid_RN(self) -> torch.Tensor:
        """bool [R, N]: the tokens each row generated."""
        return torch.arange(self.max_new_tokens, device=self.lengths_R.device) < self.lengths_R[:, None]

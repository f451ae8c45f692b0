"""Built-in generation on the training model itself (any TP/PP/VPP), with megatron-core's static KV cache.

How a batch is generated:

- rows = prompts x n (row i * n + j is sample j of prompt i), processed in consecutive batches of at most
  `max_batch_size` rows and at most `max_batch_tokens` KV-cache token slots (`batch_ranges`); the KV cache is a
  `megatron.core.inference.contexts.StaticInferenceContext` (one cache offset for all rows) of rows x (longest
  prompt of the batch + max_new_tokens) slots per layer, so `max_batch_tokens` bounds its memory;
- each row samples with counter-based noise (sampling.counter_uniform, sampling.inverse_cdf_draw): the random
  number of its k-th token is a hash of its seed, `engine.response_seed` (the call's seed, its prompt index and
  sample index), and k. A response
  depends on its prompt and that seed, not on which rows share its batch, nor on the prompt scheme below, so the
  batch caps change no sampled token (greedy decoding: no token either, up to the float rounding of other batch
  shapes). (Until 2026-11-27 each row drew from a torch.Generator of its own, one kernel per row and step, and until
  2026-12-02 from a race of exponentials: the same seeds now give other, equally distributed, samples.);
- on a CPU the model's linears multiply by oneDNN-packed copies of the weights, packed at the start of every call
  and again after a weight update taken during one (models/lean_linears.packed_weights);
- prompts of different lengths, two schemes (`prompt_alignment`):
  "left_pad" (the default where it is exact, see below): prompts are left-padded to the longest and prefilled in one
  forward pass with an explicit boolean attention mask (causal, and padding keys masked out) that is also passed at
  every decode step (built once per forward step for all layers; in SDPA's additive form where the layers' core
  attention is models/sdpa_attention.SdpaAttention). RoPE is applied from the cache offset (the local spec rotates
  each key once, as it enters the cache: models/rope_once_attention.py), so a row with p pads sees its tokens at
  positions shifted by p; attention scores depend only on position differences, so this is the unpadded computation
  (up to float rounding). It needs attention that honours an explicit mask: megatron's DotProductAttention with the
  unfused softmax (the CPU path). Transformer Engine's attention and megatron's fused causal softmax kernel apply
  their own causal mask and ignore a padding mask;
  "teacher_force" (the scheme of megatron-core's own static-batch generation controller; exact with every
  attention backend, and the automatic choice where left padding is not): the first min(prompt lengths) tokens are
  prefilled with the plain causal mask, then all rows advance one position per step; rows still inside their prompt
  are fed their next prompt token (the model's prediction is discarded). No padding and no masks, at the price of
  (longest - shortest prompt) extra decode steps;
- a row that samples a stop token, or reaches max_new_tokens, stops generating; its KV-cache rows are dropped (the
  cache compacted) once the finished rows are a quarter of the batch's rows (decode_rows.DecodeRows.compaction_pays:
  a compaction copies the cache, a finished row kept costs its share of every later step; with 4 rows or fewer a
  finished row leaves at once). The loop ends when no row is left;
- a call's `between_steps` (`submit`'s argument) is called before every forward step, on every rank of the group
  alike: what it raises abandons the generation (a rollout server's pre-emption by a newer trainer session). It may
  change the model's weights (a rollout server taking a weight update while it generates: remote_server.py); it
  then returns how many updates it took, and the rows in
  flight are prefilled again under the new weights (their KV cache is computed afresh from their tokens so far), so
  every later token is sampled from the new policy, and is stamped with the updates taken before it
  (`Responses.weight_updates_T`).

Pipeline parallelism: each forward step walks the virtual pipeline stages in order; a stage receives the hidden
states [s, b, h] of the previous one from its pipeline peer (torch.distributed send/recv on the pipeline group) and
sends its own output to the next one, each stage keeping the KV cache of its own layers. The last stage samples; the
sampled tokens and log-probs go to every rank of the model-parallel group (a broadcast from TP rank 0 within the last
stage's TP group, then from the last stage along each pipeline group), so all ranks follow the same control flow and
return the same responses. The decode loop's state (which rows are in the cache, their tokens, log-probs, lengths
and whether they still generate) lives on the device (decode_rows.py): a decode step copies no host list to the
device, samples all rows in a fixed number of kernels, and reads back one number, the count of rows still
generating (for the early exit and the compaction).

Mixture-of-experts models with expert parallelism: the ranks of an expert-parallel group exchange tokens inside every
MoE layer, so they must take every forward step together, whatever their own prompts (their replicas generate
different responses of different lengths). Before each forward step every rank says whether it has rows left, one
all-reduce (MAX) over the group; a rank with none left takes part in its peers' steps with a one-token forward whose
output it drops (`stand_by`), until no peer has rows left. Without expert parallelism nothing of this runs.
`record_routing`: `submit`'s rollout also gives, per response, the experts each of its fed tokens went to at this
rank's MoE layers (models/moe_routing.py), for routing replay in training; it stays on the rank, beside the record.
`record_entropies`: it also gives each token's sampling entropy (`Rollout.entropies_T`), computed on the last stage by
the trainer's own op (distributed/vocab_parallel.py) on the logits it samples from, and shared with the tokens: the
old policy's entropies where the trainer trains the weights that sampled (training/old_policy.py).

Sampling and the log-prob convention are in sampling.py and engine.py. Sequence parallelism is switched off for the
duration of a call (decode steps have one token, which cannot be split over TP ranks) with megatron's own
`set_model_to_sequence_parallel`, and restored afterwards, as are the modules' train/eval modes.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_gtpo.models.lean_linears import packed_weights
from megatron_gtpo.models.moe_routing import recording
from megatron_gtpo.progress import progress_bar

from .engine import Rollout, SamplingParams, check_prompts, response_seed
from .decode_rows import DecodeRows
from .responses import Responses
from .sampling import sample_next_tokens


def _no_update() -> int:
    return 0


def unwrap_chunk(model_chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model_chunk)


class BuiltinEngine:
    """Megatron-native rollout engine (rollout/engine.RolloutEngine) on this rank's model chunks.

    `generate` is collective over the model-parallel group (TP x PP): every rank calls it with the same prompts and
    params and gets the same result. Data-parallel replicas call it independently with their own prompts.
    """

    def __init__(self, model_chunks: list, parallel, vocab_size: int, *, max_batch_size: int | None = None,
                 max_batch_tokens: int | None = None, prompt_alignment: str = "auto", progress: bool = False,
                 record_routing: bool = False, record_entropies: bool = False):
        """`max_batch_size` / `max_batch_tokens`: caps on the rows and on the KV-cache token slots of one batch
        (None: no cap; see the module doc). `prompt_alignment`: "left_pad", "teacher_force" or "auto" (left_pad
        where the attention honours explicit masks, else teacher_force). `progress`: a progress bar over the rows.
        `record_routing`: responses carry their tokens' experts (a mixture-of-experts model; module doc).
        `record_entropies`: rollouts carry each token's sampling entropy (module doc)."""
        if not model_chunks:
            raise ValueError("model_chunks is empty")
        if prompt_alignment not in ("auto", "left_pad", "teacher_force"):
            raise ValueError(f"prompt_alignment must be 'auto', 'left_pad' or 'teacher_force', got "
                             f"{prompt_alignment!r}")
        for name, cap in (("max_batch_size", max_batch_size), ("max_batch_tokens", max_batch_tokens)):
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {cap!r}")
        self.model_chunks = model_chunks
        self.models = [unwrap_chunk(c) for c in model_chunks]
        self.parallel = parallel
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.progress = progress
        self.record_routing = record_routing
        self.record_entropies = record_entropies
        self.lockstep_group = parallel.expert_lockstep_group  # None for a dense model: no lockstep
        config = self.models[0].config
        padded_vocab = self.models[0].vocab_size
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded_vocab:
            raise ValueError(f"vocab_size must be an int in [1, {padded_vocab}] (the model's padded vocabulary), "
                             f"got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.max_positions = self.models[0].max_sequence_length
        self.hidden_size = config.hidden_size
        self.pipeline_dtype = config.pipeline_dtype or config.params_dtype
        self.num_virtual_stages = parallel.pp_size * len(self.models)
        # Every rank decides from its own layers; all layers share one layer spec, so the ranks agree.
        honours_masks = all(_attention_honours_masks(m) for m in self.models)
        if prompt_alignment == "left_pad" and not honours_masks:
            raise ValueError("prompt_alignment='left_pad' needs attention that applies explicit masks (megatron's "
                             "DotProductAttention without the fused softmax); use 'teacher_force' or 'auto'")
        self.left_pad = prompt_alignment == "left_pad" or (prompt_alignment == "auto" and honours_masks)
        self.additive_masks = all(_attention_is_sdpa(m) for m in self.models)

    def sync_weights(self, model_chunks: list, parallel) -> None:
        """Nothing to copy: generation runs on the training model. Refuses other models, which would be ignored."""
        if [unwrap_chunk(c) for c in model_chunks] != self.models:
            raise ValueError("the built-in engine generates with the model chunks it was built with; "
                             "sync_weights was given different ones")

    def submit(self, prompts: list[list[int]], params: SamplingParams, *,
               between_steps: Callable[[], int] | None = None) -> Callable[[], Rollout]:
        """The rollout, generated now (the engine runs on the trainer's own ranks), given when asked: the record
        (responses.py) of params.n responses per prompt, on the group's device on every rank, and with
        `record_routing` (a mixture-of-experts model) the experts each response's fed tokens went to at this rank's
        MoE layers (`Rollout`; M ordered as moe_routing.routed_layers), and the seconds this rank spent in the
        decode loop (`Rollout.generation_s`; expert-parallel peers' steps after its own rows included). The routing
        differs between pipeline stages (each rank records its own layers), so it stays rank-local, beside the
        record: never sent between ranks.
        `between_steps`: called before every forward step (module doc; None: nothing)."""
        rollout = self._generate(prompts, params, between_steps or _no_update)
        return lambda: rollout

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Responses:
        """The record of `submit`'s rollout."""
        return self._generate(prompts, params, _no_update).responses

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, between_steps: Callable[[], int]) \
            -> Rollout:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_prompts(prompts, vocab_size=self.vocab_size, max_positions=self.max_positions,
                      max_new_tokens=params.max_new_tokens)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        seeds = [response_seed(params.seed, i, j, params.n) for i in range(len(prompts)) for j in range(params.n)]
        batches = batch_ranges([len(r) for r in rows], max_new_tokens=params.max_new_tokens,
                               max_rows=self.max_batch_size, max_tokens=self.max_batch_tokens, rows_per_prompt=params.n)
        parts: list[tuple[torch.Tensor, ...]] = []  # per batch: (tokens_T, logprobs_T, updates_T, lengths_R, finish_R)
        entropies: list[torch.Tensor] = []  # per batch, with record_entropies
        routed: list[torch.Tensor] | None = [] if self.record_routing else None
        self._between_steps, self._updates_taken = between_steps, 0  # this call's, and the updates it took
        # No device sync for the end time: every decode step reads the count of live rows back from the device.
        start_s = time.perf_counter()
        with self._inference_mode(), recording(self.models, self.record_routing) as recorder, \
                packed_weights(self.models) as self._packed, \
                progress_bar(total=len(rows), desc="decoding", unit="row", leave=False,
                             disable=not self.progress) as bar:
            for batch in batches:
                *batch_parts, batch_entropies, batch_routes = self._generate_batch(
                    [rows[r] for r in batch], [seeds[r] for r in batch], params, recorder)
                parts.append(batch_parts)
                entropies += [batch_entropies] if batch_entropies is not None else []
                if routed is not None:
                    routed += batch_routes if batch_routes is not None else [None] * len(batch)
                bar.update(len(batch))
            self._stand_by()
        generation_s = time.perf_counter() - start_s
        if routed is not None and any(r is None for r in routed):
            routed = None  # a model without experts records nothing
        tokens_T, logprobs_T, updates_T, lengths_R, finish_R = (torch.cat(p) for p in zip(*parts))
        record = Responses(responses_per_prompt_P=torch.full((len(prompts),), params.n, device=self.parallel.device),
                           lengths_R=lengths_R, finish_R=finish_R, token_ids_T=tokens_T, logprobs_T=logprobs_T,
                           weight_updates_T=updates_T)
        return Rollout(record, routed, generation_s, torch.cat(entropies) if self.record_entropies else None)

    def idle(self) -> bool:
        """True: the engine answers within the call."""
        return True

    @torch.no_grad()
    def stand_by(self) -> None:
        """Generate nothing, but take part in the forward steps of the expert-parallel peers that generate (a rank
        whose replica has no prompts this time, e.g. dynamic sampling's later rounds). Collective over the
        expert-parallel group; a no-op without expert parallelism."""
        with self._inference_mode():
            self._stand_by()

    def _stand_by(self) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        while self._peers_forward(False):  # a one-token forward, dropped, for each of the peers' steps
            self._forward(torch.zeros(1, 1, dtype=torch.long, device=self.parallel.device),
                          StaticInferenceContext(max_batch_size=1, max_sequence_length=1), None)

    def _peers_forward(self, forwarding: bool) -> bool:
        """Whether this rank or an expert-parallel peer takes a forward step now (one all-reduce over the lockstep
        group; without one, `forwarding`)."""
        if self.lockstep_group is None:
            return forwarding
        flag = torch.tensor([float(forwarding)], device=self.parallel.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return bool(flag.item())

    @contextlib.contextmanager
    def _inference_mode(self):
        """Eval mode and no sequence parallelism for the duration; previous states restored on exit."""
        from megatron.core.transformer.utils import set_model_to_sequence_parallel

        was_training = [m.training for m in self.models]
        had_sequence_parallel = [m.config.sequence_parallel for m in self.models]
        try:
            for model, sp in zip(self.models, had_sequence_parallel):
                model.eval()
                if sp:
                    set_model_to_sequence_parallel(model, False)
            yield
        finally:
            for model, training, sp in zip(self.models, was_training, had_sequence_parallel):
                model.train(training)
                if sp:
                    set_model_to_sequence_parallel(model, True)
                if not model.pre_process:
                    model.set_input_tensor(None)

    def _generate_batch(self, rows: list[list[int]], seeds: list[int], params: SamplingParams, recorder):
        """One batch of rows: (token_ids_T, logprobs_T, weight_updates_T, lengths_R, finish_R) on the device, the
        rows' tokens back to back, with `record_entropies` their entropies_T (else None), and with a `recorder` each
        row's recorded experts (else None)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        # The position the next logits predict: after the longest prompt (left padding), else after the shortest.
        position = max(len(r) for r in rows) if self.left_pad else min(len(r) for r in rows)
        context = StaticInferenceContext(max_batch_size=len(rows),
                                         max_sequence_length=max(len(r) for r in rows) + params.max_new_tokens)
        state = DecodeRows(rows, seeds, left_pad=self.left_pad, max_new_tokens=params.max_new_tokens,
                           stop_token_ids=params.stop_token_ids, cache_len=context.max_sequence_length,
                           device=self.parallel.device, record_entropies=self.record_entropies)
        feed_BS = state.prefill_tokens(position)
        routes = _RouteLog(len(rows), state.pads) if recorder is not None else None
        while True:
            if self._take_updates():  # new weights: the rows in flight are prefilled again under them
                feed_BS = state.prefill_tokens(position)
                context = StaticInferenceContext(max_batch_size=state.batch_rows,
                                                 max_sequence_length=context.max_sequence_length)
            self._peers_forward(True)
            logits_BV = self._forward(feed_BS, context, self._step_mask(state.key_is_pad_BK, feed_BS.shape[1],
                                                                        position))
            if routes is not None:  # the fed columns [position - S, position) of the batch's rows
                routes.add(position - feed_BS.shape[1], state.row_B, state.live_B.clone(), recorder.take())
            context.enable_decode_mode()
            tokens_B, logprobs_B, entropies_B = self._sample_and_share(logits_BV, state, params)
            feed_BS = state.record(tokens_B, logprobs_B, position, self._updates_taken, entropies_B)
            position += 1
            if state.live_rows() == 0:
                break
            if state.compaction_pays():
                keep_B = state.compact()
                _keep_cache_rows(context, keep_B)
                feed_BS = feed_BS.index_select(0, keep_B)
        experts = routes.per_row() if routes is not None else None
        return (*state.results(), state.entropies_T(), experts)

    def _take_updates(self) -> int:
        """The call's `between_steps`, counting the weight updates it took (never while recording routing: a row's
        routing would mix two prefills)."""
        taken = self._between_steps()
        assert not (taken and self.record_routing), "config_rules: updates during generation without routing replay"
        self._updates_taken += taken
        if taken and self._packed is not None:
            self._packed.pack()  # the packed copies of the old weights
        return taken

    def _step_mask(self, key_is_pad_BK: torch.Tensor | None, seq: int, kv_len: int) -> torch.Tensor | None:
        """A forward step's attention mask (_attention_mask), built once for all layers; in SDPA's additive form
        where every layer's core attention is SdpaAttention, which would convert a boolean mask in each layer."""
        from megatron_gtpo.models.sdpa_attention import additive_mask

        masked_BHQK = _attention_mask(key_is_pad_BK, seq, kv_len)
        if masked_BHQK is None or not self.additive_masks:
            return masked_BHQK
        return additive_mask(masked_BHQK, self.pipeline_dtype)

    def _forward(self, tokens_BS: torch.Tensor, context, attention_mask) -> torch.Tensor | None:
        """One forward step of `tokens_BS` (positions from the cache offset on) through all pipeline stages, with
        `attention_mask` (None: megatron's causal default). Returns the last-position logits [B, V_padded] on the
        last stage, None elsewhere."""
        parallel = self.parallel
        batch, seq = tokens_BS.shape
        offset = context.sequence_len_offset
        position_ids_BS = torch.arange(offset, offset + seq, device=tokens_BS.device).expand(batch, seq)
        logits_BV = None
        for virtual_stage in range(self.num_virtual_stages):
            owner = virtual_stage % parallel.pp_size
            if owner != parallel.pp_rank:
                continue
            model = self.models[virtual_stage // parallel.pp_size]
            if virtual_stage > 0:
                hidden_SBH = torch.empty(seq, batch, self.hidden_size, dtype=self.pipeline_dtype,
                                         device=parallel.device)
                dist.recv(hidden_SBH, src=dist.get_global_rank(parallel.pp_group, (owner - 1) % parallel.pp_size),
                          group=parallel.pp_group)
                model.set_input_tensor(hidden_SBH)
            output = model(tokens_BS, position_ids_BS, attention_mask=attention_mask, inference_context=context,
                           runtime_gather_output=True)
            if virtual_stage < self.num_virtual_stages - 1:
                dist.send(output.contiguous(),
                          dst=dist.get_global_rank(parallel.pp_group, (owner + 1) % parallel.pp_size),
                          group=parallel.pp_group)
            else:
                logits_BV = output[:, -1, :]  # [B, 1, V]: the static context materialises the last position only
        context.increment_sequence_len_offset(seq)
        return logits_BV

    def _sample_and_share(self, logits_BV, state: DecodeRows, params: SamplingParams):
        """Sample on the last stage (each row from its seed and draw index: sample_next_tokens); every rank of the
        model-parallel group gets the token ids (int64 [B]), their float32 log-probs and with `record_entropies`
        the float32 entropies of the distributions they were sampled from (else None), on the device."""
        parallel = self.parallel
        rows = 3 if self.record_entropies else 2
        if parallel.is_last_stage:
            tokens_B, logprobs_B = sample_next_tokens(
                logits_BV, vocab_size=self.vocab_size, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, stream_keys_B=state.stream_keys_B, draws_B=state.draws_B())
            shared = [tokens_B, logprobs_B]
            if self.record_entropies:
                shared.append(sampling_entropies(logits_BV, vocab_size=self.vocab_size, temperature=params.temperature))
            # float64 carries token ids exactly (< 2**53) and the float32 values unchanged: one message.
            shared_KB = torch.stack([values.double() for values in shared])
            if parallel.tp_size > 1:
                dist.broadcast(shared_KB, src=dist.get_global_rank(parallel.tp_group, 0), group=parallel.tp_group)
        else:
            shared_KB = torch.empty(rows, state.batch_rows, dtype=torch.float64, device=parallel.device)
        if parallel.pp_size > 1:
            dist.broadcast(shared_KB, src=parallel.last_stage_global_rank, group=parallel.pp_group)
        return shared_KB[0].long(), shared_KB[1].float(), shared_KB[2].float() if self.record_entropies else None


def sampling_entropies(logits_BV: torch.Tensor, *, vocab_size: int, temperature: float) -> torch.Tensor:
    """float32 [B]: the entropy of each row's next-token distribution, softmax(logits / temperature) over the true
    vocabulary (temperature 1 when greedy), by the trainer's own op (distributed/vocab_parallel.py), here over the
    whole vocabulary, which every TP rank holds. Top-k / top-p are not folded in, unlike the sampled tokens'
    log-probs: the trainer's entropy is the full distribution's (docs/algorithms.md, "Which entropy")."""
    from megatron_gtpo.distributed.vocab_parallel import vocab_parallel_logprobs_and_entropy

    no_targets_B = torch.zeros(logits_BV.shape[0], dtype=torch.long, device=logits_BV.device)
    _, entropies_B = vocab_parallel_logprobs_and_entropy(logits_BV.contiguous(), no_targets_B, tp_group=None,
                                                         vocab_size=vocab_size, temperature=temperature or 1.0,
                                                         check_targets=False)
    return entropies_B.float()


class _RouteLog:
    """The experts recorded at each forward step of one batch, sorted out per row at the end: row r's fed tokens,
    its pads (left padding) and the steps after it finished left out, in position order."""

    def __init__(self, num_rows: int, pads: list[int]):
        self.pads = pads
        self.steps: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_rows = num_rows

    def add(self, first_column: int, row_B: torch.Tensor, fed_B: torch.Tensor, experts_TMK: torch.Tensor) -> None:
        """A forward step over columns first_column.. of the batch rows `row_B` (the rows given, in KV-cache order),
        of which those with `fed_B` were fed tokens of their own (the others had finished); `experts_TMK`: the
        recorder's [S * B, M, k] (position major)."""
        self.steps.append((first_column, row_B, fed_B, experts_TMK.view(-1, len(row_B), *experts_TMK.shape[1:])))

    def per_row(self) -> list[torch.Tensor]:
        parts: list[list[torch.Tensor]] = [[] for _ in range(self.num_rows)]
        for first_column, row_B, fed_B, experts_SBMK in self.steps:
            for b, (row, fed) in enumerate(zip(row_B.tolist(), fed_B.tolist())):
                if fed:
                    skip = max(0, self.pads[row] - first_column)  # left pads are no tokens of the row
                    parts[row].append(experts_SBMK[skip:, b])
        return [torch.cat(p) for p in parts]


def batch_ranges(row_lengths: list[int], *, max_new_tokens: int, max_rows: int | None, max_tokens: int | None,
                 rows_per_prompt: int = 1) -> list[range]:
    """Consecutive row ranges covering every row, each as long as the caps allow: at most `max_rows` rows, and rows x
    (its longest row + max_new_tokens) <= `max_tokens` (the batch's KV-cache token slots); None = no cap.
    ValueError if one row alone exceeds max_tokens (named by its prompt, row // rows_per_prompt)."""
    batches, start, width = [], 0, 0
    for row, length in enumerate(row_lengths):
        if max_tokens is not None and length + max_new_tokens > max_tokens:
            raise ValueError(f"max_batch_tokens={max_tokens} cannot hold one row: prompts[{row // rows_per_prompt}] "
                             f"has {length} tokens + max_new_tokens={max_new_tokens}")
        width = max(width, length)
        count = row - start + 1
        if (max_rows is not None and count > max_rows) or \
                (max_tokens is not None and count * (width + max_new_tokens) > max_tokens):
            batches.append(range(start, row))
            start, width = row, length
    batches.append(range(start, len(row_lengths)))
    return batches


def _attention_honours_masks(model) -> bool:
    """True if every layer's core attention applies an explicit attention mask as given: megatron's
    DotProductAttention with the unfused softmax. (TE attention and the fused causal softmax kernel impose their own
    causal mask and drop a padding mask.)"""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layers = model.decoder.layers if model.decoder is not None else []
    return all(isinstance(layer.self_attention.core_attention, DotProductAttention)
               and not layer.config.masked_softmax_fusion for layer in layers)


def _attention_is_sdpa(model) -> bool:
    """True if every layer's core attention is an SdpaAttention (models/sdpa_attention.py)."""
    from megatron_gtpo.models.sdpa_attention import SdpaAttention

    layers = model.decoder.layers if model.decoder is not None else []
    return all(isinstance(layer.self_attention.core_attention, SdpaAttention) for layer in layers)


def _attention_mask(key_is_pad_BK: torch.Tensor | None, seq: int, kv_len: int) -> torch.Tensor | None:
    """Boolean mask [B, 1, seq, kv_len], True = masked, for `seq` new queries at the end of `kv_len` keys: causal
    and padding keys. None without padding (megatron's default causal mask then applies)."""
    if key_is_pad_BK is None:
        return None
    masked_BSK = key_is_pad_BK[:, None, None, :kv_len]
    if seq > 1:
        query_position_S1 = torch.arange(kv_len - seq, kv_len, device=key_is_pad_BK.device)[:, None]
        masked_BSK = masked_BSK | (torch.arange(kv_len, device=key_is_pad_BK.device)[None, :] > query_position_S1)
    return masked_BSK


def _keep_cache_rows(context, keep_B: torch.Tensor) -> None:
    """Drop finished rows from the static KV cache: keep batch rows `keep_B` (in that order) of every layer."""
    for layer, (keys, values) in context.key_value_memory_dict.items():
        context.key_value_memory_dict[layer] = (keys.index_select(1, keep_B), values.index_select(1, keep_B))

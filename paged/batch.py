"""Turns a scheduled batch into padded, bucketed host arrays for the jitted step.

Shapes the step sees: T tokens (8, 16, 24, 32, 48, 64, 96, ...: powers of two and the midpoints between them,
so padding wastes at most a third; capped at max_num_batched_tokens) and S sequences (min(T, max_num_seqs): a
step has at most one sequence per token, and tying S to T keeps one shape per token bucket). Page tables are
always their full width: the attention walks only the pages that exist, so the width costs no time and
needs no bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged.models.attention import AttentionMetadata
from paged.models.bert import TOKEN_TYPE_SHIFT
from paged.block_manager import SINK_BLOCK, BlockManager
from paged.request import PLACEHOLDER, Request
from paged.logit_adjustments import LogitAdjustments, RowAdjustment, build_adjustments, entries_bucket
from paged.sampler import PROMPT_LOGPROBS_CHUNK, SamplingMetadata
from paged.scheduler import ScheduledBatch


@dataclasses.dataclass(frozen=True)
class Buckets:
    max_num_batched_tokens: int
    max_num_seqs: int
    min_tokens: int = 8
    # The vocabulary, the longest sequence and the per-request limits bound how many entries a step's adjusted
    # rows can list.
    vocab_size: int = 0
    max_model_len: int = 0
    max_logit_bias_entries: int = 1024
    max_stop_token_ids: int = 1024
    # Every step carries AttentionMetadata.rope_lengths (the model's rope depends on the sequence length).
    rope_lengths: bool = False
    # Every step carries each token's LoRA slot (StepInputs.lora_slots).
    lora: bool = False
    # Speculative decoding: the most packed tokens a step verifies (the speculating rows' last verified token and
    # proposals); 0 when the engine does not speculate.
    max_verify_tokens: int = 0

    def token_sizes(self) -> list[int]:
        sizes, size = [], self.min_tokens
        while size < self.max_num_batched_tokens:
            sizes.append(size)
            if size >= 16:
                sizes.append(size * 3 // 2)
            size *= 2
        return sorted({s for s in sizes if s < self.max_num_batched_tokens} | {self.max_num_batched_tokens})

    def tokens(self, n: int) -> int:
        return next(size for size in self.token_sizes() if size >= n)

    def seqs(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    @property
    def adjusted_width(self) -> int:
        """Rows of the hidden states the adjusted rows read: the step's sampled rows at full width, then its
        verified positions (ModelRunner)."""
        return self.max_num_seqs + self.max_verify_tokens

    def verify_rows(self, num_tokens_bucket: int) -> int:
        """V, the verified rows of a step of token bucket T: never more than its tokens."""
        return min(num_tokens_bucket, self.max_verify_tokens)

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) the engine can produce; what a full warm-up compiles."""
        return [(t, self.seqs(t)) for t in self.token_sizes()]

    @property
    def mask_words(self) -> int:
        """int32 words of one row's grammar bitmask."""
        return (self.vocab_size + 31) // 32

    def adjustment_shapes(self) -> list[tuple[int, int]]:
        """Every (R, E) of the adjusted rows (paged/logit_adjustments.py) a step can produce. A row lists at
        most its distinct prompt and output tokens, its logit_bias entries and its banned stop ids (and never
        more than the vocabulary); the few eos ids are within the margin."""
        per_row = min(self.vocab_size,
                      self.max_model_len + self.max_logit_bias_entries + self.max_stop_token_ids + 64)
        shapes, rows = [], 1
        while True:
            rows = min(rows, self.adjusted_width)
            entries = 0
            while entries < entries_bucket(rows * per_row):
                entries = entries_bucket(entries + 1)
                shapes.append((rows, entries))
            if rows == self.adjusted_width:
                return shapes
            rows *= 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: np.ndarray  # int32 [T]
    # int32 [T]: -1, or the row of the previous step's samples that holds this token (it was in flight when
    # this step was prepared: async scheduling); the step then reads the token on the device.
    token_source: np.ndarray
    attention: AttentionMetadata
    logits_indices: np.ndarray  # int32 [S]
    sampling: SamplingMetadata
    # bool []: whether the fused step samples at all (False when every row is sampled apart).
    sample_in_step: np.ndarray
    # The rows sampled apart, or None (the runner runs them after the fused step, which never sees them).
    adjustments: LogitAdjustments | None
    # int32 [P]: packed tokens whose logits give prompt logprobs, and int32 [P]: the prompt token each one
    # predicts. P is 0 when no row asks for prompt logprobs, else the token bucket T rounded up to whole
    # PROMPT_LOGPROBS_CHUNKs. The runner computes them after the fused step, from its normed hidden states.
    prompt_logprob_indices: np.ndarray
    prompt_logprob_targets: np.ndarray
    # int32 [T]: each token's LoRA slot (-1: the base model alone; padding too), or None when LoRA is off.
    lora_slots: np.ndarray | None = None
    # Speculative decoding: int32 []: how many of the V rows below are live (0: the step verifies nothing);
    # int32 [V]: the packed tokens whose next token is drawn to verify proposals (a speculating row's last
    # verified token and its proposals); their sampling inputs [V], each token's output_index its own. The step
    # gives their samples as SamplerOutput.verified. V is Buckets.verify_rows(T): 0 unless speculating.
    num_verify: np.ndarray = dataclasses.field(default_factory=lambda: np.asarray(0, np.int32))
    verify_indices: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    verify_sampling: SamplingMetadata | None = None
    # The verified positions whose logits the request changes (grammar, logit_bias, penalties), or None: their
    # rows index the step's hidden states past its sampled rows (Buckets.adjusted_width).
    verify_adjustments: LogitAdjustments | None = None


@dataclasses.dataclass(frozen=True)
class PromptLogprobSpan:
    """`count` of a step's prompt-logprob rows, from row `offset`: the logprobs of `request`'s prompt tokens
    `first_position`, `first_position + 1`, ... (each from the logits of the token before it), computed in
    the step's batch row `row`."""

    request: Request
    row: int
    first_position: int
    count: int
    offset: int


def prompt_logprob_spans(batch: ScheduledBatch) -> list[PromptLogprobSpan]:
    """The prompt logprobs `batch` computes: for each row asking for them, the prompt positions of its chunk
    whose logprob is still missing. Read before the launch advances the rows' computed tokens."""
    spans, offset = [], 0
    for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        if request.prompt_logprobs is None:
            continue
        start = request.num_computed_tokens
        # The logits at position q give token q + 1's logprob; entries already held (before a preemption
        # recomputed the prompt) are not computed again.
        first = max(start + 1, len(request.prompt_logprobs))
        last = min(start + num_new, request.num_prompt_tokens - 1)
        if first <= last:
            spans.append(PromptLogprobSpan(request, row, first, last - first + 1, offset))
            offset += last - first + 1
    return spans


def prepare_inputs(batch: ScheduledBatch, block_manager: BlockManager, buckets: Buckets,
                   spans: list[PromptLogprobSpan] | None = None) -> StepInputs:
    """`spans`: `prompt_logprob_spans(batch)`, when the caller needs them too (computed here otherwise)."""
    num_tokens = batch.total_tokens
    t_pad = buckets.tokens(num_tokens)
    s_pad = buckets.seqs(t_pad)
    num_seqs = len(batch.requests)
    assert num_tokens <= t_pad and num_seqs <= s_pad, (num_tokens, t_pad, num_seqs, s_pad)
    spans = prompt_logprob_spans(batch) if spans is None else spans
    return _fill(batch, block_manager, buckets, t_pad, s_pad, spans)


def padding_inputs(block_manager: BlockManager, buckets: Buckets, t_pad: int) -> StepInputs:
    """An all-padding step of shape (T, S): it touches only the sink block. Used to compile ahead."""
    empty = ScheduledBatch([], [], [])
    return _fill(empty, block_manager, buckets, t_pad, buckets.seqs(t_pad), [])


def prompt_logprob_rows(t_pad: int) -> int:
    """P for a step of token bucket T that computes prompt logprobs."""
    return t_pad if t_pad <= PROMPT_LOGPROBS_CHUNK else -(-t_pad // PROMPT_LOGPROBS_CHUNK) * PROMPT_LOGPROBS_CHUNK


def _fill(batch: ScheduledBatch, block_manager: BlockManager, buckets: Buckets, t_pad: int,
          s_pad: int, spans: list[PromptLogprobSpan]) -> StepInputs:
    num_seqs = len(batch.requests)
    token_ids = np.zeros(t_pad, np.int32)
    token_source = np.full(t_pad, -1, np.int32)
    positions = np.zeros(t_pad, np.int32)
    rope_lengths = np.ones(t_pad, np.int32) if buckets.rope_lengths else None
    lora_slots = np.full(t_pad, -1, np.int32) if buckets.lora else None
    # Padded tokens write into the sink block and read as sequence 0 at position 0: harmless and NaN-free.
    slot_mapping = np.full(t_pad, SINK_BLOCK * block_manager.block_size, np.int32)
    token_seq_ids = np.zeros(t_pad, np.int32)
    query_start = np.zeros(s_pad + 1, np.int32)
    seq_lens = np.zeros(s_pad, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    rows = np.zeros(s_pad, np.int64)
    has_row = np.zeros(s_pad, bool)

    temperature = np.zeros(s_pad, np.float32)
    top_k = np.zeros(s_pad, np.int32)
    top_p = np.ones(s_pad, np.float32)
    min_p = np.zeros(s_pad, np.float32)
    seeds = np.zeros(s_pad, np.uint32)
    output_index = np.zeros(s_pad, np.int32)
    wants_logprobs = np.zeros(s_pad, bool)
    adjusted_rows: list[RowAdjustment] = []  # rows whose logits the request changes
    verify = _VerifyRows(buckets.verify_rows(t_pad))
    verify_adjusted: list[RowAdjustment] = []  # verified positions whose logits the request changes

    offset = 0
    row_offsets = []
    for i, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start, stop = request.num_computed_tokens, request.num_computed_tokens + num_new
        row_offsets.append(offset)
        token_ids[offset:offset + num_new] = request.token_ids[start:stop]
        if request.token_type_ids is not None:  # an encoder's pair: each token's segment in its id's high bits
            token_ids[offset:offset + num_new] |= np.asarray(request.token_type_ids[start:stop],
                                                             np.int32) << TOKEN_TYPE_SHIFT
        in_flight = stop - 1 - batch.drafts_of(i)  # only the last token before any proposals can be in flight
        if request.token_ids[in_flight] == PLACEHOLDER:
            token_ids[offset + in_flight - start] = 0
            token_source[offset + in_flight - start] = request.placeholder_row
        positions[offset:offset + num_new] = np.arange(start, stop)
        if rope_lengths is not None:  # a prompt's tokens follow its length; later ones their position + 1
            floor = max(request.num_prompt_tokens, request.rope_length_floor)
            rope_lengths[offset:offset + num_new] = np.maximum(floor, np.arange(start + 1, stop + 1))
        slot_mapping[offset:offset + num_new] = block_manager.slots(request, start, stop)
        token_seq_ids[offset:offset + num_new] = i
        if lora_slots is not None:
            lora_slots[offset:offset + num_new] = request.lora_slot
        offset += num_new
        query_start[i + 1] = offset
        seq_lens[i] = stop
        logits_indices[i] = offset - 1
        rows[i] = request.page_row
        has_row[i] = True

        params = request.params
        temperature[i] = params.temperature
        top_k[i] = params.top_k
        top_p[i] = params.top_p
        min_p[i] = params.min_p
        seeds[i] = request.seed
        output_index[i] = request.num_output_tokens
        wants_logprobs[i] = params.logprobs is not None
        banned = []  # stop ids are banned until min_tokens
        if request.num_output_tokens < params.min_tokens:
            banned = [*params.stop_token_ids, *(() if params.ignore_eos else request.eos_token_ids)]
        # Only a row whose sample is kept (not a prompt chunk before the last) is adjusted.
        samples_next = stop == request.num_tokens
        grammar = request.grammar if samples_next and request.grammar_after is None else None
        if batch.drafts_of(i):  # the last verified token and the proposals: each one's next token is drawn
            if params.logit_bias or params.has_penalties or grammar is not None:
                verify_adjusted += _position_adjustments(request, verify.count, batch.drafts_of(i),
                                                         buckets.mask_words)
            verify.add(request, offset - num_new, num_new, request.num_output_tokens - batch.drafts_of(i))
        elif samples_next and (params.logit_bias or banned or params.has_penalties or grammar is not None):
            adjusted = RowAdjustment(i, [*params.logit_bias, *banned],
                                     [*params.logit_bias.values(), *[-np.inf] * len(banned)], grammar=grammar)
            if params.has_penalties:
                adjusted.penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
                adjusted.penalty_ids, adjusted.penalty_counts = _penalty_tokens(request)
            adjusted_rows.append(adjusted)
    query_start[num_seqs + 1:] = offset

    sampling = SamplingMetadata(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                                output_index=output_index, wants_logprobs=wants_logprobs)
    adjustments = None
    if adjusted_rows:  # sampled apart; the fused step treats them as plain greedy rows
        adjustments = build_adjustments(adjusted_rows, sampling, buckets.adjusted_width, buckets.mask_words)
        rows_apart = [adj.row for adj in adjusted_rows]
        temperature[rows_apart], wants_logprobs[rows_apart] = 0.0, False
    verify_sampling = verify.sampling() if buckets.max_verify_tokens else None
    verify_adjustments = None
    if verify_adjusted:  # sampled apart too; the step's own draw takes them as plain greedy rows
        verify_adjustments = build_adjustments(verify_adjusted, verify_sampling, buckets.adjusted_width,
                                               buckets.mask_words, row_base=buckets.max_num_seqs)
        rows_apart = [adj.row for adj in verify_adjusted]
        verify.temperature[rows_apart], verify.wants_logprobs[rows_apart] = 0.0, False
    page_tables = np.where(has_row[:, None], block_manager.page_table[rows], SINK_BLOCK).astype(np.int32)
    num_prompt_rows = prompt_logprob_rows(t_pad) if spans else 0
    prompt_indices = np.zeros(num_prompt_rows, np.int32)
    prompt_targets = np.zeros(num_prompt_rows, np.int32)
    for span in spans:
        request, rows_of_span = span.request, slice(span.offset, span.offset + span.count)
        # Position q sits at packed index row_offset + (q - num_computed_tokens); it predicts token q + 1.
        first_q = span.first_position - 1
        prompt_indices[rows_of_span] = (row_offsets[span.row] + first_q - request.num_computed_tokens
                                        + np.arange(span.count))
        prompt_targets[rows_of_span] = request.prompt_token_ids[span.first_position:span.first_position + span.count]
    return StepInputs(
        token_ids=token_ids,
        token_source=token_source,
        attention=AttentionMetadata(slot_mapping=slot_mapping, positions=positions, token_seq_ids=token_seq_ids,
                                    page_tables=page_tables, query_start=query_start, seq_lens=seq_lens,
                                    num_decode_rows=np.asarray(sum(n == 1 for n in batch.num_new_tokens), np.int32),
                                    num_prefill_rows=np.asarray(sum(n > 1 for n in batch.num_new_tokens), np.int32),
                                    rope_lengths=rope_lengths),
        logits_indices=logits_indices,
        sampling=sampling,
        sample_in_step=np.asarray(len(adjusted_rows) < max(num_seqs, 1)),
        adjustments=adjustments,
        prompt_logprob_indices=prompt_indices,
        prompt_logprob_targets=prompt_targets,
        lora_slots=lora_slots,
        num_verify=np.asarray(verify.count, np.int32),
        verify_indices=verify.indices,
        verify_sampling=verify_sampling,
        verify_adjustments=verify_adjustments,
    )


class _VerifyRows:
    """The verified rows of a step (StepInputs.verify_*), filled row by row."""

    def __init__(self, size: int):
        self.count = 0
        self.indices = np.zeros(size, np.int32)
        self.temperature = np.zeros(size, np.float32)
        self.top_k = np.zeros(size, np.int32)
        self.top_p = np.ones(size, np.float32)
        self.min_p = np.zeros(size, np.float32)
        self.seeds = np.zeros(size, np.uint32)
        self.output_index = np.zeros(size, np.int32)
        self.wants_logprobs = np.zeros(size, bool)

    def add(self, request: Request, first: int, count: int, first_output_index: int) -> None:
        """`count` packed tokens of `request` from packed index `first`; the first one's next token is output
        token `first_output_index`, so each keeps the random key it would have without proposals."""
        rows, params = slice(self.count, self.count + count), request.params
        self.indices[rows] = np.arange(first, first + count)
        self.temperature[rows], self.top_k[rows], self.top_p[rows] = params.temperature, params.top_k, params.top_p
        self.min_p[rows], self.seeds[rows] = params.min_p, request.seed
        self.output_index[rows] = np.arange(first_output_index, first_output_index + count)
        self.wants_logprobs[rows] = params.logprobs is not None
        self.count += count

    def sampling(self) -> SamplingMetadata:
        return SamplingMetadata(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                                seeds=self.seeds, output_index=self.output_index,
                                wants_logprobs=self.wants_logprobs)


def _position_adjustments(request: Request, first_row: int, num_drafts: int, mask_words: int
                          ) -> list[RowAdjustment]:
    """What `request` changes about the logits at each of its verified positions (verified rows `first_row`
    on): its logit_bias; penalties counting the proposals before the position as output; the grammar's mask
    after them (the scheduler proposes only what the grammar accepts)."""
    params = request.params
    start = request.num_tokens - num_drafts  # where the proposals begin
    masks = None
    if request.grammar is not None:
        masks = np.empty((num_drafts + 1, mask_words), np.int32)
        request.grammar.masks_along(request.token_ids[start:], masks)
    rows = []
    for j in range(num_drafts + 1):
        adjusted = RowAdjustment(first_row + j, list(params.logit_bias), list(params.logit_bias.values()),
                                 mask=masks[j] if masks is not None else None)
        if params.has_penalties:
            adjusted.penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
            adjusted.penalty_ids, adjusted.penalty_counts = _penalty_tokens(request, start + j)
        rows.append(adjusted)
    return rows


def _penalty_tokens(request, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Distinct token ids of prompt + output, and each one's count in the output (the output up to token_ids
    index `end` when given)."""
    output = request.output_token_ids if end is None else request.token_ids[request.num_prompt_tokens:end]
    out_ids, out_counts = np.unique(np.asarray(output, np.int64), return_counts=True)
    ids = np.union1d(np.asarray(request.prompt_token_ids, np.int64), out_ids)
    counts = np.zeros(len(ids), np.int32)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    return ids.astype(np.int32), counts

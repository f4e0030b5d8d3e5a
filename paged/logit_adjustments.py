"""What a request may change about its logits (grammar masks, logit_bias, the stop ids min_tokens holds back,
repetition/frequency/presence penalties), applied to the rows that ask for it in a small program of its own.

Why apart from the fused step: how many ids a row lists (its bias entries, the distinct tokens its penalties
look at) and whether a row is constrained are request data. Inside the fused step they were array widths, so
a new width recompiled the whole model on the request path. Here the step's adjusted rows are gathered into
R rows (a power-of-two bucket) and their entries flattened into one list of E entries (a power-of-four
bucket), both bounded by the engine's limits, so every shape exists at start-up (`Buckets.adjustment_shapes`)
and none is compiled for a request.

Each entry is one distinct (row, token) pair: its bias (logit_bias values and -inf bans, summed when an id is
listed twice), its count in the row's output, and whether penalties apply to it (the token occurs in the
prompt or the output). vLLM's order on a row: the grammar's mask, then biases, then the repetition penalty
(dividing a positive logit, multiplying a negative one), then frequency x count and presence.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged.sampler import SamplerOutput, SamplingMetadata, apply_token_mask, draw

# Fewest entries a step's list holds: steps with a few biases or bans share one shape.
MIN_ENTRIES = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitAdjustments:
    """The adjusted rows of one step. R: rows (bucketed), E: entries (bucketed), W: ceil(V / 32).

    Attributes:
      rows: int32 [R]; the batch row each adjusted row samples for; padding rows hold the sampler's padded
        width (max_num_seqs), which every gather clamps and every scatter drops.
      num_rows: int32 []; how many of the R rows are real.
      sampling: SamplingMetadata of [R]; the rows' own temperature, filters, seed and logprobs.
      presence_penalty, frequency_penalty, repetition_penalty: float32 [R] (0, 0, 1 disable).
      allowed_tokens: int32 [R, W] packed grammar masks (bit i % 32 of word i // 32: token i allowed); -1 words
        for unconstrained rows.
      entry_rows: int32 [E]; the adjusted row (0..R-1) of each entry; R for padding entries.
      entry_tokens: int32 [E]; the token id.
      entry_bias: float32 [E]; added to the logit (-inf bans the token).
      entry_counts: int32 [E]; the token's occurrences in the row's output so far.
      entry_penalised: bool [E]; whether penalties apply (the token is in the row's prompt or output).
    """

    rows: np.ndarray
    num_rows: np.ndarray
    sampling: SamplingMetadata
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    allowed_tokens: np.ndarray
    entry_rows: np.ndarray
    entry_tokens: np.ndarray
    entry_bias: np.ndarray
    entry_counts: np.ndarray
    entry_penalised: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        """(R, E): what the adjustment programs compile for."""
        return self.rows.shape[0], self.entry_rows.shape[0]


@dataclasses.dataclass
class RowAdjustment:
    """What one batch row changes, as the host gathers it.

    bias_ids / bias_values: logit_bias entries and -inf for banned ids (an id may repeat; the values add up).
    penalty_ids: distinct tokens of the prompt and output (None: no penalties), penalty_counts: each one's
    occurrences in the output. grammar: the row's matcher when its sample is constrained, else None; mask:
    its allowed tokens computed already (int32 [W]), for a position past proposals the matcher has not taken.
    """

    row: int
    bias_ids: list[int]
    bias_values: list[float]
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)  # presence, frequency, repetition
    penalty_ids: np.ndarray | None = None
    penalty_counts: np.ndarray | None = None
    grammar: object = None
    mask: np.ndarray | None = None


def rows_bucket(num_rows: int, max_rows: int) -> int:
    """R for `num_rows` adjusted rows: the next power of two, at most max_rows (max_num_seqs)."""
    bucket = 1
    while bucket < num_rows:
        bucket *= 2
    return min(bucket, max_rows)


def entries_bucket(num_entries: int) -> int:
    """E for `num_entries` entries: MIN_ENTRIES times the next power of four."""
    bucket = MIN_ENTRIES
    while bucket < num_entries:
        bucket *= 4
    return bucket


_NO_ENTRIES = (np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, bool))


def row_entries(adj: RowAdjustment) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The row's distinct tokens with their summed bias, output count and whether penalties apply."""
    if adj.penalty_ids is None and not adj.bias_ids:  # a grammar's mask only (the common case: no numpy work)
        return _NO_ENTRIES
    if not adj.bias_ids:  # penalties only: their ids are distinct already
        num = len(adj.penalty_ids)
        return (np.asarray(adj.penalty_ids, np.int32), np.zeros(num, np.float32),
                np.asarray(adj.penalty_counts, np.int32), np.ones(num, bool))
    bias_ids = np.asarray(adj.bias_ids, np.int64)
    penalty_ids = np.asarray(adj.penalty_ids if adj.penalty_ids is not None else (), np.int64)
    tokens = np.union1d(bias_ids, penalty_ids)
    bias = np.zeros(len(tokens), np.float32)
    np.add.at(bias, np.searchsorted(tokens, bias_ids), np.asarray(adj.bias_values, np.float32))
    counts = np.zeros(len(tokens), np.int32)
    penalised = np.zeros(len(tokens), bool)
    if len(penalty_ids):
        where = np.searchsorted(tokens, penalty_ids)
        counts[where] = adj.penalty_counts
        penalised[where] = True
    return tokens.astype(np.int32), bias, counts, penalised


def build_adjustments(rows: list[RowAdjustment], sampling: SamplingMetadata, max_rows: int, mask_words: int,
                      num_rows: int | None = None, num_entries: int | None = None,
                      row_base: int = 0) -> LogitAdjustments:
    """Host arrays for `rows`. `sampling` holds the step's per-row host arrays (the rows' own are taken from
    it). `num_rows` / `num_entries` force the buckets (ahead-of-time compilation); they default to the buckets
    of what `rows` needs. `row_base` is added to each real row's index into the hidden states (a verified
    position's row sits past the step's sampled rows: ModelRunner's adjusted width)."""
    per_row = [row_entries(adj) for adj in rows]
    lengths = [len(tokens) for tokens, *_ in per_row]
    r_pad = num_rows or rows_bucket(len(rows), max_rows)
    e_pad = num_entries or entries_bucket(sum(lengths))
    real = len(rows)
    batch_rows = np.full(r_pad, max_rows, np.int32)
    batch_rows[:real] = [adj.row for adj in rows]
    source = batch_rows[:real].copy()  # where each row's sampling settings are
    penalties = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (r_pad, 1))
    if real:
        penalties[:real] = [adj.penalties for adj in rows]
    allowed = np.full((r_pad, mask_words), -1, np.int32)
    for r, adj in enumerate(rows):
        if adj.mask is not None:
            allowed[r] = adj.mask
        elif adj.grammar is not None:
            adj.grammar.fill_bitmask(allowed[r])
    entry_rows = np.full(e_pad, r_pad, np.int32)
    entry_tokens = np.zeros(e_pad, np.int32)
    entry_bias = np.zeros(e_pad, np.float32)
    entry_counts = np.zeros(e_pad, np.int32)
    entry_penalised = np.zeros(e_pad, bool)
    if sum(lengths):
        used = slice(0, sum(lengths))
        entry_rows[used] = np.repeat(np.arange(real, dtype=np.int32), lengths)
        for target, part in zip((entry_tokens, entry_bias, entry_counts, entry_penalised), zip(*per_row)):
            target[used] = np.concatenate(part)
    batch_rows[:real] += row_base
    # The rows' own sampling settings; padding rows sample greedily with nothing asked.

    def take(values, fill):
        values = np.asarray(values)
        out = np.full(r_pad, fill, values.dtype)
        out[:real] = values[source]
        return out

    row_sampling = SamplingMetadata(
        temperature=take(sampling.temperature, 0), top_k=take(sampling.top_k, 0), top_p=take(sampling.top_p, 1),
        min_p=take(sampling.min_p, 0), seeds=take(sampling.seeds, 0), output_index=take(sampling.output_index, 0),
        wants_logprobs=take(sampling.wants_logprobs, False))
    return LogitAdjustments(
        rows=batch_rows, num_rows=np.asarray(real, np.int32), sampling=row_sampling,
        presence_penalty=penalties[:, 0].copy(), frequency_penalty=penalties[:, 1].copy(),
        repetition_penalty=penalties[:, 2].copy(), allowed_tokens=allowed, entry_rows=entry_rows,
        entry_tokens=entry_tokens, entry_bias=entry_bias, entry_counts=entry_counts,
        entry_penalised=entry_penalised)


def apply_entries(logits: jax.Array, adj: LogitAdjustments) -> jax.Array:
    """float32 logits [R, V] with each entry's bias added and, where penalties apply, the row's repetition,
    frequency and presence penalties applied to the biased logit (vLLM's order)."""
    num_rows = logits.shape[0]
    valid = adj.entry_rows < num_rows
    rows = jnp.where(valid, adj.entry_rows, 0)
    tokens = adj.entry_tokens
    x = logits[rows, tokens] + adj.entry_bias
    repetition = adj.repetition_penalty[rows]
    penalised = jnp.where(x > 0, x / repetition, x * repetition)
    counts = adj.entry_counts.astype(jnp.float32)
    penalised -= counts * adj.frequency_penalty[rows] + (counts > 0) * adj.presence_penalty[rows]
    x = jnp.where(adj.entry_penalised, penalised, x)
    # Entries are distinct (row, token) pairs, so a plain set is exact; padding entries fall out of range.
    return logits.at[jnp.where(valid, rows, num_rows), tokens].set(x, mode="drop")


def sample_adjusted(logits: jax.Array, adj: LogitAdjustments, argmax=None) -> SamplerOutput:
    """The adjusted rows' samples from their float32 logits [R, V]: the grammar's mask, then the entries, then
    `draw` (whose logprobs report the masked, unbiased distribution)."""
    masked = apply_token_mask(logits, adj.allowed_tokens)
    return draw(apply_entries(masked, adj), masked, adj.sampling, argmax)

"""Token sampling on device, fused into the jitted step so only token ids (and requested logprobs) return.

Each row carries its own temperature, filters and seed; a row's random key is its seed folded with the number
of tokens it has generated, so its samples do not depend on what else shares the batch (or on preemption,
which recomputes but does not re-sample).

Order of operations on a row's logits (vLLM's): the structured-output mask, logit biases and penalties (rows
that ask for any of these are sampled apart: paged/logit_adjustments.py), then greedy argmax or temperature
-> min_p -> top_k -> top_p -> draw. Logprobs report the model's raw distribution (log-softmax of the logits
before any of that, the grammar's mask aside), as vLLM does by default.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from paged.sampling_params import MAX_LOGPROBS  # top logprobs per token the step can return


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs, padded to the step's sequence bucket S.

    Attributes:
      temperature: float32 [S]; 0 means greedy.
      top_k: int32 [S]; 0 disables.
      top_p: float32 [S]; 1 disables.
      min_p: float32 [S]; 0 disables.
      seeds: uint32 [S]; the request's seed.
      output_index: int32 [S]; how many tokens the request has generated (folded into its key).
      wants_logprobs: bool [S]; whether the row asked for logprobs.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    output_index: jax.Array
    wants_logprobs: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens, one row per position the step's `prompt_logprob_indices` picks (P rows):
    token_logprobs float32 [P] and token_ranks int32 [P] of the prompt's actual next token; top_ids int32
    [P, MAX_LOGPROBS] and top_logprobs float32 [P, MAX_LOGPROBS]."""

    token_logprobs: jax.Array
    token_ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """tokens int32 [S]; token_logprobs float32 [S] and token_ranks int32 [S] of the sampled tokens;
    top_ids int32 [S, MAX_LOGPROBS] and top_logprobs float32 [S, MAX_LOGPROBS] (zeros unless requested);
    prompt: the step's prompt logprobs, None when no row asked for them; adjusted: the samples of the rows
    sampled apart (paged/logit_adjustments.py), None when there were none. `merged()` puts them in place."""

    tokens: jax.Array
    token_logprobs: jax.Array
    token_ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    prompt: PromptLogprobs | None = None
    adjusted: AdjustedSamples | None = None
    # Speculative decoding: the tokens drawn after each verified packed token (StepInputs.verify_indices), with
    # their logprobs where asked; None in an engine that does not speculate.
    verified: SamplerOutput | None = None

    def merged(self) -> SamplerOutput:
        """On host arrays: the adjusted rows' samples written over the fused step's (which sampled them as
        plain greedy rows, or not at all)."""
        verified = self.verified.merged() if self.verified is not None else None
        if self.adjusted is None:
            return dataclasses.replace(self, verified=verified)
        rows = np.asarray(self.adjusted.rows)
        real = rows < len(self.tokens)
        fields = {}
        for name in ("tokens", "token_logprobs", "token_ranks", "top_ids", "top_logprobs"):
            values = np.array(getattr(self, name))
            values[rows[real]] = np.asarray(getattr(self.adjusted.samples, name))[real]
            fields[name] = values
        return SamplerOutput(**fields, prompt=self.prompt, verified=verified)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdjustedSamples:
    """rows int32 [R]: the batch row of each adjusted row (padding rows hold max_num_seqs); samples: their
    SamplerOutput of [R]."""

    rows: jax.Array
    samples: SamplerOutput


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with filtered-out tokens at -inf. float32 [S, V] -> [S, V].

    Order: min_p on the full distribution, then top_k, then top_p on the renormalised remainder (a token
    stays while the probability mass ranked strictly above it is below top_p, so the top token always stays).
    """
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def apply_filters(scaled):
        sorted_logits, order = jax.lax.top_k(scaled, vocab)  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep = probs >= min_p[:, None] * probs[:, :1]
        rank = jnp.arange(vocab)[None, :]
        keep &= rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
        kept = jnp.where(keep, probs, 0.0)
        kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
        mass_above = jnp.cumsum(kept, axis=-1) - kept
        keep &= mass_above < top_p[:, None]
        filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
        rows = jnp.arange(scaled.shape[0])[:, None]
        return jnp.full_like(scaled, -jnp.inf).at[rows, order].set(filtered_sorted)

    # Sorting the vocabulary is the expensive part; skip it when no row filters.
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0) | (min_p > 0.0))
    return jax.lax.cond(needs_filter, apply_filters, lambda s: s, scaled)


def _logprobs(raw_logits: jax.Array, tokens: jax.Array):
    logp = jax.nn.log_softmax(raw_logits, axis=-1)
    token_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(logp > token_logp[:, None], axis=-1).astype(jnp.int32) + 1
    k = min(MAX_LOGPROBS, logp.shape[-1])
    top_logp, top_ids = jax.lax.top_k(logp, k)
    pad = ((0, 0), (0, MAX_LOGPROBS - k))
    return token_logp, ranks, jnp.pad(top_ids.astype(jnp.int32), pad), jnp.pad(top_logp, pad)


# Prompt positions whose logits exist at once: a long prompt's logprobs never hold [prompt_len, V] float32.
PROMPT_LOGPROBS_CHUNK = 128


def prompt_logprobs(logits: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array) -> PromptLogprobs:
    """Raw-distribution logprobs of each prompt position's next token, as vLLM's prompt_logprobs.

    Args:
      logits: hidden rows [C, H] -> float32 logits [C, V] (the model's LM head).
      hidden: [P, H] final-normed hidden states of the positions; P is a multiple of PROMPT_LOGPROBS_CHUNK
        or at most one chunk.
      targets: int32 [P]; the prompt token that follows each position.
    """
    num = hidden.shape[0]
    chunk = min(num, PROMPT_LOGPROBS_CHUNK)
    if num % chunk:
        raise ValueError(f"prompt logprob rows ({num}) must be a multiple of {chunk}")

    def one_chunk(args):
        h, tokens = args
        return _logprobs(logits(h), tokens)

    chunks = (hidden.reshape(num // chunk, chunk, -1), targets.reshape(num // chunk, chunk))
    token_logp, ranks, top_ids, top_logp = jax.lax.map(one_chunk, chunks)
    return PromptLogprobs(token_logp.reshape(num), ranks.reshape(num), top_ids.reshape(num, MAX_LOGPROBS),
                          top_logp.reshape(num, MAX_LOGPROBS))


def first_argmax(x: jax.Array, chunk: int = 128) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` for x [S, V], as int32: the first maximum, a NaN counting as +inf (numpy's
    argmax differs only for a row holding +inf before its first NaN).

    XLA's CPU argmax is a variadic (value, index) reduction that does not vectorise (0.84 ms for 48 x 8192
    logits). Plain reductions instead, in two levels so that only one pass reads all of x: the maximum of
    each `chunk` of a row, the first chunk that holds the row's maximum, then the first index inside it.
    (A max and then a min over all matching indices in one level took 2-2.5x as long.)
    """
    rows, vocab = x.shape
    if vocab % chunk:  # -inf padding at the end never changes the first maximum
        x = jnp.pad(x, ((0, 0), (0, chunk - vocab % chunk)), constant_values=-jnp.inf)
    chunks = x.reshape(rows, -1, chunk)
    best = _first_max_index(jnp.max(_nan_as_inf(chunks), axis=-1))
    inside = _first_max_index(_nan_as_inf(jnp.take_along_axis(chunks, best[:, None, None], axis=1)[:, 0]))
    return best * chunk + inside


def _nan_as_inf(x: jax.Array) -> jax.Array:
    # Whether XLA's float max propagates NaN differs between its CPU code paths; +inf is unambiguous.
    return jnp.where(jnp.isnan(x), jnp.inf, x)


def _first_max_index(x: jax.Array) -> jax.Array:
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1] - 1), axis=-1)


def apply_token_mask(logits: jax.Array, allowed_tokens: jax.Array) -> jax.Array:
    """logits float32 [S, V] with the tokens whose bit is clear in allowed_tokens (int32 [S, W]) at -inf;
    ids past W * 32 count as disallowed."""
    rows, vocab = logits.shape
    bits = (allowed_tokens[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(rows, -1) != 0
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    return jnp.where(allowed[:, :vocab], logits, -jnp.inf)


def sample(logits: jax.Array | Callable[[], jax.Array], meta: SamplingMetadata,
           argmax: Callable[[jax.Array], jax.Array] | None = None,
           greedy: Callable[[], jax.Array] | None = None) -> SamplerOutput:
    """Picks one token per row from float32 logits [S, V].

    A step where every row is plain greedy (no temperature, no logprobs) only takes the argmax: the full path
    keeps the raw logits live for logprobs beside the filtered ones, and on CPU that copy and the passes over
    it were 1.5-6% of a decode step. `argmax`: `first_argmax` (the default) or a kernel with its semantics
    (the runner passes the native CPU one on a single CPU device).

    `logits` may be a function computing them, and `greedy` a function giving the plain-greedy tokens without
    them (the LM head's fused argmax, `LlamaForCausalLM.greedy_head`): then a plain-greedy step never computes
    the logits.
    """
    argmax = argmax or first_argmax
    compute = logits if callable(logits) else (lambda: logits)
    plain_greedy = ~(jnp.any(meta.temperature > 0) | jnp.any(meta.wants_logprobs))
    if greedy is None:
        return jax.lax.cond(plain_greedy, lambda l, m: SamplerOutput(argmax(l), *_no_logprobs(l.shape[0])),
                            lambda l, m: draw(l, l, m, argmax), compute(), meta)
    rows = meta.temperature.shape[0]
    return jax.lax.cond(plain_greedy, lambda m: SamplerOutput(greedy(), *_no_logprobs(rows)),
                        lambda m: (lambda l: draw(l, l, m, argmax))(compute()), meta)


def no_samples(num_rows: int) -> SamplerOutput:
    """What a step whose every row is sampled apart returns from the fused sampler."""
    return SamplerOutput(jnp.zeros(num_rows, jnp.int32), *_no_logprobs(num_rows))


def _no_logprobs(num_rows: int):
    return (jnp.zeros(num_rows, jnp.float32), jnp.zeros(num_rows, jnp.int32),
            jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32))


def draw(logits: jax.Array, raw_logits: jax.Array, meta: SamplingMetadata, argmax=None) -> SamplerOutput:
    """Greedy or random tokens from `logits` [S, V] (after any adjustment), and logprobs of `raw_logits` (the
    distribution they report) where asked."""
    argmax = argmax or first_argmax
    greedy_tokens = argmax(logits)

    def random_tokens(logits):
        filtered = filter_logits(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
            meta.seeds, meta.output_index)
        sampled = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered)
        return jnp.where(meta.temperature > 0, sampled.astype(jnp.int32), greedy_tokens)

    tokens = jax.lax.cond(jnp.any(meta.temperature > 0), random_tokens, lambda _: greedy_tokens, logits)
    token_logp, ranks, top_ids, top_logp = jax.lax.cond(
        jnp.any(meta.wants_logprobs), _logprobs, lambda *_: _no_logprobs(logits.shape[0]), raw_logits, tokens)
    return SamplerOutput(tokens, token_logp, ranks, top_ids, top_logp)

"""Token sampling on device, fused into the jitted step so only token ids (and requested logprobs) return.

Each row carries its own temperature, filters, penalties and seed; a row's random key is its seed folded
with the number of tokens it has generated, so its samples do not depend on what else shares the batch (or
on preemption, which recomputes but does not re-sample).

Order of operations on a row's logits (vLLM's): the structured-output mask (tokens the row's grammar does not
allow next go to -inf), logit biases (logit_bias, and -inf for the stop ids that
min_tokens holds back), penalties (repetition, then frequency and presence), then greedy argmax or
temperature -> min_p -> top_k -> top_p -> draw. Logprobs report the model's raw distribution (log-softmax of
the logits before any of that, the grammar's mask aside), as vLLM does by default.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

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
      bias_ids: int32 [S, B]; token ids whose logits get `bias_values` added, -1 = unused.
      bias_values: float32 [S, B]; logit_bias entries, and -inf for ids min_tokens bans.
      presence_penalty, frequency_penalty, repetition_penalty: float32 [S] (0, 0, 1 disable).
      penalty_ids: int32 [S, W]; distinct tokens of the row's prompt and output, -1 = unused.
      penalty_counts: int32 [S, W]; how often each of them occurs in the output so far.
      wants_logprobs: bool [S]; whether the row asked for logprobs.
      allowed_tokens: int32 [S, ceil(V / 32)] packed bitmask (bit i % 32 of word i // 32: token i allowed),
        -1 words for unconstrained rows; int32 [S, 0] when no row of the step is constrained (no mask pass,
        and the one compiled shape such steps have always had).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    output_index: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    penalty_ids: jax.Array
    penalty_counts: jax.Array
    wants_logprobs: jax.Array
    allowed_tokens: jax.Array


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
    prompt: the step's prompt logprobs, None when no row asked for them."""

    tokens: jax.Array
    token_logprobs: jax.Array
    token_ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    prompt: PromptLogprobs | None = None


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """OpenAI/vLLM semantics: repetition divides positive (multiplies negative) logits of tokens seen in the
    prompt or output; frequency subtracts count x penalty and presence subtracts the penalty once, for tokens
    in the output."""
    rows = jnp.arange(logits.shape[0])[:, None]
    valid = meta.penalty_ids >= 0
    ids = jnp.where(valid, meta.penalty_ids, 0)
    seen = logits[rows, ids]
    rep = meta.repetition_penalty[:, None]
    penalised = jnp.where(seen > 0, seen / rep, seen * rep)
    counts = meta.penalty_counts.astype(jnp.float32)
    penalised -= counts * meta.frequency_penalty[:, None] + (counts > 0) * meta.presence_penalty[:, None]
    drop = jnp.where(valid, ids, logits.shape[-1])  # out of range -> dropped
    return logits.at[rows, drop].set(penalised, mode="drop")


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

    A step where every row is plain greedy (no penalties, biases or logprobs) only takes the argmax:
    the full path's first change to the logits copies them (the raw ones stay live for logprobs), and on CPU
    that copy and the passes over it were 1.5-6% of a decode step. `argmax`: `first_argmax` (the default) or
    a kernel with its semantics (the runner passes the native CPU one on a single CPU device).

    `logits` may be a function computing them, and `greedy` a function giving the plain-greedy tokens without
    them (the LM head's fused argmax, `LlamaForCausalLM.greedy_head`): then a plain-greedy step never computes
    the logits. A step with a constrained row (its mask applies before the argmax) always does.
    """
    argmax = argmax or first_argmax
    compute = logits if callable(logits) else (lambda: logits)
    if meta.allowed_tokens.shape[1]:  # static: some row of this step is constrained
        unmasked, greedy = compute, None
        compute = lambda: apply_token_mask(unmasked(), meta.allowed_tokens)
    plain_greedy = ~(jnp.any(meta.temperature > 0) | _needs_penalty(meta) | jnp.any(meta.bias_ids >= 0)
                     | jnp.any(meta.wants_logprobs))
    if greedy is None:
        return jax.lax.cond(plain_greedy, functools.partial(_greedy, argmax=argmax),
                            functools.partial(_sample_full, argmax=argmax), compute(), meta)
    rows = meta.temperature.shape[0]
    return jax.lax.cond(plain_greedy, lambda m: SamplerOutput(greedy(), *_no_logprobs(rows)),
                        lambda m: _sample_full(compute(), m, argmax), meta)


def _needs_penalty(meta: SamplingMetadata) -> jax.Array:
    return jnp.any((meta.presence_penalty != 0) | (meta.frequency_penalty != 0) | (meta.repetition_penalty != 1))


def _no_logprobs(num_rows: int):
    return (jnp.zeros(num_rows, jnp.float32), jnp.zeros(num_rows, jnp.int32),
            jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32))


def _greedy(logits: jax.Array, meta: SamplingMetadata, argmax) -> SamplerOutput:
    del meta
    return SamplerOutput(argmax(logits), *_no_logprobs(logits.shape[0]))


def _sample_full(logits: jax.Array, meta: SamplingMetadata, argmax) -> SamplerOutput:
    raw_logits = logits
    rows = jnp.arange(logits.shape[0])[:, None]
    biased = jnp.where(meta.bias_ids >= 0, meta.bias_ids, logits.shape[-1])  # out of range -> dropped
    logits = logits.at[rows, biased].add(meta.bias_values, mode="drop")  # adds up an id listed twice
    logits = jax.lax.cond(_needs_penalty(meta), lambda l: apply_penalties(l, meta), lambda l: l, logits)
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

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


# Candidates sorted before anything else: most rows' top-k / top-p sets lie within the most likely 256 tokens, and
# lax.top_k over 151,936 logits takes ~9 ms for 256 of 32 rows against ~1 s to sort them all. The larger tiers
# serve a top_k past the first (4,096 candidates take ~64 ms); a top_p set past them is found by bisection.
FILTER_CANDIDATES = (256, 4096)
# Up to this vocabulary a row is sorted whole (~1 ms for 32 rows of 512): the tiers and the bisection would only
# add compile time (about 0.6 s to every step program).
SORT_WHOLE_VOCAB = 1024


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with filtered-out tokens at -inf. float32 [S, V] -> [S, V].

    Order: min_p on the full distribution, then top_k, then top_p on the renormalised remainder (a token
    stays while the probability mass ranked strictly above it is below top_p, so the top token always stays).

    min_p is a threshold on the whole row. top_k and top_p need the row's order: the most likely
    FILTER_CANDIDATES[0] tokens are sorted first. Rows whose kept set might reach past them go on: those with
    top_p alone to a bisection over the values (`_top_p_by_bisection`), those whose top_k reaches past the
    candidates to the next tier; only a top_k past every tier sorts the whole vocabulary.
    """
    return _filter_scaled(*_scaled(logits, temperature, top_k, top_p, min_p), top_p)


def _filter_scaled(scaled, peak, limit, ranked, top_p, first=None):
    """filter_logits on `_scaled`'s results; `first`: `_filter_candidates`' results for FILTER_CANDIDATES[0]
    where the caller has them."""
    vocab = scaled.shape[-1]
    counts = [c for c in FILTER_CANDIDATES if c < vocab and vocab > SORT_WHOLE_VOCAB] + [vocab]
    rows = jnp.arange(scaled.shape[0])[:, None]

    def tier(index):
        kept, order, enough = (first if index == 0 and first is not None else
                               _filter_candidates(scaled, peak, limit, top_p, counts[index]))
        filtered = jnp.full_like(scaled, -jnp.inf).at[rows, order].set(kept)
        filtered = jnp.where(ranked[:, None], filtered, scaled)
        settled = enough | ~ranked
        if index + 1 == len(counts):
            return filtered
        # Rows left with top_p alone: bisection. The next tier only for a row whose top_k reaches past these.
        bisect = lambda: jnp.where(settled[:, None], filtered, _top_p_by_bisection(scaled, peak, top_p))
        more = lambda: jax.lax.cond(jnp.all(settled | (limit == vocab)), bisect, lambda: tier(index + 1))
        return jax.lax.cond(jnp.all(settled), lambda: filtered, more)

    return jax.lax.cond(jnp.any(ranked), lambda: tier(0), lambda: scaled)


def _scaled(logits, temperature, top_k, top_p, min_p):
    """(the logits over temperature with min_p's drops at -inf [S, V], their row maxima [S, 1], top_k as a
    limit [S] (the vocabulary for none), bool [S]: the rows that need the order (top_k or top_p))."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    # p >= min_p * p_top: the softmax's normaliser cancels.
    scaled = jax.lax.cond(jnp.any(min_p > 0), lambda s: jnp.where(jnp.exp(s - peak) >= min_p[:, None], s, -jnp.inf),
                          lambda s: s, scaled)
    limit = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    return scaled, peak, limit, (limit < vocab) | (top_p < 1.0)


def _filter_candidates(scaled, peak, limit, top_p, count):
    """top_k (`limit` [S]) and top_p over each row's `count` most likely tokens: (their logits, -inf where
    filtered out, [S, count], descending; their ids [S, count]; bool [S]: whether nothing past the candidates
    would have stayed)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = jax.lax.top_k(scaled, count)  # descending; ties: the lower id first
    probs = jnp.exp(sorted_logits - peak)  # unnormalised: every sum below is a ratio of two
    keep = jnp.arange(count)[None, :] < limit[:, None]
    kept = jnp.where(keep, probs, 0.0)
    # top_p renormalises over the top_k ∩ min_p set. It lies inside the candidates when top_k stops inside
    # them or min_p dropped the rest (no likelier than the last candidate); without top_k it is min_p's
    # whole set; a top_k past the candidates over a longer min_p set needs more of the order.
    # (The last candidate as a min, not a slice: XLA's CPU TopK rewrite needs every slice of the sort that
    # lax.top_k becomes to start at 0, or it sorts the whole vocabulary.)
    inside = (limit <= count) | (jnp.min(sorted_logits, axis=-1) == -jnp.inf)
    whole = jax.lax.cond(jnp.all(inside), lambda: jnp.zeros(inside.shape),
                         lambda: jnp.sum(jnp.exp(scaled - peak), axis=-1))  # a pass over the rows: only if needed
    mass = jnp.where(inside, jnp.sum(kept, axis=-1), whole)[:, None]
    covered = jnp.cumsum(kept, axis=-1) / mass
    keep &= covered - kept / mass < top_p[:, None]
    # Past the candidates nothing stays when the set is inside them or their mass already reaches top_p.
    enough = inside | ((limit == vocab) & (covered[:, -1] >= top_p))
    return jnp.where(keep, sorted_logits, -jnp.inf), order, enough


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-0 just below +0; no NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _top_p_by_bisection(scaled, peak, top_p):
    """top_p alone over whole rows (float32 [S, V], min_p applied), without sorting them: the tokens the
    sorted walk keeps are those whose value is at least the least value v with mass(> v) < top_p * mass, found
    by bisecting over the values' 2^32 keys (32 passes over the rows; ~2 ms a pass for 32 rows of 151,936
    against ~1 s for the sort). Tokens tied at v stay in id order while the mass before them is below it."""
    probs = jnp.exp(scaled - peak)
    target = top_p[:, None] * jnp.sum(probs, axis=-1, keepdims=True)
    keys = _sortable(scaled)
    above = lambda v: jnp.sum(jnp.where(keys > v, probs, 0.0), axis=-1, keepdims=True)

    def halve(_, bounds):  # mass(> low) >= target > mass(> high)
        low, high = bounds
        mid = low + (high - low) // 2
        fits = above(mid) < target
        return jnp.where(fits, low, mid), jnp.where(fits, mid, high)

    low = jnp.min(keys, axis=-1, keepdims=True) - 1  # -inf's key is 2^23 - 1: no wrap
    _, cut = jax.lax.fori_loop(0, 32, halve, (low, jnp.max(keys, axis=-1, keepdims=True)))
    tied = keys == cut

    def in_id_order():  # a cumulative sum over the rows, ~40 ms: only where some row has a tie at its cut
        tied_probs = jnp.where(tied, probs, 0.0)
        return ~tied | (above(cut) + jnp.cumsum(tied_probs, axis=-1) - tied_probs < target)

    keep = (keys >= cut) & jax.lax.cond(jnp.any(jnp.sum(tied, axis=-1) > 1), in_id_order,
                                        lambda: jnp.ones_like(tied))
    return jnp.where(keep, scaled, -jnp.inf)


# Tokens per chunk of the two-level draw (`categorical`).
DRAW_CHUNK = 128


def _gumbel_rows(keys: jax.Array, width: int) -> jax.Array:
    """float32 [S, width] of Gumbel noise, row r from keys[r]."""
    return jax.vmap(lambda key: jax.random.gumbel(key, (width,)))(keys)


def draw_width(vocab: int) -> int:
    """The noise `categorical` takes a row for a vocabulary of `vocab`: up to SORT_WHOLE_VOCAB one number per
    token; past it a number per chunk, then per token of one chunk."""
    return vocab if vocab <= SORT_WHOLE_VOCAB else -(-vocab // DRAW_CHUNK) + DRAW_CHUNK


def categorical(keys: jax.Array, logits: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """One token per row drawn from softmax(logits): keys [S] (one random key per row), logits float32 [S, V]
    with -inf outside the support (a row needs one finite logit). int32 [S].

    Past SORT_WHOLE_VOCAB tokens, in two levels, each a Gumbel-max: a chunk of DRAW_CHUNK tokens with
    probability its share of the mass, then a token of that chunk with probability its share of the chunk's,
    so P(token) is softmax's exactly (up to it, one Gumbel-max over the row).
    One Gumbel draw per token (jax.random.categorical) spends most of a step's sampling on threefry: 31 of
    74 ms for 32 rows of 151,936 logits, then 40 more on the logs and a variadic argmax. This draws
    draw_width(V) numbers a row (`noise` [S, draw_width(V)], default drawn from `keys`) and reads the logits in
    two passes.
    """
    rows, vocab = logits.shape
    noise = _gumbel_rows(keys, draw_width(vocab)) if noise is None else noise
    if vocab <= SORT_WHOLE_VOCAB:  # one Gumbel a token costs little here, and compiles in less
        return jnp.argmax(logits + noise, axis=-1).astype(jnp.int32)
    chunks = -(-vocab // DRAW_CHUNK)
    padded = jnp.pad(logits, ((0, 0), (0, chunks * DRAW_CHUNK - vocab)), constant_values=-jnp.inf)
    padded = padded.reshape(rows, chunks, DRAW_CHUNK)
    peak = jnp.max(logits, axis=-1)[:, None, None]
    log_mass = jnp.log(jnp.sum(jnp.exp(padded - peak), axis=-1))  # [S, chunks]; -inf for an empty chunk
    chunk = jnp.argmax(log_mass + noise[:, :chunks], axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(padded, chunk[:, None, None], axis=1)[:, 0]
    token = chunk * DRAW_CHUNK + jnp.argmax(inside + noise[:, chunks:], axis=-1).astype(jnp.int32)
    return jnp.minimum(token, vocab - 1)


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


def sample_filtered(keys: jax.Array, logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """One random token per row (int32 [S]) from its filtered distribution (`filter_logits`); keys [S].

    A row whose top_k / top_p set lies within its FILTER_CANDIDATES[0] most likely tokens draws among them (one
    Gumbel-max over the candidates), without writing its filtered row over the whole vocabulary and reading it
    back twice for `categorical`; any other row draws from its whole filtered row. Which of the two a row takes
    depends only on that row.
    """
    vocab, count = logits.shape[-1], FILTER_CANDIDATES[0]
    scaled, peak, limit, ranked = _scaled(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)
    if count >= vocab or vocab <= SORT_WHOLE_VOCAB:
        return categorical(keys, _filter_scaled(scaled, peak, limit, ranked, meta.top_p))
    # One draw of noise serves either path (a row takes one): threefry is slow to compile as well as to run.
    noise = _gumbel_rows(keys, max(count, draw_width(vocab)))
    whole = lambda first: categorical(keys, _filter_scaled(scaled, peak, limit, ranked, meta.top_p, first),
                                      noise[:, :draw_width(vocab)])

    def candidates():
        first = _filter_candidates(scaled, peak, limit, meta.top_p, count)
        kept, order, enough = first
        picked = jnp.take_along_axis(order, jnp.argmax(kept + noise[:, :count], axis=-1)[:, None], axis=1)[:, 0]
        return picked, ranked & enough, first

    def no_candidates():  # no row needs the order: whole rows, whose filter then leaves them as they are
        rows = ranked.shape[0]
        first = (jnp.full((rows, count), -jnp.inf), jnp.zeros((rows, count), jnp.int32), jnp.zeros_like(ranked))
        return jnp.zeros(rows, jnp.int32), jnp.zeros_like(ranked), first

    # `whole` traced once (it is most of the sampler's compile time), with the first tier's candidates.
    picked, near, first = jax.lax.cond(jnp.any(ranked), candidates, no_candidates)
    return jax.lax.cond(jnp.all(near), lambda: picked, lambda: jnp.where(near, picked, whole(first)))


def draw(logits: jax.Array, raw_logits: jax.Array, meta: SamplingMetadata, argmax=None) -> SamplerOutput:
    """Greedy or random tokens from `logits` [S, V] (after any adjustment), and logprobs of `raw_logits` (the
    distribution they report) where asked."""
    argmax = argmax or first_argmax

    def random_tokens(logits):
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
            meta.seeds, meta.output_index)
        sampled = sample_filtered(keys, logits, meta)
        greedy = jax.lax.cond(jnp.all(meta.temperature > 0), lambda l: jnp.zeros_like(sampled), argmax, logits)
        return jnp.where(meta.temperature > 0, sampled, greedy)

    tokens = jax.lax.cond(jnp.any(meta.temperature > 0), random_tokens, argmax, logits)
    token_logp, ranks, top_ids, top_logp = jax.lax.cond(
        jnp.any(meta.wants_logprobs), _logprobs, lambda *_: _no_logprobs(logits.shape[0]), raw_logits, tokens)
    return SamplerOutput(tokens, token_logp, ranks, top_ids, top_logp)

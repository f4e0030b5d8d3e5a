"""The on-device sampler against an independent float64 numpy reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import sampler
from paged.logit_adjustments import RowAdjustment, apply_entries, build_adjustments, sample_adjusted
from paged.sampler import (DRAW_CHUNK, FILTER_CANDIDATES, AdjustedSamples, SamplerOutput, SamplingMetadata, categorical,
                           filter_logits, first_argmax, sample)


def numpy_filtered_probs(logits, temperature, top_k, top_p, min_p):
    """float64 reference of the documented order: temperature, min_p, top_k, top_p (renormalised)."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(i for i in order if p[i] >= min_p * p[order[0]])
    if top_k > 0:
        keep &= set(order[:top_k])
    mass = sum(p[i] for i in keep)
    above = 0.0
    kept_p = set()
    for i in order:
        if i not in keep:
            continue
        if above < top_p:
            kept_p.add(i)
        above += p[i] / mass
    out = np.zeros_like(p)
    for i in kept_p:
        out[i] = p[i]
    return out / out.sum()


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1),
    (0.9, 20, 0.6, 0.02), (2.0, 1, 1.0, 0.0), (0.5, 0, 0.3, 0.05), (1.0, 64, 0.95, 0.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_distribution_matches_float64_reference(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(len(CASES), 64)).astype(np.float32)
    t, k, p, m = (np.array(c) for c in zip(*CASES))
    filtered = filter_logits(jnp.asarray(logits), jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32),
                             jnp.asarray(p, jnp.float32), jnp.asarray(m, jnp.float32))
    got = np.asarray(jnp.exp(filtered - filtered.max(-1, keepdims=True)), np.float64)
    got /= got.sum(-1, keepdims=True)
    for row, case in enumerate(CASES):
        want = numpy_filtered_probs(logits[row], *case)
        np.testing.assert_array_equal(got[row] > 0, want > 0, err_msg=f"support differs for {case}")
        np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-7, err_msg=str(case))


@pytest.mark.parametrize("whole_order", [False, True])
def test_filter_goes_past_the_first_candidates_only_as_rows_need_and_matches_float64_reference(whole_order):
    """Over a vocabulary of several candidate tiers (FILTER_CANDIDATES), in one batch: rows whose top-k / top-p
    set lies within the first candidates, rows that need the next tier, a nearly flat row whose top_p set
    passes every tier (found by bisection, or by sorting the whole vocabulary when another row has a top_k past
    every tier: `whole_order`), a row of equal logits (every token tied at the cut), and rows with no filter or
    min_p only. Every row's filtered distribution is float64 numpy's, support included."""
    vocab = 6000
    assert FILTER_CANDIDATES[-1] < vocab
    cases = [  # temperature, top_k, top_p, min_p, scale of the logits
        (1.0, 0, 0.9, 0.0, 8.0),  # peaky: inside the first tier
        (1.0, 0, 0.9, 0.0, 1.5),  # about 40% of the mass in the first tier, nearly all in the second
        (1.0, 0, 0.95, 0.0, 0.1),  # nearly flat: ~5,700 tokens
        (1.0, 0, 0.9, 0.0, 0.0),  # all tied, past every tier: the first 5,400 ids stay
        (1.0, 300, 1.0, 0.0, 1.0),  # top_k past the first tier
        (0.8, 20, 0.8, 0.0, 1.0),
        (1.0, 0, 1.0, 0.0, 1.0),  # no filter beside rows that sort
        (1.0, 0, 1.0, 0.2, 3.0),  # min_p only
        (1.3, 0, 0.97, 0.001, 1.0),  # min_p, then top_p over what it leaves
    ] + ([(1.0, 5000, 0.99, 0.0, 0.5)] if whole_order else [])  # top_k past every tier
    rng = np.random.default_rng(11)
    logits = np.stack([rng.normal(scale=c[4], size=vocab) if c[4] else np.zeros(vocab) for c in cases]
                      ).astype(np.float32)
    t, k, p, m = (np.array([c[i] for c in cases]) for i in range(4))
    filtered = jax.jit(filter_logits)(jnp.asarray(logits), jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32),
                                      jnp.asarray(p, jnp.float32), jnp.asarray(m, jnp.float32))
    got = np.asarray(jnp.exp(filtered - filtered.max(-1, keepdims=True)), np.float64)
    got /= got.sum(-1, keepdims=True)
    for row, case in enumerate(cases):
        want = numpy_filtered_probs(logits[row], *case[:4])
        np.testing.assert_array_equal(got[row] > 0, want > 0, err_msg=f"support differs for {case}")
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-9, err_msg=str(case))


@pytest.fixture
def tiered(monkeypatch):
    """The large-vocabulary paths (candidate tiers, bisection, two-level draw) at a test's small vocabulary."""
    monkeypatch.setattr(sampler, "SORT_WHOLE_VOCAB", 0)


def test_two_level_draw_follows_the_distribution(tiered):
    """`categorical` over several DRAW_CHUNK chunks (the last one partial, some tokens at -inf): 20,000 draws
    against the exact probabilities, within the total-variation distance that sampling noise gives; never a
    token at -inf."""
    rng = np.random.default_rng(12)
    vocab = 2 * DRAW_CHUNK + 44
    row = rng.normal(size=vocab)
    row[rng.choice(vocab, 40, replace=False)] = -np.inf
    row[-3] = 2.5  # a likely token in the partial chunk
    n = 20_000
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(jnp.arange(n))
    tokens = np.asarray(jax.jit(categorical)(keys, jnp.asarray(np.tile(row, (n, 1)), jnp.float32)))
    freq = np.bincount(tokens, minlength=vocab) / n
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    assert not freq[np.isinf(row)].any()
    expected = 0.5 * np.sum(np.sqrt(2 * probs * (1 - probs) / (np.pi * n)))  # E|freq - p| summed, halved
    assert 0.5 * np.abs(freq - probs).sum() < 1.25 * expected, (0.5 * np.abs(freq - probs).sum(), expected)


def _meta(n, temperature, top_k=0, top_p=1.0, min_p=0.0, seeds=None, output_index=None, banned=None,
          presence=0.0, frequency=0.0, repetition=1.0, penalty_ids=None, penalty_counts=None, logprobs=False,
          bias_ids=None, bias_values=None):
    """(SamplingMetadata, the rows' adjustments). `banned` [n, B] ids become -inf biases; `bias_ids` /
    `bias_values` [n, B] are passed as they are (-1 ids unused); `penalty_ids` / `penalty_counts` [n, W]
    (-1 ids unused) apply to rows whose presence, frequency or repetition is set."""
    full = lambda v, dtype: jnp.full((n,), v, dtype)
    if banned is not None:
        bias_ids, bias_values = banned, np.where(np.asarray(banned) >= 0, -np.inf, 0.0)
    meta = SamplingMetadata(
        temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32), top_p=full(top_p, jnp.float32),
        min_p=full(min_p, jnp.float32),
        seeds=jnp.asarray(seeds if seeds is not None else np.arange(n), jnp.uint32),
        output_index=jnp.asarray(output_index if output_index is not None else np.zeros(n), jnp.int32),
        wants_logprobs=full(logprobs, bool))
    presence, frequency, repetition = (np.broadcast_to(v, (n,)) for v in (presence, frequency, repetition))
    rows = []
    for r in range(n):
        ids = [] if bias_ids is None else [int(i) for i in np.asarray(bias_ids)[r] if i >= 0]
        values = [] if bias_ids is None else [float(v) for i, v in zip(np.asarray(bias_ids)[r],
                                                                       np.asarray(bias_values)[r]) if i >= 0]
        adj = RowAdjustment(r, ids, values)
        if presence[r] != 0 or frequency[r] != 0 or repetition[r] != 1:
            used = np.asarray(penalty_ids)[r] >= 0
            adj.penalties = (float(presence[r]), float(frequency[r]), float(repetition[r]))
            adj.penalty_ids = np.asarray(penalty_ids)[r][used]
            adj.penalty_counts = np.asarray(penalty_counts)[r][used]
        if adj.bias_ids or adj.penalty_ids is not None:
            rows.append(adj)
    return meta, rows


def sample_all(logits, spec) -> SamplerOutput:
    """As a step samples: rows with adjustments apart (logit_adjustments.sample_adjusted on their gathered
    logits), every other row in the fused sampler; the adjusted rows' samples merged in."""
    meta, rows = spec
    logits = jnp.asarray(logits)
    if not rows:
        return sample(logits, meta)
    host = jax.tree.map(np.asarray, meta)
    n = logits.shape[0]
    adj = build_adjustments(rows, host, n, (logits.shape[1] + 31) // 32)
    fused = sample(logits, meta)
    apart = sample_adjusted(jnp.take(logits, jnp.asarray(adj.rows), axis=0, mode="clip"),
                            jax.tree.map(jnp.asarray, adj))
    return jax.tree.map(np.asarray, dataclasses.replace(fused, adjusted=AdjustedSamples(adj.rows, apart))).merged()


def test_top_k_one_equals_greedy():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(16, 100)), jnp.float32)
    greedy = sample_all(logits, _meta(16, 0.0)).tokens
    top1 = sample_all(logits, _meta(16, 1.5, top_k=1)).tokens
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))
    np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))


def test_samples_follow_the_distribution():
    # 4000 draws of one row (distinct output_index) against the exact probabilities: a chi-square-style check.
    rng = np.random.default_rng(3)
    row = rng.normal(size=8).astype(np.float32)
    n = 4000
    logits = jnp.asarray(np.tile(row, (n, 1)))
    tokens = np.asarray(sample_all(logits, _meta(n, 1.0, seeds=np.full(n, 7), output_index=np.arange(n))).tokens)
    freq = np.bincount(tokens, minlength=8) / n
    probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    assert np.abs(freq - probs).max() < 0.03, (freq, probs)


def test_draws_among_the_candidates_follow_the_filtered_distribution(tiered):
    """Rows whose top_k / top_p set lies within the first FILTER_CANDIDATES draw among them: 20,000 draws of
    one row (distinct output_index) against float64 numpy's filtered probabilities, within the total-variation
    distance that sampling noise gives; never a token outside the set."""
    rng = np.random.default_rng(13)
    vocab, n = 1000, 20_000
    assert FILTER_CANDIDATES[0] < vocab
    row = rng.normal(scale=1.5, size=vocab).astype(np.float32)
    for top_k, top_p in ((50, 1.0), (0, 0.7), (100, 0.9)):
        probs = numpy_filtered_probs(row, 0.9, top_k, top_p, 0.0)
        logits = jnp.asarray(np.tile(row, (n, 1)))
        tokens = np.asarray(sample_all(logits, _meta(n, 0.9, top_k=top_k, top_p=top_p, seeds=np.full(n, 3),
                                                     output_index=np.arange(n))).tokens)
        freq = np.bincount(tokens, minlength=vocab) / n
        assert not freq[probs == 0].any()
        expected = 0.5 * np.sum(np.sqrt(2 * probs * (1 - probs) / (np.pi * n)))
        assert 0.5 * np.abs(freq - probs).sum() < 1.25 * expected, (top_k, top_p, expected)


def test_a_row_draws_the_same_token_whatever_its_neighbours_filter():
    """A row drawing among its candidates (top_k 40) gets the same token beside rows that also do, beside rows
    with no filter (drawn from whole rows) and beside a nearly flat top_p row (bisection)."""
    rng = np.random.default_rng(14)
    vocab = 2000
    logits = rng.normal(scale=2.0, size=(3, vocab)).astype(np.float32)
    logits[2] *= 0.01
    seeds = np.array([5, 6, 7])
    tokens = []
    for top_k, top_p in (([40, 40, 40], [1.0, 1.0, 1.0]), ([40, 0, 0], [1.0, 1.0, 1.0]), ([40, 0, 0], [1.0, 1.0, 0.99])):
        meta = _meta(3, 1.0, top_k=np.array(top_k), top_p=np.array(top_p), seeds=seeds)
        tokens.append(int(np.asarray(sample_all(logits, meta).tokens)[0]))
    assert tokens[0] == tokens[1] == tokens[2], tokens


@pytest.mark.parametrize("vocab", [50, 2000])
def test_row_key_depends_only_on_its_seed_and_index(vocab):
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(8, vocab)).astype(np.float32)
    seeds = rng.integers(0, 2**32, size=8)
    a = np.asarray(sample_all(logits, _meta(8, 1.0, seeds=seeds)).tokens)
    # Same row 3 in a different batch (other rows changed, different position): same token.
    other = rng.normal(size=(4, vocab)).astype(np.float32)
    other[1] = logits[3]
    other_seeds = rng.integers(0, 2**32, size=4)
    other_seeds[1] = seeds[3]
    b = np.asarray(sample_all(other, _meta(4, 1.0, seeds=other_seeds)).tokens)
    assert a[3] == b[1]


def test_banned_ids_are_never_sampled():
    logits = np.zeros((2, 10), np.float32)
    logits[:, 4] = 50.0  # overwhelmingly likely, and the greedy pick
    banned = np.array([[4, -1, -1, -1], [-1, -1, -1, -1]])
    for temperature in (0.0, 1.0):
        tokens = np.asarray(sample_all(logits, _meta(2, temperature, banned=banned)).tokens)
        assert tokens[0] != 4 and tokens[1] == 4


def test_logit_bias_shifts_greedy_and_sampled_tokens_as_float64_numpy():
    """Greedy rows pick argmax(logits + bias); a sampled row draws from softmax(logits + bias) (4,000 draws
    against the float64 probabilities); an id listed twice gets both biases, -inf included."""
    rng = np.random.default_rng(11)
    vocab = 8
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    ids = np.array([[2, 5, -1, -1], [0, 0, 7, -1], [1, 6, 3, -1]])
    values = np.array([[4.0, -2.5, 0, 0], [-np.inf, 3.0, 1.5, 0], [2.0, -1.0, 0.5, 0]], np.float32)
    biased = logits.astype(np.float64).copy()
    for r in range(3):
        for i, v in zip(ids[r], values[r]):
            if i >= 0:
                biased[r, i] += v
    greedy = np.asarray(sample_all(logits, _meta(3, 0.0, bias_ids=ids, bias_values=values)).tokens)
    np.testing.assert_array_equal(greedy, np.argmax(biased, axis=-1))
    assert greedy[1] != 0  # banned, whatever else was added
    n = 4000
    tokens = np.asarray(sample_all(np.tile(logits[2], (n, 1)),
                               _meta(n, 1.0, seeds=np.full(n, 3), output_index=np.arange(n),
                                     bias_ids=np.tile(ids[2], (n, 1)), bias_values=np.tile(values[2], (n, 1)))).tokens)
    probs = np.exp(biased[2] - biased[2].max())
    probs /= probs.sum()
    assert np.abs(np.bincount(tokens, minlength=vocab) / n - probs).max() < 0.03


def test_logit_bias_applies_before_penalties():
    """vLLM's order: the repetition penalty sees the biased logit (dividing a positive one, multiplying a
    negative one), so a bias that flips a logit's sign changes how the penalty acts on it."""
    logits = np.array([[1.0, 0.5, -0.2, 0.0]], np.float32)
    ids, values = np.array([[0, 2]]), np.array([[-3.0, 1.0]], np.float32)
    rep = 2.0
    want = logits.astype(np.float64)[0] + np.array([-3.0, 0.0, 1.0, 0.0])
    for i in (0, 2):  # both seen in the prompt
        want[i] = want[i] / rep if want[i] > 0 else want[i] * rep
    meta = _meta(1, 0.0, bias_ids=ids, bias_values=values, repetition=rep, penalty_ids=np.array([[0, 2]]),
                 penalty_counts=np.zeros((1, 2)), logprobs=True)
    out = sample_all(logits, meta)
    assert int(np.asarray(out.tokens)[0]) == int(np.argmax(want))  # token 1: 0.5 beats 0.4 and -4.0


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(5)
    n, vocab = 3, 30
    logits = rng.normal(scale=2.0, size=(n, vocab)).astype(np.float32)
    prompt = [[1, 2, 3], [4, 4, 5], [6]]
    output = [[2, 2, 7], [], [6, 6, 6, 9]]
    presence, frequency, repetition = np.array([0.5, 0.0, -0.3]), np.array([0.2, 1.0, 0.4]), np.array([1.3, 1.0, 0.8])
    ids = -np.ones((n, 8), np.int32)
    counts = np.zeros((n, 8), np.int32)
    want = logits.astype(np.float64).copy()
    for r in range(n):
        distinct = sorted(set(prompt[r]) | set(output[r]))
        ids[r, :len(distinct)] = distinct
        counts[r, :len(distinct)] = [output[r].count(t) for t in distinct]
        for t in distinct:
            x = want[r, t]
            x = x / repetition[r] if x > 0 else x * repetition[r]
            c = output[r].count(t)
            want[r, t] = x - c * frequency[r] - (c > 0) * presence[r]
    _, rows = _meta(n, 1.0, presence=presence, frequency=frequency, repetition=repetition, penalty_ids=ids,
                    penalty_counts=counts)
    adj = build_adjustments(rows, jax.tree.map(np.asarray, _meta(n, 1.0)[0]), n, 1)
    got = apply_entries(jnp.asarray(logits), jax.tree.map(jnp.asarray, adj))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(6)
    logits = rng.normal(scale=2.0, size=(4, 50)).astype(np.float32)
    out = sample_all(logits, _meta(4, 0.7, logprobs=True, repetition=1.5,
                                             penalty_ids=np.tile(np.arange(8), (4, 1)),
                                             penalty_counts=np.ones((4, 8))))
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.token_logprobs), logp[np.arange(4), tokens], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.token_ranks), (logp > logp[np.arange(4), tokens][:, None]).sum(-1) + 1)
    order = np.argsort(-logp, axis=-1)[:, :20]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(logp, order, -1), atol=1e-5)


@pytest.mark.parametrize("vocab", [1000, 1024, 8192])
def test_first_argmax_equals_numpy_argmax(vocab):
    """Ties go to the first maximum and an all -inf row to 0, also across the 128-wide chunks and the -inf
    padding of a vocabulary that is not a multiple of them; a NaN counts as +inf."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, size=(64, vocab)).astype(np.float32)  # many ties, within and across chunks
    x[1] = -np.inf
    x[2, 17] = np.inf
    x[3, [5, 900]] = np.nan
    x[4] = rng.normal(size=vocab)
    x[5, vocab - 1] = 10.0  # the last element, in the padded chunk when there is one
    x[6, 300], x[6, 700] = 10.0, np.nan  # NaN after the maximum, in a later chunk
    x[7, [200, 201, 900]] = 10.0
    x[8, 150], x[8, 600] = np.inf, np.nan  # the one case where numpy differs: it would pick the NaN
    got = np.asarray(first_argmax(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(np.where(np.isnan(x), np.inf, x), axis=-1))
    np.testing.assert_array_equal(np.delete(got, 8), np.delete(np.argmax(x, axis=-1), 8))


def test_greedy_rows_agree_on_the_plain_and_full_paths():
    """An all-greedy batch takes only the argmax; the same rows beside a row that needs the full path
    (temperature, biases, penalties or logprobs) get the same tokens."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    want = np.argmax(logits, axis=-1)
    plain = sample_all(logits, _meta(4, 0.0))
    np.testing.assert_array_equal(np.asarray(plain.tokens), want)
    assert not np.asarray(plain.token_logprobs).any() and not np.asarray(plain.top_ids).any()
    banned = -np.ones((4, 4))
    banned[3, 0] = want[3]
    for mixed in (_meta(4, np.array([0.0, 0.0, 0.0, 1.0])), _meta(4, 0.0, banned=banned),
                  _meta(4, 0.0, repetition=np.array([1.0, 1.0, 1.0, 1.2]), penalty_ids=np.full((4, 1), want[3]),
                        penalty_counts=np.ones((4, 1))),
                  _meta(4, 0.0, logprobs=True)):
        np.testing.assert_array_equal(np.asarray(sample_all(logits, mixed).tokens)[:3], want[:3])
    full = sample_all(logits, _meta(4, 0.0, banned=banned))
    assert np.asarray(full.tokens)[3] != want[3]

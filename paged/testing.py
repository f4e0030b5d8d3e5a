"""`check_attention`: an attention implementation against a float64 numpy reference, case by case.

    from paged.testing import check_attention
    report = check_attention(my_attend)      # or a backend name: "xla", "cpu", "pallas", ...
    print(report)                            # one line per case: what it covers, the error, pass or fail
    assert report.passed, report

The matrix is the one the built-in kernels are tested with: page sizes 8 and 16, GQA ratios 1, 2, 4 and MQA,
decode steps, whole prompts and prompt chunks after a cached prefix in one batch, context lengths 1, a page,
a page plus one and the page table's maximum, a padded row of length 0, padding tokens, random permutations
of the pool's pages, layer 1 of 2 read (a kernel that ignores `layer` fails), sliding windows (a traced int32,
and 0 meaning none) and logit soft caps. Every slot a sequence does not own (the sink block, spare pages, the
tail of a last page, the other layer) holds a poison value, so reading past a sequence's keys shows up as a
large error instead of a small one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from paged.models.attention import AttentionMetadata, UserAttention, get_attention_backend

LAYER, NUM_LAYERS = 1, 2
PAGES_PER_SEQ = 4
# Large enough that one poisoned key wins the softmax and one poisoned value dominates the output; finite so a
# kernel that multiplies masked probabilities (exact zeros) by it still gets zero.
POISON = 1e4


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One step's batch. rows: (tokens cached before the step, new tokens) per sequence row, decode rows
    first as the engine packs them; (0, 0) is a padded row."""

    name: str
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    rows: tuple[tuple[int, int], ...]
    sliding_window: int | None = None  # passed as a traced int32 scalar when set (0: no window)
    soft_cap: float | None = None
    head_dim: int = 32
    padding_tokens: int = 3  # tokens past the real ones, as a bucketed step has


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: AttentionCase
    passed: bool
    max_error: float  # largest |got - expected| over the real tokens (inf for NaN or a crash)
    message: str


@dataclasses.dataclass(frozen=True)
class AttentionReport:
    results: tuple[CaseResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.results if not r.passed)

    def __str__(self) -> str:
        lines = [f"{'ok  ' if r.passed else 'FAIL'} {r.case.name:<48} max error {r.max_error:.2e}  {r.message}"
                 for r in self.results]
        lines.append(f"{len(self.results) - len(self.failures)} of {len(self.results)} cases passed")
        return "\n".join(lines)


def default_cases() -> list[AttentionCase]:
    cases = []
    for page in (8, 16):
        last = PAGES_PER_SEQ * page
        batches = {
            # Context lengths 1, a page, a page + 1 and the table's maximum; one padded row.
            "decode": ((0, 1), (page - 1, 1), (page, 1), (last - 1, 1), (0, 0)),
            "prefill": ((0, 1), (0, page), (0, page + 3), (0, 0)),
            # Decode rows first, then chunks continuing a cached prefix (one ends exactly at the maximum).
            "mixed": ((5, 1), (page, page + 2), (2 * page - 1, 3), (last - 4, 4)),
        }
        for heads in ((2, 2), (4, 2), (8, 2), (4, 1)):
            for kind, rows in batches.items():
                cases.append(AttentionCase(f"{kind} page{page} q{heads[0]}/kv{heads[1]}", page, *heads, rows))
    mixed = ((5, 1), (8, 10), (15, 3), (28, 4))
    for window in (5, 0):
        for cap in (None, 5.0):
            cases.append(AttentionCase(f"mixed page8 q4/kv2 window{window} cap{cap}", 8, 4, 2, mixed, window, cap))
    cases.append(AttentionCase("decode page8 q4/kv2 window3", 8, 4, 2, ((0, 1), (9, 1), (30, 1)), 3))
    cases.append(AttentionCase("prefill page8 q4/kv2 cap2", 8, 4, 2, ((0, 13), (0, 1)), None, 2.0))
    return cases


def _step(case: AttentionCase, rng: np.random.Generator, dtype):
    """Pool, queries and metadata of one case (host numpy), and the float64 expectation."""
    bs, hq, hkv, d = case.page_size, case.num_q_heads, case.num_kv_heads, case.head_dim
    num_rows = len(case.rows)
    num_pages = num_rows * PAGES_PER_SEQ + 3  # spare pages no row owns
    k_pool = np.full((NUM_LAYERS, hkv, num_pages, bs, d), POISON, np.float32)
    v_pool = np.full_like(k_pool, POISON)
    owned = rng.permutation(np.arange(1, num_pages))[:num_rows * PAGES_PER_SEQ]  # block 0: the sink
    tables = owned.reshape(num_rows, PAGES_PER_SEQ).astype(np.int32)
    seq_lens = np.array([c + n for c, n in case.rows], np.int32)
    tables[seq_lens == 0] = 0  # padded rows point at the sink, as the engine's do
    for row, length in enumerate(seq_lens):
        for pos in range(length):
            block, offset = tables[row, pos // bs], pos % bs
            k_pool[LAYER, :, block, offset] = rng.normal(size=(hkv, d))
            v_pool[LAYER, :, block, offset] = rng.normal(size=(hkv, d))
    k_pool, v_pool = k_pool.astype(dtype), v_pool.astype(dtype)  # the values both sides see

    seq_ids, positions = [], []
    for row, (cached, new) in enumerate(case.rows):
        seq_ids += [row] * new
        positions += list(range(cached, cached + new))
    num_real = len(positions)
    query_start = np.concatenate([[0], np.cumsum([n for _, n in case.rows])]).astype(np.int32)
    slots = [tables[s, p // bs] * bs + p % bs for s, p in zip(seq_ids, positions)]
    pad = case.padding_tokens
    meta = AttentionMetadata(
        slot_mapping=np.array(slots + [0] * pad, np.int32),
        positions=np.array(positions + [0] * pad, np.int32),
        token_seq_ids=np.array(seq_ids + [0] * pad, np.int32),
        page_tables=tables, query_start=query_start, seq_lens=seq_lens,
        num_decode_rows=np.asarray(sum(n == 1 for _, n in case.rows), np.int32),
        num_prefill_rows=np.asarray(sum(n > 1 for _, n in case.rows), np.int32))
    q = rng.normal(size=(num_real + pad, hq, d)).astype(dtype)
    # The step's new keys and values, as the pool holds them (written before attention runs).
    flat = lambda pool: pool[LAYER].reshape(hkv, -1, d)
    k_new = np.stack([flat(k_pool)[:, s] for s in meta.slot_mapping])
    v_new = np.stack([flat(v_pool)[:, s] for s in meta.slot_mapping])
    expected = _reference_f64(q[:num_real], k_pool, v_pool, tables, seq_ids, positions, case)
    return q, k_new, v_new, k_pool, v_pool, meta, expected


def _reference_f64(q, k_pool, v_pool, tables, seq_ids, positions, case: AttentionCase) -> np.ndarray:
    """float64 causal softmax attention of each real token over its sequence's keys (window, soft cap)."""
    bs, group = case.page_size, case.num_q_heads // case.num_kv_heads
    scale = 1.0 / math.sqrt(case.head_dim)
    window = case.sliding_window
    out = np.zeros(q.shape, np.float64)
    for i, (row, pos) in enumerate(zip(seq_ids, positions)):
        lo = 0 if not window or window <= 0 else max(0, pos - window + 1)
        keys = range(lo, pos + 1)
        blocks = [tables[row, p // bs] for p in keys]
        offsets = [p % bs for p in keys]
        for h in range(case.num_q_heads):
            kh = k_pool[LAYER, h // group, blocks, offsets].astype(np.float64)
            vh = v_pool[LAYER, h // group, blocks, offsets].astype(np.float64)
            logits = kh @ q[i, h].astype(np.float64) * scale
            if case.soft_cap is not None:
                logits = case.soft_cap * np.tanh(logits / case.soft_cap)
            p = np.exp(logits - logits.max())
            out[i, h] = (p / p.sum()) @ vh
    return out


def _backend(attention, platform: str):
    if isinstance(attention, str):
        return get_attention_backend(attention, platform)
    if hasattr(attention, "attend") and hasattr(attention, "prepare"):
        return attention
    if callable(attention):
        return UserAttention(getattr(attention, "__name__", "user"), attention)
    raise TypeError(f"check_attention takes a backend name, a backend object or an attend function, got "
                    f"{type(attention).__name__}")


def check_attention(attention, *, dtype="float32", cases: list[AttentionCase] | None = None, atol: float | None = None,
                    rtol: float | None = None, seed: int = 0) -> AttentionReport:
    """Runs `attention` (an attend function as `paged.register_attention_backend` takes, a backend object, or
    a backend name) jitted on every case and compares the real tokens' outputs with float64 numpy.

    Tolerances: float32 2e-5 (a kernel accumulating in float32 over at most 64 keys stays near 1e-6; one
    wrong key moves an output by ~1e-1); bfloat16 1.6e-2, about four output ulps (inputs are the same bf16
    values on both sides and the output is rounded once).
    """
    dtype = jnp.dtype(dtype)
    default = (2e-5, 2e-5) if dtype == jnp.float32 else (1.6e-2, 1.6e-2)
    atol = default[0] if atol is None else atol
    rtol = default[1] if rtol is None else rtol
    backend = _backend(attention, jax.default_backend())
    rng = np.random.default_rng(seed)
    results = []
    for case in cases or default_cases():
        q, k, v, k_pool, v_pool, meta, expected = _step(case, rng, dtype)
        try:
            meta = jax.tree.map(jnp.asarray, backend.prepare(meta))
            scale = 1.0 / math.sqrt(case.head_dim)
            window = None if case.sliding_window is None else jnp.int32(case.sliding_window)

            @jax.jit
            def run(q, k, v, k_pool, v_pool, meta, window):
                return backend.attend(q, k, v, k_pool, v_pool, jnp.int32(LAYER), meta, scale=scale,
                                      sliding_window=window, soft_cap=case.soft_cap)

            got = np.asarray(run(q, k, v, k_pool, v_pool, meta, window)).astype(np.float64)
        except Exception as error:  # noqa: BLE001 - a crash is one failed case, reported with its cause
            results.append(CaseResult(case, False, math.inf, f"raised {type(error).__name__}: {error}"[:300]))
            continue
        if got.shape != q.shape:
            results.append(CaseResult(case, False, math.inf, f"output shape {got.shape}, expected {q.shape}"))
            continue
        real = got[:len(expected)]
        error = float(np.max(np.abs(real - expected))) if np.isfinite(real).all() else math.inf
        ok = bool(np.allclose(real, expected, atol=atol, rtol=rtol))
        results.append(CaseResult(case, ok, error, "" if ok else f"outside atol={atol:g}, rtol={rtol:g}"))
    return AttentionReport(tuple(results))

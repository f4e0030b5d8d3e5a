"""`paged bench kernels`: paged attention kernels against the machine's limits and the baselines, in one run.

Decode (one query per sequence) is memory-bound: each implementation's achieved KV bandwidth (bytes of K
and V the sequences own, read once, divided by the time) is reported as a fraction of a device copy
bandwidth measured in the same run. Prefill (ragged chunks over a cached context) is compute-bound: its
FLOP rate (4 x visible query-key pairs x query heads x head_dim; causal pairs only) is reported as a
fraction of a matmul rate measured in the same run.

Implementations, each where it runs:
  pallas          the portable Pallas kernels (Triton lowering on GPU; interpret mode on CPU)
  pallas-mosaic   the Hopper decode kernel (Mosaic GPU; only on a GPU)
  pallas-tpu      the TPU ragged kernel (Mosaic TPU; under the TPU interpreter on CPU)
  cpu             the native CPU kernel (C++ through XLA's FFI; CPU only)
  cpu-no-amx      the same kernel built without AMX (prefill; only where bfloat16 prompts run on AMX tiles)
  xla             the chunked XLA paths
  jnp-reference   the plain jax.numpy references
  jax-pallas-ops  jax.experimental.pallas.ops.gpu.paged_attention (Triton; decode only)
  NAME            a backend registered with paged.register_attention_backend (--backend NAME; --plugin MODULE
                  imports the module that registers it), called through the engine's attention contract

    paged bench kernels                        # preset by platform: "smoke" on CPU, "gpu" on a GPU
    paged bench kernels --plugin my_kernels --backend mine   # your kernel beside the built-in ones
    paged bench kernels --preset cpu-bf16      # the 0.5B shape's attention in bfloat16 on CPU
    paged bench kernels --preset cpu-long      # the same decoding at 32k and 128k contexts
    paged bench kernels --preset gpu --json docs/results/kernels_h200.json --png docs/results/kernels_h200.png
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable

import numpy as np

from paged.benchmarks.common import pyplot

PRESETS = {
    # Tiny shapes: a CPU smoke run of every code path in well under a minute.
    "smoke": dict(batch=[1, 4], context=[64, 256], page_size=[16], gqa=[1, 4], dtype=["float32"], head_dim=64,
                  num_kv_heads=2, prefill_chunk=[32], prefill_batch=2),
    # GPU shapes: batch 8-128, context 512-8192, pages of 16 and 32, GQA 1/4/8, bf16, head_dim 128, 8 KV heads.
    # Each list is in priority order (the decode goal's shapes, batch >= 32 and context >= 2048, first): a
    # time-limited GPU run ends before the whole product (54 points, each compiling each kernel once), and
    # --budget-s stops the sweep with the most important points measured.
    "gpu": dict(batch=[32, 128, 8], context=[2048, 8192, 512, 32768], page_size=[16, 32], gqa=[8, 4, 1],
                dtype=["bfloat16"], head_dim=128, num_kv_heads=8, prefill_chunk=[512], prefill_batch=4),
    # Qwen2.5-0.5B's attention (14 query heads, 2 KV heads, head_dim 64) in bfloat16 on CPU: 32 decodes, and
    # a 512-token prompt (no cached context) and one 512-token chunk after 1,536 cached tokens.
    "cpu-bf16": dict(batch=[32], context=[512, 2048], page_size=[16], gqa=[7], dtype=["bfloat16"], head_dim=64,
                     num_kv_heads=2, prefill_chunk=[512], prefill_batch=1),
    # The same attention decoding at long contexts: one sequence and eight, at 32k and 128k tokens.
    "cpu-long": dict(batch=[1, 8], context=[32768, 131072], page_size=[16], gqa=[7], dtype=["bfloat16"],
                     head_dim=64, num_kv_heads=2, prefill_chunk=[], prefill_batch=1),
}

# On CPU the TPU kernel runs under jax's TPU interpreter, seconds a call at 16 MiB of K/V: for scale only, and
# skipped beyond this many bytes so that a long-context sweep finishes.
TPU_INTERPRETER_MAX_KV_BYTES = 8 * 2**20


# On a GPU, decode inputs are rotated over at least this many bytes, 4x an H200's 60 MB L2: a point whose K/V
# fit in the cache would otherwise be timed from it on every call after the first.
GPU_ROTATION_BYTES = 256 * 2**20


def time_call(fn, arg_sets: list[tuple], repeats: int, calls_per_sample: int = 1) -> float:
    """Median seconds of one `fn` call over `repeats` samples, after a warm-up (compiling) call.

    Each sample dispatches `calls_per_sample` calls back to back, cycling through `arg_sets`, and waits for
    them all: on a GPU the host dispatches call i+1 while the device runs call i, so a sample measures the
    device's time rather than a dispatch and a synchronization per call (tens of microseconds, as much as a
    whole decode kernel at small shapes).
    """
    import jax
    jax.block_until_ready(fn(*arg_sets[0]))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)]) for i in range(calls_per_sample)])
        times.append((time.perf_counter() - start) / calls_per_sample)
    return float(np.median(times))


def _pool(rng, num_seqs, pages_per_seq, num_kv_heads, page_size, head_dim, dtype):
    import jax.numpy as jnp
    num_pages = num_seqs * pages_per_seq + 1
    shape = (1, num_kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    tables = rng.permutation(np.arange(1, num_pages))[:num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    return k, v, jnp.asarray(tables, jnp.int32)


def decode_implementations(on_gpu: bool, group: int, head_dim: int, dtype: str) -> dict:
    """name -> fn(q, k, v, tables, lengths, scale) for decode, or name -> reason it does not run here."""
    import jax
    import jax.numpy as jnp

    from paged.kernels import paged_attention_chunked, paged_decode_attention, paged_decode_reference

    impls = {
        "pallas": lambda q, k, v, t, n, s: paged_decode_attention(q, k, v, t, n, scale=s),
        "jnp-reference": lambda q, k, v, t, n, s: paged_decode_reference(q, k, v, t, n, scale=s),
    }

    def xla(q, k, v, t, n, s):
        rows = jnp.arange(q.shape[0], dtype=jnp.int32)
        return paged_attention_chunked(q, k, v, 0, t, rows, jnp.maximum(n - 1, 0), scale=s)

    impls["xla"] = xla

    def cpu(q, k, v, t, n, s):  # length 0 -> position -1: the kernel gives zeros
        rows = jnp.arange(q.shape[0], dtype=jnp.int32)
        return _cpu_kernel().paged_attention_cpu(q, k, v, 0, t, rows, n - 1, scale=s)

    impls["cpu"] = _native_cpu(on_gpu, cpu)
    # Decode as the ragged kernel sees it: one token per row (a row of length 0 sees no key: zeros).
    impls["pallas-tpu"] = _tpu_kernel(on_gpu, lambda q, k, v, t, n, s: _tpu_ragged()(
        q, k, v, t, jnp.arange(q.shape[0] + 1, dtype=jnp.int32), n, scale=s, tokens_per_block=_decode_block(q, k)))
    if on_gpu:
        from paged.kernels.gpu.decode_mgpu import paged_decode_attention_mgpu
        if dtype in ("bfloat16", "float16") and head_dim % 64 == 0:
            impls["pallas-mosaic"] = lambda q, k, v, t, n, s: paged_decode_attention_mgpu(q, k, v, t, n, scale=s)
        else:
            impls["pallas-mosaic"] = "needs bf16/f16 and head_dim % 64 == 0"
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_ops
    except ImportError as error:
        impls["jax-pallas-ops"] = f"not importable: {error}"
    else:
        if not on_gpu:
            impls["jax-pallas-ops"] = "GPU only here (its BlockSpecs copy the whole pool per grid step when interpreted)"
        else:
            def jax_paged(q, k, v, t, n, s):
                pages = t.shape[1]
                splits = max(d for d in (16, 8, 4, 2, 1) if pages % d == 0)
                # Its kernel takes [Hkv, N, page, D] and applies no softmax scale (pre-scale q).
                return jax_ops.paged_attention((q * s).astype(q.dtype), k[0], v[0], t, n, k_splits=splits,
                                               pages_per_compute_block=min(8, pages // splits))
            impls["jax-pallas-ops"] = jax_paged
    return {name: (jax.jit(fn, static_argnums=5) if callable(fn) else fn) for name, fn in impls.items()}


def prefill_implementations(dtype: str = "float32") -> dict:
    import jax
    import jax.numpy as jnp

    from paged.kernels import paged_attention_chunked, ragged_paged_attention, ragged_paged_attention_reference

    def token_rows(qs, n, num_tokens):
        """Each packed token's sequence and position, from the ragged offsets (what the engine passes)."""
        tok = jnp.arange(num_tokens, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(qs, tok, side="right") - 1, 0, n.shape[0] - 1).astype(jnp.int32)
        return seq, n[seq] - (qs[1:] - qs[:-1])[seq] + tok - qs[seq]

    def xla(q, k, v, t, qs, n, s):
        return paged_attention_chunked(q, k, v, 0, t, *token_rows(qs, n, q.shape[0]), scale=s)

    def cpu(q, k, v, t, qs, n, s):
        return _cpu_kernel().paged_attention_cpu(q, k, v, 0, t, *token_rows(qs, n, q.shape[0]), scale=s)

    def cpu_without_amx(q, k, v, t, qs, n, s):
        target = _cpu_kernel().matmul_target_without_amx().replace("matmul_cpu", "paged_attention_cpu")
        return _cpu_kernel().paged_attention_cpu(q, k, v, 0, t, *token_rows(qs, n, q.shape[0]), scale=s,
                                                 _target=target)

    on_cpu = jax.default_backend() == "cpu"
    impls = {
        "pallas": lambda q, k, v, t, qs, n, s: ragged_paged_attention(q, k, v, t, qs, n, scale=s),
        "cpu": _native_cpu(not on_cpu, cpu),
        # The float32 FMA tiles that bfloat16 prompt chunks took before the AMX ones (amx_attention.cc).
        "cpu-no-amx": (_native_cpu(not on_cpu, cpu_without_amx)
                       if not on_cpu or (dtype == "bfloat16" and _cpu_kernel().prompt_attention_on_amx())
                       else "only for bfloat16 where its prompts run on AMX (the cpu entry is this path here)"),
        "pallas-tpu": _tpu_kernel(jax.default_backend() == "gpu",
                                  lambda q, k, v, t, qs, n, s: _tpu_ragged()(q, k, v, t, qs, n, scale=s)),
        "xla": xla,
        "jnp-reference": lambda q, k, v, t, qs, n, s: ragged_paged_attention_reference(q, k, v, t, qs, n, scale=s),
    }
    return {name: (jax.jit(fn, static_argnums=6) if callable(fn) else fn) for name, fn in impls.items()}


def _engine_metadata(tables, lengths, query_start, token_seq_ids, positions, num_prefill_rows):
    """The step metadata the engine would build for these rows (host numpy), for registered backends."""
    from paged.models.attention import AttentionMetadata
    rows = len(lengths)
    return AttentionMetadata(
        slot_mapping=np.zeros(len(positions), np.int32), positions=np.asarray(positions, np.int32),
        token_seq_ids=np.asarray(token_seq_ids, np.int32), page_tables=np.asarray(tables, np.int32),
        query_start=np.asarray(query_start, np.int32), seq_lens=np.asarray(lengths, np.int32),
        num_decode_rows=np.asarray(rows - num_prefill_rows, np.int32),
        num_prefill_rows=np.asarray(num_prefill_rows, np.int32))


def registered_implementations(names: list[str], kind: str) -> dict:
    """name -> fn with the decode (kind "decode") or prefill signature of the built-in entries, running a
    registered backend through `attend` as a model layer would (its `prepare` hook on the host first). Built
    afresh for each sweep point: each fn serves one point's arrays."""
    import jax
    import jax.numpy as jnp

    from paged.models.attention import get_attention_backend, registered_attention_backends

    impls = {}
    for name in names:
        if name not in registered_attention_backends():
            impls[name] = (f"not registered (registered: {', '.join(registered_attention_backends()) or 'none'}; "
                           "--plugin MODULE imports the module that registers it)")
            continue
        backend = get_attention_backend(name, jax.default_backend())
        attend = jax.jit(lambda q, k_new, v_new, k, v, meta, scale, backend=backend: backend.attend(
            q, k_new, v_new, k, v, jnp.int32(0), meta, scale=scale, sliding_window=None, soft_cap=None),
            static_argnums=6)

        # Called once per point (a fresh cache each time): the metadata and the backend's host-side `prepare`
        # are built at the first call, as the engine builds them once per step for all layers, so the timed
        # calls run the attention alone.
        prepared: list = []

        def run(q, k, v, build, scale, attend=attend, backend=backend, prepared=prepared):
            if not prepared:
                prepared += [jax.tree.map(jnp.asarray, backend.prepare(build())),
                             jnp.zeros((q.shape[0], k.shape[1], k.shape[-1]), q.dtype)]  # new K/V: unread
            meta, new = prepared
            return attend(q, new, new, k, v, meta, scale)

        if kind == "decode":
            def fn(q, k, v, t, n, s, run=run):
                rows = np.arange(q.shape[0])
                build = lambda: _engine_metadata(t, n, np.arange(q.shape[0] + 1), rows, np.asarray(n) - 1, 0)
                return run(q, k, v, build, s)
        else:
            def fn(q, k, v, t, qs, n, s, run=run):
                def build():
                    qs_, n_ = np.asarray(qs), np.asarray(n)
                    seq = np.repeat(np.arange(len(n_)), np.diff(qs_))
                    pos = n_[seq] - np.diff(qs_)[seq] + np.arange(q.shape[0]) - qs_[seq]
                    return _engine_metadata(t, n_, qs_, seq, pos, len(n_))
                return run(q, k, v, build, s)
        impls[name] = fn
    return impls


def _cpu_kernel():
    from paged.kernels import cpu as cpu_kernel
    return cpu_kernel


def _tpu_ragged():
    from paged.kernels.tpu.ragged import ragged_paged_attention_tpu  # Mosaic TPU: imported only when used
    return ragged_paged_attention_tpu


def _decode_block(q, k):
    """The engine's decode-step query block for the TPU kernel (one real token per block)."""
    from paged.kernels.tpu.block_sizes import tokens_per_block_for
    return tokens_per_block_for(1, q.shape[1] // k.shape[1], q.dtype)


def _tpu_kernel(on_gpu: bool, fn):
    """The TPU kernel on a TPU, and under the TPU interpreter on CPU (as "pallas" runs interpreted there)."""
    return "TPU only (the Mosaic TPU kernel; on CPU it runs interpreted)" if on_gpu else fn


def _native_cpu(on_gpu: bool, fn):
    """fn, or the reason the native CPU kernel does not run here."""
    if on_gpu:
        return "CPU only"
    ok, reason = _cpu_kernel().available()
    return fn if ok else f"unavailable: {reason}"


@dataclasses.dataclass(frozen=True)
class Sweep:
    """How a sweep times its points and when it stops."""

    repeats: int  # samples per implementation and point (the median is reported)
    calls_per_sample: int = 1  # back-to-back calls a sample times (time_call)
    rotation_bytes: int = 0  # decode: K/V copies enough to read this many distinct bytes in turn
    deadline: float = float("inf")  # time.monotonic() after which no new point starts
    on_row: Callable[[list], None] | None = None  # called with the rows so far after every point

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def done(self, rows: list, row: dict) -> None:
        rows.append(row)
        if self.on_row is not None:
            self.on_row(rows)


def run_decode(cfg: dict, rng, sweep: Sweep, copy_bw: float, on_gpu: bool, max_reference_bytes: float,
               backends: list[str] = ()) -> list:
    import jax.numpy as jnp
    rows = []
    for batch, context, page_size, group, dtype in itertools.product(
            cfg["batch"], cfg["context"], cfg["page_size"], cfg["gqa"], cfg["dtype"]):
        if sweep.out_of_time():
            break
        num_kv_heads, head_dim = cfg["num_kv_heads"], cfg["head_dim"]
        pages_per_seq = -(-context // page_size)
        kv_bytes = 2 * batch * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        copies = min(16, max(1, -(-sweep.rotation_bytes // kv_bytes)))
        pools = [_pool(rng, batch, pages_per_seq, num_kv_heads, page_size, head_dim, dtype) for _ in range(copies)]
        q = jnp.asarray(rng.standard_normal((batch, num_kv_heads * group, head_dim), np.float32), dtype)
        lengths = jnp.full((batch,), context, jnp.int32)
        arg_sets = [(q, k, v, tables, lengths, head_dim ** -0.5) for k, v, tables in pools]
        row = dict(kind="decode", batch=batch, context=context, page_size=page_size, gqa=group, dtype=dtype,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, kv_bytes=kv_bytes, kv_copies=copies, results={})
        expected = None
        impls = {**decode_implementations(on_gpu, group, head_dim, dtype),
                 **registered_implementations(list(backends), "decode")}
        for name, fn in impls.items():
            if not callable(fn):
                row["results"][name] = {"skipped": fn}
                continue
            if name == "jnp-reference" and kv_bytes * 4 > max_reference_bytes:
                row["results"][name] = {"skipped": "its gathered copy of every context would not fit the budget"}
                continue
            if name == "pallas-tpu" and not on_gpu and kv_bytes > TPU_INTERPRETER_MAX_KV_BYTES:
                row["results"][name] = {"skipped": f"interpreted on CPU; skipped beyond "
                                                   f"{TPU_INTERPRETER_MAX_KV_BYTES // 2**20} MiB of K/V"}
                continue
            result, expected = _measure(fn, arg_sets, sweep, expected)
            if "seconds" in result:
                result.update(bytes_per_s=kv_bytes / result["seconds"],
                              fraction_of_copy=kv_bytes / result["seconds"] / copy_bw)
            row["results"][name] = result
        del pools, arg_sets
        sweep.done(rows, row)
        _print_row(row, "fraction_of_copy")
    return rows


def run_prefill(cfg: dict, rng, sweep: Sweep, matmul: float, max_reference_bytes: float,
                backends: list[str] = ()) -> list:
    import jax.numpy as jnp
    rows = []
    batch = cfg["prefill_batch"]
    for chunk, context, page_size, group, dtype in itertools.product(
            cfg["prefill_chunk"], cfg["context"], cfg["page_size"], cfg["gqa"], cfg["dtype"]):
        if chunk > context:
            continue
        if sweep.out_of_time():
            break
        num_kv_heads, head_dim = cfg["num_kv_heads"], cfg["head_dim"]
        num_q_heads = num_kv_heads * group
        pages_per_seq = -(-context // page_size)
        k, v, tables = _pool(rng, batch, pages_per_seq, num_kv_heads, page_size, head_dim, dtype)
        q = jnp.asarray(rng.standard_normal((batch * chunk, num_q_heads, head_dim), np.float32), dtype)
        query_start = jnp.arange(batch + 1, dtype=jnp.int32) * chunk
        seq_lens = jnp.full((batch,), context, jnp.int32)
        # Query i of a chunk ending at `context` sees context - chunk + i + 1 keys.
        pairs = batch * sum(context - chunk + i + 1 for i in range(chunk))
        flops = 4 * pairs * num_q_heads * head_dim
        row = dict(kind="prefill", batch=batch, chunk=chunk, context=context, page_size=page_size, gqa=group,
                   dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim, flops=flops, results={})
        expected = None
        for name, fn in {**prefill_implementations(dtype),
                         **registered_implementations(list(backends), "prefill")}.items():
            gathered = batch * chunk * context * num_kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
            if name in ("jnp-reference", "xla") and gathered > max_reference_bytes:
                row["results"][name] = {"skipped": f"gathers each token's context ({gathered / 1e9:.1f} GB)"}
                continue
            args = (q, k, v, tables, query_start, seq_lens, head_dim ** -0.5)
            result, expected = _measure(fn, [args], sweep, expected)
            if "seconds" in result:
                result.update(flops_per_s=flops / result["seconds"],
                              fraction_of_matmul=flops / result["seconds"] / matmul)
            row["results"][name] = result
        sweep.done(rows, row)
        _print_row(row, "fraction_of_matmul")
    return rows


def _measure(fn, arg_sets: list[tuple], sweep: Sweep, expected):
    """Times fn over `arg_sets`; returns its result entry and the output later implementations are compared
    with (the first one's, on the first argument set). A baseline that cannot run a shape is reported as an
    error, not fatal."""
    import jax.numpy as jnp
    try:
        out = fn(*arg_sets[0])
        seconds = time_call(fn, arg_sets, sweep.repeats, sweep.calls_per_sample)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}, expected
    out = np.asarray(out.astype(jnp.float32))
    expected = out if expected is None else expected
    return dict(seconds=seconds, max_abs_diff_vs_first=float(np.abs(out - expected).max())), expected


def _print_row(row: dict, metric: str) -> None:
    shape = (f"{row['kind']:<8} b={row['batch']:<3} ctx={row['context']:<5} page={row['page_size']:<3} "
             f"gqa={row['gqa']:<2} {row['dtype']:<9}" + (f" chunk={row['chunk']}" if "chunk" in row else ""))
    parts = []
    for name, r in row["results"].items():
        parts.append(f"{name} {r['seconds'] * 1e3:.3f} ms ({r[metric]:.1%})" if "seconds" in r else f"{name} -")
    print(shape + " | " + "; ".join(parts), file=sys.stderr)


def plot(report: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind, metric, label in ((axes[0], "decode", "fraction_of_copy", "KV bandwidth / copy bandwidth"),
                                    (axes[1], "prefill", "fraction_of_matmul", "FLOP rate / matmul rate")):
        rows = [r for r in report["rows"] if r["kind"] == kind]
        names = sorted({n for r in rows for n, v in r["results"].items() if "seconds" in v})
        for i, name in enumerate(names):
            xs = [j for j, r in enumerate(rows) if "seconds" in r["results"].get(name, {})]
            ys = [rows[j]["results"][name][metric] for j in xs]
            ax.plot(xs, ys, "o-" if name.startswith("pallas") else "s--", label=name, markersize=4)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"b{r['batch']} c{r['context']} p{r['page_size']} g{r['gqa']}" for r in rows],
                           rotation=90, fontsize=6)
        ax.set_ylabel(label)
        ax.set_title(f"{kind} ({report['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="sweep sizes (default: smoke on CPU, gpu on a GPU)")
    parser.add_argument("--batch", type=int, nargs="*")
    parser.add_argument("--context", type=int, nargs="*")
    parser.add_argument("--page-size", type=int, nargs="*")
    parser.add_argument("--gqa", type=int, nargs="*", help="query heads per KV head")
    parser.add_argument("--dtype", nargs="*", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--num-kv-heads", type=int)
    parser.add_argument("--prefill-chunk", type=int, nargs="*", help="new tokens per sequence (0 entries: none)")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (median)")
    parser.add_argument("--reference-budget-gb", type=float, default=4.0,
                        help="skip the gathering baselines above this much temporary memory")
    parser.add_argument("--backend", action="append", default=[],
                        help="a registered attention backend to run beside the built-in ones (repeatable)")
    parser.add_argument("--plugin", action="append", default=[],
                        help="a module to import first (it calls paged.register_attention_backend)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new points after this many seconds (decode gets 70%%, prefill the "
                             "rest); the JSON holds every finished point as the sweep goes")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)

    import importlib

    import jax

    for module in args.plugin:
        importlib.import_module(module)

    from paged.benchmarks.common import copy_bandwidth, matmul_rate

    start = time.monotonic()
    on_gpu = jax.default_backend() == "gpu"
    cfg = dict(PRESETS[args.preset or ("gpu" if on_gpu else "smoke")])
    for key in ("batch", "context", "page_size", "gqa", "dtype", "head_dim", "num_kv_heads", "prefill_chunk"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    repeats = args.repeats or (20 if on_gpu else 3)
    calls_per_sample = 10 if on_gpu else 1
    copy_bw = copy_bandwidth(megabytes=2048 if on_gpu else 256, calls_per_sample=calls_per_sample)
    dtype = "bfloat16" if "bfloat16" in cfg["dtype"] else cfg["dtype"][0]
    matmul = matmul_rate(dtype, size=8192 if on_gpu else 1024, calls_per_sample=calls_per_sample)
    device = jax.devices()[0].device_kind
    print(f"{device}: copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write); {dtype} matmul "
          f"{matmul / 1e12:.2f} TFLOP/s", file=sys.stderr)
    rng = np.random.default_rng(0)
    budget = args.reference_budget_gb * 1e9
    report = dict(device=device, jax_version=jax.__version__, platform=jax.default_backend(), config=cfg,
                  copy_bytes_per_s=copy_bw, matmul_flops_per_s=matmul, matmul_dtype=dtype, repeats=repeats,
                  calls_per_sample=calls_per_sample,
                  conventions=dict(decode="KV bytes = 2 x sum(lengths) x Hkv x D x itemsize; fraction of the copy "
                                          "bandwidth (bytes read + written by a large in-place update)",
                                   prefill="FLOPs = 4 x causal query-key pairs x Hq x D; fraction of a square "
                                           "matmul's rate",
                                   timing="median of `repeats` samples, each `calls_per_sample` calls dispatched "
                                          "back to back; decode K/V rotated over `kv_copies` pools"),
                  rows=[])

    def write(rows):  # after every point: a sweep cut short keeps what it measured
        report["rows"] = rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    total = float("inf") if args.budget_s is None else args.budget_s
    sweep = Sweep(repeats, calls_per_sample, GPU_ROTATION_BYTES if on_gpu else 0,
                  deadline=start + 0.7 * total, on_row=write)
    rows = run_decode(cfg, rng, sweep, copy_bw, on_gpu, budget, args.backend)
    if not args.no_prefill:
        sweep = dataclasses.replace(sweep, deadline=start + total, on_row=lambda more: write(rows + more))
        rows = rows + run_prefill(cfg, rng, sweep, matmul, budget, args.backend)
    write(rows)
    if args.png:
        plot(report, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

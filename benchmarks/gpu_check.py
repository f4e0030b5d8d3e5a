"""One prepared script for a lent GPU: kernel correctness on the device, then the kernel benchmark.

Needs only jax and numpy (the device machine has jax but none of our other dependencies):

    python3 benchmarks/gpu_check.py --out "$OUT"     # from the repository root

Correctness: every kernel against the jnp reference on random paged inputs (lengths 0, 1, a page, a partial
page, the maximum; random page permutations), float32 and bfloat16 where the kernel takes it. Then
`benchmarks/kernels.py --preset gpu` writes kernels_gpu.json / .png under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def check(name, got, expected, tol):
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    err = float(np.abs(got - expected).max())
    ok = np.isfinite(got).all() and err <= tol
    print(f"{'PASS' if ok else 'FAIL'} {name}: max abs error {err:.2e} (tolerance {tol})", flush=True)
    return ok


def correctness() -> bool:
    from pallas_kernels import (paged_decode_attention, paged_decode_reference, ragged_paged_attention,
                                ragged_paged_attention_reference)
    from pallas_kernels.gpu.decode_mgpu import paged_decode_attention_mgpu
    rng = np.random.default_rng(0)
    on_cpu = jax.default_backend() == "cpu"  # a dry run here: the Mosaic kernel under its interpreter
    ok = True
    for dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)):  # f32 dots may use TF32 on GPU
        for page_size, group, head_dim in ((16, 1, 128), (16, 8, 128), (32, 4, 64), (8, 2, 64)):
            num_kv_heads, pages_per_seq = 2, 12
            lengths = np.array([0, 1, page_size, 3 * page_size + 5, pages_per_seq * page_size, 77], np.int32)
            num_seqs = len(lengths)
            num_pages = num_seqs * pages_per_seq + 3
            shape = (2, num_kv_heads, num_pages, page_size, head_dim)
            k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
            v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
            tables = jnp.asarray(rng.permutation(num_pages)[:num_seqs * pages_per_seq].reshape(num_seqs, -1),
                                 jnp.int32)
            q = jnp.asarray(rng.standard_normal((num_seqs, num_kv_heads * group, head_dim), np.float32), dtype)
            n = jnp.asarray(lengths)
            tag = f"{jnp.dtype(dtype).name} page={page_size} gqa={group} D={head_dim}"
            ref = paged_decode_reference(q, k, v, tables, n, 1, scale=head_dim ** -0.5)
            for splits in (1, 3):
                ok &= _run(f"decode portable splits={splits} {tag}", lambda: paged_decode_attention(
                    q, k, v, tables, n, 1, scale=head_dim ** -0.5, num_splits=splits), ref, tol)
            if dtype == jnp.bfloat16:
                ok &= _run(f"decode mosaic {tag}", lambda: paged_decode_attention_mgpu(
                    q, k, v, tables, n, 1, scale=head_dim ** -0.5, interpret=on_cpu), ref, tol)
                ok &= _run(f"decode mosaic splits=3 window=40 cap=5 {tag}", lambda: paged_decode_attention_mgpu(
                    q, k, v, tables, n, 1, 40, scale=head_dim ** -0.5, soft_cap=5.0, num_splits=3,
                    interpret=on_cpu),
                    paged_decode_reference(q, k, v, tables, n, 1, 40, scale=head_dim ** -0.5, soft_cap=5.0), tol)
            q_lens = np.array([0, 1, 5, 3 * page_size + 5, page_size, 40], np.int32)
            query_start = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            qr = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + 7, num_kv_heads * group, head_dim),
                                                 np.float32), dtype)
            ctx = jnp.asarray(np.maximum(lengths, q_lens))
            ref = ragged_paged_attention_reference(qr, k, v, tables, query_start, ctx, 1, scale=head_dim ** -0.5)
            ok &= _run(f"ragged portable {tag}", lambda: ragged_paged_attention(
                qr, k, v, tables, query_start, ctx, 1, scale=head_dim ** -0.5), ref, tol)
    return ok


def _run(name, fn, ref, tol) -> bool:
    try:
        return check(name, fn(), ref, tol)
    except Exception:
        print(f"FAIL {name}: raised\n{traceback.format_exc()[-3000:]}", flush=True)
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--skip-benchmark", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()}", flush=True)
    start = time.time()
    ok = correctness()
    print(f"correctness {'passed' if ok else 'FAILED'} in {time.time() - start:.0f} s", flush=True)
    if not args.skip_benchmark:
        from benchmarks import kernels
        kernels.main(["--json", os.path.join(args.out, "kernels_gpu.json"),
                      "--png", os.path.join(args.out, "kernels_gpu.png")])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

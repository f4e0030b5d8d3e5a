"""First run of the TPU ragged kernel on a TPU: compiled, against its jnp twin, then timed against the XLA path.

    python benchmarks/tpu_first_run.py              # on a TPU VM (pip install -e ".[tpu]")
    python benchmarks/tpu_first_run.py --interpret  # anywhere: the TPU interpreter at a small shape

Prints one line per shape: the largest difference from `ragged_paged_attention_reference` and, compiled, the
kernel's and the XLA path's time per call. Nothing here has run on a TPU yet (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

# (name, num_seqs, tokens per sequence, context, q heads, kv heads, head_dim, page size): decode and prefill
# shapes of Llama-3-8B and Qwen2.5-0.5B.
SHAPES = [("decode llama3-8b", 64, 1, 2048, 32, 8, 128, 16), ("prefill llama3-8b", 4, 512, 1024, 32, 8, 128, 16),
          ("decode qwen2.5-0.5b", 64, 1, 2048, 14, 2, 64, 16)]
SMALL = [("decode small", 4, 1, 40, 8, 2, 64, 16), ("prefill small", 2, 20, 40, 8, 2, 64, 16)]


def inputs(rng, num_seqs, q_len, context, hq, hkv, head_dim, page_size):
    import jax.numpy as jnp
    pages_per_seq = -(-context // page_size)
    num_pages = num_seqs * pages_per_seq + 1
    k, v = (jnp.asarray(rng.normal(size=(1, hkv, num_pages, page_size, head_dim)), jnp.bfloat16) for _ in range(2))
    tables = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq), jnp.int32)
    query_start = jnp.asarray(np.arange(num_seqs + 1) * q_len, jnp.int32)
    q = jnp.asarray(rng.normal(size=(num_seqs * q_len, hq, head_dim)), jnp.bfloat16)
    return q, k, v, tables, query_start, jnp.full((num_seqs,), context, jnp.int32)


def timed(fn, *args, repeats=10) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    import functools

    import jax
    import jax.numpy as jnp

    from paged.kernels import paged_attention_chunked, ragged_paged_attention_reference
    from paged.kernels.tpu.block_sizes import tokens_per_block_for
    from paged.kernels.tpu.ragged import ragged_paged_attention_tpu

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interpret", action="store_true", help="the TPU interpreter at small shapes (any machine)")
    args = parser.parse_args(argv)
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not args.interpret:
        print(f"no TPU here (jax.default_backend() is {jax.default_backend()!r}); pass --interpret to run the "
              "TPU interpreter at small shapes")
        return 2
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    for name, num_seqs, q_len, context, hq, hkv, head_dim, page_size in (SMALL if args.interpret else SHAPES):
        q, k, v, tables, qs, lens = inputs(rng, num_seqs, q_len, context, hq, hkv, head_dim, page_size)
        scale = head_dim ** -0.5
        block = tokens_per_block_for(1, hq // hkv, q.dtype) if q_len == 1 else None
        kernel = jax.jit(functools.partial(ragged_paged_attention_tpu, scale=scale, tokens_per_block=block,
                                           interpret=True if args.interpret else None))
        got = kernel(q, k, v, tables, qs, lens)
        want = ragged_paged_attention_reference(q, k, v, tables, qs, lens, scale=scale)
        error = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        line = f"{name}: max |kernel - jnp twin| = {error:.2e}"
        if on_tpu:
            t = jnp.arange(q.shape[0], dtype=jnp.int32)
            seq = t // q_len
            positions = context - q_len + t % q_len
            xla = jax.jit(lambda q, k, v, tables: paged_attention_chunked(q, k, v, 0, tables, seq, positions,
                                                                          scale=scale))
            line += (f"; kernel {timed(kernel, q, k, v, tables, qs, lens) * 1e3:.3f} ms, "
                     f"XLA {timed(xla, q, k, v, tables) * 1e3:.3f} ms")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

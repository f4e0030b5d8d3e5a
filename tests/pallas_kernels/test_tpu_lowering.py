"""The TPU kernel lowers for TPU without one: JAX's Mosaic TPU lowering runs on CPU, at the shapes the engine
uses (its attention call as the model makes it: decode and prefill blocks under one `lax.cond`, the layer
and the sliding window traced).

Catches what the interpreter accepts but Mosaic's lowering rules do not (operations with no TPU rule, a
rule that needs the chip generation). Mosaic's own compile (tiling and layout checks) runs inside libtpu
on a TPU only: see docs/kernels.md for what remains unverified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from paged.models.attention import AttentionMetadata, PallasTpuAttention

# (name, num_q_heads, num_kv_heads, head_dim, dtype): the tests' tiny Llama, Qwen2.5-0.5B, Llama-3-8B.
MODELS = [("tiny", 4, 2, 16, jnp.float32), ("qwen2.5-0.5b", 14, 2, 64, jnp.bfloat16),
          ("llama3-8b", 32, 8, 128, jnp.bfloat16)]
# (tokens, rows, pages per row): a decode-sized and a prefill-sized step bucket; block size 16.
STEPS = [(64, 64, 128), (512, 16, 128)]


@pytest.mark.parametrize("name, num_q_heads, num_kv_heads, head_dim, dtype", MODELS, ids=[m[0] for m in MODELS])
@pytest.mark.parametrize("num_tokens, num_rows, pages_per_row", STEPS, ids=["decode-bucket", "prefill-bucket"])
def test_the_engine_call_lowers_for_tpu(name, num_q_heads, num_kv_heads, head_dim, dtype, num_tokens, num_rows,
                                        pages_per_row):
    backend = PallasTpuAttention(interpret=False)
    sds = jax.ShapeDtypeStruct
    i32 = lambda *shape: sds(shape, jnp.int32)
    pool = sds((2, num_kv_heads, 4096, 16, head_dim), dtype)
    meta = AttentionMetadata(slot_mapping=i32(num_tokens), positions=i32(num_tokens), token_seq_ids=i32(num_tokens),
                             page_tables=i32(num_rows, pages_per_row), query_start=i32(num_rows + 1),
                             seq_lens=i32(num_rows), num_decode_rows=i32(), num_prefill_rows=i32())

    def layer_call(q, k_cache, v_cache, layer, window, meta):
        return backend.attend(q, None, None, k_cache, v_cache, layer, meta, scale=head_dim ** -0.5,
                              sliding_window=window, soft_cap=None)

    q = sds((num_tokens, num_q_heads, head_dim), dtype)
    text = jax.jit(layer_call).trace(q, pool, pool, i32(), i32(), meta).lower(
        lowering_platforms=("tpu",)).as_text()
    # Two Mosaic kernels (decode and prefill blocks) behind the step's cond.
    assert text.count("tpu_custom_call") >= 2, text[:2000]

"""Every attention backend ("pallas" in interpret mode and "pallas-tpu" under the TPU interpreter on CPU, the
native "cpu" kernel, "xla") gives the reference backend's greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged import LLM, SamplingParams
from tests.native import needs_compiler


def _ids(n, seed):
    return np.random.default_rng(seed).integers(2, 400, size=n).tolist()


def _greedy(directory, prompts, max_tokens=10, **engine_args):
    llm = LLM(directory, block_size=8, max_model_len=160, dtype="float32", show_progress=False, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("backend", ["pallas", pytest.param("pallas-tpu", marks=pytest.mark.tpu_interpreter),
                                     pytest.param("cpu", marks=needs_compiler), "xla"])
def test_backend_matches_reference_for_prefill_chunks_prefix_hits_and_decode(tiny_model_dir, backend):
    shared = _ids(27, seed=99)  # a prefix several prompts share: prefix-cache hits on later steps
    prompts = [_ids(n, seed=n) for n in (70, 5, 1, 33, 8)] + [shared + _ids(n, seed=n + 7) for n in (3, 12, 20)]
    _, expected = _greedy(tiny_model_dir, prompts, attention_backend="reference", enable_chunked_prefill=False,
                          enable_prefix_caching=False, max_num_batched_tokens=512)
    # A small token budget chunks the 70-token prompt and mixes prompt chunks with decode steps.
    llm, got = _greedy(tiny_model_dir, prompts, attention_backend=backend, max_num_seqs=4,
                       max_num_batched_tokens=32)
    assert got == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_usable_blocks


@needs_compiler
def test_auto_backend_is_the_native_kernel_on_cpu_and_pallas_on_gpu():
    from paged.models import get_attention_backend
    assert get_attention_backend("auto", "cpu").name == "cpu"  # the kernel builds on every CI machine
    assert get_attention_backend("auto", "gpu").name == "pallas"
    assert get_attention_backend("pallas", "cpu").name == "pallas"
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cpu", "gpu")


@pytest.mark.skipif(tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11),
                    reason="the Mosaic GPU interpreter of jax 0.10 lacks layout_cast (the 0.12 CI leg runs this)")
def test_mosaic_backend_decode_step_matches_reference():
    """One decode step of the "pallas-mosaic" backend (Mosaic GPU interpreter) against the reference backend,
    with padded rows and a padding token, in bfloat16."""
    from paged.models.attention import AttentionMetadata, get_attention_backend
    rng = np.random.default_rng(0)
    num_layers, num_kv_heads, num_blocks, block_size, head_dim, group = 2, 2, 24, 16, 64, 4
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    v_cache = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    seq_lens = jnp.asarray([5, 40, 0, 0], jnp.int32)  # two real rows, two padded
    tables = jnp.asarray(rng.permutation(num_blocks)[:16].reshape(4, 4), jnp.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros(5, jnp.int32), positions=jnp.asarray([4, 39, 0, 0, 0], jnp.int32),
        token_seq_ids=jnp.asarray([0, 1, 0, 0, 0], jnp.int32), page_tables=tables,
        query_start=jnp.asarray([0, 1, 2, 2, 2], jnp.int32), seq_lens=seq_lens, num_decode_rows=jnp.int32(2),
        num_prefill_rows=jnp.int32(0))
    q = jnp.asarray(rng.normal(size=(5, num_kv_heads * group, head_dim)), jnp.bfloat16)
    args = (q, None, None, k_cache, v_cache, 1, meta)
    got = get_attention_backend("pallas-mosaic", "cpu").attend(*args, scale=0.125, sliding_window=jnp.int32(0))
    expected = get_attention_backend("reference", "cpu").attend(*args, scale=0.125, sliding_window=jnp.int32(0))
    np.testing.assert_allclose(np.asarray(got[:2], np.float32), np.asarray(expected[:2], np.float32),
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.asarray(got[2:], np.float32), 0.0)


@pytest.mark.parametrize("dtype, reason", [("float32", "bfloat16 or float16"), ("bfloat16", "multiple of 64")])
def test_mosaic_backend_refuses_a_model_it_cannot_run_at_start_up(tiny_model_dir, dtype, reason):
    """The tiny model has head_dim 16: the Mosaic kernel takes bf16/f16 and head_dim a multiple of 64. The
    engine says so when it is built, not from inside the first step's trace."""
    with pytest.raises(ValueError, match=f"pallas-mosaic.*{reason}.*attention_backend='pallas'"):
        LLM(tiny_model_dir, dtype=dtype, attention_backend="pallas-mosaic", max_model_len=64, show_progress=False)

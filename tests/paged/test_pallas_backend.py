"""attention_backend="pallas" (the kernels, in interpret mode on CPU) gives the reference backend's tokens."""

from __future__ import annotations

import numpy as np

from paged import LLM, SamplingParams


def _ids(n, seed):
    return np.random.default_rng(seed).integers(2, 400, size=n).tolist()


def _greedy(directory, prompts, max_tokens=10, **engine_args):
    llm = LLM(directory, block_size=8, max_model_len=160, dtype="float32", show_progress=False, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def test_pallas_matches_reference_for_prefill_chunks_prefix_hits_and_decode(tiny_model_dir):
    shared = _ids(27, seed=99)  # a prefix several prompts share: prefix-cache hits on later steps
    prompts = [_ids(n, seed=n) for n in (70, 5, 1, 33, 8)] + [shared + _ids(n, seed=n + 7) for n in (3, 12, 20)]
    _, expected = _greedy(tiny_model_dir, prompts, attention_backend="reference", enable_chunked_prefill=False,
                          enable_prefix_caching=False, max_num_batched_tokens=512)
    # A small token budget chunks the 70-token prompt and mixes prompt chunks with decode steps.
    llm, got = _greedy(tiny_model_dir, prompts, attention_backend="pallas", max_num_seqs=4,
                       max_num_batched_tokens=32)
    assert got == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_auto_backend_is_xla_on_cpu_and_pallas_on_gpu():
    from models import get_attention_backend
    assert get_attention_backend("auto", "cpu").name == "xla"
    assert get_attention_backend("auto", "gpu").name == "pallas"
    assert get_attention_backend("pallas", "cpu").name == "pallas"

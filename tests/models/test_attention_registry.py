"""Bring your own attention: a registered function runs in `LLM.generate` and in `paged bench kernels`."""

from __future__ import annotations

import json

import pytest

from paged.models import attention
from paged.kernels import paged_attention_reference
from paged import LLM, SamplingParams, register_attention_backend

CALLS = []


def counted_reference(q, k, v, k_cache, v_cache, layer, meta, *, scale, sliding_window, soft_cap):
    CALLS.append(q.shape)  # at trace time: once per layer per compiled shape
    return paged_attention_reference(q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids,
                                     meta.positions, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.fixture
def registered():
    register_attention_backend("my-reference", counted_reference)
    yield "my-reference"
    attention._REGISTERED.pop("my-reference", None)


def test_a_registered_kernel_runs_in_generate(tiny_model_dir, registered):
    options = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                   show_progress=False)
    prompts = ["Hello world", "Paged attention keeps the cache in blocks and pages"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    CALLS.clear()
    mine = LLM(tiny_model_dir, attention_backend=registered, **options)
    got = [o.outputs[0].token_ids for o in mine.generate(prompts, params, use_tqdm=False)]
    assert CALLS, "the registered function was never called"
    assert mine.engine.attention_name == registered
    want = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, attention_backend="reference", **options)
            .generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_a_registered_kernel_runs_in_the_kernel_benchmark(tmp_path, monkeypatch):
    plugin = tmp_path / "my_kernel_plugin.py"
    plugin.write_text("from paged import register_attention_backend\n"
                      "from tests.models.test_attention_registry import counted_reference\n"
                      "register_attention_backend('plugin-reference', counted_reference)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from paged.serving.cli import main
    out = tmp_path / "kernels.json"
    try:
        assert main(["bench", "kernels", "--batch", "2", "--context", "48", "--page-size", "8", "--gqa", "2",
                     "--prefill-chunk", "16", "--repeats", "1", "--plugin", "my_kernel_plugin",
                     "--backend", "plugin-reference", "--json", str(out)]) == 0
    finally:
        attention._REGISTERED.pop("plugin-reference", None)
    for row in json.loads(out.read_text())["rows"]:
        result = row["results"]["plugin-reference"]
        assert result["seconds"] > 0 and result["max_abs_diff_vs_first"] < 1e-4, (row["kind"], result)


def test_registration_refuses_what_would_be_ambiguous():
    with pytest.raises(ValueError, match="new non-empty string"):
        register_attention_backend("xla", counted_reference)
    with pytest.raises(ValueError, match="exactly one"):
        register_attention_backend("both", counted_reference, backend=object())
    with pytest.raises(ValueError, match="callable"):
        register_attention_backend("not-callable", 3)


def test_an_unregistered_name_is_refused_with_the_choices(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown attention_backend 'nope'"):
        LLM(tiny_model_dir, attention_backend="nope", show_progress=False)

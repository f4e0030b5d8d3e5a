"""kv_cache_dtype="fp8": the pool in float8, the same tokens on every attention backend, twice the blocks of a
bfloat16 pool in the same memory, and preemption (swap) and copy-on-write on fp8 blocks."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, SamplingParams
from tests.native import needs_compiler

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 13, 200], [7, 7, 30], list(range(40, 90)), [3])]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(block_size=8, max_model_len=128, max_num_seqs=8, num_kv_blocks=64, show_progress=False,
              compilation_cache_dir=None)


def _tokens(llm, params=GREEDY):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _fp8_tokens(model_dir, backend):
    llm = LLM(model_dir, kv_cache_dtype="fp8", attention_backend=backend, **ENGINE)
    assert llm.engine.worker.runner.kv_cache[0].dtype == np.dtype("float8_e4m3fn")
    return _tokens(llm)


@pytest.fixture(scope="module")
def fp8_reference_tokens(tiny_model_dir):
    return _fp8_tokens(tiny_model_dir, "reference")


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=needs_compiler), "pallas"])
def test_every_backend_draws_the_same_tokens_from_an_fp8_pool(tiny_model_dir, fp8_reference_tokens, backend):
    """The backends dequantize the same codes with the same float32 math, prompt tokens included (the XLA
    path's dense prompt attention rounds the new keys as the pool stores them)."""
    assert _fp8_tokens(tiny_model_dir, backend) == fp8_reference_tokens


def test_fp8_pool_holds_twice_the_blocks_of_bfloat16(tiny_model_dir):
    options = {**ENGINE, "num_kv_blocks": None, "max_num_seqs": 256, "max_model_len": 1024, "dtype": "bfloat16",
               "kv_cache_memory_bytes": 2**22}
    bf16 = LLM(tiny_model_dir, **options).engine
    fp8 = LLM(tiny_model_dir, kv_cache_dtype="fp8", **options).engine
    assert fp8.block_manager.num_blocks == 2 * bf16.block_manager.num_blocks
    assert sum(c.nbytes for c in fp8.worker.runner.kv_cache) == sum(c.nbytes for c in bf16.worker.runner.kv_cache)


def test_swapped_and_forked_fp8_blocks_keep_their_codes(tiny_model_dir):
    """n=2 forks copy fp8 blocks; a pool too small for the batch swaps them out and back: the tokens are those
    of a pool large enough for neither to happen."""
    params = [SamplingParams(temperature=1.0, n=2, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    roomy = LLM(tiny_model_dir, kv_cache_dtype="fp8", **ENGINE)
    tight = LLM(tiny_model_dir, kv_cache_dtype="fp8", preemption_mode="swap", **{**ENGINE, "num_kv_blocks": 20})
    assert _tokens(tight, params) == _tokens(roomy, params)
    assert tight.engine.num_preemptions > 0


def test_pallas_mosaic_refuses_fp8(tiny_model_dir):
    with pytest.raises(NotImplementedError, match="pallas-mosaic"):
        LLM(tiny_model_dir, kv_cache_dtype="fp8", attention_backend="pallas-mosaic", **ENGINE)


def _with_kv_scales(model_dir: str, out_dir, k_scale: float, v_scale: float) -> str:
    """The checkpoint plus per-layer self_attn.k_scale / v_scale tensors, as llm-compressor's kv_cache_scheme
    writes them ([1] float32 each)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(f"{out_dir}/model.safetensors")
    layers = json.loads(open(f"{out_dir}/config.json").read())["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array([k_scale], np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array([v_scale], np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, f"{out_dir}/model.safetensors")
    return str(out_dir)


def test_checkpoint_kv_scales_are_read_for_an_fp8_pool_only(tiny_model_dir, tmp_path):
    """A float checkpoint whose quantization_config holds only llm-compressor's kv_cache_scheme."""
    import json
    scaled = _with_kv_scales(tiny_model_dir, tmp_path / "scaled", 3.0, 0.25)
    config = json.loads(open(f"{scaled}/config.json").read())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "dynamic": False, "symmetric": True}}
    open(f"{scaled}/config.json", "w").write(json.dumps(config))
    fp8 = LLM(scaled, kv_cache_dtype="fp8", **ENGINE).engine
    assert fp8.model_config.kv_scales
    attn = fp8.worker.runner.params["layers"][0]["self_attn"]
    assert float(attn["k_scale"]) == 3.0 and float(attn["v_scale"]) == 0.25
    plain = LLM(scaled, **ENGINE).engine  # a float pool has no use for them
    assert not plain.model_config.kv_scales and "k_scale" not in plain.worker.runner.params["layers"][0]["self_attn"]


def test_kv_scales_divide_what_the_pool_holds_and_nothing_else(tiny_model_dir):
    """One real prefill step through the model twice, on a float32 pool: without scales, and with k_scale 4 and
    v_scale 1/4 (powers of two: every product is exact). The pool holds k / 4 and 4 v, and the logits are
    the same: the queries and outputs undo the scales."""
    import dataclasses

    import jax

    from paged.models.llama import LlamaForCausalLM
    from paged.batch import prepare_inputs
    engine = LLM(tiny_model_dir, attention_backend="xla", **ENGINE).engine
    engine.add_request(engine.make_request("r", None, list(range(5, 30)), SamplingParams(max_tokens=1)))
    inputs = prepare_inputs(engine.scheduler.schedule(), engine.block_manager, engine.buckets)
    meta = engine.worker.runner.attention.prepare(inputs.attention)
    base_params = engine.worker.runner.params
    scaled_model = LlamaForCausalLM(dataclasses.replace(engine.model_config, kv_scales=True), engine.dtype)
    scaled_params = {**base_params, "layers": [
        {**layer, "self_attn": {**layer["self_attn"], "k_scale": np.float32(4.0), "v_scale": np.float32(0.25)}}
        for layer in base_params["layers"]]}
    pool = jax.numpy.zeros_like(engine.worker.runner.kv_cache[0])

    def run(model, params):
        step = jax.jit(lambda p, kv, ids, meta, rows: model.forward(p, kv, ids, meta, rows, engine.worker.runner.attention))
        return step(params, (pool, pool), inputs.token_ids, meta, inputs.logits_indices)

    base_logits, (base_k, base_v) = run(engine.worker.model, base_params)
    logits, (k, v) = run(scaled_model, scaled_params)
    np.testing.assert_array_equal(np.asarray(k) * 4, np.asarray(base_k))
    np.testing.assert_array_equal(np.asarray(v) / 4, np.asarray(base_v))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(base_logits), rtol=1e-6, atol=1e-6)

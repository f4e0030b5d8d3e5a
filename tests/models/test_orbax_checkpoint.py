"""Orbax checkpoints: what `LLM.save` writes restores to the same weights and tokens (float, online int8, GPTQ;
one device and tensor parallel), onto the target shardings; a layout the restoring engine would build
differently is refused with the difference named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.models.orbax_checkpoint import LAYOUT_FILE
from paged.models.tiny import create_tiny_llama

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 13, 200], [7, 7, 30], list(range(40, 90)))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(block_size=8, max_model_len=128, num_kv_blocks=64, max_num_seqs=8, show_progress=False,
             enforce_eager=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_llama(str(tmp_path_factory.mktemp("llama")), num_heads=8, num_kv_heads=4, hidden_size=64,
                             num_layers=2)


@pytest.fixture(scope="module")
def gptq_dir(model_dir, tmp_path_factory):
    from paged.benchmarks.gptq_checkpoint import main as write_gptq
    out = str(tmp_path_factory.mktemp("gptq") / "gptq4")
    assert write_gptq([model_dir, out, "--bits", "4", "--group-size", "32"]) == 0
    return out


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _leaves(llm) -> dict:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(llm.get_params())[0]}


@pytest.mark.parametrize("source, options", [
    ("float", {"dtype": "float32"}),
    ("float", {"dtype": "bfloat16", "layer_loop": "scan"}),  # layers stacked in memory as on disk
    ("float", {"dtype": "bfloat16", "quantization": "int8"}),
    ("float", {"dtype": "bfloat16", "quantization": "w8a8"}),  # on AMX-INT8: the codes held packed for the tiles
    ("gptq", {"dtype": "bfloat16"}),
], ids=["float32", "bfloat16-scan", "int8", "w8a8", "gptq4"])
def test_a_saved_model_restores_to_the_same_weights_and_tokens(model_dir, gptq_dir, tmp_path, source, options):
    original = LLM(gptq_dir if source == "gptq" else model_dir, **SMALL, **options)
    tokens, leaves = _tokens(original), _leaves(original)
    saved = str(tmp_path / "saved")
    original.save(saved)
    del original
    assert not any(name.endswith(".safetensors") for name in os.listdir(saved))  # the tree replaces the weights
    layout = json.load(open(os.path.join(saved, LAYOUT_FILE)))
    assert layout["dtype"] == options["dtype"]
    method = "gptq" if source == "gptq" else options.get("quantization")
    assert (layout["weight_quant"] or {}).get("method") == method
    restored = LLM(saved, **SMALL, layer_loop=options.get("layer_loop", "auto"))
    # The checkpoint's dtype and quantization come back without being asked for.
    assert restored.engine.dtype == np.dtype(jax.numpy.dtype(options["dtype"]))
    assert _tokens(restored) == tokens
    got = _leaves(restored)
    assert got.keys() == leaves.keys()
    for name, array in leaves.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name


@pytest.mark.parametrize("saved_loop, restored_loop", [("unroll", "scan"), ("scan", "unroll")])
def test_the_other_layer_loop_restores_the_same_tree(model_dir, tmp_path, saved_loop, restored_loop):
    """Saved as held (a list of layers from the unrolled loop, stacked from the scanned one), restored for the
    other loop."""
    saved = LLM(model_dir, **SMALL, dtype="float32", layer_loop=saved_loop)
    tokens = _tokens(saved)
    layers = saved.get_params()["layers"]
    saved.save(str(tmp_path / "saved"))
    del saved
    restored = LLM(str(tmp_path / "saved"), **SMALL, layer_loop=restored_loop)
    assert isinstance(restored.get_params()["layers"], list) == (restored_loop == "unroll")
    assert _tokens(restored) == tokens
    stacked_before = layers if not isinstance(layers, list) else jax.tree.map(lambda *x: np.stack(x), *layers)
    after = restored.get_params()["layers"]
    stacked_after = after if not isinstance(after, list) else jax.tree.map(lambda *x: np.stack(x), *after)
    assert jax.tree.all(jax.tree.map(np.array_equal, stacked_before, stacked_after))


def test_what_does_not_fit_is_refused_by_name(model_dir, tmp_path):
    llm = LLM(model_dir, **SMALL, dtype="bfloat16")
    saved = str(tmp_path / "saved")
    llm.save(saved)
    with pytest.raises(FileExistsError, match="not empty"):
        llm.save(saved)
    del llm
    with pytest.raises(ValueError, match="saved with dtype='bfloat16'"):
        LLM(saved, **SMALL, dtype="float32")
    with pytest.raises(ValueError, match="quantization='int8'.*saved unquantized"):
        LLM(saved, **SMALL, quantization="int8")


def test_paged_convert_writes_a_checkpoint_the_engine_restores(model_dir, tmp_path):
    from paged.serving.cli import main
    out = str(tmp_path / "converted")
    assert main(["convert", model_dir, out, "--dtype", "bfloat16", "--quantization", "int8"]) == 0
    reference = LLM(model_dir, **SMALL, dtype="bfloat16", quantization="int8")
    assert _tokens(LLM(out, **SMALL)) == _tokens(reference)


TP_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from paged import LLM, SamplingParams
    model_dir, gqa_dir, mqa_dir, out = sys.argv[1:5]
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 13, 200], [7, 7, 30], list(range(40, 90)))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = dict(block_size=8, max_model_len=128, num_kv_blocks=64, max_num_seqs=8, show_progress=False,
                 enforce_eager=True, dtype="float32")
    tokens = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    result = {}
    one = LLM(model_dir, **small)
    result["one"] = tokens(one)
    del one
    for source, size, name in ((model_dir, 2, "tp2"), (mqa_dir, 2, "mqa_tp2")):
        llm = LLM(source, tensor_parallel_size=size, **small)
        result[name] = tokens(llm)
        llm.save(f"{out}/{name}")
        del llm
    # Restored at the size it was saved at, and at another whose layout is the same (Orbax reshards).
    for size in (2, 1):
        llm = LLM(f"{out}/tp2", tensor_parallel_size=size, **small)
        kernel = llm.get_params()["layers"][0]["self_attn"]["q_proj"]["kernel"]
        result[f"tp2_at_{size}"] = {"tokens": tokens(llm),
                                    "q_shard_cols": [s.data.shape[-1] for s in kernel.addressable_shards]}
        del llm
    # At 4 the vocabulary (not a multiple of 4) would be padded: another tree.
    try:
        LLM(f"{out}/tp2", tensor_parallel_size=4, **small)
        result["tp2_at_4"] = "restored"
    except ValueError as exc:
        result["tp2_at_4"] = str(exc)
    # One KV head at TP 2 is held twice: at TP 1 the tree would differ.
    try:
        LLM(f"{out}/mqa_tp2", tensor_parallel_size=1, **small)
        result["mqa_at_1"] = "restored"
    except ValueError as exc:
        result["mqa_at_1"] = str(exc)
    llm = LLM(f"{out}/mqa_tp2", tensor_parallel_size=2, **small)
    result["mqa_tp2_at_2"] = tokens(llm)
    print("RESULT " + json.dumps(result))
""")


def test_tensor_parallel_saves_and_restores_across_sizes(model_dir, tmp_path):
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    assert vocab % 2 == 0 and vocab % 4, vocab  # what the sizes below rely on
    mqa_dir = create_tiny_llama(str(tmp_path / "mqa"), num_heads=4, num_kv_heads=1, hidden_size=64, num_layers=2)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, model_dir, model_dir, mqa_dir, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[0][7:])
    assert result["tp2"] == result["one"]
    for size in (2, 1):
        got = result[f"tp2_at_{size}"]
        assert got["tokens"] == result["one"], size
        assert got["q_shard_cols"] == [64 // size] * size  # each device holds only its columns
    assert "padded_vocab_size" in result["tp2_at_4"]
    assert "kv_head_replicas=2" in result["mqa_at_1"] and "tensor_parallel_size=2" in result["mqa_at_1"]
    assert result["mqa_tp2_at_2"] == result["mqa_tp2"]

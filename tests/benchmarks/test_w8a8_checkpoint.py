"""benchmarks/w8a8_checkpoint.py writes, with compressed-tensors, a W8A8 checkpoint the engine loads as one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file


def test_w8a8_checkpoint_loads_as_int8_weights_and_activations_close_to_the_float_weights(tiny_model_dir, tmp_path):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors needs torch (Python 3.11 here)")
    from paged import LLM, SamplingParams
    from paged.benchmarks.w8a8_checkpoint import main
    from paged.kernels import cpu
    from paged.models.quantization import dequantize
    out = tmp_path / "w8a8"
    assert main([tiny_model_dir, str(out)]) == 0
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]
    assert scheme["format"] == "int-quantized" and scheme["ignore"] == ["lm_head"]
    llm = LLM(str(out), block_size=8, max_model_len=64, show_progress=False)
    quant = llm.engine.model_config.weight_quant
    assert (quant.bits, quant.activations) == (8, "int8") and llm.engine.weight_bytes["int8"] > 0
    layer = llm.engine.worker.runner.params["layers"][0]["mlp"]["up_proj"]
    want = load_file(f"{tiny_model_dir}/model.safetensors")["model.layers.0.mlp.up_proj.weight"].T.astype(np.float32)
    qweight = layer["qweight"]
    if qweight.ndim == 3:  # held packed for the AMX tiles
        qweight = cpu.unpack_from_amx(qweight, want.shape[0])
    got = np.asarray(dequantize(qweight, layer["scales"], layer["zero_offsets"], 8), np.float32)
    step = np.asarray(layer["scales"], np.float32).reshape(1, -1)  # a code's width, one per output channel
    # min/max calibration: each channel's largest weight is code 127 (the scale as the checkpoint's dtype holds it)
    np.testing.assert_allclose(step[0], np.abs(want).max(0) / 127, rtol=1e-2)
    error = np.abs(got - want) / step
    # Half a code from rounding (plus the scale's own rounding to the checkpoint's dtype); a misread layout or
    # scale is off by many codes.
    assert error.max() <= 0.6 and error.mean() < 0.3, (error.max(), error.mean())
    assert llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids

"""benchmarks/gptq_checkpoint.py writes a GPTQ checkpoint the engine loads, close to the float weights."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file

from paged.benchmarks.gptq_checkpoint import main
from paged.models.quantization import dequantize


def test_round_to_nearest_gptq_checkpoint_loads_close_to_the_float_weights(tiny_model_dir, tmp_path):
    from paged import LLM, SamplingParams
    out = tmp_path / "gptq"
    assert main([tiny_model_dir, str(out), "--bits", "4", "--group-size", "32"]) == 0
    llm = LLM(str(out), block_size=8, max_model_len=64, show_progress=False)
    assert llm.engine.model_config.weight_quant.bits == 4 and llm.engine.weight_bytes["uint8"] > 0
    layer = llm.engine.worker.runner.params["layers"][0]["mlp"]["up_proj"]
    got = np.asarray(dequantize(layer["qweight"], layer["scales"], layer["zero_offsets"], 4))
    want = load_file(f"{tiny_model_dir}/model.safetensors")["model.layers.0.mlp.up_proj.weight"].T
    step = np.asarray(layer["scales"]).repeat(32, axis=0)  # a code's width
    error = np.abs(got - want) / step
    # Half a code from rounding, up to one more where the zero point was rounded or held at 1 (v1's floor);
    # a misread layout is off by many codes.
    assert error.max() <= 1.5 and error.mean() < 0.3, (error.max(), error.mean())
    assert llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids

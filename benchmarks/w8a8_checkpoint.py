"""Writes a W8A8 checkpoint of a float checkpoint with compressed-tensors itself, for benchmarks against vLLM.

    python -m paged.benchmarks.w8a8_checkpoint SRC DST
    paged bench throughput --model DST --vllm-python ... ...

Every projection of the decoder layers gets int8 weights, one symmetric scale per output channel (min/max, as
llm-compressor's default observer), and int8 activations quantized per token at run time (dynamic, symmetric):
compressed-tensors' "int-quantized" format, written by its own compressor, which both this engine and vLLM load
as a W8A8 model. The LM head stays in the checkpoint's dtype. No calibration data: the tokens are not a real
W8A8 release's. Needs torch and compressed-tensors (test dependencies).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(args.src, dtype="auto").eval()
    weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    activations = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=activations)}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "quantization_scheme"):
                w = module.weight.data
                scale, _ = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), weights)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(args.dst)
    compressor.update_config(args.dst)
    for name in os.listdir(args.src):
        if name.startswith("tokenizer") or name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(os.path.join(args.src, name), args.dst)
    print(f"wrote {args.dst} (W8A8: int8 weights per channel, int8 activations per token)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

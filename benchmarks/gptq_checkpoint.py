"""Writes a GPTQ-format checkpoint of a float checkpoint by round-to-nearest, for speed and memory benchmarks.

    python -m paged.benchmarks.gptq_checkpoint SRC DST [--bits 4] [--group-size 128]
    paged bench throughput --model DST ...

No calibration: each group of input rows gets its min/max scale and zero point (asymmetric). The file layout is
AutoGPTQ's v1 "gptq" format (docs/quantization.md), so the engine loads it as it would a real GPTQ release; the
tokens are not a real GPTQ model's. The correctness of loading is tested against independent packers
(tests/models/test_quantized_checkpoints.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so that bfloat16 checkpoints read and write
import numpy as np
from safetensors.numpy import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [R, C] -> int32 words [R * bits / 32, C], value j of a word at bit offset bits * j."""
    per_word = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0] // per_word, per_word, values.shape[1])
    words = np.zeros(v[:, 0].shape, np.uint32)
    for j in range(per_word):
        words |= v[:, j] << np.uint32(bits * j)
    return words.view(np.int32)


def quantize_layer(weight: np.ndarray, bits: int, group_size: int) -> dict[str, np.ndarray]:
    """GPTQ tensors of a float weight [out, in]."""
    w = weight.astype(np.float32).T  # [in, out]
    rows = w.shape[0] if group_size == -1 else group_size
    grouped = w.reshape(w.shape[0] // rows, rows, w.shape[1])
    lo, hi = np.minimum(grouped.min(1), 0), np.maximum(grouped.max(1), 0)
    levels = (1 << bits) - 1
    scales = np.maximum(hi - lo, 1e-8) / levels
    zeros = np.clip(np.round(-lo / scales), 1, levels)  # v1 stores zero - 1: a zero of 0 would not fit
    codes = np.clip(np.round(grouped / scales[:, None]) + zeros[:, None], 0, levels).reshape(w.shape)
    tensors = {"qweight": _words(codes, bits), "qzeros": _words((zeros - 1).T, bits).T,
               "scales": scales.astype(np.float16), "g_idx": (np.arange(w.shape[0]) // rows).astype(np.int32)}
    # safetensors writes an array's buffer as it lies: views of transposed data must be made contiguous.
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args(argv)
    if os.path.exists(os.path.join(args.src, "model.safetensors.index.json")):
        raise SystemExit("sharded checkpoints are not handled here; pass a single-file checkpoint")
    shutil.copytree(args.src, args.dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    out = {}
    for name, tensor in load_file(os.path.join(args.src, "model.safetensors")).items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and len(module) == 3 and module[1] in PROJECTIONS:
            out.update({f"{name[:-len('.weight')]}.{k}": v
                        for k, v in quantize_layer(tensor, args.bits, args.group_size).items()})
        else:
            out[name] = tensor
    save_file(out, os.path.join(args.dst, "model.safetensors"))
    config_path = os.path.join(args.dst, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": args.bits, "group_size": args.group_size,
                                     "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {args.dst} (GPTQ {args.bits}-bit, group {args.group_size}, round to nearest)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

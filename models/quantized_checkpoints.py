"""Quantized checkpoints and online quantization, converted to models/quantization.py's one layout.

Formats, as their producers write them (the unpacking follows each format's public description):
- GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq" or "gptq_v2"): qweight int32 [in * bits / 32, out],
  packed along the input dimension (value j of a word at bit offset bits * j); qzeros int32
  [groups, out * bits / 32], packed along the output dimension, holding zero - 1 in "gptq" (v1) format and the
  zero itself in "gptq_v2"; scales [groups, out]; g_idx int32 [in], each input row's group (not sorted with
  desc_act). W[i, o] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i].
- AWQ "gemm": qweight int32 [in, out / 8], packed along the output dimension in the order 0, 2, 4, 6, 1, 3, 5, 7;
  qzeros int32 [in / group, out / 8], packed the same way, no offset; scales [in / group, out].
  W = (q - zero) * scale.
- compressed-tensors "pack-quantized" (llm-compressor's W4A16 / W8A16): weight_packed int32
  [out, in * bits / 32], packed along the input dimension as GPTQ's words are, holding q + 2^(bits - 1) for the
  signed code q; weight_scale [out, groups]; weight_zero_point int32 [out * bits / 32, groups] (asymmetric
  only), packed along the output dimension with the same offset; weight_shape [out, in].
  W = (q - zero_point) * scale.
- compressed-tensors "int-quantized" (W8A8's weights): weight int8 [out, in], the signed codes; weight_scale
  [out, groups] (group, channel) or one value (tensor); weight_zero_point int8 of the same shape (asymmetric).
  "float-quantized" (FP8 W8A8, FP8_DYNAMIC): weight float8_e4m3fn [out, in]; weight_scale [out, 1] (channel),
  one value (tensor) or [out / bo, in / bi] (block). W = (q - zero_point) * scale. Dynamic, symmetric,
  per-token input activations (W8A8) are quantized and dequantized in the step (paged.models.quantization.
  quantize_activations); the product itself is a float matmul.
- HF "fp8" (`quant_method: fp8`, the FP8 releases of Qwen3 and DeepSeek): weight float8_e4m3fn [out, in] and
  weight_scale_inv float32 [out / 128, in / 128] (`weight_block_size`), W = weight * weight_scale_inv per block.
  Activations stay in the compute dtype here (weight-only); vLLM's fp8 GEMMs also quantize them per token group.
- online int8 / fp8 (`quantization="int8"` or `"fp8"` on a float checkpoint): symmetric, one scale per output
  channel.
"""

from __future__ import annotations

import numpy as np

from paged.models.quantization import (QUANT_BITS, WeightQuant, pack, quantize_per_channel_float8,
                                       quantize_per_channel_int8)

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx",  # GPTQ, AWQ
                  "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",  # compressed-tensors
                  "weight_scale_inv")  # HF fp8 (its codes are `weight`: see quantized_suffixes)
ONLINE_METHODS = ("int8", "fp8", "w8a8")  # what quantization= may ask of a float checkpoint


def is_online(scheme: WeightQuant) -> bool:
    """Quantized from float weights while loading (not read from a quantized checkpoint)."""
    return scheme.method in ("int8", "fp8-online", "w8a8")
_AWQ_REORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # column c of an 8-column word sits in nibble _AWQ_REORDER[c]


def weight_quant(quantization_config: dict | None, requested: str | None) -> WeightQuant | None:
    """The scheme a model loads with: the checkpoint's `quantization_config`, or `requested` online.

    Raises ValueError (or NotImplementedError) naming the config field and value before any weight is read.
    """
    if requested is not None and not isinstance(requested, str):
        raise ValueError(f"quantization must be a method name or None, got {requested!r}")
    if quantization_config is None:
        if requested is None:
            return None
        if requested == "int8":
            scheme = WeightQuant(bits=8, group_size=-1, method="int8")
        elif requested == "fp8":
            scheme = WeightQuant(bits=8, group_size=-1, method="fp8-online", kind="float8")
        elif requested == "w8a8":  # int8 weights per output channel and int8 activations per token, dynamic
            scheme = WeightQuant(bits=8, group_size=-1, method="w8a8", activations="int8")
        elif requested in ("gptq", "awq", "compressed-tensors"):
            raise ValueError(f"quantization={requested!r} needs a checkpoint quantized that way; this one has no "
                             "quantization_config in its config.json")
        else:
            raise NotImplementedError(f"quantization={requested!r} is not implemented (online methods: "
                                      f"{', '.join(ONLINE_METHODS)}; checkpoint formats: gptq, awq, "
                                      "compressed-tensors, fp8)")
    else:
        method = str(quantization_config.get("quant_method", "")).lower()
        if requested is not None and requested != method:  # (fp8 names both the online method and this format)
            raise ValueError(f"quantization={requested!r} does not match the checkpoint's "
                             f"quantization_config.quant_method={method!r}")
        scheme = _checkpoint_scheme(quantization_config, method)
    return scheme


def _checkpoint_scheme(config: dict, method: str) -> WeightQuant | None:
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    if method == "fp8":
        return _fp8_scheme(config)
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size", -1))
    if method not in ("gptq", "awq"):
        raise NotImplementedError(f"quantization_config.quant_method={method!r} is not implemented yet "
                                  "(implemented: gptq, awq, compressed-tensors, fp8)")
    if bits not in QUANT_BITS or (method == "awq" and bits != 4):
        raise NotImplementedError(f"quantization_config.bits={bits!r} is not implemented for {method} "
                                  f"(implemented: {'4' if method == 'awq' else '4, 8'})")
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"quantization_config.group_size must be -1 or a positive integer, got {group_size!r}")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise NotImplementedError(f"quantization_config.version={version!r} is not implemented for awq "
                                      "(implemented: gemm)")
        if group_size == -1:
            raise NotImplementedError("quantization_config.group_size=-1 is not implemented for awq")
        return WeightQuant(bits=4, group_size=group_size, method="awq")
    checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise NotImplementedError(f"quantization_config.checkpoint_format={checkpoint_format!r} is not "
                                  "implemented (implemented: gptq, gptq_v2)")
    act_order = bool(config.get("desc_act", False)) and group_size != -1
    return WeightQuant(bits=bits, group_size=group_size, act_order=act_order,
                       method="gptq_v2" if checkpoint_format == "gptq_v2" else "gptq")


# compressed-tensors formats: pack-quantized (int codes in int32 words), int-quantized (int8 codes as they are:
# W8A8's weights) and float-quantized (float8 e4m3 codes: FP8 W8A8 / FP8_DYNAMIC's weights).
_CT_FORMATS = {"pack-quantized": "compressed-tensors", "int-quantized": "compressed-tensors-int8",
               "float-quantized": "compressed-tensors-fp8"}
_CT_STRATEGIES = {"pack-quantized": ("group", "channel"), "int-quantized": ("group", "channel", "tensor"),
                  "float-quantized": ("channel", "tensor", "block")}


def _compressed_tensors_scheme(config: dict) -> WeightQuant | None:
    """One weight scheme for every quantized layer, and W8A8's activations when they are dynamic, symmetric
    and per token (`quantize_activations`); static activation scales are refused."""
    groups = config.get("config_groups") or {}
    kv_scheme = config.get("kv_cache_scheme")
    if kv_scheme and (kv_scheme.get("type") != "float" or kv_scheme.get("num_bits") != 8):
        raise NotImplementedError(f"quantization_config.kv_cache_scheme type={kv_scheme.get('type')!r} num_bits="
                                  f"{kv_scheme.get('num_bits')!r} is not implemented (implemented: float with 8 bits, "
                                  "read with kv_cache_dtype='fp8')")
    if not groups:
        if kv_scheme:  # float weights; only the KV cache scales are quantization parameters
            return None
        raise ValueError("quantization_config.config_groups is empty")
    weights = set()
    for name, group in groups.items():
        field = f"quantization_config.config_groups.{name}"
        if group.get("output_activations"):
            raise NotImplementedError(f"{field}.output_activations is set: output quantization is not implemented")
        activations = group.get("input_activations")
        act_kind = _activation_kind(activations, f"{field}.input_activations") if activations else None
        args = group.get("weights") or {}
        fmt = group.get("format") or config.get("format")
        if fmt not in _CT_FORMATS:
            raise NotImplementedError(f"{field}.format={fmt!r} is not implemented yet (implemented: "
                                      f"{', '.join(_CT_FORMATS)})")
        kind = "float" if fmt == "float-quantized" else "int"
        allowed_bits = (8,) if fmt != "pack-quantized" else QUANT_BITS
        if args.get("type") != kind or args.get("num_bits") not in allowed_bits:
            raise NotImplementedError(f"{field}.weights: type={args.get('type')!r} num_bits={args.get('num_bits')!r} "
                                      f"is not implemented for {fmt} (implemented: {kind} with "
                                      f"{' or '.join(map(str, allowed_bits))} bits)")
        strategy = args.get("strategy")
        if strategy not in _CT_STRATEGIES[fmt]:
            raise NotImplementedError(f"{field}.weights.strategy={strategy!r} is not implemented for {fmt} "
                                      f"(implemented: {', '.join(_CT_STRATEGIES[fmt])})")
        if args.get("actorder"):
            raise NotImplementedError(f"{field}.weights.actorder={args['actorder']!r} is not implemented yet")
        if kind == "float" and not args.get("symmetric", True):
            raise NotImplementedError(f"{field}.weights.symmetric=False is not implemented for float weights")
        group_size, block_out = -1, 1
        if strategy == "group":
            group_size = args.get("group_size")
            if not isinstance(group_size, int) or group_size <= 0:
                raise ValueError(f"{field}.weights.group_size must be a positive integer, got {group_size!r}")
        elif strategy == "block":
            block = args.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"{field}.weights.block_structure must be [out, in] block sizes, got {block!r}")
            block_out, group_size = block
        weights.add((fmt, args["num_bits"], group_size, block_out, act_kind))
    if len(weights) != 1:
        raise NotImplementedError("quantization_config.config_groups with different weight schemes per layer are "
                                  f"not implemented yet (got {sorted(weights)})")
    fmt, bits, group_size, block_out, act_kind = weights.pop()
    if not any("lm_head" in entry for entry in config.get("ignore") or []):
        raise NotImplementedError("a quantized lm_head is not implemented (quantization_config.ignore lacks lm_head)")
    return WeightQuant(bits=bits, group_size=group_size, method=_CT_FORMATS[fmt],
                       kind="float8" if fmt == "float-quantized" else "int", block_out=block_out,
                       activations=act_kind)


def _activation_kind(args: dict, field: str) -> str:
    """"int8" or "fp8" for dynamic, symmetric, per-token activations; NotImplementedError naming the field
    for anything else."""
    if not args.get("dynamic"):
        raise NotImplementedError(f"{field}.dynamic={args.get('dynamic')!r}: static activation scales are not "
                                  "implemented (dynamic per-token ones are)")
    if args.get("strategy") != "token":
        raise NotImplementedError(f"{field}.strategy={args.get('strategy')!r} is not implemented (implemented: "
                                  "token)")
    if not args.get("symmetric", True):
        raise NotImplementedError(f"{field}.symmetric=False is not implemented (implemented: symmetric)")
    kind = {("int", 8): "int8", ("float", 8): "fp8"}.get((args.get("type"), args.get("num_bits")))
    if kind is None:
        raise NotImplementedError(f"{field}: type={args.get('type')!r} num_bits={args.get('num_bits')!r} is not "
                                  "implemented (implemented: int or float with 8 bits)")
    return kind


def _fp8_scheme(config: dict) -> WeightQuant:
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(f"quantization_config.activation_scheme={config['activation_scheme']!r} is not "
                                  "implemented (implemented: dynamic, run weight-only)")
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise NotImplementedError(f"quantization_config.fmt={fmt!r} is not implemented (implemented: e4m3)")
    block = config.get("weight_block_size")
    if block is None:
        raise NotImplementedError("quantization_config.weight_block_size=None (per-tensor fp8 scales) is not "
                                  "implemented yet (implemented: block scales)")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [out, in] block sizes, got {block!r}")
    return WeightQuant(bits=8, group_size=block[1], method="fp8", kind="float8", block_out=block[0])


# Formats whose codes are the layer's `weight` tensor itself.
_CODES_IN_WEIGHT = ("fp8", "compressed-tensors-int8", "compressed-tensors-fp8")


def quantized_suffixes(scheme: WeightQuant) -> tuple[str, ...]:
    """Suffixes of a quantized layer's checkpoint tensors, which the loader gathers for `convert`."""
    return (*QUANT_SUFFIXES, "weight") if scheme.method in _CODES_IN_WEIGHT else QUANT_SUFFIXES


def quantize_online(kernel: np.ndarray, scheme: WeightQuant, dtype) -> dict[str, np.ndarray]:
    """A float kernel [in, out] in the layout (int8, or fp8 per output channel)."""
    if scheme.kind == "float8":
        return quantize_per_channel_float8(kernel)
    return quantize_per_channel_int8(kernel, dtype)


def convert(prefix: str, tensors: dict[str, np.ndarray], scheme: WeightQuant, in_features: int,
            out_features: int, dtype) -> dict[str, np.ndarray]:
    """One layer's checkpoint tensors (by suffix: qweight, qzeros, scales, g_idx) in the layout.

    Raises ValueError naming the tensor and the shape the config implies.
    """
    scheme.check(in_features, prefix, out_features)
    groups = scheme.num_groups(in_features)
    per_word = 32 // scheme.bits
    if scheme.method == "fp8":
        return _convert_fp8(prefix, tensors, scheme, in_features, out_features, groups)
    if scheme.method == "compressed-tensors":
        return _convert_compressed_tensors(prefix, tensors, scheme, in_features, out_features, groups, dtype)
    if scheme.method in ("compressed-tensors-int8", "compressed-tensors-fp8"):
        return _convert_compressed_codes(prefix, tensors, scheme, in_features, out_features, groups, dtype)
    if scheme.method == "awq":
        expected = {"qweight": (in_features, out_features // 8), "qzeros": (groups, out_features // 8),
                    "scales": (groups, out_features)}
    else:
        expected = {"qweight": (in_features // per_word, out_features),
                    "qzeros": (groups, out_features // per_word), "scales": (groups, out_features)}
    _check_shapes(prefix, tensors, expected, f"{scheme.method} with bits={scheme.bits}, "
                                             f"group_size={scheme.group_size}")
    scales = tensors["scales"].astype(np.float32)
    if scheme.method == "awq":
        q = _unpack_awq(tensors["qweight"])
        zeros = _unpack_awq(tensors["qzeros"]).astype(np.float32)
        return pack(q, zeros, scales, 4, dtype)
    q = _unpack_words(tensors["qweight"].view(np.uint32), scheme.bits, axis=0)
    zeros = _unpack_words(tensors["qzeros"].view(np.uint32), scheme.bits, axis=1).astype(np.float32)
    if scheme.method == "gptq":
        zeros += 1  # v1 checkpoints store zero - 1
    perm = None
    if "g_idx" in tensors and scheme.group_size != -1:
        g_idx = np.asarray(tensors["g_idx"]).astype(np.int64)
        if g_idx.shape != (in_features,) or g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"checkpoint tensor {prefix}.g_idx must be {in_features} group indices in [0, "
                             f"{groups}), got shape {g_idx.shape}")
        sequential = np.arange(in_features) // scheme.group_size
        if scheme.act_order:
            if not (np.bincount(g_idx, minlength=groups) == scheme.group_size).all():
                raise ValueError(f"checkpoint tensor {prefix}.g_idx must put exactly group_size="
                                 f"{scheme.group_size} rows in each group")
            perm = np.argsort(g_idx, kind="stable")
            q = q[perm]
        elif not (g_idx == sequential).all():
            raise ValueError(f"checkpoint tensor {prefix}.g_idx is not sequential but quantization_config."
                             "desc_act is false")
    elif scheme.act_order:
        perm = np.arange(in_features)
    return pack(q, zeros, scales, scheme.bits, dtype, perm)


def _convert_fp8(prefix, tensors, scheme, in_features, out_features, groups):
    import ml_dtypes
    expected = {"weight": (out_features, in_features),
                "weight_scale_inv": (out_features // scheme.block_out, groups)}
    _check_shapes(prefix, tensors, expected,
                  f"fp8 with weight_block_size [{scheme.block_out}, {scheme.group_rows(in_features)}]")
    weight = tensors["weight"]
    if weight.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(f"checkpoint tensor {prefix}.weight is {weight.dtype}; fp8 checkpoints hold float8_e4m3fn")
    return {"qweight": np.ascontiguousarray(weight.T), "scales": tensors["weight_scale_inv"].astype(np.float32).T}


def _convert_compressed_tensors(prefix, tensors, scheme, in_features, out_features, groups, dtype):
    per_word = 32 // scheme.bits
    expected = {"weight_packed": (out_features, in_features // per_word), "weight_scale": (out_features, groups)}
    if "weight_zero_point" in tensors:
        expected["weight_zero_point"] = (-(-out_features // per_word), groups)
    _check_shapes(prefix, tensors, expected, f"pack-quantized with num_bits={scheme.bits}, "
                                             f"group_size={scheme.group_size}")
    if "weight_shape" in tensors and tuple(int(v) for v in tensors["weight_shape"]) != (out_features, in_features):
        raise ValueError(f"checkpoint tensor {prefix}.weight_shape is {tensors['weight_shape'].tolist()}; the config "
                         f"implies {[out_features, in_features]}")
    q = _unpack_words(tensors["weight_packed"].view(np.uint32), scheme.bits, axis=1).T  # codes + offset, [in, out]
    centre = 1 << (scheme.bits - 1)
    if "weight_zero_point" in tensors:
        zeros = _unpack_words(tensors["weight_zero_point"].view(np.uint32), scheme.bits, axis=0)[:out_features]
        zeros = zeros.T.astype(np.float32)  # zero point + offset, [groups, out]: the codes' own domain
    else:
        zeros = np.full((groups, out_features), centre, np.float32)  # symmetric
    return pack(q, zeros, tensors["weight_scale"].astype(np.float32).T, scheme.bits, dtype)


def _convert_compressed_codes(prefix, tensors, scheme, in_features, out_features, groups, dtype):
    """int-quantized (int8 codes [out, in]) or float-quantized (e4m3 codes [out, in]) with weight_scale [out,
    groups] (group, channel), [out / bo, in / bi] (block) or one value (tensor: broadcast to every channel)."""
    import ml_dtypes
    float8 = scheme.kind == "float8"
    scale_cols = out_features // scheme.block_out
    scale = tensors.get("weight_scale")
    if scale is not None and scale.size == 1:  # strategy "tensor"
        tensors = {**tensors, "weight_scale": np.full((scale_cols, groups), scale.reshape(()), np.float32)}
    expected = {"weight": (out_features, in_features), "weight_scale": (scale_cols, groups)}
    if "weight_zero_point" in tensors and not float8:
        zero = tensors["weight_zero_point"]
        if zero.size == 1:
            tensors = {**tensors, "weight_zero_point": np.full((out_features, groups), zero.reshape(()), np.int8)}
        expected["weight_zero_point"] = (out_features, groups)
    fmt = "float-quantized" if float8 else "int-quantized"
    _check_shapes(prefix, tensors, expected, f"{fmt} with group_size={scheme.group_size}, block_out={scheme.block_out}")
    weight = tensors["weight"]
    want = np.dtype(ml_dtypes.float8_e4m3fn) if float8 else np.dtype(np.int8)
    if weight.dtype != want:
        raise ValueError(f"checkpoint tensor {prefix}.weight is {weight.dtype}; {fmt} checkpoints hold {want}")
    scales = tensors["weight_scale"].astype(np.float32).T  # [groups, out / bo]
    if float8:
        return {"qweight": np.ascontiguousarray(weight.T), "scales": scales}
    zero = tensors.get("weight_zero_point")
    zeros = (zero.astype(np.float32).T if zero is not None else np.zeros((groups, out_features), np.float32)) + 128
    return pack(weight.T.astype(np.int16) + 128, zeros, scales, 8, dtype)


def _check_shapes(prefix: str, tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]],
                  scheme_text: str) -> None:
    """ValueError naming the first tensor of `expected` that is missing or misshaped."""
    for suffix, shape in expected.items():
        if suffix not in tensors:
            raise ValueError(f"checkpoint lacks {prefix}.{suffix} ({scheme_text}: expected shape {shape})")
        if tuple(tensors[suffix].shape) != shape:
            raise ValueError(f"checkpoint tensor {prefix}.{suffix} has shape {tuple(tensors[suffix].shape)}; "
                             f"{scheme_text} and this config imply {shape}")


def _unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint32 words -> their bits-wide values, value j of each word at bit offset bits * j, expanded along
    `axis` (word w's values become entries w * (32 / bits) + j)."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(words.shape[0] * per_word, words.shape[1]).astype(np.uint8)
    values = (words[:, :, None] >> shifts[None, None, :]) & mask
    return values.reshape(words.shape[0], words.shape[1] * per_word).astype(np.uint8)


def _unpack_awq(words: np.ndarray) -> np.ndarray:
    nibbles = _unpack_words(words.view(np.uint32), 4, axis=1).reshape(words.shape[0], -1, 8)
    return nibbles[:, :, _AWQ_REORDER].reshape(words.shape[0], -1)

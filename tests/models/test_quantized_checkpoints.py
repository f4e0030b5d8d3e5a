"""Quantized checkpoints (GPTQ, AWQ) and online int8 against transformers running the dequantized weights.

The checkpoints are written here by packers that follow each format's public description (AutoGPTQ's
"gptq" layout, AutoAWQ's "gemm" layout), independently of the engine's unpacking; transformers then runs the
float weights those codes stand for (the same math: dequantize, then a float32 matmul), and the engine must
give the same greedy tokens from the packed files.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged import LLM, SamplingParams
from tests.hf_checkpoints import build_checkpoint, hf_greedy, model_greedy

PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 7], [11, 12, 13, 14, 15, 16, 17, 18], [300, 2, 250]]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
          "w1", "w2", "w3")  # Mixtral's experts
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of a word holds column AWQ_ORDER[k]


def _asymmetric_codes(w_in_out: np.ndarray, bits: int, groups: np.ndarray, num_groups: int, rng):
    """Per-group min/max codes of w [in, out]; groups[i] is row i's group. Returns q [in, out], zeros and
    scales [num_groups, out] (scales rounded to float16, as checkpoints store them)."""
    levels = (1 << bits) - 1
    zeros = np.zeros((num_groups, w_in_out.shape[1]))
    scales = np.zeros((num_groups, w_in_out.shape[1]))
    for g in range(num_groups):
        rows = w_in_out[groups == g]
        lo, hi = rows.min(0), rows.max(0)
        scales[g] = np.maximum(hi - lo, 1e-3) / levels
        # Zero points of 1 or more: GPTQ's v1 format stores zero - 1, which cannot hold 0 (AutoGPTQ's own limit).
        zeros[g] = np.clip(np.round(-lo / scales[g]) + rng.integers(-1, 2, size=lo.shape), 1, levels)
    scales = scales.astype(np.float16).astype(np.float64)
    q = np.clip(np.round(w_in_out / scales[groups]) + zeros[groups], 0, levels).astype(np.int64)
    return q, zeros.astype(np.int64), scales


def _pack_along(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words holding 32 / bits values each along `axis`, value j at bit offset bits * j."""
    per_word = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, 0)
    v = v.reshape(v.shape[0] // per_word, per_word, *v.shape[1:])
    words = np.zeros(v.shape[:1] + v.shape[2:], np.uint64)
    for j in range(per_word):
        words |= v[:, j] << np.uint64(bits * j)
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), 0, axis))


def _gptq_layer(w_out_in, bits, group_size, desc_act, rng):
    """GPTQ "gptq" (v1) tensors and the float weight [out, in] they decode to."""
    w = w_out_in.T.astype(np.float64)
    in_features = w.shape[0]
    gs = in_features if group_size == -1 else group_size
    num_groups = in_features // gs
    order = rng.permutation(in_features) if desc_act else np.arange(in_features)
    g_idx = np.empty(in_features, np.int64)
    g_idx[order] = np.arange(in_features) // gs  # desc_act: groups follow a permutation of the rows
    q, zeros, scales = _asymmetric_codes(w, bits, g_idx, num_groups, rng)
    tensors = {"qweight": _pack_along(q, bits, 0), "qzeros": _pack_along(zeros - 1, bits, 1),
               "scales": scales.astype(np.float16), "g_idx": g_idx.astype(np.int32)}
    dequantized = scales[g_idx] * (q - zeros[g_idx])
    return tensors, dequantized.T.astype(np.float32)


def _awq_layer(w_out_in, group_size, rng):
    w = w_out_in.T.astype(np.float64)
    in_features, out_features = w.shape
    groups = np.arange(in_features) // group_size
    q, zeros, scales = _asymmetric_codes(w, 4, groups, in_features // group_size, rng)

    def pack(values):  # [rows, out] -> int32 [rows, out / 8], AWQ's interleaved nibble order
        v = values.astype(np.uint64).reshape(values.shape[0], out_features // 8, 8)
        words = np.zeros(v.shape[:2], np.uint64)
        for k, column in enumerate(AWQ_ORDER):
            words |= v[:, :, column] << np.uint64(4 * k)
        return words.astype(np.uint32).view(np.int32)

    tensors = {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales.astype(np.float16)}
    return tensors, (scales[groups] * (q - zeros[groups])).T.astype(np.float32)


def _write_quantized(float_dir, out_dir, ref_dir, layer_fn, quantization_config, drop=()):
    """The quantized checkpoint (out_dir) and the float checkpoint of its dequantized weights (ref_dir)."""
    rng = np.random.default_rng(0)
    for d in (out_dir, ref_dir):
        shutil.copytree(float_dir, d, dirs_exist_ok=True)
    weights = load_file(os.path.join(float_dir, "model.safetensors"))
    packed, reference = {}, {}
    for name, tensor in weights.items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in LINEAR:
            tensors, dequantized = layer_fn(tensor, rng)
            prefix = name[:-len(".weight")]
            packed.update({f"{prefix}.{k}": v for k, v in tensors.items() if k not in drop})
            reference[name] = dequantized
        else:
            packed[name] = reference[name] = tensor
    # safetensors writes an array's buffer as it lies: transposed views must be made contiguous first.
    save_file({k: np.ascontiguousarray(v) for k, v in packed.items()}, os.path.join(out_dir, "model.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in reference.items()}, os.path.join(ref_dir, "model.safetensors"))
    config = json.loads(open(os.path.join(float_dir, "config.json")).read())
    config["quantization_config"] = quantization_config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir, ref_dir


def _greedy(model_dir, **options):
    llm = LLM(model_dir, dtype="float32", block_size=8, max_model_len=64, show_progress=False, **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-tied"])
def float_dir(request, tmp_path_factory):
    return build_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


GPTQ_CASES = [(4, 32, True), (4, -1, False), (8, 16, True), (8, 32, False)]


@pytest.mark.parametrize("bits, group_size, desc_act", GPTQ_CASES)
def test_gptq_matches_transformers_on_the_dequantized_weights(float_dir, tmp_path, bits, group_size, desc_act):
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": False,
              "checkpoint_format": "gptq"}
    quantized, reference = _write_quantized(
        float_dir, tmp_path / "q", tmp_path / "ref",
        lambda w, rng: _gptq_layer(w, bits, group_size, desc_act, rng), config)
    tokens, engine = _greedy(str(quantized))
    assert tokens == hf_greedy(str(reference), PROMPTS, 12)
    assert engine.model_config.weight_quant.bits == bits
    assert engine.weight_bytes["int8" if bits == 8 else "uint8"] > 0


@pytest.mark.parametrize("name", ["mixtral-moe", "qwen2-moe"])
def test_gptq_mixture_of_experts(name, tmp_path):
    """Every expert's projections (and Qwen2-MoE's shared expert) in GPTQ 4-bit with act order; the routers
    stay float, as GPTQ leaves them."""
    float_dir = build_checkpoint(name, str(tmp_path / name))
    config = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False}
    quantized, reference = _write_quantized(float_dir, tmp_path / "q", tmp_path / "ref",
                                            lambda w, rng: _gptq_layer(w, 4, 16, True, rng), config)
    tokens, engine = _greedy(str(quantized))
    assert tokens == hf_greedy(str(reference), PROMPTS, 12)
    experts = engine.worker.runner.params["layers"][0]["mlp"]["experts_gate_proj"]
    assert set(experts) == {"qweight", "scales", "zero_offsets", "perm"} and experts["qweight"].shape[0] == 4


def test_gptq_mutations_are_caught(float_dir, tmp_path):
    """Reading the zero points without GPTQ's +1, or ignoring g_idx, must change the tokens: the comparison
    above is sensitive to both."""
    config = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False}
    quantized, reference = _write_quantized(
        float_dir, tmp_path / "q", tmp_path / "ref", lambda w, rng: _gptq_layer(w, 4, 16, True, rng), config)
    want = hf_greedy(str(reference), PROMPTS, 12)
    assert _greedy(str(quantized))[0] == want
    no_offset = json.loads((quantized / "config.json").read_text())
    no_offset["quantization_config"]["checkpoint_format"] = "gptq_v2"  # zeros read as stored: no +1
    (quantized / "config.json").write_text(json.dumps(no_offset))
    assert _greedy(str(quantized))[0] != want
    no_g_idx, _ = _write_quantized(float_dir, tmp_path / "q2", tmp_path / "ref2",
                                   lambda w, rng: _gptq_layer(w, 4, 16, True, rng), config, drop=("g_idx",))
    assert _greedy(str(no_g_idx))[0] != want


def test_awq_matches_transformers_and_its_nibble_order_matters(float_dir, tmp_path, monkeypatch):
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
    quantized, reference = _write_quantized(float_dir, tmp_path / "q", tmp_path / "ref",
                                            lambda w, rng: _awq_layer(w, 32, rng), config)
    want = hf_greedy(str(reference), PROMPTS, 12)
    assert _greedy(str(quantized))[0] == want
    import paged.models.quantized_checkpoints as formats
    monkeypatch.setattr(formats, "_AWQ_REORDER", np.arange(8))  # columns read in storage order
    assert _greedy(str(quantized))[0] != want


def _online_reference(float_dir, ref, round_trip):
    """The float checkpoint with every projection weight [out, in] replaced by round_trip(weight)."""
    shutil.copytree(float_dir, ref)
    weights = load_file(os.path.join(float_dir, "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR:
            weights[name] = round_trip(w).astype(np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.path.join(ref, "model.safetensors"))
    return str(ref)


def test_online_int8_matches_per_channel_round_to_nearest(float_dir, tmp_path):
    def round_trip(w):
        scale = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True) / 127  # per output row of [out, in]
        return np.round(w / scale) * scale

    tokens, engine = _greedy(float_dir, quantization="int8")
    assert tokens == hf_greedy(_online_reference(float_dir, tmp_path / "ref", round_trip), PROMPTS, 12)
    assert engine.model_config.weight_quant.method == "int8" and engine.weight_bytes["int8"] > 0


def test_online_w8a8_matches_the_librarys_dynamic_activations_on_rounded_weights(float_dir, tmp_path, monkeypatch):
    """quantization="w8a8": int8 weights per output channel (as "int8") and int8 activations per token. The
    reference: transformers on the round-tripped weights, with compressed-tensors' own dynamic per-token int8
    quantization of every projection's input (its forward wrapper); without it the tokens must differ. Both
    CPU routes: these small steps take the weight-only path, and every step the integer matmul when its row
    threshold is lowered to 1 (where the build has AVX-512 VNNI); on a CPU with AMX-INT8, the layers held for
    its tiles, every step through them."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors needs torch (Python 3.11 here)")
    import torch
    import transformers
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    def round_trip(w):
        scale = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True) / 127  # per output row of [out, in]
        return np.round(w / scale) * scale

    reference = _online_reference(float_dir, tmp_path / "ref", round_trip)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    activations = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], input_activations=activations)}, ignore=["lm_head"]))
    # Each step recomputes the whole sequence (no KV cache): quantizing activations turns the last-bit
    # differences between transformers' cached and uncached passes into different codes, which flipped a near
    # tie (0.009 nats) on one host; the uncached pass is the computation itself.
    want = model_greedy(model, PROMPTS, 12, eos_token_id=None, use_cache=False)
    from paged.kernels import cpu
    amx_calls = []
    real_amx = cpu.w8a8_matmul_packed_cpu
    monkeypatch.setattr(cpu, "w8a8_matmul_packed_cpu", lambda *a, **k: amx_calls.append(1) or real_amx(*a, **k))
    tokens, engine = _greedy(float_dir, quantization="w8a8")
    assert tokens == want
    assert bool(amx_calls) == cpu.w8a8_on_amx()  # with AMX-INT8, the layers were held for its tiles
    assert tokens != _greedy(float_dir, quantization="int8")[0]  # the activations' quantization shows
    monkeypatch.setattr(cpu, "w8a8_on_amx", lambda: False)  # the routes of a CPU without it
    if cpu.int8_matmul_is_vectorized():
        calls = []
        real = cpu.w8a8_matmul_cpu
        monkeypatch.setattr(cpu, "w8a8_matmul_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
        monkeypatch.setattr(cpu, "INT8_MATMUL_MIN_ROWS", 1)
        assert _greedy(float_dir, quantization="w8a8")[0] == want and calls
    scheme = engine.model_config.weight_quant
    assert scheme.method == "w8a8" and scheme.activations == "int8" and engine.weight_bytes["int8"] > 0


@pytest.mark.parametrize("group_size", [64, -1])
def test_int4_layers_of_bfloat16_models_run_on_amx_tiles(float_dir, tmp_path, monkeypatch, group_size):
    """On a CPU with AMX-INT8, a bfloat16 model's GPTQ int4 layers (groups of 64 rows, or one per column) load
    packed for the AMX tiles and run there, the gated MLP in one call (decode-sized steps on the int8 tiles,
    prompt-sized ones against the weights dequantized to bfloat16). Their first tokens' log-probabilities stay
    within twice the distance bfloat16 itself puts between the float32 model (which the tests above hold to
    transformers) and the dequantized weights run in bfloat16: on this tiny random model that distance is
    0.06-0.09 nats, so greedy sequences part at near ties and are compared only where the winner is clear."""
    from paged.kernels import cpu
    if not cpu.int4_on_amx():
        pytest.skip("no AMX-INT8 tiles here")
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}
    quantized, dequantized = _write_quantized(float_dir, tmp_path / "q", tmp_path / "ref",
                                              lambda w, rng: _gptq_layer(w, 4, group_size, False, rng), config)
    calls = []
    for name in ("int4_matmul_packed_cpu", "int4_gated_matmul_packed_cpu"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))

    def first_logprobs(model_dir, dtype):
        llm = LLM(str(model_dir), dtype=dtype, block_size=8, max_model_len=64, show_progress=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outputs]

    on_tiles = first_logprobs(quantized, "bfloat16")
    assert set(calls) == {"int4_matmul_packed_cpu", "int4_gated_matmul_packed_cpu"}
    calls.clear()
    float32, rounded = first_logprobs(quantized, "float32"), first_logprobs(dequantized, "bfloat16")
    assert not calls

    def distance(got):
        return max(abs(g[t] - want[t]) for g, want in zip(got, float32) for t in want.keys() & g.keys())

    assert distance(on_tiles) < 2 * distance(rounded), (distance(on_tiles), distance(rounded))
    for got, want in zip(on_tiles, float32):
        first, second = sorted(want.values(), reverse=True)[:2]
        if first - second > 0.3:  # a clear winner is the greedy token on the tiles too
            assert max(got, key=got.get) == max(want, key=want.get)


def test_quantized_weights_take_a_fraction_of_the_bfloat16_bytes(tmp_path):
    """Layers of realistic width (group 128): int4 at most 0.3x and int8 at most 0.55x of bf16, scales and zero
    points included (the embeddings and norms stay bf16 and are left out of the ratio)."""
    from paged.models.tiny import create_tiny_llama
    float_dir = create_tiny_llama(str(tmp_path / "wide"), hidden_size=512, intermediate_size=1024, num_layers=1,
                                  num_heads=8, num_kv_heads=8)
    quantized, _ = _write_quantized(float_dir, tmp_path / "q", tmp_path / "ref",
                                    lambda w, rng: _gptq_layer(w, 4, 128, False, rng),
                                    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})

    def layer_bytes(engine):
        import jax
        layers = engine.worker.runner.params["layers"]
        return sum(leaf.nbytes for path, leaf in jax.tree_util.tree_flatten_with_path(layers)[0]
                   if any(getattr(p, "key", None) in LINEAR for p in path))

    options = dict(dtype="bfloat16", block_size=8, max_model_len=64, show_progress=False)
    bf16 = layer_bytes(LLM(float_dir, **options).engine)
    int4 = layer_bytes(LLM(str(quantized), **options).engine)
    int8 = layer_bytes(LLM(float_dir, quantization="int8", **options).engine)
    assert int4 <= 0.3 * bf16 and int8 <= 0.55 * bf16, (int4 / bf16, int8 / bf16)


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, "quantization_config.bits=3"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({"group_size": 48}, "group_size 48"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
])
def test_unsupported_or_inconsistent_configs_fail_before_loading(float_dir, tmp_path, change, message):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, **change}
    quantized, _ = _write_quantized(float_dir, tmp_path / "q", tmp_path / "ref",
                                    lambda w, rng: _gptq_layer(w, 4, 32, False, rng), config)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        LLM(str(quantized), show_progress=False)


def test_misshaped_scales_name_the_tensor(float_dir, tmp_path):
    def bad_scales(w, rng):
        tensors, dequantized = _gptq_layer(w, 4, 32, False, rng)
        tensors["scales"] = tensors["scales"][:, :-1]
        return tensors, dequantized

    quantized, _ = _write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", bad_scales,
                                    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False})
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\w+\.\w+_proj\.scales has shape"):
        LLM(str(quantized), show_progress=False)


def _save_compressed(model, fmt: str, float_dir: str, out):
    """Compresses the calibrated model with compressed-tensors' own compressor and saves it, with the float
    checkpoint's tokenizer, to `out`; returns the compressor (to decompress the model for the reference)."""
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for name in os.listdir(float_dir):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(float_dir, name), out)
    return compressor


@pytest.mark.parametrize("bits, strategy, symmetric", [(4, "group", False), (4, "channel", True),
                                                       (8, "channel", True), (8, "group", False)])
def test_compressed_tensors_checkpoints_written_by_the_library_itself(float_dir, tmp_path, monkeypatch, bits,
                                                                      strategy, symmetric):
    """llm-compressor's format, written by compressed-tensors' own compressor (pack-quantized); the reference
    is the same model decompressed by the library and run by transformers."""
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors needs torch (Python 3.11 here)")
    import torch
    import transformers
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    del ct
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, symmetric=symmetric,
                            group_size=16 if strategy == "group" else None)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):  # min/max calibration of the weights, as llm-compressor's
            w = module.weight.data
            grouped = w.unflatten(-1, (w.shape[-1] // 16, 16)) if strategy == "group" else w.unsqueeze(1)
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    out = tmp_path / "ct"
    compressor = _save_compressed(model, "pack-quantized", float_dir, out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"

    compressor.decompress_model(model)
    want = model_greedy(model, PROMPTS, 12, eos_token_id=None)
    tokens, engine = _greedy(str(out))
    assert tokens == want
    assert engine.model_config.weight_quant.method == "compressed-tensors"
    from paged.kernels import cpu
    if bits == 4 and strategy == "channel" and cpu.int4_on_amx():
        # In bfloat16 on a CPU with AMX-INT8 the per-channel codes load packed for the tiles (their shape read
        # from the checkpoint's weight_shape): the first token's log-probabilities stay within twice the
        # distance bfloat16 puts between the decompressed model in float32 and in bfloat16.
        calls = []
        real = cpu.int4_matmul_packed_cpu
        monkeypatch.setattr(cpu, "int4_matmul_packed_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
        options = dict(block_size=8, max_model_len=64, show_progress=False)
        first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

        def logprobs(llm):
            return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}
                    for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], first, use_tqdm=False)]

        on_tiles = logprobs(LLM(str(out), dtype="bfloat16", **options))
        assert calls
        decompressed = tmp_path / "decompressed"  # the float checkpoint with the library's decompressed weights
        shutil.copytree(float_dir, decompressed)
        from safetensors.torch import save_file as save_torch
        weights = {k: v.contiguous().clone() for k, v in model.state_dict().items() if k.endswith((".weight", ".bias"))}
        save_torch(weights, str(decompressed / "model.safetensors"))
        float32, rounded = (logprobs(LLM(str(decompressed), dtype=d, **options)) for d in ("float32", "bfloat16"))

        def distance(got):
            return max(abs(g[t] - want[t]) for g, want in zip(got, float32) for t in want.keys() & g.keys())

        assert distance(on_tiles) < 2 * distance(rounded), (distance(on_tiles), distance(rounded))


# (format, weight args, dynamic input activations): W8A8 int8, W8 int8 per group with zero points, and FP8 per
# channel (FP8_DYNAMIC), per tensor and per block.
CODE_CASES = [
    ("int-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True), True),
    ("int-quantized", dict(num_bits=8, type="int", strategy="group", group_size=16, symmetric=False), False),
    ("float-quantized", dict(num_bits=8, type="float", strategy="channel", symmetric=True), True),
    ("float-quantized", dict(num_bits=8, type="float", strategy="tensor", symmetric=True), True),
    ("float-quantized", dict(num_bits=8, type="float", strategy="block", block_structure=[16, 32],
                             symmetric=True), False),
]


@pytest.mark.parametrize("fmt, weight_args, dynamic_inputs", CODE_CASES,
                         ids=["w8a8-int8", "w8-int8-group-asym", "fp8-dynamic", "fp8-tensor", "fp8-block"])
def test_compressed_tensors_int8_and_fp8_codes_written_by_the_library_itself(float_dir, tmp_path, fmt,
                                                                             weight_args, dynamic_inputs):
    """int-quantized and float-quantized checkpoints, written by compressed-tensors' own compressor. The
    reference is the library's own model, decompressed and run by transformers: its forward quantizes the
    activations per token where the scheme asks (W8A8), as the engine must."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors needs torch (Python 3.11 here)")
    import torch
    import transformers
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    args = QuantizationArgs(**weight_args)
    inputs = QuantizationArgs(num_bits=8, type=weight_args["type"], strategy="token", dynamic=True,
                              symmetric=True) if dynamic_inputs else None
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=inputs)}, ignore=["lm_head"]))
    for module in model.modules():
        if not hasattr(module, "quantization_scheme"):
            continue
        w = module.weight.data  # min/max calibration of the weights, as llm-compressor's default observer
        strategy = weight_args["strategy"]
        if strategy == "group":
            lo, hi = (f(w.unflatten(-1, (-1, 16)), -1) for f in (torch.amin, torch.amax))
        elif strategy == "block":
            bo, bi = weight_args["block_structure"]
            blocks = w.reshape(w.shape[0] // bo, bo, w.shape[1] // bi, bi)
            lo, hi = (f(blocks, (1, 3)) for f in (torch.amin, torch.amax))
        elif strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    out = tmp_path / "ct"
    compressor = _save_compressed(model, fmt, float_dir, out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == fmt

    compressor.decompress_model(model)
    # The same decoded weights in a plain model (no activation quantization): W8A8's reference must differ.
    weights_only = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    weights_only.load_state_dict({k: v for k, v in model.state_dict().items() if k.endswith(".weight")},
                                 strict=False)
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        differs = not torch.equal(model(ids).logits, weights_only(ids).logits)
    assert differs == dynamic_inputs
    want = model_greedy(model, PROMPTS, 12, eos_token_id=None)
    tokens, engine = _greedy(str(out))
    assert tokens == want
    bytes_ = engine.weight_bytes
    assert bytes_.get("int8" if fmt == "int-quantized" else "float8_e4m3fn", 0) > 0


def test_static_activation_scales_are_refused_by_name(float_dir, tmp_path):
    config = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized",
                                            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                                            "input_activations": {"num_bits": 8, "type": "int", "dynamic": False,
                                                                  "strategy": "tensor"}}}}
    out = tmp_path / "w8a8-static"
    shutil.copytree(float_dir, out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(NotImplementedError, match=r"config_groups\.group_0\.input_activations\.dynamic"):
        LLM(str(out), show_progress=False)


def _write_fp8(float_dir, out_dir, ref_dir, block):
    """An HF "fp8" checkpoint (float8_e4m3fn weights, weight_scale_inv per [out, in] block), written with torch's
    float8 dtype as the FP8 releases are, and the float checkpoint of the weights it decodes to."""
    import ml_dtypes
    import torch
    from safetensors.torch import save_file as save_torch
    for d in (out_dir, ref_dir):
        shutil.copytree(float_dir, d, dirs_exist_ok=True)
    weights = load_file(os.path.join(float_dir, "model.safetensors"))
    packed, reference = {}, {}
    for name, w in weights.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR:
            out_f, in_f = w.shape
            blocks = np.abs(w).reshape(out_f // block[0], block[0], in_f // block[1], block[1]).max(axis=(1, 3))
            scale = (blocks / 448.0).astype(np.float32)
            full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)
            codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
            packed[name] = torch.from_numpy(np.ascontiguousarray(codes).view(np.uint8)).view(torch.float8_e4m3fn)
            packed[name[:-len("weight")] + "weight_scale_inv"] = torch.from_numpy(scale)
            reference[name] = torch.from_numpy((codes.astype(np.float32) * full).astype(np.float32))
        else:
            packed[name] = reference[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_torch(packed, os.path.join(out_dir, "model.safetensors"))
    save_torch(reference, os.path.join(ref_dir, "model.safetensors"))
    config = json.loads(open(os.path.join(float_dir, "config.json")).read())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir, ref_dir


def test_fp8_block_checkpoints_match_transformers_on_the_dequantized_weights(float_dir, tmp_path):
    quantized, reference = _write_fp8(float_dir, tmp_path / "q", tmp_path / "ref", (32, 16))
    tokens, engine = _greedy(str(quantized))
    assert tokens == hf_greedy(str(reference), PROMPTS, 12)
    assert engine.model_config.weight_quant.kind == "float8" and engine.weight_bytes["float8_e4m3fn"] > 0


def test_online_fp8_matches_per_channel_e4m3(float_dir, tmp_path):
    import ml_dtypes

    def round_trip(w):
        scale = (np.abs(w).max(axis=1, keepdims=True) / 448.0).astype(np.float32)  # per output row of [out, in]
        return (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale

    tokens, engine = _greedy(float_dir, quantization="fp8")
    assert tokens == hf_greedy(_online_reference(float_dir, tmp_path / "ref", round_trip), PROMPTS, 12)
    assert engine.model_config.weight_quant.method == "fp8-online"


def test_fp8_with_static_activation_scales_is_refused(float_dir, tmp_path):
    quantized, _ = _write_fp8(float_dir, tmp_path / "q", tmp_path / "ref", (32, 16))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="activation_scheme='static'"):
        LLM(str(quantized), show_progress=False)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_activation_quantization_is_the_libraries_bit_for_bit(kind):
    """W8A8's dynamic per-token quantize-dequantize, jitted, against compressed-tensors' own forward_quantize
    on the same float32 rows (rows whose largest value sits exactly on a rounding boundary included)."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors needs torch (Python 3.11 here)")
    import jax
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    from paged.models.quantization import quantize_activations
    x = (np.random.default_rng(3).normal(size=(1, 300, 64)) * 3).astype(np.float32)
    args = QuantizationArgs(num_bits=8, type="int" if kind == "int8" else "float", strategy="token", dynamic=True,
                            symmetric=True)
    module = torch.nn.Linear(64, 64)
    module.quantization_status = None
    want = forward_quantize(module, torch.tensor(x), "input", args).numpy()[0]
    got = np.asarray(jax.jit(lambda v: quantize_activations(v, kind))(x[0]))
    np.testing.assert_array_equal(got, want)

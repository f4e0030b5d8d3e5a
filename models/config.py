"""Model configuration read from a Hugging Face `config.json` (transformers 4 and 5 spellings)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from paged.models.quantization import WeightQuant


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Rope types whose frequencies depend on the sequence's length (transformers recomputes them per forward).
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the ramp between extrapolated and interpolated frequencies, and the cos/sin scale (the attention
    # factor, given or derived from factor, mscale and mscale_all_dim as transformers derives it).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # Dynamic NTK: the length past which the base grows (the checkpoint's max_position_embeddings).
    max_position_embeddings: int = 2048
    # LongRoPE (Phi-3 128k): per-frequency divisors for sequences up to / past original_max_position_embeddings.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @property
    def length_dependent(self) -> bool:
        """Whether a token's frequencies depend on its sequence's length (dynamic NTK, LongRoPE)."""
        return self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES

    def length_class(self, prompt_len: int) -> str | None:
        """What a prompt of this length rotates its tokens with, when that differs from the base frequencies
        (None: the base): requests whose prompts differ here must not share cached K/V."""
        if self.rope_type == "dynamic" and prompt_len > self.max_position_embeddings:
            return f"dynamic:{prompt_len}"
        if self.rope_type == "longrope" and prompt_len > self.original_max_position_embeddings:
            return "longrope:long"
        return None

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (1 except for YaRN and LongRoPE)."""
        if self.rope_type == "longrope":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale_of(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale_of(self.factor, self.mscale) / mscale_of(self.factor, self.mscale_all_dim))
        return mscale_of(self.factor)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float32 [head_dim // 2], computed as transformers does (float32 powers of theta). For a
        length-dependent rope: the frequencies of sequences no longer than its threshold (dynamic: the base;
        LongRoPE: the short factors); `models.layers.rotary_cos_sin_by_length` computes the others."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv_freq = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.rope_type in ("default", "dynamic"):
            return inv_freq
        if self.rope_type == "longrope":
            return self.longrope_inv_freq(head_dim, long=False)
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            return _llama3_inv_freq(self, inv_freq)
        if self.rope_type == "yarn":
            return _yarn_inv_freq(self, inv_freq, head_dim)
        raise NotImplementedError(
            f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


    def longrope_inv_freq(self, head_dim: int, long: bool) -> np.ndarray:
        """float32 [head_dim // 2]: 1 / (factor_i * theta ** (2i / head_dim)) with the short or long factors."""
        factors = self.long_factor if long else self.short_factor
        if factors is None or len(factors) != head_dim // 2:
            raise ValueError(f"longrope needs {head_dim // 2} {'long' if long else 'short'}_factor values (one per "
                             f"rotary frequency), got {None if factors is None else len(factors)}")
        shape = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        return (np.float32(1.0) / (np.asarray(factors, np.float32) * np.float32(self.theta) ** shape)).astype(
            np.float32)


def _yarn_inv_freq(rope: RopeConfig, inv_freq: np.ndarray, dim: int) -> np.ndarray:
    # YaRN (arXiv 2309.00071): frequencies that turn many times over the original context keep their value
    # (extrapolation), slow ones are divided by `factor` (interpolation), and a linear ramp over the dimensions
    # between beta_fast and beta_slow rotations blends the two. float32 as transformers computes it.
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a width
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32)
                                            / np.float32(dim))).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def _llama3_inv_freq(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and interpolates in between.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the Flax models need to know, independent of the HF spelling it came from."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    local_rope: RopeConfig | None = None  # Gemma 3: sliding-window layers use their own rotary base
    rotary_dim: int = 0  # leading dims of each head that rotate (0: all); GLM rotates half
    rotary_interleaved: bool = False  # rotate (x0, x1), (x2, x3), ... pairs (GLM) instead of the two halves
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary (Qwen3)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Per-layer sliding windows (0 = full attention); empty when no layer slides.
    layer_windows: tuple[int, ...] = ()
    # Gemma 2/3 family: RMSNorm scales by (1 + weight); embeddings times sqrt(hidden); norms around attention and
    # MLP outputs; scores scaled by query_pre_attn_scalar ** -0.5; tanh soft caps on scores and logits.
    norm_plus_one: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    # Sparse MoE (Mixtral, Qwen2-MoE, Qwen3-MoE); num_experts = 0 means a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    # How the linear layers are held quantized (models/quantization.py); set by the loader, None: float.
    weight_quant: "WeightQuant | None" = None
    # LoRA slots in every adapted projection (q/k/v/o, gate/up/down) and the rank they are padded to (set by
    # the loader when LoRA is enabled; 0: no slots).
    lora_slots: int = 0
    lora_rank: int = 0
    # Rows of the embedding and LM head when tensor parallelism pads the vocabulary to a multiple of the mesh
    # (set by the loader; 0: vocab_size). The padding rows are zeros and their logits are dropped, so every
    # device holds 1 / N of the tables instead of all of them replicated.
    padded_vocab_size: int = 0
    # The attention layers hold the checkpoint's per-layer k_scale / v_scale, for an fp8 KV pool (set by the
    # loader when the pool is fp8 and the checkpoint has them; otherwise the pool stores K/V with scale 1.0).
    kv_scales: bool = False
    # Copies of each checkpoint KV head (tensor parallelism over more devices than KV heads; set by the loader):
    # num_kv_heads counts the copies, the checkpoint holds num_kv_heads / kv_head_replicas.
    kv_head_replicas: int = 1
    # Encoders (BERT, XLM-RoBERTa): bidirectional attention within each sequence, no KV cache; learned
    # absolute positions starting at `position_offset` (XLM-RoBERTa's padding_idx + 1), `type_vocab_size`
    # token-type rows (segment A / B of a pair).
    encoder_only: bool = False
    position_offset: int = 0
    type_vocab_size: int = 0
    # A sequence-classification head's labels (id2label order); empty without one.
    labels: tuple[str, ...] = ()
    # A causal LM read as a classifier (Qwen3-Reranker, through hf_overrides as vLLM takes it): its head is the
    # LM head's rows of these tokens; with `two_way_softmax` one label scored as the softmax of the second
    # token against the first (the LM's p("yes") over "no" and "yes").
    classifier_from_tokens: tuple[str, ...] = ()
    two_way_softmax: bool = False
    classifier_token_ids: tuple[int, ...] = ()  # those tokens' ids (set by the loader, from the tokenizer)

    @property
    def rope_recompute_len(self) -> int | None:
        """The sequence length at which a sequence recomputes all its K/V with the long frequencies (None: never).
        Phi-3's LongRoPE does (transformers' Phi3ForCausalLM drops its cache when a sequence first reaches
        original_max_position_embeddings + 1 tokens, so every key is rotated the long way from then on);
        other models keep the keys they computed."""
        if self.rope.rope_type == "longrope" and self.model_type in ("phi3", "phimoe"):
            return self.rope.original_max_position_embeddings + 1
        return None

    @property
    def max_context_len(self) -> int:
        """The longest context its rope supports, as vLLM derives it: YaRN's original length x factor; linear
        and dynamic scale max_position_embeddings by their factor; the rest (llama3, LongRoPE, Gemma 3, whose
        configs already state the scaled length) max_position_embeddings."""
        rope = self.rope
        if self.local_rope is not None or rope.factor <= 1:
            return self.max_position_embeddings
        if rope.rope_type == "yarn":
            return max(self.max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
        if rope.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * rope.factor)
        return self.max_position_embeddings

    @property
    def vocab_rows(self) -> int:
        """Rows the embedding and LM head tables hold (the vocabulary, padded under tensor parallelism)."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from_hf(raw: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    # transformers 5 folds theta and scaling into `rope_parameters` (per layer type for Gemma 3); transformers
    # 4 uses `rope_theta` plus an optional `rope_scaling` dict whose type key is "rope_type" or "type".
    params = dict(raw.get("rope_parameters") or {})
    if layer_type in params or "full_attention" in params:
        params = dict(params.get(layer_type) or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in (*SUPPORTED_ROPE_TYPES, "su"):
        raise NotImplementedError(
            f"rope scaling {rope_type!r} is not supported yet; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "su":  # Phi-3's first spelling of LongRoPE
        rope_type = "longrope"
    original = int(merged.get("original_max_position_embeddings",
                              raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))))
    factor = merged.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):  # DeepSeek-V3's, Phi-3's: the lengths' ratio
        factor = raw.get("max_position_embeddings", original) / original
    factors = lambda key: None if merged.get(key) is None else tuple(float(f) for f in merged[key])  # noqa: E731
    optional = lambda key: None if merged.get(key) is None else float(merged[key])  # noqa: E731
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        short_factor=factors("short_factor"),
        long_factor=factors("long_factor"),
    )


def _local_rope_from_hf(raw: dict[str, Any]) -> RopeConfig | None:
    """Gemma 3's sliding layers: `rope_parameters["sliding_attention"]` (transformers 5) or
    `rope_local_base_freq` without scaling (transformers 4)."""
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:
        local = _rope_from_hf(raw, "sliding_attention")
        if local.length_dependent:
            raise NotImplementedError(f"a {local.rope_type!r} rope on the sliding layers is not supported yet")
        return local
    if "rope_local_base_freq" in raw:
        return RopeConfig(theta=float(raw["rope_local_base_freq"]))
    return None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _moe_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Mixtral: num_local_experts over intermediate_size, always renormalised; Qwen MoE: its own names."""
    # transformers 5 writes num_local_experts for Qwen3-MoE too (an attribute alias of num_experts).
    num_experts = raw.get("num_local_experts") or raw.get("num_experts")
    if model_type == "mixtral":
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        num_layers = int(raw["num_hidden_layers"])
        step = int(raw.get("decoder_sparse_step") or 1)
        dense_layers = set(raw.get("mlp_only_layers") or []) | {i for i in range(num_layers) if (i + 1) % step}
        if dense_layers:
            raise NotImplementedError(f"{model_type} with dense MLP layers {sorted(dense_layers)} among sparse ones "
                                      "is not supported (decoder_sparse_step > 1 or mlp_only_layers)")
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0))
    return {}


def _layer_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    window = int(raw.get("sliding_window") or 0)
    if model_type in QWEN_TYPES and not raw.get("use_sliding_window", False):
        return ()  # Qwen2/3 only slide when asked to
    layer_types = raw.get("layer_types")
    if model_type in ("gemma2", "gemma3_text") and not layer_types:
        pattern = 2 if model_type == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    elif model_type in QWEN_TYPES:
        first_sliding = int(raw.get("max_window_layers", num_layers))
        windows = tuple(window if i >= first_sliding else 0 for i in range(num_layers))
    else:
        windows = (window,) * num_layers
    return windows if any(windows) else ()


def _gpt2_spelling(raw: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's config names -> the Llama-family names used below (LayerNorm eps goes in rms_norm_eps)."""
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise NotImplementedError("GPT-2 variants with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn "
                                  "are not supported")
    if not raw.get("scale_attn_weights", True):
        raise NotImplementedError("GPT-2 with scale_attn_weights=False is not supported")
    hidden = raw["n_embd"]
    return {**raw, "hidden_size": hidden, "num_attention_heads": raw["n_head"], "num_key_value_heads": raw["n_head"],
            "num_hidden_layers": raw["n_layer"], "max_position_embeddings": raw["n_positions"],
            "intermediate_size": raw.get("n_inner") or 4 * hidden, "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-5),
            "hidden_act": raw.get("activation_function", "gelu_new"),
            "tie_word_embeddings": raw.get("tie_word_embeddings", True)}


# Encoders (models/bert.py); RoBERTa's positions start after its padding id.
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
_OFFSET_POSITIONS = ("roberta", "xlm-roberta")


def _encoder_spelling(raw: dict[str, Any]) -> dict[str, Any]:
    """BERT's config names -> the names read below (LayerNorm eps goes in rms_norm_eps, as for GPT-2)."""
    offset = int(raw.get("pad_token_id", 1)) + 1 if raw.get("model_type") in _OFFSET_POSITIONS else 0
    return {**raw, "num_key_value_heads": raw["num_attention_heads"], "rms_norm_eps": raw.get("layer_norm_eps", 1e-12),
            "hidden_act": raw.get("hidden_act", "gelu"), "tie_word_embeddings": False,
            "max_position_embeddings": int(raw.get("max_position_embeddings", 512)) - offset,
            "paged_position_offset": offset}


def _two_way_softmax(raw: dict[str, Any]) -> bool:
    return bool(raw.get("is_original_qwen3_reranker")) or raw.get("method") == "from_2_way_softmax"


def _labels(raw: dict[str, Any], architecture: str) -> tuple[str, ...]:
    """A sequence classifier's label names in id order (transformers' LABEL_i where it names none)."""
    if not architecture.endswith("ForSequenceClassification"):
        return ()
    tokens = raw.get("classifier_from_token")
    if tokens:
        if _two_way_softmax(raw):
            if len(tokens) != 2:
                raise ValueError(f"a two-way softmax classifier reads two tokens (no, yes), got {tokens!r}")
            return ("LABEL_0",)
        return tuple(str(t) for t in tokens)
    id2label = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
    count = int(raw.get("num_labels") or len(id2label) or 2)
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(max(count, len(id2label))))


def model_config_from_hf(raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json (and optional generation_config.json)."""
    if raw.get("model_type") == "gpt2":
        raw = _gpt2_spelling(raw)
    encoder = raw.get("model_type") in ENCODER_TYPES
    if encoder:
        raw = _encoder_spelling(raw)
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    model_type = raw.get("model_type", "")
    gemma = model_type in ("gemma2", "gemma3_text")
    if gemma:
        raw = {"hidden_act": raw.get("hidden_activation", "gelu_pytorch_tanh"), **raw}
    partial_rotary = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                                   raw.get("partial_rotary_factor", 1.0)))
    eos = _as_id_tuple(raw.get("eos_token_id"))
    if generation_config:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation_config.get("eos_token_id"))))
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return ModelConfig(
        architecture=architectures[0],
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(raw),
        local_rope=_local_rope_from_hf(raw) if model_type == "gemma3_text" else None,
        rotary_dim=int(int(head_dim) * partial_rotary) if partial_rotary != 1.0 else 0,
        rotary_interleaved=model_type in ("glm", "glm4"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama and Mistral only when `attention_bias` says so.
        attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", model_type == "qwen2"))),
        # Llama's `attention_bias` covers o_proj too; Qwen2's o_proj never has a bias.
        o_proj_bias=bool(raw.get("attention_bias", False)) and model_type == "llama",
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        layer_windows=_layer_windows(raw, model_type, int(raw["num_hidden_layers"])),
        norm_plus_one=gemma,
        embed_scale=gemma,
        sandwich_norms=gemma or model_type == "glm4",
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma else None,
        attn_soft_cap=raw.get("attn_logit_softcapping") if gemma else None,
        final_soft_cap=raw.get("final_logit_softcapping") if gemma else None,
        **_moe_fields(raw, model_type),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        checkpoint_dtype=str(dtype).replace("torch.", ""),
        encoder_only=encoder,
        position_offset=int(raw.get("paged_position_offset", 0)),
        type_vocab_size=int(raw.get("type_vocab_size", 0)) if encoder else 0,
        labels=_labels(raw, architectures[0]),
        classifier_from_tokens=tuple(str(t) for t in raw.get("classifier_from_token") or ()),
        two_way_softmax=_two_way_softmax(raw) and bool(raw.get("classifier_from_token")),
    )


def load_model_config(model_dir: str, hf_overrides: dict | None = None) -> ModelConfig:
    """The model's config.json (and generation_config.json), with `hf_overrides`' fields set over it (vLLM's
    --hf-overrides)."""
    from paged.models.gemma_checkpoint import hf_config, is_gemma_checkpoint
    if is_gemma_checkpoint(model_dir):  # the gemma library saves no config: read from its tree's shapes
        raw = {**hf_config(model_dir), **(hf_overrides or {})}
        return model_config_from_hf(raw, None)
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = {**json.load(f), **(hf_overrides or {})}
    generation = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            generation = json.load(f)
    return model_config_from_hf(raw, generation)

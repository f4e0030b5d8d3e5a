"""Flax Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3 (text), GLM and GLM-4, and the sparse-MoE Mixtral, Qwen2-MoE
and Qwen3-MoE (one decoder; differences live in ModelConfig and, for Phi-3's fused projections and the
experts, in the checkpoint layout below; GLM-4's four norms load under Gemma's names).

The parameter tree mirrors Hugging Face names, with the decoder layers stacked on a leading axis so the
forward pass scans over layers (one layer is compiled instead of L: start-up time matters), or, for the
unrolled loop that is faster on CPU, `layers` is a list of per-layer trees without that axis:

    embed_tokens/embedding            [V, H]
    layers/input_layernorm/scale      [L, H]
    layers/self_attn/{q,k,v,o}_proj/{kernel [L, in, out], bias [L, out]}
    layers/self_attn/{q,k}_norm/scale [L, head_dim]   (Qwen3, Gemma 3)
    layers/post_attention_layernorm/scale
    layers/{pre,post}_feedforward_layernorm/scale     (Gemma 2 and 3)
    layers/mlp/{gate,up,down}_proj/kernel
    layers/mlp/gate/kernel [L, H, E], layers/mlp/experts_{gate,up,down}_proj/kernel [L, E, in, out]   (MoE)
    norm/scale                        [H]
    lm_head/kernel                    [H, V]   (absent when embeddings are tied)
    rotary/{global,local}             [P, 2, rotary_dim / 2]   (optional: `precomputed`, not a checkpoint's)
"""

from __future__ import annotations

import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paged.models.attention import AttentionMetadata, ReferenceAttention
from paged.models.config import ModelConfig
from paged.models.layers import (Block, GatedMLP, PagedSelfAttention, RMSNorm, rotary_cos_sin,
                                 rotary_cos_sin_by_length, rotary_table,
                                 run_layers)
from paged.models.linear import GREEDY_SCREEN, Embedding, LastHidden, Linear, tied_greedy_head, tied_head_screen
from paged.models.moe import SparseMoE


class DecoderLayer(Block):
    """One layer: (h, delta) -> (h + delta + attention's output, the MLP's output, k_cache, v_cache).

    The residual stream arrives with the previous layer's last block output not yet added (`delta`): each add is
    made where a norm reads its result, so the two are one pass on the native path (`RMSNorm` with a residual).
    """

    # False: attention reads the residual stream as it is (an EAGLE head's layer, whose input is already the
    # fused embedding and target features: it has no input_layernorm).
    input_norm: bool = True

    @nn.compact
    def __call__(self, h, delta, cos, sin, k_cache, v_cache, layer, window, meta, attention, live_rows=None):
        cfg = self.config
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_plus_one, self.linear_backend, name=name)
        if self.input_norm:
            h, x = norm("input_layernorm")(h, delta)
        else:
            h = x = h + delta
        x, k_cache, v_cache = PagedSelfAttention(cfg, self.dtype, self.linear_backend, name="self_attn")(
            x, cos, sin, k_cache, v_cache, layer, window, meta, attention, live_rows)
        mlp_cls = SparseMoE if cfg.num_experts else GatedMLP
        mlp = mlp_cls(cfg, self.dtype, linear_backend=self.linear_backend, name="mlp")
        if cfg.sandwich_norms:  # Gemma 2: normalise each block's output before the residual add
            h = h + norm("post_attention_layernorm")(x)
            return h, norm("post_feedforward_layernorm")(mlp(norm("pre_feedforward_layernorm")(h), live_rows)), \
                k_cache, v_cache
        h, x = norm("post_attention_layernorm")(h, x)
        return h, mlp(x, live_rows), k_cache, v_cache


class LlamaForCausalLM:
    """Functional causal LM over a paged KV cache.

    `forward(params, kv_cache, token_ids, meta, logits_indices, attention)` returns logits float32 [S, V] for
    the tokens picked by `logits_indices` (only those reach the LM head) and the updated cache. It is
    `hidden_states` then `logits`; the runner calls the two itself, so that a greedy step can take
    `greedy_head`'s tokens instead of the logits.
    """

    def __init__(self, config: ModelConfig, dtype: Any, linear_backend: str = "xla"):
        """`linear_backend` names the matmul every projection and the LM head run (paged.models.linear); the
        parameters are the same whichever it is."""
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.linear_backend = linear_backend
        self.layer = DecoderLayer(config, self.dtype, linear_backend)
        self.final_norm = RMSNorm(config.rms_norm_eps, self.dtype, config.norm_plus_one, linear_backend)
        self.embed = Embedding(config.vocab_rows, config.hidden_size, self.dtype, backend=linear_backend)
        self.lm_head = Linear(config.vocab_rows, self.dtype, parallel="column", backend=linear_backend,
                              out_dtype=jnp.float32)
        rotary_dim = config.rotary_dim or config.head_dim
        self.inv_freq = config.rope.inv_freq(rotary_dim)
        self.rope_scaling = config.rope.attention_scaling
        self.local_inv_freq = config.local_rope.inv_freq(rotary_dim) if config.local_rope else None
        self.local_rope_scaling = config.local_rope.attention_scaling if config.local_rope else 1.0
        # A decoder saved without its LM head (sentence-transformers' Qwen3Model, gte-Qwen2's Qwen2Model): its
        # tensors lack the "model." prefix, and it can only pool.
        self.base_model = config.architecture.endswith("Model")
        # Only a causal LM generates; a sequence classifier has a `score` head over its last token instead.
        self.has_lm_head = config.architecture.endswith("ForCausalLM") and not config.tie_word_embeddings
        self.score = (Linear(len(config.labels), self.dtype, backend=linear_backend, out_dtype=jnp.float32)
                      if config.labels else None)

    # ---- checkpoint layout --------------------------------------------------------------------------

    # paged_*: a quantized layer's tensors in models/quantization.py's layout, as the loader converted them.
    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|paged_qweight|paged_scales|"
                           r"paged_zero_offsets|paged_perm)$")
    # Experts, stacked per layer on an expert axis: Mixtral's w1/w3/w2 and Qwen-MoE's gate/up/down.
    _EXPERT_RE = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
    _EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    # An fp8 KV cache's per-layer scales: compressed-tensors' (llm-compressor's kv_cache_scheme) and AutoFP8's.
    KV_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
    _GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
                   "post_attention_layernorm": "pre_feedforward_layernorm",
                   "post_mlp_layernorm": "post_feedforward_layernorm"}

    def global_params(self) -> dict:
        """The parameters outside the decoder layers as Flax's init makes them (shapes and partition specs,
        as `jax.ShapeDtypeStruct`s inside `nn.Partitioned`)."""
        cfg = self.config
        key = jax.random.key(0)
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        init = lambda module, *args: jax.eval_shape(lambda: module.init(key, *args))["params"]
        params = {"embed_tokens": init(self.embed, jnp.zeros((1,), jnp.int32)), "norm": init(self.final_norm, h)}
        if self.has_lm_head:
            params["lm_head"] = init(self.lm_head, h)
        if self.score is not None:
            params["score"] = init(self.score, h)
        return params

    def checkpoint_target(self, name: str) -> tuple[tuple[str, ...], int | None, bool] | None:
        """HF tensor name -> (path in our tree, index or None, transpose?). None = not ours to load.

        The index is the layer, or (layer, expert) for an expert's matrix.
        """
        if self.base_model and not name.startswith("model."):
            name = "model." + name
        if name == "model.embed_tokens.weight":
            return ("embed_tokens", "embedding"), None, False
        if name == "model.norm.weight":
            return ("norm", "scale"), None, False
        if name == "lm_head.weight":
            return ("lm_head", "kernel"), None, True
        if name == "score.weight":
            return ("score", "kernel"), None, True
        if scale := self.KV_SCALE_RE.match(name):
            which = scale.group(2) or scale.group(3)
            return ("layers", "self_attn", f"{which}_scale"), int(scale.group(1)), False
        match = self._LAYER_RE.match(name)
        if not match:
            return None
        layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
        expert = self._EXPERT_RE.match(module)
        if expert:
            proj = self._EXPERT_NAMES.get(expert.group(2), expert.group(2))
            if kind.startswith("paged_"):
                return ("layers", "mlp", f"experts_{proj}", kind[len("paged_"):]), (layer, int(expert.group(1))), False
            return ("layers", "mlp", f"experts_{proj}", "kernel"), (layer, int(expert.group(1))), True
        if module == "block_sparse_moe.gate":
            module = "mlp.gate"
        if self.config.model_type == "glm4":  # its sandwich norms, in Gemma's names
            module = self._GLM4_NORMS.get(module, module)
        parts = tuple(module.split("."))
        if kind.startswith("paged_"):
            return ("layers", *parts, kind[len("paged_"):]), layer, False
        if parts[-1].endswith("norm"):
            return ("layers", *parts, "scale"), layer, False
        return ("layers", *parts, "kernel" if kind == "weight" else "bias"), layer, kind == "weight"

    def split_fused(self, name: str, f):
        """Yields (name, read) pairs, splitting fused projections (Phi-3's qkv_proj and gate_up_proj).

        `read()` returns the tensor; unfused tensors are read only if the loader wants them.
        """
        cfg = self.config
        if name.endswith(".self_attn.qkv_proj.weight"):
            fused = f.get_tensor(name)
            prefix = name[:-len("qkv_proj.weight")]
            q, kv = cfg.q_size, cfg.kv_size // cfg.kv_head_replicas  # the checkpoint's KV heads
            parts = (("q_proj", fused[:q]), ("k_proj", fused[q:q + kv]), ("v_proj", fused[q + kv:]))
        elif name.endswith(".mlp.gate_up_proj.weight"):
            fused = f.get_tensor(name)
            prefix = name[:-len("gate_up_proj.weight")]
            half = cfg.intermediate_size
            parts = (("gate_proj", fused[:half]), ("up_proj", fused[half:]))
        else:
            if cfg.classifier_token_ids and name == ("model.embed_tokens.weight" if cfg.tie_word_embeddings
                                                     else "lm_head.weight"):
                yield "score.weight", lambda: self._classifier_rows(f.get_tensor(name))
            yield name, lambda: f.get_tensor(name)
            return
        for part, tensor in parts:
            yield f"{prefix}{part}.weight", lambda tensor=tensor: tensor

    def _classifier_rows(self, lm_head) -> np.ndarray:
        """A causal LM read as a classifier: the LM head's rows of its classifier tokens, [labels, H]; for a
        two-way softmax one row, yes minus no (in float32), whose sigmoid is softmax([no, yes])[yes]."""
        rows = np.asarray(lm_head[list(self.config.classifier_token_ids)], np.float32)
        return rows[1:] - rows[:1] if self.config.two_way_softmax else rows

    def classify(self, params, pooled: jax.Array) -> jax.Array:
        """float32 [S, labels]: the score head on each row's pooled (last-token) float32 [S, H]."""
        return self.score.apply({"params": params["score"]}, pooled.astype(self.dtype))

    def layer_params(self) -> dict:
        """One decoder layer's parameters as Flax's init makes them (shapes and partition specs; the loader
        validates checkpoints against them)."""
        cfg = self.config
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        cos = jnp.zeros((1, cfg.head_dim), jnp.float32)
        kv = jnp.zeros((1, cfg.num_kv_heads, 2, 1, cfg.head_dim), self.dtype)
        meta = AttentionMetadata.placeholder()
        shapes = jax.eval_shape(lambda: self.layer.init(jax.random.key(0), h, h, cos, cos, kv, kv, 0, 0, meta,
                                                        ReferenceAttention()))
        return shapes["params"]

    def precomputed(self, max_positions: int) -> dict:
        """Arrays for `forward` to read beside the weights (add them to `params`): the rotary cos/sin tables
        for positions [0, max_positions), float32 [max_positions, 2, rotary_dim / 2] each."""
        # A length-dependent rope (dynamic NTK, LongRoPE) computes each token's cos/sin in the step instead.
        tables = {} if self.config.rope.length_dependent else {
            "global": rotary_table(max_positions, self.inv_freq, self.rope_scaling)}
        if self.local_inv_freq is not None:
            tables["local"] = rotary_table(max_positions, self.local_inv_freq, self.local_rope_scaling)
        return {"rotary": tables}

    def hidden_states(self, params, kv_cache, token_ids, meta: AttentionMetadata, logits_indices, attention,
                      aux_layers: tuple[int, ...] = ()):
        """The step's layers, up to the LM head.

        Args:
          params: the tree described in the module docstring; with `precomputed`'s arrays, positions must
            lie below its max_positions.
          kv_cache: (k, v), each [L, num_kv_heads, num_blocks, block_size, head_dim].
          token_ids: int32 [T]; the step's packed new tokens.
          meta: AttentionMetadata for the step.
          logits_indices: int32 [S]; which packed token's hidden state feeds each sequence's logits.
          attention: the attention backend.
          aux_layers: residual streams to return beside (an EAGLE-3 head's features): id j is the stream
            entering layer j (0: the embedding).
        Returns:
          (LastHidden: the final-normed hidden states of the tokens logits_indices picks, kv_cache), and with
          aux_layers a third item: [len(aux_layers), T, H], each packed token's streams.
        """
        cfg = self.config
        embed = {"params": params["embed_tokens"]}
        h = self.embed.apply(embed, token_ids)
        if cfg.embed_scale:  # Gemma: the normaliser is rounded to the model dtype first, as transformers does
            h = h * jnp.asarray(cfg.hidden_size ** 0.5, self.dtype)
        tables = params.get("rotary", {})
        if cfg.rope.length_dependent:
            cos, sin = rotary_cos_sin_by_length(meta.positions, meta.rope_lengths, cfg.rope,
                                                cfg.rotary_dim or cfg.head_dim, cfg.rotary_interleaved)
        else:
            cos, sin = rotary_cos_sin(meta.positions, self.inv_freq, cfg.rotary_interleaved, tables.get("global"),
                                      self.rope_scaling)
        if self.local_inv_freq is not None:
            local_cos, local_sin = rotary_cos_sin(meta.positions, self.local_inv_freq, cfg.rotary_interleaved,
                                                  tables.get("local"), self.local_rope_scaling)
        k_all, v_all = kv_cache
        # Tokens from query_start[-1] on are the buckets' padding: the linear layers may skip their rows
        # (their outputs are never read).
        live_tokens = meta.query_start[-1]

        def one_layer(carry, xs):
            h, delta, k_all, v_all = carry
            layer_params, index, window = xs
            layer_cos, layer_sin = cos, sin
            if self.local_inv_freq is not None:  # Gemma 3: sliding layers rotate with their own base
                layer_cos = jnp.where(window > 0, local_cos, cos)
                layer_sin = jnp.where(window > 0, local_sin, sin)
            # The whole pool rides in the scan carry and each layer scatters into it, so with the pool
            # donated the update happens in place (no per-layer copies).
            return self.layer.apply({"params": layer_params}, h, delta, layer_cos, layer_sin, k_all, v_all,
                                    index, window, meta, attention, live_tokens)

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        windows = jnp.asarray(cfg.layer_windows or (0,) * cfg.num_layers, jnp.int32)
        # The first layer adds zeros: bf16(h + 0) is h.
        carry = (h, jnp.zeros_like(h), k_all, v_all)
        if aux_layers:
            wanted = jnp.asarray(aux_layers, jnp.int32)[:, None, None]

            def capturing(carry, xs):  # the stream entering a wanted layer (h + delta) is kept as it passes
                *inner, aux = carry
                aux = jnp.where(wanted == xs[1], (inner[0] + inner[1])[None], aux)
                return (*one_layer(tuple(inner), xs), aux)
            h, delta, k_all, v_all, aux = run_layers(capturing, (*carry, jnp.zeros((len(aux_layers), *h.shape),
                                                                                    h.dtype)),
                                                     params["layers"], (layer_ids, windows))
        else:
            h, delta, k_all, v_all = run_layers(one_layer, carry, params["layers"], (layer_ids, windows))
        _, h = self.final_norm.apply({"params": params["norm"]}, h[logits_indices], delta[logits_indices])
        live_seqs = jnp.sum(meta.seq_lens > 0, dtype=jnp.int32)  # rows of padded sequences may be skipped
        if aux_layers:
            return LastHidden(h, live_seqs), (k_all, v_all), aux
        return LastHidden(h, live_seqs), (k_all, v_all)

    def logits(self, params, last: LastHidden) -> jax.Array:
        """float32 logits [S, V] of `hidden_states`' rows."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            logits = self.embed.apply({"params": params["embed_tokens"]}, last.h, last.live_rows, method="attend")
        else:
            logits = self.lm_head.apply({"params": params["lm_head"]}, last.h, last.live_rows)
        if cfg.padded_vocab_size:
            logits = logits[:, :cfg.vocab_size]  # the padding rows are not tokens
        if cfg.final_soft_cap:
            logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
        return logits

    def greedy_head(self, params, last: LastHidden) -> Callable[[], jax.Array] | None:
        """A function giving `first_argmax(self.logits(params, last))` without the logits (int32 [S]), or None
        where no kernel fuses them (`paged.models.linear.tied_greedy_head`: a tied table on the native path)."""
        if not self.config.tie_word_embeddings:
            return None
        return tied_greedy_head(self.embed, params["embed_tokens"], last, self.config, params.get(GREEDY_SCREEN))

    def head_screen(self, params) -> dict:
        """Arrays for `greedy_head` to read beside the weights (`paged.models.linear.tied_head_screen`): built
        from the table's values, so again whenever it changes. {} where none applies."""
        if not self.config.tie_word_embeddings:
            return {}
        return tied_head_screen(self.embed, params["embed_tokens"], self.config)

    def forward(self, params, kv_cache, token_ids, meta: AttentionMetadata, logits_indices, attention):
        """`hidden_states` then `logits`: (logits float32 [S, V], kv_cache)."""
        last, kv_cache = self.hidden_states(params, kv_cache, token_ids, meta, logits_indices, attention)
        return self.logits(params, last), kv_cache

"""Flax BERT and XLM-RoBERTa encoders (bge, e5, gte, MiniLM and the cross-encoder rerankers built on them).

An encoder attends in both directions within its sequence and keeps no K/V: a pooling engine computes every
prompt whole in one step, so each step's packed tokens attend to the tokens of their own sequence, all of
them, through a [T, T] mask built from the step's row ids. The KV pool it is handed has no layers and is
passed through untouched. Post-LayerNorm blocks, learned absolute positions (XLM-RoBERTa's start after its
padding id), token types (segment A / B of a sentence pair, packed into the token ids, see `TOKEN_TYPE_SHIFT`).

Parameter tree (layers stacked on a leading axis, or a list of layers, as for the decoders):

    embeddings/{word,position,token_type}/embedding   [V | P | types, H]
    embeddings/norm/{scale, bias}                     [H]
    layers/{query,key,value,attention_output,intermediate,output}/{kernel [L, in, out], bias [L, out]}
    layers/{attention_norm,output_norm}/{scale, bias} [L, H]
    head/dense/{kernel [H, H], bias}, head/out/{kernel [H, labels], bias}   (sequence classifiers only)

A sequence classifier's head is BERT's pooler (dense + tanh on the CLS token) and classifier, or
XLM-RoBERTa's classification head (the same two layers under other names).
"""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged.models.attention import AttentionMetadata
from paged.models.config import ModelConfig
from paged.models.layers import Block, activation, run_layers
from paged.models.linear import Embedding, LastHidden, Linear

# A token's type rides in the bits above its id (the step carries one id array); ids stay below 2**24.
TOKEN_TYPE_SHIFT = 24


def _layer_norm(cfg: ModelConfig, dtype, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=cfg.rms_norm_eps, dtype=dtype, param_dtype=dtype, name=name)


class EncoderLayer(Block):
    """One post-LayerNorm block: h = norm(h + attention(h)); h = norm(h + mlp(h))."""

    @nn.compact
    def __call__(self, h, rows, live_rows=None):
        """`rows`: (token_seq_ids [T], query_start [S + 1]) of the step, whose sequences attend within
        themselves."""
        cfg = self.config
        num_tokens = h.shape[0]
        linear = lambda n, name, parallel: Linear(n, self.dtype, True, parallel, self.linear_backend, name=name)
        heads = lambda x: x.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        q = heads(linear(cfg.hidden_size, "query", "column")(h, live_rows))
        k = heads(linear(cfg.hidden_size, "key", "column")(h, live_rows))
        v = heads(linear(cfg.hidden_size, "value", "column")(h, live_rows))
        out = segment_attention(q, k, v, *rows, scale=cfg.head_dim ** -0.5).reshape(num_tokens, cfg.hidden_size)
        out = linear(cfg.hidden_size, "attention_output", "row")(out, live_rows)
        h = _layer_norm(cfg, self.dtype, "attention_norm")(h + out)
        x = activation(cfg.hidden_act)(linear(cfg.intermediate_size, "intermediate", "column")(h, live_rows))
        x = linear(cfg.hidden_size, "output", "row")(x, live_rows)
        return _layer_norm(cfg, self.dtype, "output_norm")(h + x)


ATTENTION_BLOCK = 64  # tokens per query and key tile of `segment_attention`


def segment_attention(q, k, v, token_seq_ids, query_start, *, scale: float, block: int = ATTENTION_BLOCK):
    """Bidirectional attention of each packed token over the tokens of its own sequence.

    Args:
      q, k, v: [T, H, D], the step's packed tokens (every sequence whole, contiguous, in row order).
      token_seq_ids: int32 [T]; each token's row (padding tokens: any).
      query_start: int32 [S + 1]; where each row starts; query_start[-1] is the live token count.
      scale: the score scale (head_dim ** -0.5).
    Returns:
      [T, H, D] in q's dtype; padding tokens get zeros.

    Queries go by tiles of `block` tokens; each tile walks only the key tiles that hold its sequences (a while
    loop of dynamic length, online softmax in float32), so a step costs about the sum of its sequences'
    squared lengths instead of T^2 for a dense mask over the whole step.
    """
    num_tokens, heads, dim = q.shape
    token_seq_ids, query_start = jnp.asarray(token_seq_ids), jnp.asarray(query_start)
    live = query_start[-1]
    num_blocks = -(-num_tokens // block)
    padded = num_blocks * block
    pad = lambda x, value=0: jnp.pad(x, [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1), constant_values=value)
    q, k, v = pad(q), pad(k), pad(v)
    positions = jnp.arange(padded)
    seq = jnp.where(positions < live, pad(token_seq_ids), -1)  # padding belongs to no sequence
    starts = jnp.arange(num_blocks) * block
    # Each query tile's keys: from the start of its first token's sequence to the end of its last live one's.
    first = token_seq_ids[jnp.minimum(starts, num_tokens - 1)]
    last = token_seq_ids[jnp.clip(jnp.minimum(starts + block, live) - 1, 0, num_tokens - 1)]
    key_lo = query_start[first] // block
    key_hi = jnp.where(starts < live, -(-query_start[last + 1] // block), key_lo)  # padding tiles: no keys

    def query_tile(index):
        start = index * block
        q_tile = jax.lax.dynamic_slice_in_dim(q, start, block).astype(jnp.float32) * scale
        q_seq = jax.lax.dynamic_slice_in_dim(seq, start, block)

        def key_tile(j, carry):
            best, total, acc = carry
            k_tile = jax.lax.dynamic_slice_in_dim(k, j * block, block).astype(jnp.float32)
            v_tile = jax.lax.dynamic_slice_in_dim(v, j * block, block).astype(jnp.float32)
            k_seq = jax.lax.dynamic_slice_in_dim(seq, j * block, block)
            scores = jnp.einsum("qhd,khd->hqk", q_tile, k_tile)
            scores = jnp.where((q_seq[:, None] == k_seq[None, :]) & (k_seq[None, :] >= 0), scores, -jnp.inf)
            new_best = jnp.maximum(best, scores.max(-1))
            safe = jnp.where(jnp.isfinite(new_best), new_best, 0.0)
            probs = jnp.exp(scores - safe[..., None])
            rescale = jnp.exp(jnp.where(jnp.isfinite(best), best - safe, -jnp.inf))
            return (new_best, total * rescale + probs.sum(-1),
                    acc * rescale[..., None] + jnp.einsum("hqk,khd->hqd", probs, v_tile))

        init = (jnp.full((heads, block), -jnp.inf, jnp.float32), jnp.zeros((heads, block), jnp.float32),
                jnp.zeros((heads, block, dim), jnp.float32))
        _, total, acc = jax.lax.fori_loop(key_lo[index], key_hi[index], key_tile, init)
        return (acc / jnp.maximum(total, 1e-30)[..., None]).transpose(1, 0, 2)

    out = jax.lax.map(query_tile, jnp.arange(num_blocks))
    return out.reshape(padded, heads, dim)[:num_tokens].astype(q.dtype)


class ClassifierHead(Block):
    """dense + tanh, then the labels' logits (float32), on each row's pooled (CLS) hidden state."""

    @nn.compact
    def __call__(self, pooled):
        cfg = self.config
        x = jnp.tanh(Linear(cfg.hidden_size, self.dtype, True, name="dense")(pooled.astype(self.dtype)))
        return Linear(len(cfg.labels), self.dtype, True, out_dtype=jnp.float32, name="out")(x)


class BertModel:
    """Functional BERT / XLM-RoBERTa encoder with the decoders' step interface (`hidden_states`), for the
    pooling runner; `classify` is the sequence classifier's head."""

    # HF names -> ours, inside one layer (`encoder.layer.N.` stripped).
    _LAYER_NAMES = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
                    "attention.output.dense": "attention_output", "attention.output.LayerNorm": "attention_norm",
                    "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm"}
    _LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
    _HEADS = {"pooler.dense": "dense", "classifier": "out",  # BERT's pooler and classifier
              "classifier.dense": "dense", "classifier.out_proj": "out"}  # XLM-RoBERTa's classification head

    def __init__(self, config: ModelConfig, dtype: Any, linear_backend: str = "xla"):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.layer = EncoderLayer(config, self.dtype, linear_backend)
        self.word = Embedding(config.vocab_rows, config.hidden_size, self.dtype, backend=linear_backend)
        self.position = Embedding(config.max_position_embeddings + config.position_offset, config.hidden_size,
                                  self.dtype, vocab_parallel=False)
        self.token_type = Embedding(max(config.type_vocab_size, 1), config.hidden_size, self.dtype,
                                    vocab_parallel=False)
        self.norm = _layer_norm(config, self.dtype)
        self.head = ClassifierHead(config, self.dtype) if config.labels else None

    # ---- checkpoint layout --------------------------------------------------------------------------

    def global_params(self) -> dict:
        """See LlamaForCausalLM.global_params."""
        cfg = self.config
        key = jax.random.key(0)
        ids = jnp.zeros((1,), jnp.int32)
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        init = lambda module, x: jax.eval_shape(lambda: module.init(key, x))["params"]
        params = {"embeddings": {"word": init(self.word, ids), "position": init(self.position, ids),
                                 "token_type": init(self.token_type, ids), "norm": init(self.norm, h)}}
        if self.head is not None:
            params["head"] = init(self.head, h)
        return params

    def layer_params(self) -> dict:
        cfg = self.config
        h = jnp.zeros((1, cfg.hidden_size), self.dtype)
        rows = (jnp.zeros(1, jnp.int32), jnp.array([0, 1], jnp.int32))
        return jax.eval_shape(lambda: self.layer.init(jax.random.key(0), h, rows))["params"]

    def checkpoint_target(self, name: str) -> tuple[tuple[str, ...], int | None, bool] | None:
        """HF tensor name -> (path in our tree, layer or None, transpose?); None: not ours to load."""
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        module, _, kind = name.rpartition(".")
        leaf = {"weight": "kernel", "bias": "bias", "gamma": "scale", "beta": "bias"}.get(kind)
        if module.startswith("embeddings."):
            part = module[len("embeddings."):]
            if part == "LayerNorm":
                return ("embeddings", "norm", "scale" if kind in ("weight", "gamma") else "bias"), None, False
            table = {"word_embeddings": "word", "position_embeddings": "position",
                     "token_type_embeddings": "token_type"}.get(part)
            return (("embeddings", table, "embedding"), None, False) if table and kind == "weight" else None
        if module in self._HEADS:
            if self.head is None:
                return None  # an embedding model's unused pooler
            return ("head", self._HEADS[module], leaf), None, kind == "weight"
        match = self._LAYER_RE.match(name)
        if not match or match.group(2) not in self._LAYER_NAMES:
            return None
        ours = self._LAYER_NAMES[match.group(2)]
        if ours.endswith("norm"):
            leaf = "scale" if kind in ("weight", "gamma") else "bias"
            return ("layers", ours, leaf), int(match.group(1)), False
        return ("layers", ours, leaf), int(match.group(1)), kind == "weight"

    def split_fused(self, name: str, f):
        yield name, lambda: f.get_tensor(name)

    def precomputed(self, max_positions: int) -> dict:
        """Nothing: positions are a learned table among the weights."""
        del max_positions
        return {}

    # ---- the step -----------------------------------------------------------------------------------

    def hidden_states(self, params, kv_cache, token_ids, meta: AttentionMetadata, logits_indices, attention):
        """The encoder over the step's packed sequences (each computed whole).

        Args:
          params: the tree in the module docstring.
          kv_cache: passed through (an encoder keeps no K/V).
          token_ids: int32 [T]; each token's id, with its token type in the bits from TOKEN_TYPE_SHIFT up.
          meta: the step's AttentionMetadata (positions, token_seq_ids and query_start are read).
          logits_indices: int32 [N]; whose final hidden states are returned.
          attention: unused (the encoder's attention is its own).
        Returns:
          (LastHidden of the rows logits_indices picks, kv_cache)
        """
        del attention
        cfg = self.config
        embeddings = params["embeddings"]
        ids = token_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        types = jnp.minimum(token_ids >> TOKEN_TYPE_SHIFT, max(cfg.type_vocab_size, 1) - 1)
        h = (embeddings["word"]["embedding"][ids] + embeddings["position"]["embedding"][meta.positions
                                                                                       + cfg.position_offset]
             + embeddings["token_type"]["embedding"][types])
        h = self.norm.apply({"params": embeddings["norm"]}, h.astype(self.dtype))
        live_tokens = meta.query_start[-1]
        rows = (meta.token_seq_ids, meta.query_start)  # each token sees every token of its own sequence

        def one_layer(h, xs):
            layer_params, = xs
            return self.layer.apply({"params": layer_params}, h, rows, live_tokens)

        h = run_layers(one_layer, h, params["layers"], ())
        live_seqs = jnp.sum(meta.seq_lens > 0, dtype=jnp.int32)
        return LastHidden(h[logits_indices], live_seqs), kv_cache

    def classify(self, params, pooled: jax.Array) -> jax.Array:
        """float32 [S, labels]: the classifier head on each row's pooled float32 [S, H]."""
        return self.head.apply({"params": params["head"]}, pooled)

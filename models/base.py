"""The contract a model class meets to be served (`paged.register_model`), and a base class that fills in its
optional parts.

The engine builds the class as `cls(config: ModelConfig, dtype, linear_backend="xla")` from the checkpoint's
config.json and calls:

    global_params() -> dict        parameters outside the layers, as Flax's init makes them (jax.eval_shape)
    layer_params() -> dict         one layer's parameters, likewise (the loader stacks or lists L of them)
    checkpoint_target(name)        a checkpoint tensor's place: (path in the tree, layer index or None,
                                   transpose?), or None to skip it
    hidden_states(params, kv_cache, token_ids, meta, logits_indices, attention)
                                   the step's layers: (LastHidden of the rows `logits_indices` picks, kv_cache)
    logits(params, last) -> float32 [S, V]

and, where the class has them (PagedModel gives defaults): split_fused(name, f) (one stored tensor as
several), precomputed(max_positions) (tables kept beside the weights, e.g. rotary cos/sin),
greedy_head(params, last) (a fused argmax, or None), head_screen(params) (arrays the greedy head reads
beside the weights, derived from them), and for a pooling model classify(params, pooled).

Inside `hidden_states` a layer writes its new K/V with `attention.write_kv(k_cache, v_cache, layer, k, v, meta)`
and reads the sequence's keys with `attention.attend(q, k, v, k_cache, v_cache, layer, meta, scale=...)`, whatever
backend the engine runs (models/attention.py; `meta` is the step's AttentionMetadata); `run_layers` loops the
layers (scanned over stacked weights, or unrolled over a list). Projections are `paged.models.linear.Linear`
(its partitioning names the tensor-parallel split), embeddings `Embedding`.
"""

from __future__ import annotations

import re
from typing import Callable

import jax


class PagedModel:
    """Defaults for a model of your own: no fused tensors, no precomputed tables, no fused greedy head, and
    `checkpoint_target` from `weight_names`.

    weight_names: checkpoint tensor name (a regular expression, matched whole) -> its path in the parameter
      tree, "/"-separated; the path may name the pattern's groups (\\2, as re's expand). A path under "layers/" is
      one layer's tensor, its layer index the pattern's first group. A tensor whose path ends in "kernel" is a linear weight stored [out, in] (PyTorch's layout) and is
      transposed to the kernel's [in, out]; give `transposed_kernels = False` for checkpoints that store
      [in, out] already.
    """

    weight_names: dict[str, str] = {}
    transposed_kernels: bool = True

    def checkpoint_target(self, name: str) -> tuple[tuple[str, ...], int | None, bool] | None:
        for pattern, path in self._compiled_names():
            match = pattern.fullmatch(name)
            if match is None:
                continue
            keys = tuple(match.expand(path).split("/"))
            layer = int(match.group(1)) if keys[0] == "layers" else None
            return keys, layer, self.transposed_kernels and keys[-1] == "kernel"
        return None

    def _compiled_names(self) -> list[tuple[re.Pattern, str]]:
        cached = type(self).__dict__.get("_weight_patterns")
        if cached is None:
            cached = [(re.compile(pattern), path) for pattern, path in self.weight_names.items()]
            type(self)._weight_patterns = cached
        return cached

    def split_fused(self, name: str, f):
        yield name, lambda: f.get_tensor(name)

    def precomputed(self, max_positions: int) -> dict:
        del max_positions
        return {}

    def greedy_head(self, params, last) -> Callable[[], jax.Array] | None:
        return None

    def head_screen(self, params) -> dict:
        del params
        return {}

    def forward(self, params, kv_cache, token_ids, meta, logits_indices, attention):
        """`hidden_states` then `logits`: (logits float32 [S, V], kv_cache)."""
        last, kv_cache = self.hidden_states(params, kv_cache, token_ids, meta, logits_indices, attention)
        return self.logits(params, last), kv_cache

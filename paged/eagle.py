"""Speculative decoding's `eagle` and `eagle3` methods: an EAGLE head (models/eagle.py) proposes from the
target's own hidden states.

The target's step writes every computed token's features into a pool beside its K/V, at the token's K/V slot
(ModelRunner `keep_hidden`): its final-normed hidden state for EAGLE-1, three of its intermediate residual
streams for EAGLE-3 (`aux_layers`). The features live exactly as long as the K/V they came with and need no
bookkeeping of their own. Drafting is the draft model's (paged/draft_model.py) with two changes:
position p reads the token after it (`shift` 1) and the target's feature at p, gathered from that pool by the
target's slots (through the head's `combine`: EAGLE-3's fc); the single-token passes then feed the head's own
output as the next feature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged.block_manager import SINK_BLOCK
from paged.draft_model import DraftModelProposer, _Row
from paged.models.eagle import load_eagle3_head, load_eagle_head
from paged.models.llama import LlamaForCausalLM


class EagleProposer(DraftModelProposer):
    shift = 1

    def __init__(self, speculative, config, target, target_config, runner, target_blocks, attention_name: str,
                 linear_backend: str, num_blocks: int, show_progress: bool = False):
        """`target`: the target model; `runner`: its ModelRunner (its parameters, and the hidden-state pool it
        fills); `target_blocks`: its BlockManager (where each position's feature lies)."""
        self.target, self.runner, self.target_blocks = target, runner, target_blocks
        if not isinstance(target, LlamaForCausalLM) or target_config.embed_scale or target_config.encoder_only:
            raise NotImplementedError(f"speculative decoding by an EAGLE head for {target_config.architecture} is not "
                                      "implemented: heads read the Llama-family decoders' features (Llama, Mistral, "
                                      "Qwen2/3, Phi-3, GLM), whose embedding is not scaled")
        if runner.hidden_pool is None:
            raise ValueError("the target's runner keeps no hidden states (ModelRunner keep_hidden)")
        super().__init__(speculative, config, target_config, attention_name, linear_backend, num_blocks,
                         show_progress)

    def _load(self, speculative, config, target_config, linear_backend: str, show_progress: bool):
        load = load_eagle3_head if speculative.method == "eagle3" else load_eagle_head
        model_config, head, params = load(speculative.model, target_config, self.runner.hidden_pool.dtype,
                                          linear_backend, show_progress)
        return model_config, head, params, np.dtype(self.runner.hidden_pool.dtype)

    def _target_head_params(self) -> dict:
        """The target's embedding table and LM head (only these reach the drafting program)."""
        return {name: self.runner.params[name] for name in ("embed_tokens", "lm_head") if name in self.runner.params}

    def _extra_inputs(self, rows: list[_Row], t_pad: int) -> tuple:
        slots = np.full(t_pad, SINK_BLOCK * self.target_blocks.block_size, np.int32)
        offset = 0
        for row in rows:
            start = row.sequence.num_computed_tokens
            slots[offset:offset + len(row.new_tokens)] = self.target_blocks.slots(row.request, start,
                                                                                 start + len(row.new_tokens))
            offset += len(row.new_tokens)
        return self.runner.hidden_pool, slots, self._target_head_params()

    def _propose_impl(self, params, kv_cache, token_ids, meta, logits_indices, decode_metas, hidden_pool,
                      target_slots, target_params):
        """int32 [S, k]: each row's k greedy proposals (rows past their own count hold junk)."""
        self.num_compilations += 1  # runs only while tracing
        head, target = self.model, self.target
        features = head.combine(params, jnp.take(hidden_pool, target_slots, axis=0))
        out, kv_cache = head.hidden_states(params, kv_cache, token_ids, meta, logits_indices, self.attention,
                                           features=features, target=target, target_params=target_params)
        rows = out.shape[0]
        propose = lambda out: head.propose(params, target, target_params, out)
        first = propose(out)
        if decode_metas is None:
            return kv_cache, first[:, None]
        every_row = jnp.arange(rows, dtype=jnp.int32)

        def one_token(carry, step_meta):
            tokens, previous, kv = carry
            out, kv = head.hidden_states(params, kv, tokens, step_meta, every_row, self.attention, features=previous,
                                         target=target, target_params=target_params)
            following = propose(out)
            return (following, out, kv), following

        (_, _, kv_cache), rest = jax.lax.scan(one_token, (first, out, kv_cache), decode_metas)
        return kv_cache, jnp.concatenate([first[:, None], rest.T], axis=1)

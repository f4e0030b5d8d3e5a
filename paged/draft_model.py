"""Speculative decoding's `draft_model` method: a smaller checkpoint with the target's vocabulary proposes
each speculating row's next k tokens, greedily, from a paged KV pool of its own.

Per step, one jitted program per token bucket does all of a step's drafting: a catch-up pass over the tokens
each row gained since its last proposal (the accepted proposals and the target's own token; the whole prompt
the first time), whose last position gives the first proposal, then k - 1 single-token passes, each feeding
the previous pass's argmax. Only the proposals are read back. One dispatch per step instead of k matters on
hosts where launching a step costs as much as running a small model.

The draft proposes its argmax: a proposal distribution that puts all its mass on one token, which the target
verifies exactly (ModelRunner._verify) for greedy and sampled requests alike.

The draft's K/V for proposals the target rejected are simply overwritten: each row remembers which tokens its
pool holds (`_DraftSequence`) and catches up from the first one verification changed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged.batch import Buckets
from paged.block_manager import SINK_BLOCK, BlockManager
from paged.models import get_attention_backend, load_model
from paged.models.attention import AttentionMetadata
from paged.models.builtin import builtin_model
from paged.models.config import load_model_config
from paged.models.layers import unrolled_layers
from paged.models.loader import resolve_dtype, resolve_model_path
from paged.request import PLACEHOLDER, Request
from paged.runner import kv_block_bytes
from paged.sampler import first_argmax


def _checkpoint(model: str) -> str:
    """A built-in model's directory, else `model` as given (a directory or hub id)."""
    builtin = builtin_model(model)
    return builtin[0] if builtin else model


def proposer_block_bytes(speculative, target_config, block_size: int, engine_dtype, target_dtype) -> int:
    """Bytes a model-based proposer keeps for each block of the target's KV pool (its own pool has as many
    blocks): a draft model's K/V in its dtype; an EAGLE head's K/V and the target's features it reads
    (ModelRunner `keep_hidden`: H, or 3H for EAGLE-3, a token), both in the target's dtype. 0 for n-gram.
    `engine_dtype`: the engine's dtype setting (a draft resolves "auto" to its own checkpoint's)."""
    from paged.models.eagle import head_config  # paged.eagle imports this module
    if speculative is None or speculative.method == "ngram":
        return 0
    model_dir = resolve_model_path(_checkpoint(speculative.model))
    if speculative.method == "draft_model":
        config = load_model_config(model_dir)
        return kv_block_bytes(config, block_size, resolve_dtype(engine_dtype, config))
    features = (3 if speculative.method == "eagle3" else 1) * target_config.hidden_size
    return kv_block_bytes(head_config(model_dir, speculative.method), block_size, target_dtype) + \
        block_size * features * np.dtype(target_dtype).itemsize


class _DraftSequence:
    """The draft pool's view of one target request: its pages (BlockManager reads page_row, block_ids and
    num_registered_blocks) and which tokens its K/V were computed from: the request's first `num_known`,
    then `proposed`, the draft's own proposals not verified yet. Position p reads token p + shift (a draft
    model: shift 0; an EAGLE head, which reads the next token beside the feature at p: 1)."""

    def __init__(self, shift: int):
        self.page_row: int | None = None
        self.block_ids: list[int] = []
        self.num_registered_blocks = 0
        self.num_known = 0
        self.proposed: list[int] = []
        self.shift = shift

    @property
    def num_computed_tokens(self) -> int:
        """Positions whose K/V are in the pool."""
        return max(self.num_known + len(self.proposed) - self.shift, 0)

    def keep_verified(self, target_tokens: list[int]) -> None:
        """Keeps the proposals the target's sequence now holds (their K/V stand) and drops the rest from the
        first that differs: the request's own tokens never change once verified."""
        agreed = 0
        for token in self.proposed:
            position = self.num_known + agreed
            if position >= len(target_tokens) or target_tokens[position] != token:
                break
            agreed += 1
        self.num_known += agreed
        self.proposed = []

    def forget(self) -> None:
        self.num_known = 0
        self.proposed = []


@dataclasses.dataclass
class _Row:
    request: Request
    sequence: _DraftSequence
    new_tokens: list[int]  # the tokens read at the positions caught up this step (from num_computed_tokens on)
    num_proposals: int  # 0: the catch-up did not fit this step; no proposals yet


class DraftModelProposer:
    """Loads the draft checkpoint beside the target and proposes for the scheduler (Scheduler's `propose`):
    `begin_step` drafts for every candidate at once, then each request's call returns its own proposals."""

    needs_known_tokens = True  # drafting reads the last token: a step in flight must be read back first
    shift = 0  # position p reads token p (an EAGLE head reads p + 1)

    def __init__(self, speculative, config, target_config, attention_name: str, linear_backend: str,
                 num_blocks: int, show_progress: bool = False):
        """`speculative`: the SpeculativeConfig (method "draft_model", `model` the draft checkpoint); `config`:
        the engine's EngineConfig; `target_config`: the target's ModelConfig (the draft must share its
        vocabulary); `num_blocks`: the draft pool's blocks (the target's: the draft holds the same tokens)."""
        platform = jax.default_backend()
        self.model_config, self.model, params, dtype = self._load(speculative, config, target_config, linear_backend,
                                                                  show_progress)
        self.attention = get_attention_backend(attention_name, platform)
        if (check := getattr(self.attention, "check_model", None)) is not None:
            check(self.model_config, dtype, dtype, config.block_size)
        self.params = {**params, **self.model.precomputed(config.max_model_len)}
        self.k = speculative.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.buckets = Buckets(config.max_num_batched_tokens, config.max_num_seqs,
                               rope_lengths=self.model_config.rope.length_dependent)
        max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.max_num_seqs, max_blocks_per_seq)
        cfg = self.model_config
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, config.block_size, cfg.head_dim)
        self.kv_cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        self.kv_pool_bytes = num_blocks * kv_block_bytes(cfg, config.block_size, dtype)
        self.sequences: dict[int, tuple[Request, _DraftSequence]] = {}  # id(request) -> its draft sequence
        self.proposals: dict[int, list[int]] = {}  # this step's, by id(request)
        self.num_compilations = 0
        self._propose = jax.jit(self._propose_impl, donate_argnums=(1,))

    def _load(self, speculative, config, target_config, linear_backend: str, show_progress: bool):
        """(config, model, params, dtype) of the draft checkpoint."""
        model_dir = _checkpoint(speculative.model)
        unroll = unrolled_layers(config.layer_loop, jax.default_backend())
        _, model_config, model, params, dtype = load_model(
            model_dir, config.dtype, show_progress, stacked_layers=not unroll, linear_backend=linear_backend)
        if model_config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {speculative.model!r} has a vocabulary of "
                             f"{model_config.vocab_size} tokens, the target {target_config.vocab_size}; a draft "
                             "model must share the target's tokenizer")
        if model_config.encoder_only:
            raise ValueError(f"speculative_config: the draft model {speculative.model!r} does not generate")
        return model_config, model, params, dtype

    # ---- the scheduler's interface ---------------------------------------------------------------------

    def begin_step(self, candidates: list[tuple[Request, int]], running: list[Request]) -> None:
        """Drafts up to `limit` tokens for each (request, limit) in one device program; forgets the draft
        sequences of requests no longer running (finished, aborted or preempted: their pages go back)."""
        self.proposals = {}
        live = {id(request) for request in running}
        for key in [key for key in self.sequences if key not in live]:
            self.block_manager.free(self.sequences.pop(key)[1])
        rows, budget = [], self.buckets.max_num_batched_tokens
        for request, limit in candidates:
            tokens = request.token_ids
            if limit <= 0 or not tokens or tokens[-1] == PLACEHOLDER or budget <= 0:
                continue
            _, sequence = self.sequences.setdefault(id(request), (request, _DraftSequence(self.shift)))
            sequence.keep_verified(tokens)
            new = tokens[sequence.num_computed_tokens + self.shift:]  # read at positions up to len - shift - 1
            if not new:
                continue
            count = min(limit, self.k, self.max_model_len - len(tokens))
            if len(new) > budget:  # a long catch-up (a prompt) goes in chunks, proposing once it is through
                new, count = new[:budget], 0
            # K/V for the positions caught up and then all but the last proposal.
            if not self.block_manager.allocate(sequence, sequence.num_computed_tokens + len(new) + max(count - 1, 0)):
                self.block_manager.free(sequence)
                sequence.forget()
                continue
            rows.append(_Row(request, sequence, list(new), count))
            budget -= len(new)
        if rows:
            self._draft(rows)

    def __call__(self, request: Request, limit: int) -> list[int]:
        return self.proposals.get(id(request), [])[:limit]

    # ---- drafting ---------------------------------------------------------------------------------------

    def _draft(self, rows: list[_Row]) -> None:
        catch_up, logits_indices = self._catch_up_inputs(rows)
        decode_metas = self._decode_metas(rows, logits_indices.shape[0])
        self.kv_cache, proposals = self._propose(self.params, self.kv_cache, self._catch_up_tokens(rows, catch_up),
                                                 self.attention.prepare(catch_up), logits_indices, decode_metas,
                                                 *self._extra_inputs(rows, catch_up.positions.shape[0]))
        proposals = np.asarray(proposals)
        for i, row in enumerate(rows):
            drafted = [int(t) for t in proposals[i, :row.num_proposals]]
            sequence = row.sequence
            sequence.num_known = sequence.num_computed_tokens + len(row.new_tokens) + self.shift
            sequence.proposed = drafted[:-1]  # the last proposal's K/V are not computed
            if row.num_proposals:
                self.proposals[id(row.request)] = drafted

    def _extra_inputs(self, rows: list[_Row], t_pad: int) -> tuple:
        """What `_propose_impl` reads beyond the draft's own inputs (an EAGLE head: the target's features)."""
        return ()

    def _catch_up_tokens(self, rows: list[_Row], meta: AttentionMetadata) -> np.ndarray:
        tokens = np.zeros(meta.positions.shape[0], np.int32)
        tokens[:sum(len(row.new_tokens) for row in rows)] = np.concatenate([row.new_tokens for row in rows])
        return tokens

    def _catch_up_inputs(self, rows: list[_Row]) -> tuple[AttentionMetadata, np.ndarray]:
        """The catch-up pass: every row's new tokens packed, padded to the token bucket."""
        manager, bs = self.block_manager, self.block_manager.block_size
        num_tokens = sum(len(row.new_tokens) for row in rows)
        t_pad = self.buckets.tokens(num_tokens)
        s_pad = self.buckets.seqs(t_pad)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, SINK_BLOCK * bs, np.int32)
        token_seq_ids = np.zeros(t_pad, np.int32)
        query_start = np.zeros(s_pad + 1, np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        logits_indices = np.zeros(s_pad, np.int32)
        page_tables = np.full((s_pad, manager.max_blocks_per_seq), SINK_BLOCK, np.int32)
        offset = 0
        for i, row in enumerate(rows):
            start = row.sequence.num_computed_tokens
            stop = start + len(row.new_tokens)
            span = slice(offset, offset + len(row.new_tokens))
            positions[span] = np.arange(start, stop)
            slot_mapping[span] = manager.slots(row.sequence, start, stop)
            token_seq_ids[span] = i
            page_tables[i] = manager.page_table[row.sequence.page_row]
            offset += len(row.new_tokens)
            query_start[i + 1] = offset
            seq_lens[i] = stop
            logits_indices[i] = offset - 1
        query_start[len(rows) + 1:] = offset
        lengths = [len(row.new_tokens) for row in rows]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, positions=positions, token_seq_ids=token_seq_ids, page_tables=page_tables,
            query_start=query_start, seq_lens=seq_lens,
            num_decode_rows=np.asarray(sum(n == 1 for n in lengths), np.int32),
            num_prefill_rows=np.asarray(sum(n > 1 for n in lengths), np.int32),
            # A length-dependent rope follows each position here (not the prompt's length, as the target's
            # prompt pass does): the draft only proposes, so its rope need not match the target's schedule.
            rope_lengths=positions + 1 if self.buckets.rope_lengths else None)
        return meta, logits_indices

    def _decode_metas(self, rows: list[_Row], s_pad: int) -> AttentionMetadata | None:
        """The k - 1 single-token passes' metadata, stacked on a leading axis (None when k is 1). Row i's
        token j sits at position len + j - 1 (len: its tokens after the catch-up). A row past its own proposal
        count, and every padded row, still runs (one token per row keeps the shape) but writes only to the
        sink block."""
        if self.k == 1:
            return None
        manager, bs = self.block_manager, self.block_manager.block_size
        page_tables = np.full((s_pad, manager.max_blocks_per_seq), SINK_BLOCK, np.int32)
        lengths = np.ones(s_pad, np.int64)  # a padded row: position 0 of an all-sink sequence
        counts = np.zeros(s_pad, np.int64)
        for i, row in enumerate(rows):
            page_tables[i] = manager.page_table[row.sequence.page_row]
            lengths[i] = row.sequence.num_computed_tokens + len(row.new_tokens)
            counts[i] = row.num_proposals
        # [k - 1, S]: pass j (from 1) of row i puts its token at position len_i + j - 1.
        live = np.arange(1, self.k)[:, None] < counts[None, :]
        positions = np.where(live, lengths[None, :] + np.arange(self.k - 1)[:, None], 0).astype(np.int32)
        blocks = page_tables[np.arange(s_pad)[None, :], positions // bs]
        slot_mapping = np.where(live, blocks * bs + positions % bs, SINK_BLOCK * bs).astype(np.int32)
        passes = self.k - 1
        stacked = AttentionMetadata(
            slot_mapping=slot_mapping, positions=positions,
            token_seq_ids=np.broadcast_to(np.arange(s_pad, dtype=np.int32), (passes, s_pad)),
            page_tables=np.where(live[:, :, None], page_tables[None], SINK_BLOCK).astype(np.int32),
            query_start=np.broadcast_to(np.arange(s_pad + 1, dtype=np.int32), (passes, s_pad + 1)),
            seq_lens=positions + 1, num_decode_rows=np.full(passes, s_pad, np.int32),
            num_prefill_rows=np.zeros(passes, np.int32),
            rope_lengths=positions + 1 if self.buckets.rope_lengths else None)
        # The backend's own data from the first pass, for every pass: the passes share their layout (one token
        # per row), which is all a backend's `prepare` reads (XlaAttention's TailSplit).
        first = self.attention.prepare(jax.tree.map(lambda leaf: leaf[0], stacked)).backend_data
        return dataclasses.replace(stacked, backend_data=jax.tree.map(
            lambda leaf: np.broadcast_to(leaf, (passes, *np.shape(leaf))), first))

    def _propose_impl(self, params, kv_cache, token_ids, meta, logits_indices, decode_metas):
        """int32 [S, k]: each row's k greedy proposals (rows past their own count hold junk)."""
        self.num_compilations += 1  # runs only while tracing
        last, kv_cache = self.model.hidden_states(params, kv_cache, token_ids, meta, logits_indices, self.attention)
        first = first_argmax(self.model.logits(params, last))
        if decode_metas is None:
            return kv_cache, first[:, None]
        rows = jnp.arange(first.shape[0], dtype=jnp.int32)

        def one_token(carry, step_meta):
            tokens, kv = carry
            last, kv = self.model.hidden_states(params, kv, tokens, step_meta, rows, self.attention)
            following = first_argmax(self.model.logits(params, last))
            return (following, kv), following

        (_, kv_cache), rest = jax.lax.scan(one_token, (first, kv_cache), decode_metas)
        return kv_cache, jnp.concatenate([first[:, None], rest.T], axis=1)

    def precompile(self) -> None:
        """Compiles the drafting program for every token bucket (all-padding inputs touch only the sink)."""
        for t_pad, s_pad in self.buckets.all_shapes():
            meta, logits_indices = self._padding_inputs(t_pad, s_pad)
            self.kv_cache, _ = self._propose(self.params, self.kv_cache, np.zeros(t_pad, np.int32),
                                             self.attention.prepare(meta), logits_indices,
                                             self._decode_metas([], s_pad), *self._extra_inputs([], t_pad))

    def _padding_inputs(self, t_pad: int, s_pad: int) -> tuple[AttentionMetadata, np.ndarray]:
        width = self.block_manager.max_blocks_per_seq
        zeros = lambda *shape: np.zeros(shape, np.int32)
        meta = AttentionMetadata(
            slot_mapping=np.full(t_pad, SINK_BLOCK * self.block_manager.block_size, np.int32), positions=zeros(t_pad),
            token_seq_ids=zeros(t_pad), page_tables=np.full((s_pad, width), SINK_BLOCK, np.int32),
            query_start=zeros(s_pad + 1), seq_lens=zeros(s_pad), num_decode_rows=np.asarray(0, np.int32),
            num_prefill_rows=np.asarray(0, np.int32), rope_lengths=np.ones(t_pad, np.int32)
            if self.buckets.rope_lengths else None)
        return meta, zeros(s_pad)

"""A request as a user gives it (text or token ids, SamplingParams) in, validated `Request`s out: tokenized,
checked against the model (vocabulary, max_model_len, max_num_seqs), one child per sample of n, each with its
own seed, detokenizer and grammar matcher. Raises ValueError (InvalidParameter naming the field) and touches
no engine state."""

from __future__ import annotations

import numpy as np

from paged.chat import text_token_ids
from paged.config import EngineConfig
from paged.detokenizer import IncrementalDetokenizer
from paged.grammar import GrammarCompiler
from paged.prefix_keys import prefix_root
from paged.request import ParentRequest, Request
from paged.pooling_params import PoolingModel, PoolingParams
from paged.sampling_params import InvalidParameter, SamplingParams


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"could not load a tokenizer from {path!r}: {type(exc).__name__}: {exc}") from exc


class InputProcessor:
    def __init__(self, config: EngineConfig, vocab_size: int, tokenizer, eos_token_ids: tuple[int, ...],
                 grammars: GrammarCompiler | None, rope_length_class=lambda prompt_len: None):
        """`rope_length_class(prompt_len)`: for a rope whose frequencies follow the length, what a prompt of
        that length rotates with (None: the base frequencies); prompts that differ here share no cached K/V."""
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.rope_length_class = rope_length_class
        self._seed_rng = np.random.default_rng(config.seed)  # unseeded requests' seeds
        self.pooling: PoolingModel | None = None  # a pooling model's task and limits (set by the engine)

    def make_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams, cache_salt: str | None = None,
                     tenant: str | None = None, lora_request=None) -> ParentRequest:
        """`lora_request`: the adapter it runs with (checked by the engine); its K/V are cached apart."""
        prompt_token_ids = self._prompt_ids(prompt, prompt_token_ids)
        vocab, max_model_len = self.vocab_size, self.config.max_model_len
        if len(prompt_token_ids) >= max_model_len:  # first: a cheap refusal for a huge prompt
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate "
                             f"within max_model_len={max_model_len}")
        self._check_vocab(prompt_token_ids)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameter("cache_salt", "cache_salt must be a non-empty string if provided")
        root = prefix_root(cache_salt, self.rope_length_class(len(prompt_token_ids)),
                           lora_request.lora_name if lora_request is not None else None)
        params.check_limits(self.config)
        params.check_vocab(vocab)
        if params.n > self.config.max_num_seqs:
            raise InvalidParameter("n", f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        constraint = params.structured_outputs  # compiled (or found cached) by the first sample's matcher below
        if constraint is not None and self.grammars is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        length_limit = max_model_len
        if params.max_tokens is not None:
            length_limit = min(length_limit, len(prompt_token_ids) + params.max_tokens)
        children = []
        for index in range(params.n):
            # Each sample gets its own stream: seed + index when seeded (as vLLM does), else a fresh draw.
            seed = (params.seed + index) % 2**32 if params.seed is not None else int(self._seed_rng.integers(2**32))
            detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                           if self.tokenizer is not None else None)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, prompt, [int(t) for t in prompt_token_ids], params, seed,
                                    detokenizer, self.eos_token_ids, index=index, length_limit=length_limit,
                                    grammar=self.grammars.matcher(constraint) if constraint is not None else None,
                                    prefix_root=root, tenant=tenant, cache_salt=cache_salt,
                                    lora_request=lora_request))
        return ParentRequest(request_id, children)

    def make_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                             params: PoolingParams, tenant: str | None = None,
                             token_type_ids: list[int] | None = None) -> ParentRequest:
        """A pooling model's request: its prompt (cut to its last `truncate_prompt_tokens` tokens if asked),
        computed whole in one step; its output is the pooled vector, no token is sampled."""
        params.validate()
        params = self.pooling.resolve(params)
        prompt_token_ids = self._prompt_ids(prompt, prompt_token_ids)
        max_model_len = self.config.max_model_len
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = max_model_len if keep == -1 else keep
            if keep > max_model_len:
                raise InvalidParameter("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} exceeds "
                                       f"max_model_len={max_model_len}")
            prompt_token_ids = prompt_token_ids[-keep:]
            token_type_ids = token_type_ids[-keep:] if token_type_ids is not None else None
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(f"the input has {len(prompt_token_ids)} tokens, more than max_model_len="
                             f"{max_model_len} (truncate_prompt_tokens cuts it to its last tokens)")
        self._check_vocab(prompt_token_ids)
        # Never sampled: a pooling row's step reads hidden states only. Its length limit is its prompt, so the
        # scheduler never gives it a token to generate.
        request = Request(request_id, prompt, [int(t) for t in prompt_token_ids], _NOT_SAMPLED, 0, None,
                          length_limit=len(prompt_token_ids), tenant=tenant)
        request.pooling = params
        if token_type_ids is not None and any(token_type_ids):
            if len(token_type_ids) != len(prompt_token_ids):
                raise ValueError(f"token_type_ids has {len(token_type_ids)} entries for {len(prompt_token_ids)} tokens")
            request.token_type_ids = [int(t) for t in token_type_ids]
        return ParentRequest(request_id, [request])

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = text_token_ids(self.tokenizer, prompt)
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        return prompt_token_ids

    def _check_vocab(self, prompt_token_ids: list[int]) -> None:
        vocab = self.vocab_size
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in prompt_token_ids):
            bad = next(t for t in prompt_token_ids
                       if not (isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab))
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")


_NOT_SAMPLED = SamplingParams(max_tokens=1, temperature=0.0)

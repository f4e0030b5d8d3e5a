"""The offline entry point, mirroring vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import inspect
from typing import Sequence

from paged.models.progress import progress

from paged.chat import chat_prompt_token_ids
from paged.config import EngineConfig
from paged.engine import LLMEngine
from paged.lora import LoRARequest
from paged.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                           ScoringRequestOutput)
from paged.pooling_params import PoolingParams
from paged.scoring import cosine, pair_encoding, score_pairs
from paged.reasoning import REASONING_PARSERS, prepare_reasoning
from paged.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    """Generates text from a Hugging Face checkpoint (a local directory or a hub id).

    `model="paged-tiny-llama"` builds a tiny random Llama offline (handy for trying the API).
    """

    def __init__(self, model: str, show_progress: bool = True, reasoning_parser: str | None = None,
                 **engine_options):
        """`engine_options`: any field of paged.EngineConfig (tokenizer, dtype, seed, block_size, max_num_seqs,
        enable_prefix_caching, attention_backend, ...; see its help text), the same options the command line
        takes as flags.

        `reasoning_parser` ("deepseek_r1" or "qwen3", as `paged serve --reasoning-parser`): `chat` separates a
        reasoning model's thinking from its answer (each output's `reasoning_content` and `content`), and a
        structured-output constraint shapes the answer only."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {reasoning_parser!r}")
        self.reasoning_parser = reasoning_parser
        if engine_options.get("data_parallel_size", 1) != 1 and "data_parallel_rank" not in engine_options:
            # As with vLLM's offline data parallelism, each LLM is one replica: say which.
            raise ValueError("LLM runs one engine: with data_parallel_size > 1 pass its data_parallel_rank (one "
                             "LLM per replica), or serve every replica with `paged serve --data-parallel-size`")
        self.engine = LLMEngine(model, show_progress=show_progress, **engine_options)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_leader(self) -> bool:
        """False on the followers of a multi-host run, which call `follow()` while process 0 generates."""
        return self.engine.is_leader

    def follow(self) -> None:
        """On a follower of a multi-host run: runs process 0's steps on this process's devices until it ends."""
        self.engine.follow()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in input order.

        prompts: a string, a list of strings, or dicts {"prompt_token_ids": [...]} (optionally with "prompt") or
          {"prompt": "..."}; a dict may carry "cache_salt" (its prefix-cache blocks are shared only with
          prompts of the same salt).
        lora_request: the LoRA adapter every prompt runs with, or one per prompt (None: the base model); the
          LLM must have been made with enable_lora=True.
        Every prompt and parameter set is validated before any work starts, so a bad one raises ValueError
        and nothing runs.
        """
        if not self.is_leader:
            raise RuntimeError("this process follows process 0 in a multi-host run: call follow(); process 0 "
                               "generates")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        lora_request = list(lora_request)
        if len(lora_request) != len(prompts):
            raise ValueError("The lengths of prompts and lora_request must be the same.")

        requests = []
        for index, (prompt, params, adapter) in enumerate(zip(prompts, sampling_params, lora_request)):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params[{index}] is a {type(params).__name__}, not SamplingParams")
            text, token_ids = _split_prompt(prompt, index)
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            params.validate()
            try:
                requests.append(self.engine.make_request(str(next(self._ids)), text, token_ids, params, salt,
                                                         lora_request=adapter))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
        for request in requests:
            self.engine.add_request(request)
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them, then generates (with
        `lora_request` as `generate` takes it).

        With the LLM's `reasoning_parser`, each output's `reasoning_content` holds the thinking (None when it
        wrote none) and `content` the answer; `text` is the whole output either way."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            ids = chat_prompt_token_ids(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template)
            prompts.append({"prompt_token_ids": ids, "prompt": tokenizer.decode(ids)})
        if self.reasoning_parser is None:
            return self.generate(prompts, sampling_params, use_tqdm, lora_request)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} conversations")
        # Each conversation's own copy: where its constraint starts depends on how its prompt ends.
        sampling_params = [copy.copy(params) for params in sampling_params]
        starts_inside = []
        for prompt, params in zip(prompts, sampling_params):
            tail = tokenizer.decode(prompt["prompt_token_ids"][-16:])
            starts_inside.append(prepare_reasoning(self.reasoning_parser, tail, params)[1])
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        parser = REASONING_PARSERS[self.reasoning_parser]
        for output, inside in zip(outputs, starts_inside):
            for completion in output.outputs:
                split = parser.split(completion.text, inside, final=True)
                completion.reasoning_content, completion.content = split.reasoning, split.content
        return outputs

    # ---- pooling models: embeddings, classification, scores (vLLM's signatures) --------------------------

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
               pooling_task: str | None = None, truncate_prompt_tokens: int | None = None
               ) -> list[PoolingRequestOutput]:
        """A pooling model's vector for every prompt (`outputs.data`, float32 numpy), in input order: an
        embedding model's embeddings, a classifier's scores. Prompts as for `generate`; every one is validated
        before any work starts."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        pooling_params = list(pooling_params)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        items = []
        for index, (prompt, params) in enumerate(zip(prompts, pooling_params)):
            if not isinstance(params, PoolingParams):
                raise ValueError(f"pooling_params[{index}] is a {type(params).__name__}, not PoolingParams")
            changes = {"task": pooling_task} if pooling_task is not None else {}
            if truncate_prompt_tokens is not None:
                changes["truncate_prompt_tokens"] = truncate_prompt_tokens
            text, token_ids = _split_prompt(prompt, index)
            items.append((text, token_ids, None, dataclasses.replace(params, **changes)))
        return self._pool(items, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, a list of floats), in input order."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed",
                              truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """A classifier's per-label probabilities for each prompt (`outputs.probs`), in input order."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify",
                              truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None
              ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: one text against many (1 -> N) or pairwise (N -> N).

        A cross-encoder (a classifier with one label) reads each pair as one input (the tokenizer's pair
        encoding) and scores it; an embedding model scores the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        params = pooling_params or PoolingParams()
        if self.engine.pooling_task == "classify":
            tokenizer = self.get_tokenizer()
            items = []
            for first, second in pairs:
                encoded = pair_encoding(tokenizer, first, second)
                items.append((None, encoded["input_ids"], encoded.get("token_type_ids"),
                              dataclasses.replace(params, task="score",
                                                  truncate_prompt_tokens=truncate_prompt_tokens)))
            outputs = self._pool(items, use_tqdm)
            if outputs and len(outputs[0].outputs.data) != 1:
                raise ValueError(f"scoring needs a classifier with one label; this one has "
                                 f"{len(outputs[0].outputs.data)}")
            return [ScoringRequestOutput.from_base(o, float(o.outputs.data[0])) for o in outputs]
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        vectors = dict(zip(texts, self.encode(texts, params, use_tqdm=use_tqdm, pooling_task="embed",
                                              truncate_prompt_tokens=truncate_prompt_tokens)))
        return [ScoringRequestOutput.from_base(vectors[second], cosine(vectors[first].outputs.data,
                                                                       vectors[second].outputs.data))
                for first, second in pairs]

    def _pool(self, items: list, use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Runs (text, token ids, token type ids, PoolingParams) items; their outputs in order."""
        if not self.is_leader:
            raise RuntimeError("this process follows process 0 in a multi-host run: call follow()")
        requests = []
        for index, (text, token_ids, token_types, params) in enumerate(items):
            params.validate()
            try:
                requests.append(self.engine.make_pooling_request(str(next(self._ids)), text, token_ids, params,
                                                                 token_type_ids=token_types))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
        for request in requests:
            self.engine.add_request(request)
        return self._run(requests, use_tqdm, desc="Pooling")

    # ---- weights and memory: JAX-native checkpoints and a training loop's hooks --------------------------

    def save(self, path: str) -> None:
        """Writes the loaded model as an Orbax checkpoint (weights as held: quantized codes included; config and
        tokenizer beside them) into the new directory `path`; `LLM(path)` and `paged serve path` restore it,
        each device reading only its shards."""
        self.engine.save(path)

    def get_params(self) -> dict:
        """The model's weights, a tree of device arrays in its own layout (what update_weights takes)."""
        return self.engine.get_params()

    def update_weights(self, params: dict | str) -> None:
        """Swaps in new weights, as a trainer produces them: a tree shaped as get_params() (layers stacked or
        a list of layers), or a checkpoint path. Same devices and shardings, no recompiling; the prefix cache
        is cleared. The engine must be idle."""
        self.engine.update_weights(params)

    def sleep(self) -> None:
        """Releases the KV pool's device memory (vLLM's sleep mode, level 1 without moving the weights);
        generate() is refused until wake_up()."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def _run(self, requests, use_tqdm: bool, desc: str = "Generating") -> list:
        results: dict = {}
        with progress(total=len(requests), desc=desc, unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update()
        return [results[r.request_id] for r in requests]


def _split_prompt(prompt: PromptType, index: int) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError(f"prompt {index}: a dict prompt needs 'prompt_token_ids' or 'prompt'")
    raise ValueError(f"prompt {index}: expected a string or a dict, got {type(prompt).__name__}")


def _signature_with_engine_options(init) -> inspect.Signature:
    """LLM.__init__'s signature with every EngineConfig field as a keyword (for help() and editors)."""
    base = inspect.signature(init)
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(EngineConfig)]
    plain = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return base.replace(parameters=[*plain, *options])


LLM.__init__.__signature__ = _signature_with_engine_options(LLM.__init__)

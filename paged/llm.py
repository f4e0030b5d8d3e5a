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
from paged.outputs import RequestOutput
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
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in input order.

        prompts: a string, a list of strings, or dicts {"prompt_token_ids": [...]} (optionally with "prompt") or
          {"prompt": "..."}; a dict may carry "cache_salt" (its prefix-cache blocks are shared only with
          prompts of the same salt).
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

        requests = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params[{index}] is a {type(params).__name__}, not SamplingParams")
            text, token_ids = _split_prompt(prompt, index)
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            params.validate()
            try:
                requests.append(self.engine.make_request(str(next(self._ids)), text, token_ids, params, salt))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
        for request in requests:
            self.engine.add_request(request)
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them, then generates.

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
            return self.generate(prompts, sampling_params, use_tqdm)
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
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        parser = REASONING_PARSERS[self.reasoning_parser]
        for output, inside in zip(outputs, starts_inside):
            for completion in output.outputs:
                split = parser.split(completion.text, inside, final=True)
                completion.reasoning_content, completion.content = split.reasoning, split.content
        return outputs

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

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with progress(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
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

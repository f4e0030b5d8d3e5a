"""The offline entry point, mirroring vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from paged.engine import LLMEngine
from paged.outputs import RequestOutput
from paged.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    """Generates text from a Hugging Face checkpoint (a local directory or a hub id).

    `model="paged-tiny-llama"` builds a tiny random Llama offline (handy for trying the API).
    """

    def __init__(self, model: str, tokenizer: str | None = None, dtype: Any = "auto", seed: int = 0,
                 block_size: int = 16, num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, attention_backend: str = "auto",
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", swap_space: float = 4.0, layer_loop: str = "auto",
                 async_scheduling: bool = True, compilation_cache_dir: str | None = "auto",
                 tensor_parallel_size: int = 1, quantization: str | None = None, show_progress: bool = True):
        self.engine = LLMEngine(
            model, tokenizer=tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            quantization=quantization, show_progress=show_progress, seed=seed, block_size=block_size,
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, attention_backend=attention_backend,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode, swap_space=swap_space, layer_loop=layer_loop,
            async_scheduling=async_scheduling, compilation_cache_dir=compilation_cache_dir)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in input order.

        prompts: a string, a list of strings, or dicts {"prompt_token_ids": [...]} (optionally with "prompt").
        Every prompt and parameter set is validated before any work starts, so a bad one raises ValueError
        and nothing runs.
        """
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
            params.validate()
            try:
                requests.append(self.engine.make_request(str(next(self._ids)), text, token_ids, params))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
        for request in requests:
            self.engine.add_request(request)
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                chat_template=chat_template, tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids), "prompt": tokenizer.decode(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
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

"""vLLM as a baseline in `benchmarks.throughput` (`--vllm-python`): the same model and requests, run by vLLM.

    python benchmarks/vllm_baseline.py REQUEST.json RESULT.json

Run by vLLM's own interpreter (vLLM and this engine need different torch and jax stacks, so they do not share
a virtual environment): the parent writes REQUEST.json ({"model", "dtype", "max_model_len", "seed", "prompts",
"warmup_prompts", "output_lens"}) and reads RESULT.json ({"seconds", "warmup_seconds", "startup_seconds",
"version", "output_tokens"}). This file imports only the standard library and vLLM.

What is held equal to the paged run: greedy decoding with every request running exactly its output length
(ignore_eos), prefix caching off, the warm-up on other token ids of the same lengths (so nothing of the timed
run can come from a cache), the timed run one `generate` call over all requests.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Python put this file's directory first on the path, where benchmarks/kernels.py would shadow the `kernels`
# package vLLM imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        request = json.load(f)
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              seed=request["seed"], enable_prefix_caching=False, skip_tokenizer_init=False)
    startup = time.perf_counter() - start
    sampling = request.get("sampling", {"temperature": 0.0})
    params = [SamplingParams(**sampling, max_tokens=n, ignore_eos=True) for n in request["output_lens"]]
    as_prompts = lambda lists: [TokensPrompt(prompt_token_ids=ids) for ids in lists]
    llm.generate(as_prompts(request["warmup_prompts"]), params, use_tqdm=False)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(as_prompts(request["prompts"]), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "warmup_seconds": warmup, "startup_seconds": startup,
                   "version": vllm.__version__, "output_tokens": produced}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))

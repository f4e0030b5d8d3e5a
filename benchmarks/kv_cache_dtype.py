"""KV pools in other dtypes (bfloat16, fp8) against the model's own: greedy agreement over long generations and
the error in the chosen tokens' log-probabilities, on the same requests side by side.

For each request, both pools generate greedily; agreement is the length of the common prefix of the two token
sequences (after the first difference the contexts differ, so later tokens are not comparable). Within that
prefix both engines scored the same context, so the difference of the chosen token's logprob (a log-softmax
of the logits) measures what the fp8 rounding of keys and values did to the logits.

    paged bench kv_cache_dtype [--model DIR] [--kv-cache-dtypes bfloat16 fp8 fp8_e5m2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from paged.benchmarks.common import default_model_dir, random_workload


def _generate(model_dir: str, kv_cache_dtype: str, prompts, output_len: int, dtype: str):
    from paged import LLM, SamplingParams
    llm = LLM(model_dir, kv_cache_dtype=kv_cache_dtype, dtype=dtype, show_progress=False,
              max_model_len=max(len(p) for p in prompts) + output_len, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    pool = llm.engine.worker.runner.kv_cache[0]
    completions = [o.outputs[0] for o in outputs]
    tokens = [c.token_ids for c in completions]
    logprobs = [[step[t].logprob for t, step in zip(c.token_ids, c.logprobs)] for c in completions]
    return tokens, logprobs, str(pool.dtype), llm.engine.block_manager.num_blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the 30M benchmark model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["bfloat16", "fp8", "fp8_e5m2"],
                        help="pools compared with the model's own dtype")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from paged.models import load_model_config
    model_dir = args.model or default_model_dir()
    vocab = load_model_config(model_dir).vocab_size
    workload = random_workload(args.num_requests, tuple(args.input_len), (args.output_len, args.output_len), vocab,
                               args.seed)
    base = _generate(model_dir, "auto", workload.prompts, args.output_len, args.dtype)
    report = {"model": model_dir, "dtype": args.dtype, "pool": base[2], "blocks": base[3],
              "requests": args.num_requests, "output_len": args.output_len, "against": {}}
    for option in args.kv_cache_dtypes:
        other = _generate(model_dir, option, workload.prompts, args.output_len, args.dtype)
        agreed, errors = [], []
        for a, b, la, lb in zip(base[0], other[0], base[1], other[1]):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            agreed.append(n)
            # Token n was scored on the same context too (only its choice differs): compare up to it.
            errors += [abs(x - y) for x, y in zip(la[:n + 1], lb[:n + 1])]
        result = {"pool": other[2], "blocks": other[3], "agreed_prefix": agreed,
                  "fully_agreed_requests": sum(n == args.output_len for n in agreed),
                  "agreed_token_fraction": sum(agreed) / (args.num_requests * args.output_len),
                  "chosen_logprob_error_max": max(errors), "chosen_logprob_error_mean": float(np.mean(errors))}
        report["against"][option] = result
        print(f"{base[2]} vs {other[2]} pool: {result['fully_agreed_requests']}/{args.num_requests} requests agree "
              f"on all {args.output_len} tokens; agreed prefix median {int(np.median(agreed))}, min {min(agreed)}; "
              f"{result['agreed_token_fraction']:.1%} of tokens before the first difference; chosen-token logprob "
              f"error on shared contexts max {result['chosen_logprob_error_max']:.4f}, mean "
              f"{result['chosen_logprob_error_mean']:.5f} nats")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

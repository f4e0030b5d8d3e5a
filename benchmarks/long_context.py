"""Long context: one prompt of 32k-128k tokens through the engine, and decode steps at a 128k context.

    paged bench long_context [--lengths 32768 65536 131072] [--output-tokens 16] [--chunk 2048]
        [--decode-shape qwen2.5-0.5b] [--decode-contexts 512 32768 131008] [--decode-steps 24] [--json out.json]

Prompts (`--lengths`): each length runs in a fresh process (so its peak memory is its own) on a small random
Llama (2 layers, hidden 128, 4 query and 2 KV heads of head_dim 32, float32), with one sequence
(`max_num_seqs=1`, so the KV pool is sized for it: `max_model_len` = the prompt plus its output), no prefix
cache, chunked prefill of `--chunk` tokens a step: each chunk's attention reads the pages written so far.
Reported per length: the time to the first token (the whole prefill), decode tokens/s after it, the process's
peak resident memory (ru_maxrss) and its resident memory before the engine was built, and the KV pool's bytes.
Memory grows linearly if the peak minus the pool stays flat from one length to the next.

Decode (`--decode-shape`): decode steps of one sequence at each of `--decode-contexts` tokens on a
random-weight checkpoint of a real model's shape (bfloat16), with YaRN (factor 4 over its 32,768 positions, as
Qwen2.5's model card sets it for 128k). Prefilling 128k tokens at that shape takes hours on a few CPU cores,
so the context is restored instead, through the engine's swap-in path: the request starts with its first
`context - 1` tokens' K/V in host memory (random values; a step's cost does not depend on them), the engine
copies them into the pool and computes the last prompt token, then decodes. Reported: the median decode step
and tokens/s per context, all in one process, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from paged.benchmarks.common import report

CHILD = """
import json, sys
from paged.benchmarks.long_context import run_prompt
print("RESULT " + json.dumps(run_prompt(*map(int, sys.argv[1:4]))))
"""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_prompt(length: int, output_tokens: int, chunk: int) -> dict:
    """One prompt of `length` tokens and `output_tokens` greedy tokens after it, in this process."""
    from paged import LLM, SamplingParams
    from paged.models.tiny import create_tiny_llama

    max_model_len = length + output_tokens
    model_dir = create_tiny_llama(os.path.join(tempfile.mkdtemp(), "tiny"), hidden_size=128, intermediate_size=256,
                                  num_heads=4, num_kv_heads=2, max_position_embeddings=max_model_len)
    rss_before = _rss_bytes()
    llm = LLM(model_dir, max_model_len=max_model_len, max_num_seqs=1, max_num_batched_tokens=chunk,
              enable_prefix_caching=False, show_progress=False)
    engine = llm.engine
    rss_engine = _rss_bytes()
    vocab = engine.model_config.vocab_size
    tokens = np.random.default_rng(length).integers(2, vocab, length).tolist()
    engine.add_request(engine.make_request("long", None, tokens, SamplingParams(
        temperature=0, max_tokens=output_tokens, ignore_eos=True)))
    start = time.perf_counter()
    first = None
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if first is None and outputs and outputs[0].outputs[0].token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    pool = sum(int(array.nbytes) for array in engine.worker.runner.kv_cache)
    return dict(prompt_tokens=length, output_tokens=output_tokens, chunk=chunk, steps=steps,
                time_to_first_token_s=first - start,
                decode_tokens_per_s=(output_tokens - 1) / (end - first) if output_tokens > 1 else None,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                rss_before_engine_bytes=rss_before, rss_after_engine_bytes=rss_engine, kv_pool_bytes=pool,
                kv_blocks=engine.block_manager.num_blocks)


def _prompt_in_child(length: int, output_tokens: int, chunk: int) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(length), str(output_tokens), str(chunk)],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": os.environ.get(
                             "JAX_PLATFORMS", "cpu")})
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the {length}-token run failed:\n{run.stderr[-3000:]}")


def run_decode(model_dir: str, contexts: list[int], steps: int, dtype: str = "bfloat16") -> dict:
    """Decode steps of one sequence at each context, restored through swap-in (see the module docstring)."""
    from paged import LLM, SamplingParams

    with open(os.path.join(model_dir, "config.json")) as f:
        base = json.load(f)["max_position_embeddings"]
    factor = 4.0
    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": base}}
    max_model_len = int(base * factor)
    if max(contexts) + steps + 1 > max_model_len:
        raise ValueError(f"--decode-contexts and --decode-steps must fit max_model_len={max_model_len}")
    llm = LLM(model_dir, dtype=dtype, max_model_len=max_model_len, max_num_seqs=1, enable_prefix_caching=False,
              hf_overrides=overrides, preemption_mode="swap", show_progress=False)
    engine = llm.engine
    mover = engine.worker.mover
    k_pool = engine.worker.runner.kv_cache[0]
    block_size = engine.block_manager.block_size
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    # A few random blocks tiled over the context: distinct addresses, values of a realistic scale.
    layers, heads, _, _, head_dim = k_pool.shape
    seed_blocks = (rng.standard_normal((layers, heads, 64, block_size, head_dim)) * 0.5).astype(k_pool.dtype)
    rows = []
    for context in contexts:
        tokens = rng.integers(2, vocab, context).tolist()
        parent = engine.make_request(f"ctx{context}", None, tokens, SamplingParams(
            temperature=0, max_tokens=steps + 2, ignore_eos=True))
        restored = -(-(context - 1) // block_size)
        kv = np.tile(seed_blocks, (1, 1, -(-restored // 64), 1, 1))[:, :, :restored]
        leader = parent.leader
        leader.swapped_kv = (kv, kv)
        leader.num_computed_tokens = context - 1
        mover.swapped_blocks += restored  # as swap_out would have counted them
        engine.add_request(parent)
        times = []
        generated = 0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            for output in engine.step():
                generated = len(output.outputs[0].token_ids)
            times.append(time.perf_counter() - start)
        # The first step computes the last prompt token and the second may still warm up; the last only collects
        # the token in flight (async scheduling).
        decode = times[2:-1]
        median = float(np.median(decode))
        rows.append(dict(context=context, generated=generated, decode_steps=len(decode), median_step_s=median,
                         tokens_per_s=1.0 / median, kv_bytes_read_per_step=int(
                             2 * context * layers * heads * head_dim * np.dtype(k_pool.dtype).itemsize)))
        print(f"decode at {context:>7} tokens: {median * 1e3:7.2f} ms a step, {1.0 / median:6.2f} tok/s",
              file=sys.stderr, flush=True)
    return dict(dtype=dtype, rope_scaling=overrides["rope_scaling"], max_model_len=max_model_len, rows=rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[32768, 65536, 131072])
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens per step (max_num_batched_tokens)")
    parser.add_argument("--decode-shape", default="qwen2.5-0.5b", help="a benchmarks/shapes.py shape ('' skips)")
    parser.add_argument("--decode-contexts", type=int, nargs="*", default=[512, 32768, 131008])
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    result = dict(benchmark="long_context", device=str(jax.devices()[0].device_kind), prompts=[])
    for length in args.lengths:
        row = _prompt_in_child(length, args.output_tokens, args.chunk)
        result["prompts"].append(row)
        print(f"prompt of {length:>7} tokens: first token after {row['time_to_first_token_s']:7.1f} s, peak RSS "
              f"{row['peak_rss_bytes'] / 2**20:7.0f} MiB (KV pool {row['kv_pool_bytes'] / 2**20:6.0f} MiB)",
              file=sys.stderr, flush=True)
    if args.decode_shape and args.decode_contexts:
        from paged.benchmarks.shapes import model_shape_dir
        result["decode"] = dict(shape=args.decode_shape, **run_decode(
            model_shape_dir(args.decode_shape), args.decode_contexts, args.decode_steps))
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV memory utilization of the paged cache against contiguous allocation, on one mixed-length workload.

Runs the real engine (the tiny offline model: memory accounting does not depend on model size) on requests
whose prompt and output lengths spread over a wide range, under a fixed KV budget, and samples after every
step:
  - paged utilization: live K/V token slots / token slots in the blocks running requests hold;
  - the same live tokens against what contiguous allocation would reserve for the same running requests:
    max_model_len each (static KV caches), or prompt + max_tokens each (an oracle-free per-request reservation);
  - concurrency: running requests per step, against the budget / max_model_len requests contiguous allocation
    can admit at once.

    python benchmarks/memory.py [--requests 200] [--budget-tokens 32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from paged.benchmarks.common import report

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paged.models.tiny import create_tiny_llama  # noqa: E402
from paged import LLM, SamplingParams  # noqa: E402


def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_len, args.max_len + 1, args.requests)
    output_lens = rng.integers(args.min_len, args.max_len + 1, args.requests)
    max_model_len = 2 * args.max_len + args.block_size
    model_dir = create_tiny_llama(os.path.join(tempfile.mkdtemp(), "tiny"), max_position_embeddings=max_model_len)
    num_blocks = args.budget_tokens // args.block_size + 1
    llm = LLM(model_dir, block_size=args.block_size, num_kv_blocks=num_blocks, max_model_len=max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, show_progress=False)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    reserve = {}
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
        parent = engine.make_request(str(i), None, rng.integers(2, vocab, p).tolist(),
                                     SamplingParams(temperature=0, max_tokens=int(o), ignore_eos=True))
        engine.add_request(parent)
        reserve[str(i)] = int(p + o)

    live_total = held_total = static_total = oracle_total = 0
    running_counts = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if not running:
            continue
        live = engine.block_manager.live_token_slots(running)
        stats = engine.kv_stats()
        live_total += live
        held_total += stats["num_held_blocks"] * args.block_size
        static_total += len(running) * max_model_len
        oracle_total += sum(reserve[r.parent.request_id] for r in running)
        running_counts.append(len(running))
    elapsed = time.perf_counter() - start
    contiguous_concurrency = args.budget_tokens // max_model_len
    result = {
        "workload": {"requests": args.requests, "prompt_len": [args.min_len, args.max_len],
                     "output_len": [args.min_len, args.max_len], "seed": args.seed},
        "budget_tokens": args.budget_tokens, "block_size": args.block_size, "max_model_len": max_model_len,
        "steps": len(running_counts), "seconds": round(elapsed, 1),
        "paged_utilization": live_total / held_total,
        "contiguous_max_len_utilization": live_total / static_total,
        "contiguous_per_request_utilization": live_total / oracle_total,
        "paged_mean_concurrency": float(np.mean(running_counts)),
        "paged_peak_concurrency": int(np.max(running_counts)),
        "contiguous_max_len_concurrency": contiguous_concurrency,
        "concurrency_ratio": float(np.mean(running_counts)) / max(1, contiguous_concurrency),
        "preemptions": engine.kv_stats()["num_preemptions"],
    }
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--budget-tokens", type=int, default=32768, help="KV pool size in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    result = run(args)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Online serving benchmark against any OpenAI-compatible server (this one or another engine).

    python -m paged.benchmarks.serve --base-url http://127.0.0.1:8000 [--num-prompts 200] [--request-rate 4 | inf]
        [--max-concurrency 32] [--input-len 16 256] [--output-len 16 256] [--json out.json] [--png out.png]

Sends prompts to /v1/completions with streaming, arrivals at a Poisson rate (or all at once with `inf`),
optionally capped at a number in flight. Prompts are random token ids (lengths uniform in --input-len, as
vLLM's random dataset), or the first --num-prompts lines of a JSONL --dataset of {"prompt": text or
"prompt_token_ids": [ids], "output_len": n}, the format `paged bench throughput --dataset` reads.
Measures per request: TTFT (time to first token), TPOT (time per output token after the first), ITL (gaps
between streamed chunks) and end-to-end latency; reports mean, median and p99 of each, request and token
throughput, and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np

from paged.benchmarks.common import pyplot, read_jsonl_requests, report


async def _one(client, url: str, headers: dict, payload: dict) -> dict:
    start = time.perf_counter()
    chunks, usage, error = [], None, None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = await response.aread()
                return {"ok": False, "error": f"HTTP {response.status_code}: {body[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    usage = data["usage"]
                # Every chunk with a choice carries new tokens (their text may be empty: a partial UTF-8
                # sequence, or ids a tokenizer cannot spell), so each one counts as progress.
                if data.get("choices"):
                    chunks.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if error or not chunks:
        return {"ok": False, "error": error or "no tokens streamed"}
    out_tokens = usage["completion_tokens"] if usage else len(chunks)
    prompt = payload["prompt"]
    prompt_tokens = usage["prompt_tokens"] if usage else len(prompt) if isinstance(prompt, list) else None
    ttft = chunks[0] - start
    return {"ok": True, "ttft": ttft, "e2e": end - start, "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "tpot": (end - start - ttft) / (out_tokens - 1) if out_tokens > 1 else None,
            "itl": list(np.diff(chunks))}


def _stats(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "median": None, "p99": None}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


async def run(args) -> dict:
    import httpx
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(max_connections=None)) as client:
        model = args.model
        if model is None:
            model = (await client.get(args.base_url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        rng = np.random.default_rng(args.seed)
        if args.dataset:
            requests = read_jsonl_requests(args.dataset, args.num_prompts)
        else:
            in_lens = rng.integers(args.input_len[0], args.input_len[1] + 1, args.num_prompts)
            out_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_prompts)
            requests = [(rng.integers(10, args.vocab, int(n)).tolist(), int(o)) for n, o in zip(in_lens, out_lens)]
        payloads = [{"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "stream": True,
                     "ignore_eos": True, "stream_options": {"include_usage": True}} for prompt, out_len in requests]
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(payloads), desc="requests", unit="req")
        url = args.base_url + "/v1/completions"

        async def limited(payload):
            if gate is None:
                result = await _one(client, url, headers, payload)
            else:
                async with gate:
                    result = await _one(client, url, headers, payload)
            bar.update()
            return result

        start = time.perf_counter()
        tasks = []
        for payload in payloads:
            tasks.append(asyncio.ensure_future(limited(payload)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "base_url": args.base_url, "model": model, "num_prompts": len(payloads), "dataset": args.dataset,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        # None when a text prompt's server sent no usage: its prompt tokens are unknown here.
        "total_token_throughput": (None if any(r["prompt_tokens"] is None for r in ok)
                                   else (out_tokens + sum(r["prompt_tokens"] for r in ok)) / duration),
        "ttft_ms": _stats(r["ttft"] for r in ok), "tpot_ms": _stats(r["tpot"] for r in ok),
        "itl_ms": _stats(x for r in ok for x in r["itl"]), "e2e_ms": _stats(r["e2e"] for r in ok),
        "_samples": {"ttft": [r["ttft"] for r in ok], "itl": [x for r in ok for x in r["itl"]]},
    }


def plot(result: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key in zip(axes, ("ttft", "itl")):
        ax.hist(np.asarray(result["_samples"][key]) * 1000, bins=40, color="#2b6cb0")
        ax.set_xlabel(f"{key.upper()} (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first from /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--vocab", type=int, default=400, help="token ids are drawn from [10, vocab)")
    parser.add_argument("--dataset", default=None, help="JSONL of {prompt, output_len} instead of random prompts")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    if args.dataset:
        try:  # a bad file fails here, before any request is sent
            read_jsonl_requests(args.dataset, args.num_prompts)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    result = asyncio.run(run(args))
    if args.png:
        plot(result, args.png)
    result.pop("_samples")
    report(result, args.json)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

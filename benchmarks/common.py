"""Shared pieces of the benchmarks: the default model, workloads, the machine's matmul rate, FLOP counts."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

# The default benchmark model: a random-weight Llama of about 30M parameters, float32 (see docs/performance.md).
DEFAULT_MODEL = dict(model_vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                     num_kv_heads=2, max_position_embeddings=2048)


def pyplot():
    """matplotlib.pyplot on a file backend, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart written", file=sys.stderr)
        return None
    return plt


def default_model_dir() -> str:
    from paged.models.tiny import create_tiny_llama
    from paged.kernels.cache import cache_root
    directory = str(cache_root() / "benchmarks" / "bench-llama-30m")
    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        create_tiny_llama(directory, **DEFAULT_MODEL)
    return directory


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def describe(self) -> dict:
        return {"requests": len(self.prompts), "prompt_tokens": int(sum(self.prompt_lens)),
                "output_tokens": int(sum(self.output_lens)),
                "prompt_len": [min(self.prompt_lens), max(self.prompt_lens)],
                "output_len": [min(self.output_lens), max(self.output_lens)]}


def random_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                    seed: int = 0) -> Workload:
    """Lengths uniform in the inclusive ranges (like vLLM's random dataset); token ids uniform over the vocab."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, num_requests)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    prompts = [rng.integers(10, vocab, n).tolist() for n in in_lens]
    return Workload(prompts, [int(o) for o in out_lens])


def warmup_twin(workload: Workload, vocab: int, seed: int = 1) -> Workload:
    """The same lengths with other token ids: a warm-up that compiles every shape the timed run meets while
    leaving nothing a prefix cache could serve it from."""
    rng = np.random.default_rng(seed)
    prompts = []
    for prompt in workload.prompts:
        other = rng.integers(10, vocab, len(prompt))
        other[0] = 10 + (prompt[0] - 10 + 1) % (vocab - 10)  # a different first token: no shared block at all
        prompts.append(other.tolist())
    return Workload(prompts, list(workload.output_lens))


def read_jsonl_requests(path: str, limit: int | None = None) -> list[tuple[str | list[int], int]]:
    """(prompt text or token ids, output_len) from lines of {"prompt" or "prompt_token_ids", "output_len"}, the
    first `limit` of them (None: all); a bad line is an error naming it."""
    items = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if len(items) == limit:
                break
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["prompt_token_ids"] if "prompt_token_ids" in item else item["prompt"]
                output_len = int(item["output_len"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: want {{\"prompt\" or \"prompt_token_ids\", \"output_len\"}}, "
                                 f"got {line.strip()[:80]!r} ({type(exc).__name__}: {exc})") from None
            if not isinstance(prompt, (str, list)) or not prompt or output_len < 1:
                raise ValueError(f"{path}:{number}: want a non-empty prompt and output_len >= 1, "
                                 f"got {line.strip()[:80]!r}")
            items.append((prompt, output_len))
    if not items:
        raise ValueError(f"{path}: no requests")
    return items


def jsonl_workload(path: str, tokenizer) -> Workload:
    """read_jsonl_requests' lines, text prompts tokenized."""
    requests = read_jsonl_requests(path)
    return Workload([list(p) if isinstance(p, list) else tokenizer.encode(p) for p, _ in requests],
                    [n for _, n in requests])


def copy_workload(tokenizer, count: int, output_len: int, max_len: int, seed: int = 0) -> Workload:
    """An input-grounded workload: each prompt is a standard-library docstring, a blank line, and its first
    few words again, so the answer can copy from the prompt (what prompt lookup speculates on). Docstrings of
    at least `output_len` tokens whose prompt and output fit `max_len`, chosen at random."""
    from paged.models.demo_model.train import stdlib_docstrings
    rng = np.random.default_rng(seed)
    docs = [d for d in stdlib_docstrings()
            if output_len + 16 <= len(tokenizer.encode(d)) <= (max_len - output_len) // 2 - 16]
    prompts = []
    for index in rng.choice(len(docs), size=count, replace=len(docs) < count):
        doc = docs[int(index)]
        prompts.append(tokenizer.encode(doc + "\n\n" + " ".join(doc.split()[:4])))
    return Workload(prompts, [output_len] * count)


def matmul_rate(dtype="float32", size: int = 1024, repeats: int = 20, calls_per_sample: int = 1) -> float:
    """FLOP/s of a square jax matmul on the default device (best of `repeats`): the machine's compute roof.

    Accumulated in float32, as the engine's matmuls are (a bf16 result would take XLA's slow CPU path). On
    random data: a GPU multiplies zeros faster. `calls_per_sample` products are dispatched back to back per
    sample, so on a GPU the time per product leaves out the host's dispatch and wait.
    """
    import jax
    import jax.numpy as jnp
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype)
    f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([f(a) for _ in range(calls_per_sample)])
        best = min(best, (time.perf_counter() - start) / calls_per_sample)
    return 2 * size**3 / best


def workload_flops(config, workload: Workload) -> float:
    """Model FLOPs to prefill every prompt and decode every output token once (no recomputation counted).

    Per token: 2 x the layers' matrices (the embedding is a lookup) plus attention, 4 x context x heads x
    head_dim per layer (scores and weighted sum); the LM head, 2 x hidden x vocab, only for the positions that
    sample a token (one per output token: the engine never computes logits for the rest of a prompt).
    """
    c = config
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    dense = 2 * c.num_layers * per_layer
    total = 0.0
    for p, o in zip(workload.prompt_lens, workload.output_lens):
        tokens = p + o - 1  # the last sampled token is never fed back
        total += tokens * dense + o * 2 * c.hidden_size * c.vocab_size
        total += 4 * c.num_layers * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
    return total


def copy_bandwidth(megabytes: int = 256, repeats: int = 10, calls_per_sample: int = 1) -> float:
    """Bytes/s (read + written) of a large in-place device update: the machine's memory roof.

    The input is donated so the output reuses its buffer; a fresh 256 MB output each time would measure
    page faults instead of memory traffic. `calls_per_sample` updates are chained back to back per sample (as
    in matmul_rate).
    """
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    x = f(jnp.ones((megabytes * 2**20 // 4,), jnp.float32))
    x.block_until_ready()
    nbytes = x.nbytes
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            x = f(x)
        x.block_until_ready()
        best = min(best, (time.perf_counter() - start) / calls_per_sample)
    return 2 * nbytes / best


def read_bandwidth(megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes/s of a streaming read: a large array summed row by row (4 KiB rows, so XLA splits the rows
    across threads), best of `repeats`. What a memory-bound product can reach at most: a decode step reads its
    weights once and writes little."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((megabytes * 2**20 // 4096, 1024), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a, axis=1))
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def report(result: dict, path: str | None) -> None:
    """Prints a benchmark's result as JSON, and writes it to `path` too when given (--json)."""
    print(json.dumps(result, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

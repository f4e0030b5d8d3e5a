"""One prepared run on an NVIDIA GPU: versions, ceilings, kernel correctness, the engine end to end, the sweep.

    python3 benchmarks/gpu_check.py --out DIR --budget-s 420     # from the repository root

Runs under the GPU host's own python3 and packages (jax, flax, numpy, transformers, safetensors; no
fastapi, no torch needed), and on CPU as a dry run (the GPU kernels interpreted, the smoke sweep).
Every section writes as it finishes, so a run cut short still returns what it measured:

  gpu_check.json      versions, the copy bandwidth and bf16 matmul rate, every correctness case (max abs and
                      relative error against the jnp reference), the engine's greedy tokens per attention
                      backend against "xla", and the decode kernel fastest at the goal's shapes
  kernels_gpu.json    `paged bench kernels --preset gpu` (rewritten after every point), and its .png
  gpu_check.log       everything printed

The last section, `throughput` in gpu_check.json (benchmarks/gpu_throughput.py), runs the engine on GPU-sized
work: random weights in Llama-3.1-8B's and Qwen2.5-0.5B's shapes drawn on the device (load_format="dummy"),
256 requests of 512 prompt and 256 output tokens, output tokens/s and each decode step's time against its
byte floor (weights + K/V read, over the sweep's copy bandwidth). It has --throughput-s of the budget; the
sweep gets what the checks before it leave.

The summary table is printed last (a device call returns the end of the output).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from paged.benchmarks import gpu_throughput  # noqa: E402

# The decode goal's shapes (batch >= 32, context >= 2048, bf16): where "auto" must pick the fastest kernel.
GOAL = dict(min_batch=32, min_context=2048, dtype="bfloat16")
DECODE_KERNELS = ("pallas", "pallas-mosaic", "xla")  # what attention_backend can name on a GPU


class Report:
    """gpu_check.json, rewritten whenever a section adds to it."""

    def __init__(self, out: str):
        self.path = os.path.join(out, "gpu_check.json")
        self.data: dict = {}

    def set(self, key, value):
        self.data[key] = value
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=2, default=str)


class Tee:
    """Writes to the console and to gpu_check.log."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.stream.write(text)
        self.log.write(text)
        self.log.flush()

    def flush(self):
        self.stream.flush()


def versions() -> dict:
    from importlib import metadata
    found = {"python": sys.version.split()[0], "jax_backend": jax.default_backend(),
             "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()]}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "numpy",
                 "transformers", "safetensors", "triton"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    # What the engine sizes its KV pool from (paged/runner.py: kv_budget_bytes): on a GPU, XLA's allocator
    # limit (75% of the memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
    stats = jax.devices()[0].memory_stats() or {}
    found["memory_stats"] = {k: stats[k] for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use") if k in stats}
    found["xla_env"] = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}
    try:  # read-only queries: the card's settings are left as found
        found["nvidia-smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        found["nvidia-smi"] = f"unavailable: {error}"
    return found


def check(name, fn, ref, tol) -> dict:
    """One case: fn() against ref. Relative error ||out - ref|| / ||ref|| as METHOD.md asks, and the max abs
    error against `tol`; NaN or a raise fails."""
    try:
        got = np.asarray(jnp.asarray(fn(), jnp.float32))
    except Exception:
        print(f"FAIL {name}: raised\n{traceback.format_exc()[-3000:]}", flush=True)
        return dict(name=name, passed=False, error=traceback.format_exc()[-3000:])
    expected = np.asarray(jnp.asarray(ref, jnp.float32))
    err = float(np.abs(got - expected).max())
    rel = float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))
    ok = bool(np.isfinite(got).all() and err <= tol)
    print(f"{'PASS' if ok else 'FAIL'} {name}: max abs {err:.2e} (tolerance {tol}), relative {rel:.1e}",
          flush=True)
    return dict(name=name, passed=ok, max_abs_error=err, relative_error=rel, tolerance=tol)


def correctness(rng, on_cpu: bool) -> list[dict]:
    """Every kernel against the jnp reference on random paged inputs: lengths 0, 1, a page, a partial page, the
    maximum; random page permutations; float32 and bfloat16 where the kernel takes it; then one goal-sized
    point (grids of thousands of programs, which the small cases do not reach)."""
    from paged.kernels import (paged_decode_attention, paged_decode_reference, ragged_paged_attention,
                               ragged_paged_attention_reference)
    from paged.kernels.gpu.decode_mgpu import paged_decode_attention_mgpu
    cases = []
    for dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)):  # f32 dots may use TF32 on GPU
        for page_size, group, head_dim in ((16, 1, 128), (16, 8, 128), (32, 4, 64), (8, 2, 64)):
            num_kv_heads, pages_per_seq = 2, 12
            lengths = np.array([0, 1, page_size, 3 * page_size + 5, pages_per_seq * page_size, 77], np.int32)
            q, k, v, tables = _inputs(rng, lengths, pages_per_seq, num_kv_heads, group, page_size, head_dim, dtype)
            n = jnp.asarray(lengths)
            tag = f"{jnp.dtype(dtype).name} page={page_size} gqa={group} D={head_dim}"
            s = head_dim ** -0.5
            ref = paged_decode_reference(q, k, v, tables, n, 1, scale=s)
            for splits in (1, 3):
                cases.append(check(f"decode pallas splits={splits} {tag}", lambda: paged_decode_attention(
                    q, k, v, tables, n, 1, scale=s, num_splits=splits), ref, tol))
            if dtype == jnp.bfloat16:
                cases.append(check(f"decode mosaic {tag}", lambda: paged_decode_attention_mgpu(
                    q, k, v, tables, n, 1, scale=s, interpret=on_cpu), ref, tol))
                cases.append(check(f"decode mosaic splits=3 window=40 cap=5 {tag}", lambda: paged_decode_attention_mgpu(
                    q, k, v, tables, n, 1, 40, scale=s, soft_cap=5.0, num_splits=3, interpret=on_cpu),
                    paged_decode_reference(q, k, v, tables, n, 1, 40, scale=s, soft_cap=5.0), tol))
            q_lens = np.array([0, 1, 5, 3 * page_size + 5, page_size, 40], np.int32)
            query_start = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            qr = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + 7, num_kv_heads * group, head_dim),
                                                 np.float32), dtype)
            ctx = jnp.asarray(np.maximum(lengths, q_lens))
            ref = ragged_paged_attention_reference(qr, k, v, tables, query_start, ctx, 1, scale=s)
            cases.append(check(f"ragged pallas {tag}", lambda: ragged_paged_attention(
                qr, k, v, tables, query_start, ctx, 1, scale=s), ref, tol))
    if not on_cpu:  # the goal's shape: 32 sequences of 2,048 tokens, 8 KV heads x GQA 8, head_dim 128, bf16
        lengths = np.full(32, 2048, np.int32)
        lengths[:4] = (1, 17, 1000, 2047)
        q, k, v, tables = _inputs(rng, lengths, 128, 8, 8, 16, 128, jnp.bfloat16)
        n, s = jnp.asarray(lengths), 128 ** -0.5
        ref = paged_decode_reference(q, k, v, tables, n, 1, scale=s)
        cases.append(check("decode pallas goal shape", lambda: paged_decode_attention(q, k, v, tables, n, 1, scale=s),
                           ref, 3e-2))
        cases.append(check("decode mosaic goal shape", lambda: paged_decode_attention_mgpu(
            q, k, v, tables, n, 1, scale=s), ref, 3e-2))
        q_lens = np.array([512, 512, 1, 300], np.int32)
        query_start = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        qr = jnp.asarray(rng.standard_normal((int(q_lens.sum()), 64, 128), np.float32), jnp.bfloat16)
        ctx = jnp.asarray([2048, 512, 1000, 2047], jnp.int32)
        ref = ragged_paged_attention_reference(qr, k, v, tables[:4], query_start, ctx, 1, scale=s)
        cases.append(check("ragged pallas goal shape", lambda: ragged_paged_attention(
            qr, k, v, tables[:4], query_start, ctx, 1, scale=s), ref, 3e-2))
    return cases


def _inputs(rng, lengths, pages_per_seq, num_kv_heads, group, page_size, head_dim, dtype):
    """q and a two-layer pool whose pages are a random permutation (layer 1 is the one read)."""
    num_seqs = len(lengths)
    num_pages = num_seqs * pages_per_seq + 3
    shape = (2, num_kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    tables = jnp.asarray(rng.permutation(num_pages)[:num_seqs * pages_per_seq].reshape(num_seqs, -1), jnp.int32)
    q = jnp.asarray(rng.standard_normal((num_seqs, num_kv_heads * group, head_dim), np.float32), dtype)
    return q, k, v, tables


def engine_end_to_end(rng, on_cpu: bool) -> list[dict]:
    """The engine's greedy tokens with each GPU attention backend (and "auto") against "xla", float32 and
    bfloat16, on a tiny random Llama with head_dim 64 (the Mosaic kernel's smallest). Prompts of 3-300
    tokens, two sharing a 64-token prefix (a prefix-cache hit), 128 tokens a step (long prompts chunk over a
    cached context, as the ragged kernel sees it), 40 new tokens each.

    float32 must match token for token. In bfloat16 two kernels that round differently (the Mosaic kernel
    rounds the probabilities to bf16 for its second wgmma) move logits by an ulp or two, about 0.03-0.06 at
    this model's logit sizes, which flips near-ties; there a sequence passes if, where it first diverges, each
    run's token is among the other's top 5 (vLLM's check for kernels compared in low precision)."""
    from paged.models.tiny import create_tiny_llama
    from paged import LLM, SamplingParams
    directory = create_tiny_llama(tempfile.mkdtemp(), hidden_size=256, intermediate_size=512, num_layers=2,
                                  num_heads=4, num_kv_heads=2, model_vocab_size=512)
    prefix = rng.integers(10, 500, 64).tolist()
    prompts = [rng.integers(10, 500, n).tolist() for n in (3, 17, 40, 100, 300)]
    prompts += [prefix + rng.integers(10, 500, 9).tolist(), prefix + rng.integers(10, 500, 30).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    results = []
    for dtype in ("float32", "bfloat16"):
        backends = ["xla", "pallas"] + (["pallas-mosaic"] if dtype == "bfloat16" else []) + ["auto"]
        if on_cpu:  # a dry run: "auto" is the native kernel here, not a GPU choice
            backends.remove("auto")
        baseline = None
        for backend in backends:
            start = time.monotonic()
            try:
                llm = LLM(directory, dtype=dtype, attention_backend=backend, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=128, max_model_len=512, show_progress=False)
                outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
                resolved = llm.engine.attention_name
                del llm
            except Exception:
                print(f"FAIL engine {dtype} {backend}: raised\n{traceback.format_exc()[-3000:]}", flush=True)
                results.append(dict(dtype=dtype, backend=backend, passed=False, error=traceback.format_exc()[-3000:]))
                continue
            entry = dict(dtype=dtype, backend=backend, resolved=resolved, seconds=time.monotonic() - start)
            if backend == "xla":
                baseline = outs
                print(f"engine {dtype} xla: the baseline ({entry['seconds']:.0f} s with compiles)", flush=True)
            elif baseline is not None:
                verdicts = [_compare(a, b) for a, b in zip(outs, baseline)]
                exact = sum(v == "exact" for v in verdicts)
                entry.update(verdicts=verdicts, sequences_equal=f"{exact}/{len(verdicts)}",
                             passed=all(v == "exact" or (dtype != "float32" and v.startswith("near-tie"))
                                        for v in verdicts))
                print(f"{'PASS' if entry['passed'] else 'FAIL'} engine {dtype} {backend} ({resolved}): greedy tokens "
                      f"equal to xla's for {entry['sequences_equal']} sequences, {verdicts} ({entry['seconds']:.0f} s "
                      "with compiles)", flush=True)
            results.append(entry)
    return results


def _compare(got, expected) -> str:
    """"exact", "near-tie at N" (each token among the other's top 5 where they first differ), or "diverged at N"."""
    first = next((i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids)) if a != b), None)
    if first is None and len(got.token_ids) == len(expected.token_ids):
        return "exact"
    if first is None:
        return f"diverged in length ({len(got.token_ids)} against {len(expected.token_ids)})"
    close = (got.token_ids[first] in expected.logprobs[first] and expected.token_ids[first] in got.logprobs[first])
    return f"{'near-tie' if close else 'diverged'} at {first}"


def fastest_at_goal(sweep: dict) -> dict:
    """Per decode kernel the engine can name: at how many of the goal's shapes it was fastest, and its
    fraction of the copy bandwidth there. The kernel fastest most often is what "auto" should pick."""
    wins, fractions = {}, {}
    for row in sweep.get("rows", []):
        if (row["kind"] != "decode" or row["batch"] < GOAL["min_batch"] or row["context"] < GOAL["min_context"]
                or row["dtype"] != GOAL["dtype"]):
            continue
        timed = {n: r for n, r in row["results"].items() if n in DECODE_KERNELS and "seconds" in r}
        if timed:
            best = min(timed, key=lambda n: timed[n]["seconds"])
            wins[best] = wins.get(best, 0) + 1
        for name, r in row["results"].items():
            if "fraction_of_copy" in r:
                fractions.setdefault(name, []).append(r["fraction_of_copy"])
    return dict(wins=wins, fraction_of_copy={n: dict(min=min(f), median=float(np.median(f)), max=max(f))
                                             for n, f in fractions.items()},
                auto_should_pick=max(wins, key=wins.get) if wins else None)


def throughput(args, report: Report, on_cpu: bool, deadline: float) -> list[dict]:
    """The engine on GPU-sized work (benchmarks/gpu_throughput.py), each shape in turn until the deadline; on
    CPU (a dry run) a tiny Llama's config and a small batch."""
    from paged.benchmarks.common import copy_bandwidth
    from paged.benchmarks.shapes import model_shape_config_dir
    copy_bw = report.data.get("ceilings", {}).get("copy_bytes_per_s") or copy_bandwidth(
        megabytes=256 if on_cpu else 2048)
    shapes = args.throughput_shapes if args.throughput_shapes is not None else (
        ["tiny"] if on_cpu else list(gpu_throughput.SHAPES))
    requests, prompt_len, output_len = (8, 24, 8) if on_cpu else (256, 512, 256)
    entries = []
    for name in shapes:
        if time.monotonic() > deadline:
            entries.append(dict(error=f"throughput {name}: not run, the budget was spent"))
            continue
        try:
            if name == "tiny":
                from paged.models.tiny import create_tiny_llama
                directory = create_tiny_llama(tempfile.mkdtemp(), hidden_size=128, num_layers=2, num_heads=4,
                                              num_kv_heads=2, model_vocab_size=512)
            else:
                directory = model_shape_config_dir(name)
            entry = gpu_throughput.run_shape(directory, name, requests, prompt_len, output_len, copy_bw, deadline,
                                             progress=lambda e: report.set("throughput", [*entries, e]))
        except Exception:
            print(f"FAIL throughput {name}: raised\n{traceback.format_exc()[-3000:]}", flush=True)
            entry = dict(error=f"throughput {name}: raised", traceback=traceback.format_exc()[-3000:])
        entry["copy_bytes_per_s"] = copy_bw
        entries.append(entry)
        print(gpu_throughput.summary_line(entry) if "shape" in entry else entry["error"], flush=True)
        report.set("throughput", entries)  # each shape as it ends
    return entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="the whole run's seconds; the kernel sweep gets what the checks leave")
    parser.add_argument("--skip", nargs="*", default=[], choices=["correctness", "engine", "sweep", "throughput"])
    parser.add_argument("--throughput-s", type=float, default=180.0,
                        help="seconds of the budget kept for the throughput section, which runs last")
    parser.add_argument("--throughput-shapes", nargs="*", default=None,
                        help="model shapes for the throughput section (default: llama-3.1-8b, then qwen2.5-0.5b, on "
                             "a GPU; a tiny Llama on CPU)")
    args = parser.parse_args()
    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "gpu_check.log"), "w")
    sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)
    report = Report(args.out)
    on_cpu = jax.default_backend() == "cpu"
    report.set("versions", versions())
    print(json.dumps(report.data["versions"], indent=1), flush=True)
    seed = int(time.time())  # fresh inputs every run, recorded to reproduce one
    report.set("seed", seed)
    rng = np.random.default_rng(seed)
    summary = []
    if "correctness" not in args.skip:
        cases = correctness(rng, on_cpu)
        report.set("correctness", cases)
        summary.append(f"kernel correctness: {sum(c['passed'] for c in cases)}/{len(cases)} cases passed")
    if "engine" not in args.skip:
        engine = engine_end_to_end(rng, on_cpu)
        report.set("engine", engine)
        summary += [f"engine {e['dtype']} {e['backend']}: " + (
            f"{'PASS' if e['passed'] else 'FAIL'}, {e['sequences_equal']} sequences equal to xla's"
            if "sequences_equal" in e else "FAIL, raised" if "error" in e else "the baseline") for e in engine]
    if "sweep" not in args.skip:
        from paged.benchmarks import kernels
        path = os.path.join(args.out, "kernels_gpu.json")
        reserve = 0.0 if "throughput" in args.skip else args.throughput_s
        left = max(30.0, args.budget_s - reserve - (time.monotonic() - start))
        try:  # on CPU the smoke preset: a dry run of this path
            kernels.main(["--preset", "smoke" if on_cpu else "gpu", "--budget-s", f"{left:.0f}", "--json", path,
                          "--png", os.path.join(args.out, "kernels_gpu.png")])
        except Exception:
            print(f"FAIL sweep: raised\n{traceback.format_exc()[-3000:]}", flush=True)
        if os.path.exists(path):
            with open(path) as f:
                sweep = json.load(f)
            goal = fastest_at_goal(sweep)
            report.set("ceilings", dict(copy_bytes_per_s=sweep["copy_bytes_per_s"],
                                        matmul_flops_per_s=sweep["matmul_flops_per_s"],
                                        matmul_dtype=sweep["matmul_dtype"]))
            report.set("goal", goal)
            summary.append(f"copy {sweep['copy_bytes_per_s'] / 1e12:.3f} TB/s, {sweep['matmul_dtype']} matmul "
                           f"{sweep['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s; {len(sweep['rows'])} sweep points")
            summary += [f"goal shapes, {n}: {f['min']:.0%}-{f['max']:.0%} of copy (median {f['median']:.0%})"
                        for n, f in goal["fraction_of_copy"].items()]
            summary.append(f"fastest at the goal shapes: {goal['wins']} -> auto should pick "
                           f"{goal['auto_should_pick']}")
    if "throughput" not in args.skip:
        entries = throughput(args, report, on_cpu, deadline=start + args.budget_s)
        report.set("throughput", entries)
        summary += [gpu_throughput.summary_line(e) if "shape" in e else e["error"] for e in entries]
    summary.append(f"{time.monotonic() - start:.0f} s in all")
    report.set("summary", summary)
    print("\n== summary ==\n" + "\n".join(summary), flush=True)
    failed = [c for c in report.data.get("correctness", []) + report.data.get("engine", [])
              if c.get("passed") is False] + [e for e in report.data.get("throughput", []) if "traceback" in e]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Start-up from a Hugging Face checkpoint (safetensors) against the same model as an Orbax checkpoint.

    paged bench startup [--model-shape qwen2.5-0.5b | --model DIR] [--tensor-parallel-size 1] [--runs 5]
        [--dtype bfloat16] [--json out.json]

Writes the Orbax checkpoint once (`LLM.save`, at the same tensor-parallel size), then starts the engine from
each in turn, alternating, each in a fresh process (`--xla_force_host_platform_device_count` set for TP > 1),
and reports each one's seconds from `LLM(...)` to a ready engine (weights on the devices, KV pool allocated;
steps compile on first use, so compilation is not in it) and the ratio of the medians. Both read files the
earlier runs have put in the OS page cache: what is measured is the loader, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

from paged.benchmarks.common import report

CHILD = textwrap.dedent("""
    import json, sys, time
    from paged import LLM
    path, tp, dtype, save = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    started = time.perf_counter()
    llm = LLM(path, tensor_parallel_size=tp, dtype=dtype, enforce_eager=True, max_model_len=256,
              num_kv_blocks=64, block_size=16, max_num_seqs=4, show_progress=False, compilation_cache_dir=None)
    seconds = time.perf_counter() - started
    if save != "-":
        llm.save(save)
    print("RESULT " + json.dumps({"seconds": seconds, "weight_bytes": llm.engine.weight_bytes["total"]}))
""")


def _start(path: str, tp: int, dtype: str, save: str = "-") -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    if tp > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}".strip()
    run = subprocess.run([sys.executable, "-c", CHILD, path, str(tp), dtype, save], capture_output=True, text=True,
                         env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"start-up from {path} failed:\n{run.stderr[-3000:]}")
    return json.loads(lines[0][7:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen2.5-0.5b")
    parser.add_argument("--model", default=None, help="a Hugging Face checkpoint directory (instead of a shape)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.model is not None:
        source = args.model
    else:
        from paged.benchmarks.shapes import model_shape_dir
        source = model_shape_dir(args.model_shape)
    tp = args.tensor_parallel_size
    with tempfile.TemporaryDirectory(prefix="paged-orbax-") as scratch:
        orbax_dir = os.path.join(scratch, "checkpoint")
        _start(source, tp, args.dtype, save=orbax_dir)  # also puts the safetensors in the page cache
        times: dict[str, list[float]] = {"safetensors": [], "orbax": []}
        for _ in range(args.runs):
            for name, path in (("safetensors", source), ("orbax", orbax_dir)):
                result = _start(path, tp, args.dtype)
                times[name].append(result["seconds"])
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {"model": args.model or args.model_shape, "tensor_parallel_size": tp, "dtype": args.dtype,
              "weight_bytes": result["weight_bytes"], "runs": args.runs,
              "seconds": {name: [round(v, 3) for v in values] for name, values in times.items()},
              "median_s": {name: round(v, 3) for name, v in medians.items()},
              "orbax_over_safetensors": round(medians["orbax"] / medians["safetensors"], 3)}
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Each decode kernel at one of the goal's shapes, a few calls each: the program to run under Nsight Compute
when the sweep (benchmarks/gpu_check.py) shows a kernel short of the copy bandwidth.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats -c 40 --csv --page details \\
        python3 benchmarks/gpu_profile.py > ncu_decode.csv

`--clock-control none` leaves the card's clocks as found (as a served model runs). The profile holds,
per implementation in the order printed on stderr, one warm-up call and `--calls` timed ones, each with
XLA's small pad, gather and merge kernels around the attention kernel. Without ncu it prints each
implementation's median time a call (launch and wait included: the sweep's figures are the ones to quote).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--gqa", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="implementations to run (default: all that run)")
    args = parser.parse_args()

    from paged.benchmarks.kernels import _pool, decode_implementations, time_call
    on_gpu = jax.default_backend() == "gpu"
    num_kv_heads, head_dim, dtype = 8, 128, "bfloat16"
    rng = np.random.default_rng(0)
    k, v, tables = _pool(rng, args.batch, -(-args.context // args.page_size), num_kv_heads, args.page_size,
                         head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((args.batch, num_kv_heads * args.gqa, head_dim), np.float32), dtype)
    lengths = jnp.full((args.batch,), args.context, jnp.int32)
    kv_bytes = 2 * args.batch * args.context * num_kv_heads * head_dim * 2
    impls = decode_implementations(on_gpu, args.gqa, head_dim, dtype)
    for name, fn in impls.items():
        if not callable(fn) or name == "jnp-reference" or (args.only is not None and name not in args.only):
            continue
        print(f"{name}: {args.calls} calls", file=sys.stderr, flush=True)
        seconds = time_call(fn, [(q, k, v, tables, lengths, head_dim ** -0.5)], repeats=args.calls)
        print(f"  {seconds * 1e6:.1f} us a call with its launch and wait; K/V {kv_bytes / seconds / 1e9:.0f} GB/s",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

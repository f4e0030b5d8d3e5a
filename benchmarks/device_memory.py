"""Bytes per device under tensor parallelism: weights and KV pool at tensor parallel 1, 2, 4 and 8, and the
host memory the loader needs on top of the weights.

Each size runs in a subprocess with 8 simulated CPU devices (`--xla_force_host_platform_device_count`; on a
machine with real accelerators, the real ones). Counted from what each device actually holds
(`addressable_shards`), so replicated pieces (norms, a vocabulary the size does not divide, KV heads repeated
when there are fewer than devices) show up as they are. Peak host memory while loading: the process's peak
RSS minus its RSS once loading is done, i.e. what the loader held beyond the weights it placed (on CPU
devices the weights themselves live in host memory too).

    paged bench device_memory [--sizes 1 2 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = """
import json, resource, sys
from paged import LLM
model_dir, size = sys.argv[1], int(sys.argv[2])

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = rss()
llm = LLM(model_dir, tensor_parallel_size=size, num_kv_blocks=int(sys.argv[3]), block_size=16,
          max_model_len=int(sys.argv[4]), max_num_seqs=4, show_progress=False, compilation_cache_dir=None)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
after = rss()
import jax
engine = llm.engine

def per_device(arrays):
    held = {}
    for array in arrays:
        for shard in array.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return [held[d] for d in sorted(held)]

leaves = jax.tree_util.tree_leaves(engine.worker.runner.params)
replicated = sum(leaf.nbytes for leaf in leaves if leaf.sharding.is_fully_replicated) if size > 1 else 0
print("RESULT " + json.dumps({
    "weights_per_device": per_device(leaves), "kv_per_device": per_device(engine.worker.runner.kv_cache),
    "weights_total": sum(leaf.nbytes for leaf in leaves), "replicated_weight_bytes": replicated,
    "kv_total": sum(c.nbytes for c in engine.worker.runner.kv_cache), "kv_heads_in_pool": engine.model_config.num_kv_heads,
    "load_rss_growth": after - before, "load_peak_beyond_resident": max(0, peak - after)}))
"""


def build_model(directory: str) -> str:
    """A ~0.6 GB float32 Llama: 8 query heads over 4 KV heads, so tensor parallel 8 must replicate KV heads, and
    a 32,000-token vocabulary (split evenly by every size)."""
    from paged.models.tiny import create_tiny_llama
    return create_tiny_llama(directory, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=8,
                             num_kv_heads=4, model_vocab_size=32000, max_position_embeddings=1024)


def run_size(model_dir: str, size: int, num_blocks: int, max_model_len: int) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run([sys.executable, "-c", WORKER, model_dir, str(size), str(num_blocks), str(max_model_len)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tensor parallel {size} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _largest_tensor_bytes(model_dir: str) -> int:
    from safetensors import safe_open
    largest = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="np") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            count = 1
            for dim in tensor.get_shape():
                count *= dim
            largest = max(largest, count * {"F32": 4, "BF16": 2, "F16": 2}.get(tensor.get_dtype(), 1))
    return largest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--model", default=None, help="a checkpoint (default: a generated ~0.6 GB Llama)")
    parser.add_argument("--num-kv-blocks", type=int, default=257)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model_dir = args.model or build_model(os.path.join(tempfile.mkdtemp(), "llama-0.6g"))
    checkpoint = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                     if f.endswith(".safetensors"))
    results = {size: run_size(model_dir, size, args.num_kv_blocks, args.max_model_len) for size in args.sizes}
    one = results.get(1)
    mib = 2**20
    print(f"checkpoint {checkpoint / mib:.0f} MiB; largest tensor {_largest_tensor_bytes(model_dir) / mib:.0f} MiB")
    print(f"{'TP':>3}{'weights/device MiB':>20}{'x TP1':>7}{'replicated MiB':>16}{'KV/device MiB':>15}{'x TP1':>7}"
          f"{'KV heads':>10}{'load peak beyond weights MiB':>30}")
    for size, r in results.items():
        w, kv = max(r["weights_per_device"]), max(r["kv_per_device"])
        w_ratio = w / max(one["weights_per_device"]) if one else float("nan")
        kv_ratio = kv / max(one["kv_per_device"]) if one else float("nan")
        print(f"{size:>3}{w / mib:>20.1f}{w_ratio:>7.3f}{r['replicated_weight_bytes'] / mib:>16.2f}{kv / mib:>15.1f}"
              f"{kv_ratio:>7.3f}{r['kv_heads_in_pool']:>10}{r['load_peak_beyond_resident'] / mib:>30.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint_bytes": checkpoint, "largest_tensor_bytes": _largest_tensor_bytes(model_dir),
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`paged bench matmul`: the projections' matmul backends side by side on a real model's layer shapes.

Each point times one call that runs every projection of one decoder layer (q, k, v, o, gate, up, down of
`--model-shape`; `--layers` copies of each, so the weights, `--layers` x 14 MB in bfloat16 at the 0.5B shape,
stream from memory as a decode step's do) for x of `rows` rows, and reports GFLOP/s and, against this
machine's streaming read bandwidth measured first (`read_bandwidth`), the fraction of it the weights' bytes
read once over the time make (the roof of a memory-bound decode-sized product). Implementations:
  xla         XLA's dot, float32 accumulation (models/linear.py: xla_matmul)
  native      the native CPU matmul as the engine's "cpu" linear backend calls it (AMX tiles for bfloat16 where
              the CPU has them, else AVX-512)
  native-packed  bfloat16 on AMX with the weights packed once beforehand into the tiles' order, as the engine
              holds them from load (pallas_kernels/cpu: pack_for_amx)
  native-avx512  the same kernel built without AMX (only on a CPU with AMX: the path it replaces)
  int8, int4  bfloat16 runs only: the same weights quantized (int8 per output channel as quantization="int8";
              int4 in groups of 128 rows as GPTQ) through the engine's quantized layer (on AMX: the codes
              packed beforehand, as the engine holds them); their read fraction
              counts the codes and scales they stream; their max_rel_diff is against XLA's dot on the
              dequantized weights (which int4 on AMX rounds to bfloat16 over 64 rows).
  int8-f32x, int4-f32x  the same codes with x widened to float32 (the path without AVX-512 BF16)
  w8a8        the int8 weights with x quantized per row too, as a W8A8 layer runs on the "cpu" backend: on
              AMX-INT8 tiles with the codes packed beforehand and x quantized in the call, else through the
              integer matmul (AVX-512 VNNI) as prompt steps run it; against XLA's float32 dot on both sides'
              dequantized codes

    paged bench matmul                                  # qwen2.5-0.5b's shapes, bfloat16, 8 to 2048 rows
    paged bench matmul --dtype float32 --rows 8 64 256 --json docs/results/matmul_f32.json
    paged bench matmul --rows 1 8 16 32 64 --lm-head         # with the tied LM head, XLA's and the native one
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from paged.benchmarks.shapes import MODEL_SHAPES


def layer_products(shape: str) -> list[tuple[int, int]]:
    """(in, out) of each projection of one decoder layer of `shape`."""
    c = MODEL_SHAPES[shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim", hidden // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def _implementations(dtype) -> dict:
    """name -> (matmul(x, w as prepared), prepare(w [K, N]) run once before timing or None[, reference(x, w as
    prepared) where the products are not XLA's on w itself])."""
    import jax.numpy as jnp

    from paged.models.linear import xla_matmul
    from paged.kernels import cpu

    impls = {"xla": (lambda x, w: xla_matmul(x, w, None, jnp.float32), None)}
    if cpu.matmul_max_rows(dtype) > 0:
        impls["native"] = (lambda x, w: cpu.matmul_cpu(x, w), None)
    elif cpu.available()[0]:
        print(f"native: no fast path for {jnp.dtype(dtype).name} on this CPU (the engine keeps XLA's dot)",
              file=sys.stderr)
    if cpu.matmul_is_vectorized("int8") and jnp.dtype(dtype) == jnp.bfloat16:
        impls.update(_quantized_implementations(dtype))
    if cpu.matmul_on_amx() and jnp.dtype(dtype) == jnp.bfloat16:
        impls["native-packed"] = (lambda x, w: cpu.matmul_packed_cpu(x, w), cpu.pack_for_amx)
        try:
            no_amx = cpu.matmul_target_without_amx()
            impls["native-avx512"] = (lambda x, w: cpu.matmul_cpu(x, w, _target=no_amx), None)
        except RuntimeError as error:
            print(f"native-avx512: {error}", file=sys.stderr)
    return impls


def quantize_int4(kernel: np.ndarray, dtype, group_size: int = 128) -> dict[str, np.ndarray]:
    """Symmetric int4 codes with one scale per `group_size` rows and column (GPTQ's layout without act order),
    round to nearest: the benchmark's stand-in for a GPTQ checkpoint's weights."""
    from paged.models.quantization import pack
    w = kernel.astype(np.float32).reshape(-1, group_size, kernel.shape[1])
    scales = np.maximum(np.abs(w).max(axis=1), np.finfo(np.float32).tiny) / 7.0  # [groups, out]
    q = np.clip(np.rint(w / scales[:, None, :]), -8, 7).astype(np.int16) + 8
    return pack(q.reshape(kernel.shape), np.full_like(scales, 8.0), scales, 4, dtype)


def _quantized_implementations(dtype) -> dict:
    """Weight-only int8 (per channel, as `quantization="int8"`) and int4 (groups of 128 rows, as GPTQ) through
    the engine's quantized layer (models/linear.py: quantized_matmul); "-f32x" the same kernel given x widened
    to float32, the path bfloat16 models took before the bfloat16 one."""
    import jax.numpy as jnp

    from paged.kernels import cpu
    from paged.models.linear import quantized_matmul, xla_matmul
    from paged.models import low_precision_dot
    from paged.models.quantization import WeightQuant, activation_codes, dequantize, quantize_per_channel_int8

    def prepare(bits):
        def quantize(w):
            host = np.asarray(w, np.float32)
            params = quantize_per_channel_int8(host, dtype) if bits == 8 else quantize_int4(host, dtype)
            return {k: jnp.asarray(v) for k, v in params.items()}
        return quantize

    def engine(bits):
        return lambda x, p: quantized_matmul("cpu", x, p, bits, None, jnp.float32)

    def float32_x(x, p):
        return cpu.quant_matmul_cpu(x.astype(jnp.float32), p["qweight"], p["scales"].astype(jnp.float32))

    def dequantized(bits):  # their reference: XLA's float32 dot on the weights the codes stand for
        return lambda x, p: xla_matmul(x.astype(jnp.float32), dequantize(p["qweight"], p["scales"].astype(jnp.float32),
                                                                         p["zero_offsets"].astype(jnp.float32), bits),
                                       None, jnp.float32)

    def held_for_amx(bits, pack, unpack):  # the codes packed once beforehand, as the engine holds them on AMX
        def prepare_packed(w):
            params = prepare(bits)(w)
            return {**params, "qweight": pack(params["qweight"])}

        def reference(x, p):
            return dequantized(bits)(x, {**p, "qweight": unpack(p["qweight"], x.shape[1])})
        return prepare_packed, reference

    impls = {"int8": (engine(8), prepare(8), dequantized(8)), "int4": (engine(4), prepare(4), dequantized(4))}
    if cpu.int8_weights_on_amx() and jnp.dtype(dtype) == jnp.bfloat16:  # as the engine holds int8 layers there
        impls["int8"] = (lambda x, p: cpu.int8_weights_matmul_packed_cpu(x, p["qweight"], p["scales"].astype(jnp.float32),
                                                                         out_dtype=jnp.float32),
                         *held_for_amx(8, cpu.pack_for_amx, cpu.unpack_from_amx))
    if cpu.int4_on_amx() and jnp.dtype(dtype) == jnp.bfloat16:
        impls["int4"] = (lambda x, p: cpu.int4_matmul_packed_cpu(x, p["qweight"], p["scales"], p["zero_offsets"],
                                                                 out_dtype=jnp.float32),
                         *held_for_amx(4, cpu.pack_int4_for_amx, cpu.unpack_int4_from_amx))
    if cpu.int8_matmul_is_vectorized():
        w8a8 = WeightQuant(bits=8, group_size=-1, method="w8a8", activations="int8")

        on_amx = cpu.w8a8_on_amx()

        def w8a8_product(x, p):  # as a W8A8 layer runs it: x quantized per row, then the integer matmul
            if on_amx:  # the codes held packed for the tiles, x quantized in the call
                return cpu.w8a8_matmul_packed_cpu(x, p["qweight"], p["scales"], p["zero_offsets"],
                                                  out_dtype=jnp.float32)
            return low_precision_dot.w8a8_dot(x, p, w8a8, jnp.float32, native=True)

        w8a8_prepare = held_for_amx(8, cpu.pack_for_amx, cpu.unpack_from_amx)[0] if on_amx else prepare(8)

        def w8a8_reference(x, p):
            codes, row_scale = activation_codes(x, "int8")
            if on_amx:
                p = {**p, "qweight": cpu.unpack_from_amx(p["qweight"], x.shape[1])}
            return dequantized(8)(codes.astype(jnp.float32) * row_scale, p)

        impls["w8a8"] = (w8a8_product, w8a8_prepare, w8a8_reference)
    if cpu.quant_matmul_takes_bfloat16(2, 1):
        impls.update({"int8-f32x": (float32_x, prepare(8), dequantized(8)),
                      "int4-f32x": (float32_x, prepare(4), dequantized(4))})
    return impls


def run(shape: str, dtype_name: str, rows_list: list[int], layers: int, repeats: int,
        read_bytes_per_s: float) -> list[dict]:
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype_name)
    rng = np.random.default_rng(0)
    products = layer_products(shape) * layers
    weights = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, dtype) for k, n in products]
    impls = _implementations(dtype)
    results = []
    for rows in rows_list:
        xs = {k: jnp.asarray(rng.standard_normal((rows, k), np.float32), dtype) for k in {k for k, _ in products}}
        flops = sum(2 * rows * k * n for k, n in products)
        row: dict = {"rows": rows}
        reference = None
        for name, (fn, prepare, *own_reference) in impls.items():
            ws = [jax.block_until_ready(prepare(w)) for w in weights] if prepare else weights
            read_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(ws))  # what this implementation streams
            step = jax.jit(lambda xs, ws, fn=fn: [fn(xs[k], w) for (k, _), w in zip(products, ws)])
            outs = [np.asarray(y, np.float32) for y in jax.block_until_ready(step(xs, ws))]
            if reference is None:  # xla's: every implementation must compute the same products
                reference = outs
            want = reference
            if own_reference:  # quantized: the same products as XLA's dot on the weights their codes stand for
                want = [np.asarray(own_reference[0](xs[k], w), np.float32) for (k, _), w in zip(products, ws)]
            row[f"{name}_max_rel_diff"] = float(max(np.abs(a - b).max() / np.abs(b).max()
                                                    for a, b in zip(outs, want)))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(step(xs, ws))
                times.append(time.perf_counter() - start)
            row[name] = flops / float(np.median(times)) / 1e9
            row[f"{name}_read_fraction"] = read_bytes / float(np.median(times)) / read_bytes_per_s
        results.append(row)
        print(f"{rows:>6}  " + "  ".join(f"{name} {row[name]:7.1f} ({row[name + '_read_fraction']:.0%} of read)"
                                         for name in impls)
              + ("  native/xla %.2fx" % (row["native"] / row["xla"]) if "native" in row else ""))
    return results


def run_lm_head(shape: str, rows_list: list[int], repeats: int, read_bytes_per_s: float) -> list[dict]:
    """The tied LM head of `shape` (bfloat16 table [vocab, hidden]) as the engine calls it: the logits
    (`Embedding.attend`) of the "xla" linear backend's einsum and of the "cpu" backend's native transposed matmul
    (AMX tiles or AVX-512 BF16, where the CPU has either; else the same einsum), and, where the native head
    runs, the greedy heads: the fused argmax over the whole table (`attend_argmax`, "argmax") and the same
    tokens through the table's int8 screen ("screened", where the CPU has AMX-INT8 or AVX-512 VNNI). The
    calls alternate within each repeat. Milliseconds and the table's bytes read once over the time as a
    fraction of the read bandwidth."""
    import jax
    import jax.numpy as jnp

    from paged.kernels.cpu import screen as screening
    from paged.models.linear import Embedding

    config = MODEL_SHAPES[shape]
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((vocab, hidden), np.float32) * 0.02, jnp.bfloat16)
    params = {"params": {"embedding": table}}
    heads = {name: jax.jit(lambda p, h, e=Embedding(vocab, hidden, jnp.bfloat16, backend=name): e.apply(
        p, h, method="attend")) for name in ("xla", "cpu")}
    native = Embedding(vocab, hidden, jnp.bfloat16, backend="cpu")
    if native.apply(params, method="table_runs_natively"):
        heads["argmax"] = jax.jit(lambda p, h: native.apply(p, h, method="attend_argmax"))
        if screening.screen_native():
            screen = jax.tree.map(jnp.asarray, screening.greedy_screen(table))
            heads["screened"] = jax.jit(lambda p, h: native.apply(p, h, screen=screen, method="attend_argmax"))
    results = []
    for rows in rows_list:
        h = jnp.asarray(rng.standard_normal((rows, hidden), np.float32), jnp.bfloat16)
        row: dict = {"rows": rows}
        outs = {name: np.asarray(jax.block_until_ready(head(params, h))) for name, head in heads.items()}
        times: dict[str, list[float]] = {name: [] for name in heads}
        for _ in range(repeats):
            for name, head in heads.items():
                start = time.perf_counter()
                jax.block_until_ready(head(params, h))
                times[name].append(time.perf_counter() - start)
        for name in heads:
            row[f"{name}_ms"] = float(np.median(times[name])) * 1e3
            row[f"{name}_read_fraction"] = table.nbytes / float(np.median(times[name])) / read_bytes_per_s
        row["cpu_max_rel_diff"] = float(np.abs(outs["cpu"] - outs["xla"]).max() / np.abs(outs["xla"]).max())
        if "argmax" in heads:
            # The greedy heads' tokens: the native logits' first maxima (the screened head's are the same).
            row["argmax_tokens_match"] = bool((outs["argmax"] == np.argmax(outs["cpu"], axis=1)).all())
        if "screened" in heads:
            row["screened_tokens_match"] = bool((outs["screened"] == outs["argmax"]).all())
        results.append(row)
        print(f"{rows:>6}  LM head: " + "  ".join(f"{name} {row[name + '_ms']:6.1f} ms "
                                                  f"({row[name + '_read_fraction']:.0%} of read)" for name in heads)
              + f"  xla/cpu {row['xla_ms'] / row['cpu_ms']:.2f}x"
              + (f"  argmax/screened {row['argmax_ms'] / row['screened_ms']:.2f}x" if "screened" in heads else ""))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged bench matmul", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen2.5-0.5b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--layers", type=int, default=4,
                        help="copies of the layer's products per call (weights that outgrow the caches)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per point (median)")
    parser.add_argument("--lm-head", action="store_true",
                        help="also time the shape's tied LM head (its embedding table) at each row count")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.layers < 1 or args.repeats < 1:
        parser.error("--rows, --layers and --repeats must be positive")
    import jax
    from paged.benchmarks.common import read_bandwidth
    from paged.kernels import cpu
    read_bw = read_bandwidth()
    print(f"{args.model_shape} layer products x {args.layers}, {args.dtype}, GFLOP/s (median of {args.repeats}); "
          f"{jax.devices()[0].device_kind}, AMX {'on' if cpu.matmul_on_amx() else 'off'}; streaming read "
          f"{read_bw / 1e9:.1f} GB/s", file=sys.stderr)
    results = run(args.model_shape, args.dtype, args.rows, args.layers, args.repeats, read_bw)
    head = run_lm_head(args.model_shape, args.rows, args.repeats, read_bw) if args.lm_head else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_shape": args.model_shape, "dtype": args.dtype, "layers": args.layers,
                       "amx": cpu.matmul_on_amx(), "read_bytes_per_s": read_bw, "gflops": results,
                       **({"lm_head": head} if head is not None else {})}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

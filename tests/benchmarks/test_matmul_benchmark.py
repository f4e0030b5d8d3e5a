"""Smoke test of `paged bench matmul` (the figures in docs/kernels.md come from full runs)."""

from __future__ import annotations

import json

from paged.kernels import cpu
from paged.kernels.cpu import screen as screening
from paged.serving.cli import main


def test_matmul_benchmark_times_every_backend_on_the_same_products(tmp_path):
    out = tmp_path / "matmul.json"
    assert main(["bench", "matmul", "--rows", "3", "40", "--layers", "1", "--repeats", "1", "--lm-head",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["amx"] == cpu.matmul_on_amx()
    assert report["read_bytes_per_s"] > 1e8
    assert [row["rows"] for row in report["gflops"]] == [3, 40]
    for row in report["gflops"]:
        names = {key for key in row if key != "rows" and not key.endswith(("_max_rel_diff", "_read_fraction"))}
        assert "xla" in names and ("native" in names) == (cpu.matmul_max_rows("bfloat16") > 0)
        assert ("native-avx512" in names) == cpu.matmul_on_amx()
        assert {"int8", "int4"} <= names or not cpu.matmul_is_vectorized("int8")
        assert ("w8a8" in names) == (cpu.matmul_is_vectorized("int8") and cpu.int8_matmul_is_vectorized())
        assert all(row[name] > 0 and row[f"{name}_read_fraction"] > 0 for name in names)
        # One rounding of float32 sums apart at most (the products are the same bf16 values; int8 and int4 against
        # XLA's dot on their dequantized weights). int4 on AMX over 64 rows holds those weights rounded to
        # bfloat16 (a relative step of 2^-8).
        rounded = {"int4"} if cpu.int4_on_amx() and row["rows"] > 64 else set()
        assert all(row[f"{name}_max_rel_diff"] < (4e-3 if name in rounded else 1e-5) for name in names), row
    # The tied LM head: both backends' logits agree to the rounding of their float32 sums.
    assert [row["rows"] for row in report["lm_head"]] == [3, 40]
    assert all(row["xla_ms"] > 0 and row["cpu_ms"] > 0 and row["cpu_max_rel_diff"] < 1e-5 for row in report["lm_head"])
    # The greedy heads where the native head runs: the fused argmax's tokens are the native logits' first maxima,
    # and the screened head (where the CPU has it) gives the same tokens.
    for row in report["lm_head"]:
        assert ("argmax_ms" in row) == cpu.transposed_matmul_native()
        assert ("screened_ms" in row) == (cpu.transposed_matmul_native() and screening.screen_native())
        if "argmax_ms" in row:
            assert row["argmax_tokens_match"], row
        if "screened_ms" in row:
            assert row["screened_tokens_match"], row

"""`paged.testing.check_attention`: every built-in backend passes its matrix; deliberately broken kernels fail,
and the report says which cases."""

from __future__ import annotations

import math

import pytest

from paged.kernels import paged_attention_reference
from paged.testing import check_attention, default_cases
from tests.native import needs_compiler


def _reference(positions_shift=0, keep_window=True, scale_factor=1.0):
    def attend(q, k, v, k_cache, v_cache, layer, meta, *, scale, sliding_window, soft_cap):
        return paged_attention_reference(q, k_cache, v_cache, layer, meta.page_tables, meta.token_seq_ids,
                                         meta.positions + positions_shift, scale=scale * scale_factor,
                                         sliding_window=sliding_window if keep_window else None, soft_cap=soft_cap)
    return attend


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_compiler)])
def test_every_builtin_backend_passes(backend):
    report = check_attention(backend)
    assert report.passed, str(report)
    assert len(report.results) == len(default_cases())


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_compile_heavy_backends_pass_at_one_page_size(backend):
    # Each case compiles anew, and these two compile slowly on CPU (XLA's two attention paths under a
    # cond; Pallas interpret mode): page size 8 only here, windows and soft caps included (the full
    # matrix passes too: `check_attention("xla")`, about a minute).
    cases = [c for c in default_cases() if c.page_size == 8]
    report = check_attention(backend, cases=cases)
    assert report.passed, str(report)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_compiler)])
def test_bfloat16_pools_pass_at_the_bfloat16_tolerance(backend):
    report = check_attention(backend, dtype="bfloat16", cases=default_cases()[:12])
    assert report.passed, str(report)


def test_an_off_by_one_causal_mask_fails_everywhere():
    report = check_attention(_reference(positions_shift=1))
    assert not report.passed and len(report.failures) == len(report.results), str(report)


def test_an_ignored_window_fails_exactly_the_windowed_cases():
    report = check_attention(_reference(keep_window=False))
    failed = {r.case.name for r in report.failures}
    windowed = {c.name for c in default_cases() if c.sliding_window}  # window 0 means none: it passes
    assert failed == windowed and windowed, str(report)


def test_a_wrong_scale_fails_and_the_report_names_cases():
    report = check_attention(_reference(scale_factor=1.25))
    assert len(report.failures) == len(report.results)
    text = str(report)
    assert "FAIL decode page8 q2/kv2" in text and f"0 of {len(report.results)} cases passed" in text


def test_a_kernel_that_raises_is_a_failed_case_not_a_crash():
    def broken(q, *args, **kwargs):
        raise RuntimeError("not implemented for this shape")
    report = check_attention(broken, cases=default_cases()[:2])
    assert not report.passed and all(math.isinf(r.max_error) for r in report.results)
    assert "not implemented for this shape" in report.results[0].message


@pytest.mark.skipif(tuple(int(x) for x in __import__("jax").__version__.split(".")[:2]) < (0, 11),
                    reason="the Mosaic GPU interpreter of jax 0.10 has no rule for layout_cast; the jax 0.12 "
                           "CI leg runs this")
def test_the_hopper_decode_backend_passes_under_the_mosaic_interpreter():
    # bf16 and head_dim 64 (the kernel's wgmma tiles); decode steps are the ones it runs, others go to the
    # portable ragged kernel. All 30 cases pass (max error 7.8e-3, about 66 s here); the decode ones run here.
    import dataclasses
    cases = [dataclasses.replace(c, head_dim=64) for c in default_cases() if c.name.startswith("decode")]
    report = check_attention("pallas-mosaic", dtype="bfloat16", cases=cases)
    assert report.passed, str(report)


@pytest.mark.tpu_interpreter
def test_the_tpu_backend_passes_the_window_and_soft_cap_cases_under_the_tpu_interpreter():
    # Through the engine's contract ("pallas-tpu": the decode/prefill blocks' cond), poisoned slots included;
    # the kernel's own tests (tests/pallas_kernels/test_tpu_ragged.py) cover the page sizes and head layouts.
    cases = [c for c in default_cases() if c.sliding_window is not None or c.soft_cap is not None]
    report = check_attention("pallas-tpu", cases=cases)
    assert report.passed and len(report.results) == 6, str(report)

"""Which kernels run where: the one place `attention_backend="auto"` and `linear_backend="auto"` resolve.

GPU: the Pallas kernels (Triton lowering) and XLA's dot. Which of "pallas", "pallas-mosaic" and "xla" "auto"
takes there is to come from a measurement (`benchmarks/gpu_check.py` prints the kernel fastest at the decode
goal's shapes); until one has run on a GPU it is the portable "pallas". CPU: the native kernels when this
machine builds them (attention and the decode-sized matmul together), else XLA's chunked attention and dot.
TPU: the Mosaic TPU ragged kernel (`tpu/ragged.py`) and XLA's dot. An explicit "xla" attention keeps XLA's
dot too, so it stays the pure-XLA baseline that kernel comparisons measure against. Off its platform a Pallas
kernel runs in interpret mode on CPU (for tests), and is refused elsewhere: the GPU kernels' Triton
parameters mean nothing to the TPU compiler, nor the TPU kernel's to a GPU.
"""

from __future__ import annotations

import functools
import logging

from paged.kernels import cpu

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("reference", "xla", "cpu", "pallas", "pallas-mosaic", "pallas-tpu")
LINEAR_BACKENDS = ("xla", "cpu")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def select_backends(platform: str, attention: str = "auto", linear: str = "auto",
                    sharded: bool = False) -> tuple[str, str]:
    """(attention backend, linear backend) names for `platform` (jax.default_backend()), "auto" resolved.

    `sharded`: the weights are split over a mesh. The native matmul is an FFI call XLA cannot partition, so
    sharded projections keep XLA's dot. Raises ValueError for an unknown name or a backend that cannot run on
    the platform, NotImplementedError for the native matmul on sharded weights.
    """
    if attention == "auto":
        if platform in GPU_PLATFORMS:
            attention = "pallas"
        elif platform == "tpu":
            attention = "pallas-tpu"
        else:
            attention = "cpu" if platform == "cpu" and cpu.available()[0] else "xla"
            if platform == "cpu" and attention == "xla":
                _say_native_kernels_missing(cpu.available()[1])
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {attention!r}; choose one of {['auto', *ATTENTION_BACKENDS]}")
    if linear == "cpu" and sharded:
        raise NotImplementedError("linear_backend='cpu' does not run under tensor parallelism yet")
    if linear == "auto":
        linear = "cpu" if attention == "cpu" and not sharded else "xla"
    if linear not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear_backend {linear!r}; choose one of {['auto', *LINEAR_BACKENDS]}")
    if attention in ("pallas", "pallas-mosaic") and platform == "tpu":
        raise ValueError(f"attention_backend={attention!r} is a GPU kernel; on TPU use 'pallas-tpu' (or 'auto')")
    if attention == "pallas-tpu" and platform in GPU_PLATFORMS:
        raise ValueError("attention_backend='pallas-tpu' is the TPU kernel; on a GPU use 'pallas' (or 'auto')")
    for option, name in (("attention_backend", attention), ("linear_backend", linear)):
        if name == "cpu" and platform != "cpu":  # the FFI targets exist only for the host platform
            raise ValueError(f"{option}='cpu' runs on the CPU only; this engine runs on {platform!r}")
    return attention, linear


@functools.cache
def _say_native_kernels_missing(reason: str) -> None:
    """Once per process (per reason): the engine still runs, on XLA's attention and dot, only slower."""
    logger.warning("the native CPU kernels are unavailable (%s); attention and matmuls fall back to the XLA "
                   "path, which runs slower on CPU", reason)

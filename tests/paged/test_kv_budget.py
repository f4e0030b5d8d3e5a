"""How the KV pool is sized: bytes asked for, VLLM_CPU_KVCACHE_SPACE, the CPU default, the host's available
memory (not its free pages), and what the start-up summary says of it."""

from __future__ import annotations

import jax
import pytest

import paged.runner
from paged import LLM
from paged.runner import CPU_DEFAULT_KV_BYTES, host_available_bytes, kv_budget


def _meminfo_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def test_the_host_figure_is_memavailable():
    assert abs(host_available_bytes() - _meminfo_available()) < 256 * 2**20  # read a moment apart


def test_how_the_budget_is_chosen(monkeypatch):
    cpu = jax.devices("cpu")[0]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_budget(0.9, 123_456, cpu) == (123_456, "kv_cache_memory_bytes=123,456")
    monkeypatch.setattr(paged.runner, "host_available_bytes", lambda: 64 * 2**30)
    budget, note = kv_budget(0.9, None, cpu)
    assert budget == CPU_DEFAULT_KV_BYTES == 4 * 2**30 and "CPU default of 4 GiB" in note
    monkeypatch.setattr(paged.runner, "host_available_bytes", lambda: 2 * 2**30)
    assert kv_budget(0.5, None, cpu)[0] == 2**30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.25")
    assert kv_budget(0.9, None, cpu) == (2**28, "VLLM_CPU_KVCACHE_SPACE=0.25 GiB")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got 'lots'"):
        kv_budget(0.9, None, cpu)


def test_kv_cache_memory_bytes_sizes_the_pool_and_the_summary_says_so(tiny_model_dir, caplog):
    # The tiny Llama: 2 layers x 2 KV heads x 16 head dims x K and V x 4 bytes = 512 bytes a token.
    with caplog.at_level("INFO", logger="paged"):
        llm = LLM(tiny_model_dir, dtype="float32", block_size=16, max_model_len=64, max_num_seqs=4,
                  kv_cache_memory_bytes=512 * 16 * 10, show_progress=False)
    assert llm.engine.block_manager.num_blocks == 10
    assert "sized by kv_cache_memory_bytes=81,920" in caplog.text
    # 8,192 bytes are one 16-token block, the reserved sink alone: nothing fits, and a 64-token sequence needs
    # 4 blocks plus the sink.
    with pytest.raises(ValueError, match=r"sized by kv_cache_memory_bytes=8,192\). One such sequence needs "
                                         r"kv_cache_memory_bytes >= 40,960; this pool fits max_model_len <= 0"):
        LLM(tiny_model_dir, dtype="float32", block_size=16, max_model_len=64, kv_cache_memory_bytes=8192,
            show_progress=False)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be None or a positive integer"):
        LLM(tiny_model_dir, kv_cache_memory_bytes=0, show_progress=False)


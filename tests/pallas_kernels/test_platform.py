"""Backend selection where the native CPU kernels cannot be built: the engine says so once and runs on XLA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged.kernels import select_backends

REPO = Path(__file__).resolve().parents[2]

_TWO_ENGINES = """
import json, sys
from paged import LLM, SamplingParams
runs = []
for _ in range(2):
    llm = LLM(sys.argv[1], block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              show_progress=False)
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    runs.append([llm.engine.attention_name, llm.engine.linear_backend, out[0].outputs[0].token_ids])
print(json.dumps(runs))
"""


def test_without_a_compiler_the_engine_says_so_once_and_runs_on_xla(tiny_model_dir, tmp_path):
    env = {**os.environ, "CXX": "no-such-compiler", "PAGED_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _TWO_ENGINES, tiny_model_dir], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert [run[:2] for run in runs] == [["xla", "xla"], ["xla", "xla"]]
    assert all(len(run[2]) == 4 for run in runs)
    assert done.stderr.count("the native CPU kernels are unavailable") == 1, done.stderr[-3000:]
    assert "no C++ compiler: 'no-such-compiler' is not on PATH" in done.stderr


def test_gpu_platforms_take_pallas():
    assert select_backends("cuda") == ("pallas", "xla")


def test_tpu_takes_its_own_kernel_and_refuses_the_gpu_ones():
    assert select_backends("tpu") == ("pallas-tpu", "xla")
    assert select_backends("tpu", "xla") == ("xla", "xla")
    assert select_backends("cpu", "pallas-tpu") == ("pallas-tpu", "xla")  # the TPU interpreter, for tests
    for gpu_kernel in ("pallas", "pallas-mosaic"):
        with pytest.raises(ValueError, match="GPU kernel; on TPU use 'pallas-tpu'"):
            select_backends("tpu", gpu_kernel)
    with pytest.raises(ValueError, match="TPU kernel; on a GPU use 'pallas'"):
        select_backends("cuda", "pallas-tpu")

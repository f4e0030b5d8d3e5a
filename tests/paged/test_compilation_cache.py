"""The persistent compilation cache: a second process loads the steps the first compiled, same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from paged import compilation_cache
from paged.config import EngineConfig
from tests.native import cache_root_sharing_kernels

REPO = Path(__file__).resolve().parents[2]

# Counts the cache's hits through JAX's monitoring events while an engine starts and generates.
_RUN = """
import json, sys
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
from paged import LLM, SamplingParams
llm = LLM(sys.argv[1], block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
          show_progress=False)
out = llm.generate(["Hello world", "The quick brown fox"], SamplingParams(temperature=0, max_tokens=6),
                   use_tqdm=False)
print(json.dumps({"hits": len(hits), "dir": llm.engine.compilation_cache_dir,
                  "tokens": [o.outputs[0].token_ids for o in out]}))
"""


def _run(model_dir: str, cache_root: Path) -> dict:
    env = {**os.environ, "PAGED_CACHE_DIR": str(cache_root_sharing_kernels(cache_root)), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", _RUN, model_dir], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tiny_model_dir, tmp_path):
    first = _run(tiny_model_dir, tmp_path)
    assert first["dir"] == str(tmp_path / "xla") and first["hits"] == 0
    assert any((tmp_path / "xla").iterdir()), "the first run wrote nothing to the cache"
    second = _run(tiny_model_dir, tmp_path)
    assert second["hits"] > 0 and second["tokens"] == first["tokens"]


@pytest.fixture
def restore_jax_cache_config():
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    reset_cache()


def test_settings(restore_jax_cache_config, tmp_path, monkeypatch):
    """None leaves JAX alone; "auto" keeps a directory the user set, else takes $PAGED_CACHE_DIR/xla; a path
    is used as given."""
    jax.config.update("jax_compilation_cache_dir", None)
    assert compilation_cache.configure(None) is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    assert compilation_cache.configure("auto") == str(tmp_path / "xla") == jax.config.jax_compilation_cache_dir
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    jax.jit(lambda x: x * 2 - 1)(jax.numpy.arange(3.0)).block_until_ready()  # JAX opens its cache here
    assert any((tmp_path / "xla").iterdir())
    jax.config.update("jax_compilation_cache_dir", "/somewhere/the/user/chose")
    assert compilation_cache.configure("auto") == "/somewhere/the/user/chose"
    assert compilation_cache.configure(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(5.0)).block_until_ready()
    assert any((tmp_path / "mine").iterdir()), "a directory set after JAX opened its cache went unused"


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_bad_setting_is_refused(bad):
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        EngineConfig(compilation_cache_dir=bad).validate()

"""The start-up summary: logged once, at INFO, with what the engine actually built; precompile's line says how
many shapes came from the persistent compilation cache."""

from __future__ import annotations

import json
import re
import logging
import os
import subprocess
import sys
from pathlib import Path

from paged import LLM
from paged.batch import Buckets
from paged.startup import summary
from tests.native import cache_root_sharing_kernels

REPO = Path(__file__).resolve().parents[2]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_summary_is_logged_once_with_the_engine_as_built(tiny_model_dir):
    handler = _Records()
    paged_logger = logging.getLogger("paged")
    paged_logger.addHandler(handler)
    try:
        llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                  num_kv_blocks=40, show_progress=False)
    finally:
        paged_logger.removeHandler(handler)
    summaries = [r for r in handler.records if r.getMessage().startswith("engine ready in")]
    assert len(summaries) == 1 and summaries[0].levelno == logging.INFO
    text = summaries[0].getMessage()
    engine = llm.engine
    assert f"model {tiny_model_dir}" in text and "LlamaForCausalLM" in text and "in float32" in text
    assert f"devices {engine.devices[0]}" in text
    assert f"attention backend {engine.attention_name}, linear backend {engine.linear_backend}" in text
    # 40 blocks, one of them the reserved sink: 39 usable x 8 tokens.
    pool_mib = 40 * 2 * 2 * 2 * 8 * 16 * 4 / 2**20  # blocks x K,V x layers x KV heads x tokens x head_dim x 4 B
    assert f"KV pool 39 blocks x 8 tokens = 312 tokens, {pool_mib:,.1f} MiB in float32" in text
    assert "max_model_len 64, max_num_seqs 4, max_num_batched_tokens 32" in text
    assert f"{len(engine.buckets.all_shapes())} step shapes" in text
    assert f"model {tiny_model_dir} (random weights: its text is noise)" in text  # create_tiny_llama marks it



def test_summary_names_the_speculative_pools(tiny_model_dir):
    """A draft model's KV pool (its own shape, the target's block count) is reported beside the target's."""
    llm = LLM(tiny_model_dir, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              num_kv_blocks=40, show_progress=False,
              speculative_config={"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3,
                                  "disable_by_batch_size": 3})
    text = summary(llm.engine, 1.0)
    pool_mib = 40 * 2 * 2 * 2 * 8 * 16 * 4 / 2**20  # the draft is the tiny model itself: the same pool
    assert (f"speculative decoding by draft_model, up to 3 tokens a step while fewer than 3 requests run; "
            f"{tiny_model_dir}: 2 layer(s), its KV pool {pool_mib:,.1f} MiB") in text
    assert "speculative" not in summary(LLM(tiny_model_dir, show_progress=False).engine, 1.0)

_PRECOMPILE_TWICE = """
import logging, sys
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
from paged import LLM
logging.getLogger("paged").addHandler(Keep())
for _ in range(2):
    LLM(sys.argv[1], block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
        show_progress=False).engine.precompile()
import json
print(json.dumps(lines))
"""


def test_precompile_says_which_shapes_came_from_the_cache(tiny_model_dir, tmp_path):
    env = {**os.environ, "PAGED_CACHE_DIR": str(cache_root_sharing_kernels(tmp_path)), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", _PRECOMPILE_TWICE, tiny_model_dir], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    precompiled = [line for line in lines if line.startswith("precompiled")]
    summaries = [line for line in lines if line.startswith("engine ready")]
    assert len(summaries) == 2 and all(f"compiled steps are kept in {tmp_path / 'xla'}" in s for s in summaries)
    shapes = len(Buckets(16, 4).all_shapes())
    assert precompiled[0].startswith(f"precompiled {shapes} step shapes and "), precompiled
    compiled = int(re.search(r"0 programs loaded from the compilation cache, (\d+) compiled", precompiled[0])[1])
    assert compiled > shapes, precompiled  # the step shapes and the adjusted sampling's programs
    # The second engine compiles the same programs: every one is a hit.
    assert f"{compiled} programs loaded from the compilation cache, 0 compiled" in precompiled[1], precompiled
    # The default handler prints the summary to stderr (a script that configured no logging still sees it).
    assert done.stderr.count("engine ready in") == 2


def test_random_weights_are_named_as_such(tmp_path):
    from paged.models.builtin import random_weights_note
    from paged.models.tiny import create_tiny_llama
    assert random_weights_note(create_tiny_llama(str(tmp_path))) == "random weights: its text is noise"

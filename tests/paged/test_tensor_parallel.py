"""Tensor parallelism on simulated CPU devices: the same tokens as one device, weights and KV split per device.

Each case runs in a subprocess, since the device count is fixed when jax starts
(`--xla_force_host_platform_device_count`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from paged.models.tiny import create_tiny_llama
from tests.native import needs_compiler

SCRIPT = textwrap.dedent("""
    import json, sys, traceback
    import jax
    from paged import LLM, SamplingParams
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 13, 200], [7, 7, 30], list(range(40, 90)), [3])]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True,
                            logprobs=2, presence_penalty=0.3)


    def run(model_dir, backend, sizes, options):
        greedy_only = options.pop("greedy_only", False)  # half the compiles, where seeded runs are covered elsewhere
        out = {}
        for size in sizes:
            llm = LLM(model_dir, tensor_parallel_size=size, attention_backend=backend, block_size=8,
                      max_model_len=128, max_num_seqs=8, num_kv_blocks=64, show_progress=False,
                      enable_prefix_caching=False,  # every run computes the same shapes
                      compilation_cache_dir=None, **options)
            runs = [llm.generate(prompts, params, use_tqdm=False) for params in (greedy, seeded)[:1 if greedy_only else 2]]
            compiled = llm.engine.num_compilations
            llm.generate(prompts, greedy, use_tqdm=False)  # same shapes again: nothing new to compile
            k_cache = llm.engine.worker.runner.kv_cache[0]
            layer = llm.engine.worker.runner.params["layers"][0]
            q_proj = layer["self_attn"]["q_proj"] if "self_attn" in layer else {"kernel": k_cache}
            q_kernel = q_proj.get("kernel", q_proj.get("qweight"))  # float or quantized
            embedding = llm.engine.worker.runner.params.get("embed_tokens", llm.engine.worker.runner.params.get("wte"))["embedding"]
            out[size] = {
                "tokens": [[o.outputs[0].token_ids for o in run] for run in runs],
                "logprobs": [round(o.outputs[0].cumulative_logprob, 3) for o in runs[1]] if len(runs) > 1 else [],
                "recompiled": llm.engine.num_compilations - compiled,
                "kv_shard_heads": [s.data.shape[1] for s in k_cache.addressable_shards],
                "q_shard_cols": [s.data.shape[1] for s in q_kernel.addressable_shards],
                "embedding_shard_rows": [s.data.shape[0] for s in embedding.addressable_shards],
            }
            del llm
        return out


    # One job per line of the JSON list in argv[1]: each prints its RESULT (or ERROR) line, so one process
    # (one jax start) serves several checkpoints.
    for job in json.loads(sys.argv[1]):
        try:
            print("RESULT " + json.dumps(run(job["model_dir"], job["backend"], job["sizes"], job["options"])),
                  flush=True)
        except Exception:
            print("ERROR " + json.dumps(traceback.format_exc()), flush=True)
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 8 query heads over 4 KV heads: tensor parallel 2 and 4 split both evenly.
    return create_tiny_llama(str(tmp_path_factory.mktemp("tp-llama")), num_heads=8, num_kv_heads=4,
                             hidden_size=64, num_layers=2)


def _run_many(jobs: list[dict], timeout: float = 600) -> list[dict | str]:
    """Runs each job (model_dir, backend, sizes, options) in one subprocess with 8 simulated devices; per job,
    its results by size, or the traceback it raised."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(jobs)], capture_output=True, text=True, env=env,
                         timeout=timeout)
    lines = [line for line in run.stdout.splitlines() if line.startswith(("RESULT ", "ERROR "))]
    assert run.returncode == 0 and len(lines) == len(jobs), run.stderr[-3000:]
    return [{int(k): v for k, v in json.loads(line[7:]).items()} if line.startswith("RESULT ")
            else json.loads(line[6:]) for line in lines]


def _run(model_dir, backend, sizes, **options):
    (result,) = _run_many([{"model_dir": model_dir, "backend": backend, "sizes": list(sizes), "options": options}])
    assert isinstance(result, dict), result
    return result


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=needs_compiler), "reference", "pallas"])
def test_tensor_parallel_gives_the_tokens_of_one_device(model_dir, backend):
    # Every size on XLA; each other backend at 4 shards, where the 4 KV heads split one per device (its
    # per-shard path is the same at any size).
    sizes = (2, 4, 8) if backend == "xla" else (4,)
    results = _run(model_dir, backend, [1, *sizes])
    one = results[1]
    for size in sizes:
        got = results[size]
        assert got["tokens"] == one["tokens"], size  # greedy, and seeded sampling with penalties
        assert got["logprobs"] == pytest.approx(one["logprobs"], abs=2e-3)
        assert got["recompiled"] == 0
        # Each device holds only its KV heads (at 8, one copy of one of the 4 heads) and its q_proj columns.
        assert got["kv_shard_heads"] == [max(1, 4 // size)] * size
        assert got["q_shard_cols"] == [64 // size] * size
    assert one["kv_shard_heads"] == [4]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_weights_split_like_float_ones(model_dir, quantization):
    """Online int8 (codes, scales and zero offsets) and fp8 (codes, per-channel scales) over 8 devices (the 4 KV
    heads' quantized k/v_proj repeated, q_proj split 8 ways): the tokens of one device."""
    results = _run(model_dir, "xla", [1, 8], quantization=quantization)
    for size in (8,):
        assert results[size]["tokens"] == results[1]["tokens"], size
        assert results[size]["recompiled"] == 0


def test_an_fp8_pool_splits_over_its_kv_heads(model_dir):
    results = _run(model_dir, "xla", [1, 2], kv_cache_dtype="fp8")
    assert results[2]["tokens"] == results[1]["tokens"]
    assert results[2]["kv_shard_heads"] == [2, 2]


def test_a_gptq_checkpoint_splits_too(model_dir, tmp_path):
    """A GPTQ 4-bit checkpoint (two rows a byte, group scales and zero points; row-parallel layers split the
    packed rows) over 4 devices."""
    from paged.benchmarks.gptq_checkpoint import main as write_gptq
    quantized = str(tmp_path / "gptq4")
    assert write_gptq([model_dir, quantized, "--bits", "4", "--group-size", "32"]) == 0
    results = _run(quantized, "xla", [1, 4])
    for size in (4,):
        assert results[size]["tokens"] == results[1]["tokens"], size


def test_dummy_weights_are_the_same_on_every_mesh(model_dir, tmp_path):
    """load_format="dummy" draws each shard on its own device, from config.json alone: the weights, so the
    greedy tokens, are those one device draws."""
    config_only = str(tmp_path / "config-only")
    shutil.copytree(model_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    results = _run(config_only, "xla", [1, 4], load_format="dummy", greedy_only=True)
    assert results[4]["tokens"] == results[1]["tokens"]
    assert results[4]["q_shard_cols"] == [16] * 4 and results[4]["kv_shard_heads"] == [1] * 4


def test_a_vocabulary_the_size_does_not_divide_is_padded_and_split(tmp_path):
    """515 tokens over 4 devices: the tables are padded to 516 rows and split (not replicated); the padding
    rows' logits never reach the sampler, so the tokens are one device's."""
    model_dir = create_tiny_llama(str(tmp_path / "odd-vocab"), num_heads=8, num_kv_heads=4, model_vocab_size=515)
    results = _run(model_dir, "xla", [1, 4])
    for size in (4,):
        assert results[size]["tokens"] == results[1]["tokens"], size
        assert results[size]["embedding_shard_rows"] == [516 // size] * size
    assert results[1]["embedding_shard_rows"] == [515]


@needs_compiler
def test_fewer_kv_heads_than_devices_replicates_them(tmp_path):
    """MQA (1 KV head) over 4 devices: each device holds a copy of the KV head (as vLLM replicates them)
    and the tokens are one device's."""
    mqa = create_tiny_llama(str(tmp_path / "mqa"), num_heads=4, num_kv_heads=1, hidden_size=64, num_layers=2)
    results = _run(mqa, "cpu", [1, 4])
    for size in (4,):
        assert results[size]["tokens"] == results[1]["tokens"], size
        assert results[size]["logprobs"] == pytest.approx(results[1]["logprobs"], abs=2e-3)
        assert results[size]["kv_shard_heads"] == [1] * size


def test_sizes_that_do_not_fit_are_clear_errors(model_dir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    script = ("import sys\nfrom paged import LLM\n"
              "for size in (3, 4):\n"
              "    try:\n        LLM(sys.argv[1], tensor_parallel_size=size, show_progress=False)\n"
              "    except (ValueError, NotImplementedError) as exc:\n        print('ERROR', size, exc)\n")
    run = subprocess.run([sys.executable, "-c", script, model_dir], capture_output=True, text=True, env=env,
                         timeout=300)
    assert "ERROR 3 tensor_parallel_size=3 needs 3 devices; found 2" in run.stdout, run.stdout + run.stderr
    assert "ERROR 4 tensor_parallel_size=4 needs 4 devices; found 2" in run.stdout


# Every tiny checkpoint tests/hf_checkpoints.py builds (named here: importing it needs torch, which Python 3.12
# lacks, and would skip this whole module there).
FAMILIES = ["gemma2", "gemma3", "glm", "glm4", "gpt2", "llama-gqa", "llama3-mqa-tied", "mistral-window",
            "mixtral-moe", "phi3-fused", "qwen2-moe", "qwen2-tied", "qwen3-moe", "qwen3-qknorm"]


@pytest.mark.torch
def test_every_family_is_covered():
    from tests.hf_checkpoints import SPECS
    assert sorted(SPECS) == FAMILIES


@pytest.fixture(scope="module")
def family_results(tmp_path_factory):
    """Every family's run at 1 and 4 shards, in one subprocess (one jax start for all fourteen)."""
    from tests.hf_checkpoints import build_checkpoint
    jobs = []
    for name in FAMILIES:
        heads = {"n_head": 8} if name == "gpt2" else {"num_attention_heads": 8}
        model_dir = build_checkpoint(name, str(tmp_path_factory.mktemp(name)), overrides=heads)
        jobs.append({"model_dir": model_dir, "backend": "xla", "sizes": [1, 4], "options": {"greedy_only": True}})
    return dict(zip(FAMILIES, _run_many(jobs, timeout=1800)))


@pytest.mark.torch
@pytest.mark.parametrize("name", FAMILIES)
def test_tensor_parallel_across_families(name, family_results):
    """4 shards give one device's greedy tokens on every family's tiny checkpoint, built with 8 query heads:
    2 per shard, while the 2 KV heads (or MQA's 1) are repeated; GPT-2's fused c_attn is replicated; MoE experts
    split their matrices; Gemma's windows and soft caps run per shard. Other sizes and seeded sampling under
    sharding are checked on the Llama above, with every backend."""
    results = family_results[name]
    assert isinstance(results, dict), f"{name} raised:\n{results}"
    for size in (4,):
        assert results[size]["tokens"] == results[1]["tokens"], size
        assert results[size]["recompiled"] == 0


POOL_WRITES_SCRIPT = textwrap.dedent("""
    import json, sys
    from paged.kernels import cpu
    from paged import LLM, SamplingParams
    model_dir = sys.argv[1]
    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 10 + 7 * i + n))} for i, n in enumerate((5, 17, 30, 9))]
    params = [SamplingParams(temperature=1.0, n=2, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    out = {}
    for native in (True, False):
        if not native:
            cpu.writes_pool_natively = lambda dtype: False
        llm = LLM(model_dir, tensor_parallel_size=2, dtype="bfloat16", block_size=8, max_model_len=64,
                  num_kv_blocks=12, preemption_mode="swap", show_progress=False, compilation_cache_dir=None)
        tokens = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        out[str(native)] = {"tokens": tokens, "preemptions": llm.engine.num_preemptions}
        del llm
    print("RESULT " + json.dumps(out))
""")


def test_bfloat16_pool_writes_per_shard_match_xla(model_dir):
    """Under tensor parallelism a bf16 pool's token writes, copy-on-write copies (n=2) and swap-ins run the
    native calls per shard; the same run on XLA's scatter gives the same tokens."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", POOL_WRITES_SCRIPT, model_dir], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["True"]["preemptions"] > 0 and result["True"]["preemptions"] == result["False"]["preemptions"]
    assert result["True"]["tokens"] == result["False"]["tokens"]

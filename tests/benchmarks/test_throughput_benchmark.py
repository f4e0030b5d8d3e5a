"""Smoke test of `paged bench throughput` on a tiny workload (the real run is in docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from paged.serving.cli import main


def test_throughput_benchmark_reports_every_system(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", "--model", tiny_model_dir, "--num-requests", "4", "--input-len", "4", "12",
            "--output-len", "4", "12", "--no-hf-continuous", "--hf-batch-sizes", "all", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    systems = [r["system"] for r in report["results"]]
    try:
        import torch  # noqa: F401
        assert systems == ["paged", "hf-static-b4"]
    except ImportError:
        assert systems == ["paged"]
    paged = report["results"][0]
    assert paged["compilations_in_timed_run"] == 0, "warm-up must have compiled everything the run needs"
    # Run again: this time paged's warm-up loads what the first run compiled.
    assert main(args) == 0
    again = json.loads(out.read_text())["results"][0]
    assert again["compilation_cache_dir"] == paged["compilation_cache_dir"]
    assert again["warmup_compilation_cache_hits"] > 0
    assert paged["output_tokens_per_s"] > 0 and 0 < paged["mfu"] < 1
    assert report["workload"]["requests"] == 4


def test_throughput_benchmark_samples_as_asked_in_every_system(tiny_model_dir, tmp_path):
    """--temperature / --top-p / --top-k / --min-p reach paged and transformers, and the report says what ran."""
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--num-requests", "3", "--input-len", "4", "8",
                 "--output-len", "4", "8", "--no-hf-continuous", "--hf-batch-sizes", "all", "--temperature", "0.8",
                 "--top-p", "0.9", "--top-k", "20", "--min-p", "0.01", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01}
    assert all(r["output_tokens_per_s"] > 0 for r in report["results"])
    assert report["results"][0]["output_tokens"] == report["workload"]["output_tokens"]


def test_throughput_benchmark_reads_a_dataset(tiny_model_dir, tmp_path):
    """--dataset takes text prompts (tokenized with the model's tokenizer) and token-id prompts."""
    from transformers import AutoTokenizer
    data = tmp_path / "requests.jsonl"
    data.write_text(json.dumps({"prompt": "Hello world", "output_len": 3}) + "\n"
                    + json.dumps({"prompt_token_ids": [11, 12, 13, 14], "output_len": 5}) + "\n")
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--dataset", str(data), "--no-hf-continuous",
                 "--hf-batch-sizes", "--json", str(out)]) == 0
    workload = json.loads(out.read_text())["workload"]
    text_tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir).encode("Hello world"))
    assert workload["requests"] == 2 and workload["output_tokens"] == 8
    assert workload["prompt_tokens"] == text_tokens + 4


def test_throughput_benchmark_runs_json_constrained_fractions(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--num-requests", "4", "--input-len", "4", "8",
                 "--output-len", "6", "10", "--hf-batch-sizes", "--no-hf-continuous", "--json-fractions", "0.5", "1",
                 "--json", str(out)]) == 0
    results = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"paged", "paged-json-50%", "paged-json-100%"}
    assert results["paged-json-50%"]["constrained_requests"] == 2
    assert results["paged-json-100%"]["constrained_requests"] == 4
    assert results["paged-json-100%"]["grammar_compile_seconds"] > 0
    assert all(r["output_tokens"] > 0 for r in results.values())


def test_throughput_benchmark_runs_data_and_tensor_parallel(tiny_model_dir, tmp_path):
    """--data-parallel-size 2 --tensor-parallel-size 2 on 4 simulated devices: a smoke test (CPU devices share
    the same cores, so its speed means nothing)."""
    out = tmp_path / "throughput.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    subprocess.run([sys.executable, "-m", "paged.serving.cli", "bench", "throughput", "--model", tiny_model_dir,
                    "--num-requests", "5", "--input-len", "4", "12", "--output-len", "4", "8", "--hf-batch-sizes",
                    "--no-hf-continuous", "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                    "--json", str(out)], check=True, env=env, timeout=600)
    report = json.loads(out.read_text())
    paged = report["results"][0]
    assert report["engine"]["data_parallel_size"] == 2 and report["engine"]["tensor_parallel_size"] == 2
    assert paged["requests_per_replica"] == [3, 2]
    assert paged["output_tokens"] == report["workload"]["output_tokens"]
    assert paged["compilations_in_timed_run"] == 0


def test_throughput_benchmark_runs_requests_over_lora_adapters(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--num-requests", "4", "--input-len", "4", "8",
                 "--output-len", "6", "10", "--hf-batch-sizes", "--no-hf-continuous", "--lora", "2",
                 "--lora-rank", "8", "--json", str(out)]) == 0
    results = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"paged", "paged-lora-2"}
    lora = results["paged-lora-2"]
    assert (lora["lora_adapters"], lora["lora_rank"]) == (2, 8)
    assert lora["output_tokens"] == results["paged"]["output_tokens"] and lora["compilations_in_timed_run"] == 0


def test_benchmark_adapters_are_peft_adapters(tiny_model_dir):
    """The random adapters load in PEFT itself, on every projection of the model."""
    import pytest
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from paged.benchmarks.lora_adapters import TARGETS, write_random_adapters
    (path,) = write_random_adapters(tiny_model_dir, 1, rank=8)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir), path)
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == set(TARGETS)


def test_throughput_benchmark_reports_speculation_beside_the_same_run_without(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--num-requests", "3", "--copy-workload",
                 "--output-len", "6", "10", "--hf-batch-sizes", "--no-hf-continuous", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}', "--json", str(out)]) == 0
    results = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"paged", "paged-no-spec"}
    assert results["paged"]["output_tokens"] == results["paged-no-spec"]["output_tokens"]
    assert 0 <= results["paged"]["spec_acceptance_rate"] <= 1 and "spec_drafts" not in results["paged-no-spec"]
    assert results["paged"]["compilations_in_timed_run"] == 0
    workload = json.loads(out.read_text())["workload"]
    assert workload["requests"] == 3 and workload["output_tokens"] == 30


def test_throughput_benchmark_times_a_model_from_its_config_alone(tiny_model_dir, tmp_path):
    """--load-format dummy: the weights are drawn on the devices; transformers has none to load, so its
    baselines are skipped, not failed."""
    import shutil
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(config_only), "--load-format", "dummy", "--num-requests", "3",
                 "--input-len", "4", "8", "--output-len", "4", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["results"]] == ["paged"]
    assert report["engine"]["load_format"] == "dummy"
    assert report["results"][0]["output_tokens"] == report["workload"]["output_tokens"]

"""The vLLM baseline's plumbing (benchmarks/vllm_baseline.py, run_vllm) against a stand-in `vllm` package that
records what it is asked: the real vLLM is not a test dependency (its measured figures are in
docs/performance.md)."""

from __future__ import annotations

import json
import sys
import textwrap

from paged.benchmarks.common import random_workload
from paged.benchmarks.throughput import run_vllm

_FAKE_VLLM = '''
import json, os
__version__ = "0.0-test"
_LOG = os.environ["FAKE_VLLM_LOG"]

class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))

class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]

class LLM:
    def __init__(self, **kwargs):
        with open(_LOG, "a") as f:
            f.write(json.dumps({"init": kwargs}) + "\\n")

    def generate(self, prompts, params, use_tqdm=True):
        with open(_LOG, "a") as f:
            f.write(json.dumps({"prompts": [p["prompt_token_ids"] for p in prompts],
                                "params": [p.kwargs for p in params]}) + "\\n")
        return [_Output(p.kwargs["max_tokens"] - int(os.environ.get("FAKE_VLLM_SHORT", "0"))) for p in params]
'''


def _fake(tmp_path):
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(_FAKE_VLLM))
    (package / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    return str(tmp_path / "fake")


def test_vllm_gets_the_same_requests_and_a_warmup_on_other_ids(tmp_path):
    log = tmp_path / "calls.jsonl"
    workload = random_workload(5, (3, 9), (2, 6), vocab=500, seed=3)
    measured = run_vllm(sys.executable, "/some/model", workload, "bfloat16", 64, 7, 500,
                        {"PYTHONPATH": _fake(tmp_path), "FAKE_VLLM_LOG": str(log)})
    assert measured is not None
    seconds, warmup, extra = measured
    assert seconds > 0 and warmup >= extra["startup_seconds"] > 0 and extra["version"] == "0.0-test"
    init, warm, timed = (json.loads(line) for line in log.read_text().splitlines())
    assert init["init"]["model"] == "/some/model" and init["init"]["dtype"] == "bfloat16"
    assert init["init"]["enable_prefix_caching"] is False and init["init"]["max_model_len"] == 64
    assert timed["prompts"] == workload.prompts
    assert [len(p) for p in warm["prompts"]] == workload.prompt_lens
    assert all(w[0] != p[0] for w, p in zip(warm["prompts"], workload.prompts)), "no shared first block"
    for params in (warm["params"], timed["params"]):
        assert [p["max_tokens"] for p in params] == workload.output_lens
        assert all(p["temperature"] == 0 and p["ignore_eos"] for p in params)


def test_vllm_samples_as_the_other_systems_do(tmp_path):
    log = tmp_path / "calls.jsonl"
    workload = random_workload(3, (3, 9), (2, 6), vocab=500, seed=4)
    sampling = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
    assert run_vllm(sys.executable, "/some/model", workload, "bfloat16", 64, 7, 500,
                    {"PYTHONPATH": _fake(tmp_path), "FAKE_VLLM_LOG": str(log)}, sampling) is not None
    _, warm, timed = (json.loads(line) for line in log.read_text().splitlines())
    for params in (warm["params"], timed["params"]):
        assert all({k: p[k] for k in sampling} == sampling and p["ignore_eos"] for p in params)


def test_a_vllm_that_stops_early_or_fails_gives_no_figure(tmp_path, capsys):
    workload = random_workload(2, (3, 5), (4, 6), vocab=500)
    env = {"PYTHONPATH": _fake(tmp_path), "FAKE_VLLM_LOG": str(tmp_path / "log"), "FAKE_VLLM_SHORT": "1"}
    assert run_vllm(sys.executable, "/m", workload, "auto", 32, 0, 500, env) is None
    assert "vLLM produced" in capsys.readouterr().err
    assert run_vllm(sys.executable, "/m", workload, "auto", 32, 0, 500, {"PYTHONPATH": str(tmp_path)}) is None
    assert "failed with exit code" in capsys.readouterr().err

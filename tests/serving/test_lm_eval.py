"""lm-evaluation-harness against `paged serve`, as a researcher runs it: its `local-completions` model on
loglikelihood, multiple-choice, rolling-loglikelihood and generate_until tasks (local jsonl, no downloads),
item by item against lm-eval's own `hf` model on the same float32 checkpoint."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency on Python 3.11")

from lm_eval.tasks import TaskManager  # noqa: E402

from tests.hf_checkpoints import build_checkpoint  # noqa: E402
from tests.serving.server_fixture import Server  # noqa: E402

QUESTIONS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "What color is the sky?", "choices": ["red", "green", "blue"], "answer": 2},
    {"question": "How many legs has a spider?", "choices": ["six", "eight", "ten", "four"], "answer": 1},
    {"question": "Which one is a fruit?", "choices": ["carrot", "apple"], "answer": 1},
    {"question": "Water freezes at", "choices": ["0 degrees", "50 degrees", "100 degrees"], "answer": 0},
]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "one two three four five six seven eight nine ten",
         "Return the number of items in the list, or zero when it is empty."]

TASKS = {
    "paged_mc": {"output_type": "multiple_choice", "data": "questions", "doc_to_text": "Question: {{question}}\nAnswer:",
                 "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                 "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
    # loglikelihood requests carry no delimiter: the target brings its own space.
    "paged_ll": {"output_type": "loglikelihood", "data": "questions", "doc_to_text": "Question: {{question}}\nAnswer:",
                 "doc_to_target": " {{choices[answer]}}", "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]},
    "paged_rolling": {"output_type": "loglikelihood_rolling", "data": "texts", "doc_to_text": "",
                      "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]},
    "paged_gen": {"output_type": "generate_until", "data": "questions", "doc_to_text": "Question: {{question}}\nAnswer:",
                  "doc_to_target": "{{choices[answer]}}",
                  "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
                  "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval")
    checkpoint = build_checkpoint("llama-gqa", str(root / "checkpoint"))
    data = {"questions": root / "questions.jsonl", "texts": root / "texts.jsonl"}
    data["questions"].write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    data["texts"].write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, spec in TASKS.items():
        spec = dict(spec)
        files = str(data[spec.pop("data")])
        # JSON is YAML: no YAML writer needed.
        (tasks / f"{name}.yaml").write_text(json.dumps({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": files}},
            "test_split": "test", **spec, "metadata": {"version": 1.0}}))
    return checkpoint, TaskManager(include_path=str(tasks))


def _per_item(results) -> dict:
    return {(task, sample["doc_id"]): sample["filtered_resps"] for task, samples in results["samples"].items()
            for sample in samples}


def test_lm_eval_local_completions_equals_its_hf_model(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    checkpoint, task_manager = setup
    names = list(TASKS)
    server = Server(checkpoint, "--dtype", "float32", "--max-model-len", "256")
    try:
        served = lm_eval.simple_evaluate(
            model="local-completions", tasks=names, task_manager=task_manager, log_samples=True, batch_size=4,
            model_args={"base_url": server.url + "/v1/completions", "model": "tiny", "tokenizer_backend": "huggingface",
                        "tokenizer": checkpoint, "tokenized_requests": True, "max_length": 256, "max_retries": 1})
    finally:
        server.stop()
    reference = lm_eval.simple_evaluate(
        model="hf", tasks=names, task_manager=task_manager, log_samples=True, batch_size=1,
        model_args={"pretrained": checkpoint, "dtype": "float32", "device": "cpu", "max_length": 256})

    got, expected = _per_item(served), _per_item(reference)
    assert got.keys() == expected.keys()
    assert len(got) == 3 * len(QUESTIONS) + len(TEXTS)
    for key, want in expected.items():
        have = got[key]
        if key[0] == "paged_gen":
            assert have == want, key  # greedy continuations, the same text
            continue
        for a, b in zip(have, want):
            a, b = (a, b) if key[0] == "paged_rolling" else (a[0], b[0])  # (loglikelihood, is_greedy) pairs
            assert a == pytest.approx(b, abs=1e-4), key
    for task in names:
        for metric, value in reference["results"][task].items():
            if "stderr" not in metric and isinstance(value, float):
                assert served["results"][task][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, metric)
    # Not vacuous: the items are real loglikelihoods of different choices.
    mc = [got[("paged_mc", i)] for i in range(len(QUESTIONS))]
    assert all(len({round(ll, 3) for ll, _ in item}) > 1 for item in mc)
    assert all(ll < 0 for item in mc for ll, _ in item)


def test_lm_eval_local_chat_completions_generates_as_its_hf_model(setup, monkeypatch):
    """generate_until through /v1/chat/completions (the checkpoint's chat template on the server), against lm-eval's
    hf model applying the same template: the same greedy text for every item."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    checkpoint, task_manager = setup
    server = Server(checkpoint, "--dtype", "float32", "--max-model-len", "256")
    try:
        served = lm_eval.simple_evaluate(
            model="local-chat-completions", tasks=["paged_gen"], task_manager=task_manager, log_samples=True,
            apply_chat_template=True,
            model_args={"base_url": server.url + "/v1/chat/completions", "model": "tiny", "max_retries": 1})
    finally:
        server.stop()
    reference = lm_eval.simple_evaluate(
        model="hf", tasks=["paged_gen"], task_manager=task_manager, log_samples=True, batch_size=1,
        apply_chat_template=True,
        model_args={"pretrained": checkpoint, "dtype": "float32", "device": "cpu", "max_length": 256})
    got, expected = _per_item(served), _per_item(reference)
    assert len(got) == len(QUESTIONS) and got == expected
    assert any(text for (text,) in got.values())  # not all empty

from __future__ import annotations

import json

from serving.cli import main


def test_generate_prints_json(tiny_model_dir, capsys):
    code = main(["generate", "--model", tiny_model_dir, "--max-tokens", "5", "--ignore-eos", "--json",
                 "--block-size", "8", "--max-model-len", "64", "Hello world", "The quick"])
    assert code == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in results] == ["Hello world", "The quick"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in results)


def test_generate_reports_bad_input(tiny_model_dir, capsys):
    code = main(["generate", "--model", tiny_model_dir, "--temperature", "-1", "hi"])
    assert code == 2
    assert "temperature" in capsys.readouterr().err

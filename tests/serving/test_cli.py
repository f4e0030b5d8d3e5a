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


def test_generate_takes_a_compilation_cache_dir(tiny_model_dir, tmp_path, capsys):
    import jax
    saved = jax.config.jax_compilation_cache_dir
    try:
        code = main(["generate", "--model", tiny_model_dir, "--max-tokens", "3", "--block-size", "8",
                     "--max-model-len", "64", "--compilation-cache-dir", str(tmp_path / "cache"), "--json", "hi"])
        assert code == 0 and any((tmp_path / "cache").iterdir())
    finally:
        from jax.experimental.compilation_cache.compilation_cache import reset_cache
        jax.config.update("jax_compilation_cache_dir", saved)
        reset_cache()

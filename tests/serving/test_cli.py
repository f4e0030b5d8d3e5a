from __future__ import annotations

import json

import pytest

from paged.serving.cli import main


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


def test_version(capsys):
    import paged
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"paged {paged.__version__}"


def test_generate_prints_the_text_as_text_and_names_the_model(tiny_model_dir, capsys):
    code = main(["generate", "--model", tiny_model_dir, "--max-tokens", "4", "--ignore-eos", "--block-size", "8",
                 "--max-model-len", "64", "--quiet", "Hello world"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "\nHello world" in out and "'Hello world'" not in out  # the prompt and completion, not their repr
    assert f"model {tiny_model_dir} (random weights: its text is noise)" in err


def test_vllm_flags_run_or_say_why_not(tiny_model_dir, capsys):
    base = ["generate", "--model", tiny_model_dir, "--max-tokens", "2", "--block-size", "8", "--max-model-len",
            "64", "--json"]
    assert main([*base, "--trust-remote-code", "--enforce-eager", "--pipeline-parallel-size", "1", "hi"]) == 0
    capsys.readouterr()
    assert main([*base, "--pipeline-parallel-size", "2", "hi"]) == 2
    assert "pipeline parallelism is not implemented" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # an engine option's choices: auto, safetensors or dummy
        main([*base, "--load-format", "pt", "hi"])
    assert exited.value.code == 2 and "invalid choice: 'pt'" in capsys.readouterr().err
    assert main(["serve", tiny_model_dir, "--precompile", "--enforce-eager"]) == 2
    assert "contradict" in capsys.readouterr().err
    assert main([*base, "--convert", "classify", "hi"]) == 2
    assert "--hf-overrides" in capsys.readouterr().err
    assert main([*base, "--convert", "embed", "hi"]) == 2  # a causal LM made an embedding model cannot generate
    assert "pooling model" in capsys.readouterr().err


def test_enforce_eager_is_an_engine_option(tiny_model_dir):
    from paged import LLM
    llm = LLM(tiny_model_dir, enforce_eager=True, block_size=8, max_model_len=64, show_progress=False)
    assert llm.engine.config.enforce_eager and llm.engine.num_compilations == 0

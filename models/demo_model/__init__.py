"""The built-in demo model: a 2.0M-parameter Llama trained on the Python standard library's docstrings.

It is what `make demo` and `paged generate` without `--model` run: small enough to ship inside the package
(3.9 MB of bfloat16 weights, `checkpoint/`), trained once on CPU by `train.py` beside it, so its greedy text
reads as docstring English rather than noise. It knows nothing but docstrings: a demonstration of the
engine, not a useful model (the committed weights: 1,600 steps of 4,096 tokens, final training loss 2.1
nats/token, 3.5 on the held-out 2% of the corpus; `python -m paged.models.demo_model.train` prints both). The random tiny model (models/tiny.py) stays what the tests use.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "paged-demo-docstrings"
DEMO_MODEL_DESCRIPTION = "built in: a 2.0M-parameter Llama trained on the Python standard library's docstrings"


def demo_model_dir() -> str:
    """The committed checkpoint's directory (config.json, model.safetensors, the tokenizer)."""
    directory = Path(__file__).parent / "checkpoint"
    if not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"the demo model's weights are missing from {directory}; rebuild them with "
                                "`python -m paged.models.demo_model.train`")
    return str(directory)

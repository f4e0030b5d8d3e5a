"""The built-in demo model: a 2.0M-parameter Llama trained on the Python standard library's docstrings.

It is what `make demo` and `paged generate` without `--model` run: small enough to ship inside the package
(3.9 MB of bfloat16 weights, `checkpoint/`), trained once on CPU by `train.py` beside it, so its greedy text
reads as docstring English rather than noise. It knows nothing but docstrings: a demonstration of the
engine, not a useful model (the committed weights: 1,600 steps of 4,096 tokens, final training loss 2.1
nats/token, 3.5 on the held-out 2% of the corpus; `python -m paged.models.demo_model.train` prints both). The random tiny model (models/tiny.py) stays what the tests use.

`draft_checkpoint/` is its draft for speculative decoding (`paged-demo-docstrings-draft`, `train.py --shape
draft`): the same tokenizer and corpus, a quarter of the width and half the layers (0.4M parameters; 1,600
steps, 3.57 nats/token on the held-out 2%).
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "paged-demo-docstrings"
DEMO_MODEL_DESCRIPTION = "built in: a 2.0M-parameter Llama trained on the Python standard library's docstrings"
# Its draft for speculative decoding (method "draft_model"): the same tokenizer and corpus, 0.4M parameters.
DEMO_DRAFT_MODEL_NAME = "paged-demo-docstrings-draft"
DEMO_DRAFT_MODEL_DESCRIPTION = ("built in: the demo model's 0.4M-parameter draft (same tokenizer and corpus), for "
                                "speculative decoding")


def demo_model_dir() -> str:
    """The committed checkpoint's directory (config.json, model.safetensors, the tokenizer)."""
    return _checkpoint("checkpoint", "")


def demo_draft_model_dir() -> str:
    """The committed draft checkpoint's directory (`train.py --shape draft` wrote it)."""
    return _checkpoint("draft_checkpoint", " --shape draft")


def _checkpoint(name: str, shape_option: str) -> str:
    directory = Path(__file__).parent / name
    if not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"the weights are missing from {directory}; rebuild them with "
                                f"`python -m paged.models.demo_model.train{shape_option}`")
    return str(directory)

"""The models `paged` carries itself, by name: the trained demo model and the random tiny one.

`LLM("paged-demo-docstrings")` and `LLM("paged-tiny-llama")` work offline like any other model argument;
everything else is a directory or a hub id (models/loader.py).
"""

from __future__ import annotations

import json
import os

from paged.models.demo_model import (DEMO_DRAFT_MODEL_DESCRIPTION, DEMO_DRAFT_MODEL_NAME, DEMO_MODEL_DESCRIPTION,
                                     DEMO_MODEL_NAME, demo_draft_model_dir, demo_model_dir)
from paged.models.tiny import TINY_MODEL_NAME, default_tiny_model_dir

DEFAULT_MODEL = DEMO_MODEL_NAME  # what `paged generate` and `paged serve` run without a model argument

BUILTIN_MODELS = {
    DEMO_MODEL_NAME: (demo_model_dir, DEMO_MODEL_DESCRIPTION),
    DEMO_DRAFT_MODEL_NAME: (demo_draft_model_dir, DEMO_DRAFT_MODEL_DESCRIPTION),
    TINY_MODEL_NAME: (default_tiny_model_dir, "built in: a tiny Llama with random weights, for tests; its text "
                                              "is noise"),
}


def builtin_model(name: str) -> tuple[str, str] | None:
    """(checkpoint directory, description) for a built-in model's name, else None."""
    if name not in BUILTIN_MODELS:
        return None
    directory, description = BUILTIN_MODELS[name]
    return directory(), description


# config.json key that checkpoints written by this project with random weights carry (the tiny model, the
# benchmark shapes), so the start-up summary can say their text is noise.
RANDOM_WEIGHTS_KEY = "paged_random_weights"


def random_weights_note(model_dir: str) -> str | None:
    """"random weights: ..." for a checkpoint marked as random, else None."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            marked = json.load(f).get(RANDOM_WEIGHTS_KEY) is True
    except (OSError, ValueError):
        return None
    return "random weights: its text is noise" if marked else None

"""How a checkpoint pools, read from its files: sentence-transformers' `modules.json` (its Pooling module's
config and whether a Normalize module follows), and whether its config allows Matryoshka truncation.

sentence-transformers writes two spellings of the pooling mode: `"pooling_mode": "lasttoken"` (version 5 on)
and one boolean per mode (`"pooling_mode_mean_tokens": true`, older checkpoints, most on the hub); both are
read. Modules that change the vector beyond pooling and normalising (Dense projections, for one) are refused
by name rather than ignored, since the vectors would silently differ.
"""

from __future__ import annotations

import dataclasses
import json
import os

from paged.pooling_params import PoolerConfig

# sentence-transformers' pooling modes -> the pooler's types (the other modes are not implemented).
_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_FLAG_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean"}


def sentence_transformers_pooler(model_dir: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares; None for a checkpoint without modules.json."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                pooling_type = _pooling_type(json.load(f))
        elif kind == "Normalize":
            normalize = True
        else:
            raise NotImplementedError(f"{path}: the sentence-transformers module {module.get('type')!r} is not "
                                      "implemented (paged pools with Pooling and Normalize modules only)")
    return PoolerConfig(pooling_type=pooling_type, use_activation=normalize)


def _pooling_type(config: dict) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _FLAG_MODES.items() if config.get(flag)]
        if len(modes) != 1:
            raise NotImplementedError(f"sentence-transformers pooling with modes {modes or 'none'} is not "
                                      "implemented: one of lasttoken, mean, cls")
        mode = modes[0]
    if mode not in _MODES:
        raise NotImplementedError(f"sentence-transformers pooling mode {mode!r} is not implemented: one of "
                                  f"{', '.join(_MODES)}")
    if config.get("include_prompt", True) is False:
        raise NotImplementedError("sentence-transformers pooling with include_prompt=false is not implemented")
    return _MODES[mode]


def is_matryoshka(model_dir: str) -> bool:
    """Whether the checkpoint's config.json says its embeddings may be truncated (as vLLM reads it:
    `is_matryoshka` or a `matryoshka_dimensions` list)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return False
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    return bool(raw.get("is_matryoshka") or raw.get("matryoshka_dimensions"))


def resolve_pooler(model_dir: str, requested: PoolerConfig, encoder: bool) -> PoolerConfig:
    """The pooler an engine runs: what was asked for, else the checkpoint's sentence-transformers config, else
    the architecture's default (decoders pool their last token, encoders their CLS token; embeddings are
    normalised and classifier scores activated unless turned off).

    A classifier's own pooling (BERT's pooler reads the CLS token) is the architecture's; sentence-transformers'
    config describes embeddings only."""
    checkpoint = sentence_transformers_pooler(model_dir) or PoolerConfig()
    config = requested.merged(checkpoint).merged(PoolerConfig(pooling_type="CLS" if encoder else "LAST",
                                                              use_activation=True))
    config = dataclasses.replace(config, pooling_type=config.pooling_type.upper())
    config.validate()
    return config

"""What an engine tells its user once it is ready: one INFO line of what it serves and how it is laid out.

A vLLM user reads the start-up log to check the model, dtype, devices, KV pool size and limits before sending
traffic; `LLMEngine` logs this summary once, at the end of its construction, and `precompile()` adds one
line for the step shapes it compiled (how many came from the persistent compilation cache).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import jax

logger = logging.getLogger("paged")


def configure_default_logging() -> None:
    """Gives the "paged" logger its own INFO handler on stderr, as vLLM does for its own, so the start-up
    summary shows in a notebook or script that configured no logging. `PAGED_CONFIGURE_LOGGING=0` leaves
    logging to the application (the records then propagate as usual)."""
    if os.environ.get("PAGED_CONFIGURE_LOGGING", "1") == "0" or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, here, even when the application also logs to the root logger

_cache_events = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}
_listener_lock = threading.Lock()
_listening = False


def _count_cache_event(event: str, **_) -> None:
    if event in _cache_events:
        _cache_events[event] += 1


def compilation_cache_counts() -> tuple[int, int]:
    """(hits, misses) of JAX's persistent compilation cache in this process since the first engine started."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count_cache_event)
            _listening = True
    return (_cache_events["/jax/compilation_cache/cache_hits"],
            _cache_events["/jax/compilation_cache/cache_misses"])


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def summary(engine, seconds: float) -> str:
    """The start-up summary of a constructed `LLMEngine`."""
    cfg, mc = engine.config, engine.model_config
    model, description = engine.model_name, engine.model_description
    devices = engine.devices
    placed = (f"{len(devices)} x {devices[0].platform} (tensor parallel mesh {dict(engine.mesh.shape)})"
              if engine.mesh is not None else str(devices[0]))
    usable = engine.block_manager.num_usable_blocks  # block 0 is the reserved sink
    num_shapes = len(engine.buckets.all_shapes())
    cache = engine.compilation_cache_dir
    kv_line = (f"KV pool {usable:,} blocks x {cfg.block_size} tokens = {usable * cfg.block_size:,} "
               f"tokens, {_mib(engine.kv_pool_bytes)} in {engine.kv_dtype.name} (sized by {engine.kv_budget_note}); "
               f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}")
    if mc.encoder_only:
        kv_line = "no KV cache (an encoder: each prompt is computed whole in one step)"
    spec = engine.speculative
    spec_lines = []
    if spec is not None:
        spec_line = f"speculative decoding by {spec.method}, up to {spec.num_speculative_tokens} tokens a step" + (
            f" while fewer than {spec.disable_by_batch_size} requests run" if spec.disable_by_batch_size else "")
        if engine.draft is not None:  # the pools it adds beside the target's KV pool
            draft = engine.draft
            spec_line += (f"; {spec.model}: {draft.model_config.num_layers} layer(s), its KV pool "
                          f"{_mib(draft.kv_pool_bytes)}")
            if (hidden := engine.worker.runner.hidden_pool) is not None:
                spec_line += f", the target's features kept beside its K/V {_mib(hidden.nbytes)}"
        spec_lines.append(spec_line)
    lines = [
        f"model {model}" + (f" ({description})" if description else "")
        + f": {mc.architecture}, {mc.num_layers} layers, weights {_mib(engine.weight_bytes['total'])} "
          f"in {engine.dtype.name}" + (f", quantization {cfg.quantization}" if cfg.quantization else "")
        + (", random (load_format=dummy)" if cfg.load_format == "dummy" else ""),
        f"devices {placed}; attention backend {engine.attention_name}, linear backend {engine.linear_backend}",
        *([f"pooling runner ({engine.pooling_task}): {engine.pooler_config.pooling_type} pooling, "
           f"{'with' if engine.pooler_config.use_activation else 'without'} "
           f"{'normalisation' if engine.pooling_task == 'embed' else 'activation'}"]
          if engine.pooler_config is not None else []),
        kv_line,
        *spec_lines,
        f"max_model_len {cfg.max_model_len}, max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens "
        f"{cfg.max_num_batched_tokens}",
        f"{num_shapes} step shapes, each compiled on first use (precompile() compiles them up front); "
        + (f"compiled steps are kept in {cache}" if cache else "no persistent compilation cache"),
    ]
    return f"engine ready in {seconds:.1f} s\n  " + "\n  ".join(lines)


def log_summary(engine, seconds: float) -> None:
    logger.info("%s", summary(engine, seconds))


def log_precompiled(num_shapes: int, num_sampling_shapes: int, seconds: float, hits: int, misses: int,
                    cache_dir: str | None) -> None:
    source = (f"{hits} programs loaded from the compilation cache, {misses} compiled" if cache_dir
              else "no persistent compilation cache")
    logger.info("precompiled %d step shapes and %d shapes of adjusted sampling in %.1f s (%s)", num_shapes,
                num_sampling_shapes, seconds, source)

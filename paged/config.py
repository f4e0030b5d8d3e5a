"""Engine configuration: one frozen dataclass, validated up front, and the one definition of every engine option.

Each field carries its help text (and choices) in its metadata; `LLM(...)`, `paged generate`, `paged serve`
and `paged bench throughput` all derive their keyword arguments and flags from it (`add_engine_arguments`,
`from_cli_args`), so an option cannot exist in one front end and be missing in another.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


# `kv_cache_dtype` option -> the pool's element type (an ml_dtypes name; None: the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}
# How weights load (vLLM's --load-format values that mean something here; models/loader.py).
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _option(default, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = ()):
    """A field with its command-line help; `aliases` are extra flag spellings (e.g. a `--no-...` for a bool
    that defaults to True)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every option of the engine besides the model itself.

    Defaults suit a CPU: 64 sequences and 512 tokens per step keep every compiled shape small while still
    batching decode widely; GPUs want larger values (vLLM uses 256 and 8192).
    """

    tokenizer: str | None = _option(None, "tokenizer directory or hub id (default: the model's)")
    dtype: Any = _option("auto", "weights and activations: auto keeps the checkpoint's; float32/float, "
                                 "bfloat16, float16/half")
    seed: int = _option(0, "seed of the engine's per-request sampling streams")
    # vLLM's --load-format dummy: a model timed at its real size from config.json alone (models/dummy_weights.py).
    load_format: str = _option("auto", "auto (or safetensors) reads the checkpoint's weights; dummy draws random "
                                       "ones on the devices from config.json alone (for benchmarks: nothing to "
                                       "download or write)", LOAD_FORMATS)
    block_size: int = _option(16, "tokens per KV cache block", (1, 2, 4, 8, 16, 32, 64, 128))
    num_kv_blocks: int | None = _option(None, "KV cache blocks (default: from the memory budget)")
    gpu_memory_utilization: float = _option(0.9, "fraction of device memory (host memory on CPU) for weights "
                                                 "and the KV cache")
    kv_cache_memory_bytes: int | None = _option(None, "bytes for the KV cache, instead of the default budget (on "
                                                      "CPU: 4 GiB, or VLLM_CPU_KVCACHE_SPACE GiB)")
    max_num_seqs: int = _option(64, "most sequences per step")
    max_num_batched_tokens: int | None = _option(None, "most tokens per step (default: 2048 with chunked "
                                                       "prefill, else max(2048, max_model_len))")
    max_model_len: int | None = _option(None, "longest prompt + output (default: the model's)")
    enable_chunked_prefill: bool = _option(True, "split long prompts over steps", aliases=("--no-chunked-prefill",))
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of shared prompt prefixes",
                                          aliases=("--no-prefix-caching",))
    # vLLM's flag: there it skips CUDA-graph capture; here there is no eager mode (every step is jitted), so it
    # means what capture costs in both: no compiling of every step shape before the first request.
    enforce_eager: bool = _option(False, "compile each step shape on first use instead of all up front "
                                         "(`paged serve` precompiles unless this is set)")
    preemption_mode: str = _option("recompute", "what preemption does with a request's KV blocks",
                                   ("recompute", "swap"))
    swap_space: float = _option(4.0, "GiB of host memory for swapped-out K/V (preemption_mode=swap)")
    attention_backend: str = _option("auto", "attention kernels (auto: Pallas on GPU, the Pallas TPU kernel "
                                             "on TPU, the native kernel on CPU where it builds, else xla)",
                                     ("auto", "xla", "cpu", "pallas", "pallas-mosaic", "pallas-tpu", "reference"))
    linear_backend: str = _option("auto", "matmul of the projections (auto: the native CPU matmul with the cpu "
                                          "attention backend, else XLA's dot)", ("auto", "xla", "cpu"))
    # A plain-greedy step on the native CPU path finds its tokens through an int8 copy of a tied LM head's table
    # (pallas_kernels/cpu/screen.py): the same tokens, about half the head's bytes read a step.
    greedy_head_screen: bool = _option(True, "greedy steps read a tied LM head's table through an int8 copy (same "
                                             "tokens; CPUs with AMX-INT8 or AVX-512 VNNI; the copy holds half the "
                                             "table's bytes)",
                                       aliases=("--no-greedy-head-screen",))
    # "scan" compiles one layer and loops over stacked weights; "unroll" compiles every layer with its own
    # weights. "auto" unrolls on CPU, where XLA copies each scanned layer's weights out of the stacked arrays
    # on every step (unrolled decode steps are 10-30% faster there, compiles slower).
    layer_loop: str = _option("auto", "scan the decoder layers (fast compiles) or unroll them (faster steps on "
                                      "CPU); auto: unroll on CPU", ("auto", "scan", "unroll"))
    # Schedule and launch step t+1 while step t still runs, its rows reading t's samples on the device: the
    # host's scheduling, input preparation and output handling overlap device work (docs/performance.md has
    # the measurements). step() returns each step's outputs one call later. Same tokens either way.
    async_scheduling: bool = _option(True, "schedule the next step while one runs",
                                     aliases=("--no-async-scheduling",))
    # Where compiled steps are kept between runs (paged/compilation_cache.py).
    compilation_cache_dir: str | None = _option(
        "auto", "where compiled steps are kept between runs (auto: JAX's own setting, else "
                "$PAGED_CACHE_DIR/xla, i.e. ~/.cache/paged/xla); none to leave JAX's settings alone")
    # An fp8 pool holds twice the tokens of a bf16 one in the same bytes; keys and values are stored with scale
    # 1.0 (they rarely leave e4m3's +-448) and every attention backend dequantizes them as it reads.
    kv_cache_dtype: str = _option("auto", "KV cache storage: auto (the model's dtype), bfloat16, or fp8 / "
                                          "fp8_e4m3 (e4m3) and fp8_e5m2",
                                  tuple(KV_CACHE_DTYPES))
    tensor_parallel_size: int = _option(1, "devices the model is split over (Megatron layout on a jax mesh; "
                                           "must divide the attention and KV heads)")
    # Replicas are whole engines (scheduler, KV pool, weights) on disjoint devices; `paged serve` routes each
    # request to the least loaded one. One LLMEngine is one replica: `data_parallel_rank` picks its devices.
    data_parallel_size: int = _option(1, "engine replicas, each on its own tensor_parallel_size devices "
                                         "(paged serve and paged bench run them all)")
    data_parallel_rank: int = _option(0, "the replica this engine is: it runs on devices "
                                         "[rank * tensor_parallel_size, (rank + 1) * tensor_parallel_size)")
    # Several hosts: every process runs the same command with its own process id; process 0 leads (scheduler,
    # API server) and the others run its steps on their devices (paged/multihost.py). Unset fields are read
    # from PAGED_COORDINATOR_ADDRESS, PAGED_NUM_PROCESSES and PAGED_PROCESS_ID.
    distributed_coordinator_address: str | None = _option(
        None, "host:port where process 0 runs jax.distributed's coordinator (several hosts; default: "
              "$PAGED_COORDINATOR_ADDRESS, else one process)")
    distributed_num_processes: int | None = _option(None, "processes in the run (default: $PAGED_NUM_PROCESSES)")
    distributed_process_id: int | None = _option(None, "this process's id, 0 the leader (default: $PAGED_PROCESS_ID)")
    # How soon a lost process is noticed: the coordinator then ends every other one (none hangs on it).
    distributed_heartbeat_timeout_s: int = _option(100, "seconds without a heartbeat before a process counts as "
                                                        "lost and the run is ended")
    # vLLM's structured_outputs_config.disable_any_whitespace: JSON constraints then allow no whitespace between
    # tokens. Models trained to write compact JSON lose nothing; random or weak models cannot loop on blanks.
    structured_outputs_disable_any_whitespace: bool = _option(
        False, "JSON constraints allow no whitespace between tokens (requests may also ask for it)")
    # By default whitespace in constrained JSON is bounded (paged/grammar.py: JSON_WHITESPACE): a small model
    # given JSON's full freedom fills its output with blanks until max_tokens.
    structured_outputs_any_whitespace: bool = _option(
        False, "JSON constraints allow any run of JSON whitespace (default: one space, or a newline and up to 24 "
               "spaces or tabs of indent, between tokens)")
    # xgrammar (vLLM's default backend) reads a schema without additionalProperties as closed; JSON Schema
    # itself as open, which lets a model invent keys pydantic and instructor schemas never declared.
    structured_outputs_additional_properties: bool = _option(
        False, "JSON schemas that omit additionalProperties accept keys they do not declare, as JSON Schema "
               "reads them (default: such objects hold only their declared properties, as vLLM's default backend)")
    # What one request may list: bounded so that one client cannot stall the others (stop strings are matched
    # against each new piece of text) and so that every logit-adjustment shape exists at start-up (stop ids
    # and logit_bias entries are entries of paged/logit_adjustments.py).
    max_stop_strings: int = _option(128, "most stop strings one request may list")
    max_stop_string_chars: int = _option(1024, "most characters in one stop string")
    max_stop_token_ids: int = _option(1024, "most stop_token_ids one request may list")
    max_logit_bias_entries: int = _option(1024, "most logit_bias entries one request may list")
    # vLLM's --runner: a pooling model returns one vector per prompt (embeddings, classifier scores) instead of
    # generating; "auto" pools for embedding and classification architectures (BertModel, Qwen3Model,
    # *ForSequenceClassification) and generates for the rest.
    runner: str = _option("auto", "generate text, or pool each prompt into a vector (embeddings, scores); auto: "
                                  "as the architecture says", ("auto", "generate", "pooling"))
    pooler_config: str | None = _option(None, "a pooling model's settings as JSON, e.g. '{\"pooling_type\": \"MEAN\", "
                                              "\"normalize\": true}' (pooling_type LAST/MEAN/CLS, normalize, "
                                              "dimensions, use_activation; default: the checkpoint's)")
    hf_overrides: str | None = _option(None, "fields set over the checkpoint's config.json, as JSON (vLLM's "
                                             "--hf-overrides), e.g. to read a causal LM as a reranker")
    # LoRA (paged/lora.py): adapters live in `max_loras` device slots, each of every adapted layer's stacked
    # factors padded to `max_lora_rank`; a step mixes them per token. More adapters wait in host memory.
    enable_lora: bool = _option(False, "serve LoRA adapters over the base model (LoRARequest, --lora-modules)")
    max_loras: int = _option(1, "LoRA adapters on the device at once (requests of others wait)")
    max_lora_rank: int = _option(16, "largest LoRA rank served", (1, 8, 16, 32, 64, 128, 256, 320, 512))
    max_cpu_loras: int | None = _option(None, "LoRA adapters kept in host memory (default: max_loras)")
    # vLLM's --speculative-config (paged/speculative.py): the n-gram (prompt lookup) and draft_model methods.
    speculative_config: str | None = _option(None, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
                                                   "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'")
    quantization: str | None = _option(None, "quantize online (int8 or fp8: weight-only, per output channel; "
                                             "w8a8: int8 weights per output channel and int8 activations per "
                                             "token) or check the checkpoint's own quantization_config (gptq, "
                                             "awq, compressed-tensors, fp8); default: the checkpoint's")

    def validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.tokenizer is None or isinstance(self.tokenizer, str),
              f"tokenizer must be None or a path or hub id, got {self.tokenizer!r}")
        for name in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", "max_logit_bias_entries"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{name} must be an integer >= 1, got {value!r}")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        check(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
              f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        check(isinstance(self.data_parallel_rank, int) and 0 <= self.data_parallel_rank < self.data_parallel_size,
              f"data_parallel_rank must be an integer in [0, data_parallel_size={self.data_parallel_size}), got "
              f"{self.data_parallel_rank!r}")
        check(self.distributed_num_processes is None
              or (isinstance(self.distributed_num_processes, int) and self.distributed_num_processes >= 1),
              f"distributed_num_processes must be None or an integer >= 1, got {self.distributed_num_processes!r}")
        check(self.distributed_process_id is None
              or (isinstance(self.distributed_process_id, int) and self.distributed_process_id >= 0),
              f"distributed_process_id must be None or an integer >= 0, got {self.distributed_process_id!r}")
        check(isinstance(self.distributed_heartbeat_timeout_s, int) and self.distributed_heartbeat_timeout_s >= 1,
              f"distributed_heartbeat_timeout_s must be an integer >= 1, got {self.distributed_heartbeat_timeout_s!r}")
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool),
              f"seed must be an integer, got {self.seed!r}")
        check(isinstance(self.block_size, int) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
              f"block_size must be a power of two from 1 to 128, got {self.block_size!r}")
        check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 2),
              f"num_kv_blocks must be None or an integer >= 2, got {self.num_kv_blocks!r}")
        check(0 < self.gpu_memory_utilization <= 1,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(self.kv_cache_memory_bytes is None
              or (isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes > 0),
              f"kv_cache_memory_bytes must be None or a positive integer, got {self.kv_cache_memory_bytes!r}")
        check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
              f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        check(self.max_num_batched_tokens is None
              or (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1),
              f"max_num_batched_tokens must be None or an integer >= 1, got {self.max_num_batched_tokens!r}")
        check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
              f"max_model_len must be None or an integer >= 1, got {self.max_model_len!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {self.kv_cache_dtype!r}")
        check(self.load_format in LOAD_FORMATS,
              f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        check(self.preemption_mode in ("recompute", "swap"),
              f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        check(self.layer_loop in ("auto", "scan", "unroll"),
              f"layer_loop must be 'auto', 'scan' or 'unroll', got {self.layer_loop!r}")
        for name in ("structured_outputs_any_whitespace", "structured_outputs_additional_properties"):
            check(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        check(not (self.structured_outputs_any_whitespace and self.structured_outputs_disable_any_whitespace),
              "structured_outputs_any_whitespace and structured_outputs_disable_any_whitespace contradict each other")
        check(isinstance(self.structured_outputs_disable_any_whitespace, bool),
              "structured_outputs_disable_any_whitespace must be True or False, got "
              f"{self.structured_outputs_disable_any_whitespace!r}")
        check(isinstance(self.enforce_eager, bool), f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        check(isinstance(self.greedy_head_screen, bool),
              f"greedy_head_screen must be True or False, got {self.greedy_head_screen!r}")
        check(isinstance(self.async_scheduling, bool),
              f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        check(self.compilation_cache_dir is None or (isinstance(self.compilation_cache_dir, str)
                                                      and self.compilation_cache_dir.strip() != ""),
              f"compilation_cache_dir must be 'auto', a directory or None, got {self.compilation_cache_dir!r}")
        self.parsed_hf_overrides()  # raises ValueError naming what is wrong
        check(self.runner in ("auto", "generate", "pooling"),
              f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.pooler_config is not None:
            from paged.pooling_params import PoolerConfig
            PoolerConfig.parse(self.pooler_config)  # raises ValueError naming what is wrong
        if self.enable_lora:
            self.lora_config()  # raises ValueError naming what is wrong
        self.parsed_speculative_config()  # raises ValueError naming what is wrong
        check(isinstance(self.swap_space, (int, float)) and self.swap_space >= 0,
              f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")

    def lora_config(self):
        """The LoRA settings (paged.lora.LoRAConfig), or None when LoRA is off."""
        if not self.enable_lora:
            return None
        from paged.lora import LoRAConfig
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def parsed_speculative_config(self):
        """`speculative_config` checked (paged.speculative.SpeculativeConfig), or None."""
        from paged.speculative import SpeculativeConfig
        return SpeculativeConfig.parse(self.speculative_config)

    def parsed_hf_overrides(self) -> dict | None:
        """`hf_overrides` as a dict (it may be given as one, or as its JSON text)."""
        return None if self.hf_overrides is None else json_object(self.hf_overrides, "hf_overrides")

    def resolved(self, model_max_len: int, max_position_embeddings: int | None = None) -> "EngineConfig":
        """Fills max_model_len and max_num_batched_tokens from the model and each other. `model_max_len`: the
        longest context the model supports (its max_position_embeddings, scaled by its rope's factor where
        that extends it)."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            scaled = (f", scaled by its rope from max_position_embeddings={max_position_embeddings}"
                      if max_position_embeddings not in (None, model_max_len) else "")
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                             f"({model_max_len}{scaled})")
        tokens = self.max_num_batched_tokens
        if tokens is None:
            # vLLM's default for its server (its offline LLM takes 4096 on CPU, 8192 on large GPUs). On the
            # 0.5B shape's benchmark (CPU, bf16) 2048 ran 3.5% faster than 512, 4096 no faster than 2048:
            # longer prompt chunks stream the weights fewer times and fill the AMX tiles better.
            tokens = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={tokens} is smaller than max_model_len={max_model_len}; "
                             "without chunked prefill a long prompt could never be scheduled. Raise it, lower "
                             "max_model_len, or set enable_chunked_prefill=True")
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_batched_tokens=tokens)


def _field_type(field: dataclasses.Field) -> str:
    """The field's type without `| None` ("int", "float", "str", "bool")."""
    return str(field.type).replace(" | None", "").replace("None | ", "")


def _parse_none(value: str) -> str | None:
    return None if value.lower() == "none" else value


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                         exclude: tuple[str, ...] = ()) -> None:
    """Adds one flag per EngineConfig field (`--max-num-seqs`; bools as `--name` / `--no-name` plus their
    aliases). `defaults` overrides a field's default for this front end (e.g. a benchmark)."""
    defaults = defaults or {}
    group = parser.add_argument_group("engine options (paged.EngineConfig)")
    for field in dataclasses.fields(EngineConfig):
        if field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        meta = field.metadata
        kind = _field_type(field)
        if kind == "bool":
            group.add_argument(flag, dest=field.name, action="store_true", default=default,
                               help=f"{meta['help']} (default: {'on' if default else 'off'})")
            group.add_argument(f"--no-{flag[2:]}", *meta["aliases"], dest=field.name, action="store_false",
                               help="turn it off")
            continue
        parse = {"int": int, "float": float}.get(kind, _parse_none if "None" in str(field.type) else str)
        group.add_argument(flag, *meta["aliases"], dest=field.name, type=parse, default=default,
                           choices=meta["choices"], help=f"{meta['help']} (default: {default})")


def engine_kwargs_from_cli_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields that `add_engine_arguments` put on `args`, as keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}


def engine_option_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(EngineConfig))


def json_object(value: Any, option: str) -> dict:
    """An option given as a dict or as its JSON text (a command-line flag), as a dict; ValueError naming the
    option otherwise."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{option} must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{option} must be a JSON object, got {value!r}")
    return parsed

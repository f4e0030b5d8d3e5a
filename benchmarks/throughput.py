"""Offline throughput: this engine against Hugging Face transformers on the same model and requests.

    python -m paged.benchmarks.throughput [--num-requests 48] [--input-len 16 256] [--output-len 16 256]
        [--model PATH] [--hf-batch-sizes 16 all] [--no-hf-continuous] [--json out.json] [--png out.png]
        [--json-fractions 0.5 1]

Systems, one process, one after another on the same requests (greedy, every request runs exactly its
output_len tokens):
  - paged: this engine (LLM.generate);
  - hf-static-bN: transformers `generate` on left-padded static batches of N requests in arrival order, each
    batch running until its longest output is done (the approach continuous batching replaced);
  - hf-continuous: transformers' own continuous batching (init_continuous_batching), when available;
  - paged-json-F: with --json-fractions, this engine again with a fraction F of the requests constrained to a
    JSON schema (structured outputs), to measure what constraints cost the batch;
  - paged-no-spec: with --speculative-config, this engine again without it (the same requests, for the ratio);
  - paged-unquantized: with --quantization, this engine again on the checkpoint's own weights;
  - paged-lora-N: with --lora, this engine again with LoRA on and the requests spread round-robin over N random
    adapters of rank --lora-rank on every projection (all N in device slots: max_loras N), to measure what
    serving adapters costs against the base alone.
Warm-up and compilation are excluded from every system's timing and reported separately. MFU is model FLOPs
(prompt + output tokens, see benchmarks/common.py) over time, against a matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from paged.benchmarks.common import (copy_bandwidth, copy_workload, default_model_dir, jsonl_workload, matmul_rate,
                                     pyplot, random_workload, warmup_twin, workload_flops)
from paged.benchmarks.shapes import MODEL_SHAPES, model_shape_config_dir, model_shape_dir
from paged.config import add_engine_arguments, engine_kwargs_from_cli_args


def _result(name: str, workload, seconds: float, warmup: float, flops: float, rate: float, **extra) -> dict:
    # Constrained requests end when their grammar does: count what was generated.
    out_tokens = extra.get("output_tokens", sum(workload.output_lens))
    total = out_tokens + sum(workload.prompt_lens)
    return {"system": name, "seconds": seconds, "warmup_seconds": warmup,
            "requests_per_s": len(workload.prompts) / seconds, "output_tokens_per_s": out_tokens / seconds,
            "total_tokens_per_s": total / seconds, "mfu": flops / seconds / rate, **extra}


class _CacheHits:
    """Executables loaded from JAX's persistent compilation cache so far in this process."""

    count = 0
    _listening = False

    @classmethod
    def so_far(cls) -> int:
        if not cls._listening:
            import jax
            jax.monitoring.register_event_listener(cls._on_event)
            cls._listening = True
        return cls.count

    @classmethod
    def _on_event(cls, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            cls.count += 1


def _dtype_name(dtype) -> str:
    import numpy as np
    return np.dtype(dtype).name


# What --json-fractions constrains requests to: records of strings, integers and enums, with more of them
# required than any output_len can hold, so that a constrained request runs to its output_len like the others
# (the work stays the same and only the constraint's cost differs).
JSON_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 10000, "items": {
        "type": "object", "required": ["name", "qty"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["new", "used", "spare"]}}}}}}}


def _constrained(index: int, fraction: float) -> bool:
    """Spreads the constrained requests evenly over arrival order."""
    return int((index + 1) * fraction) > int(index * fraction)


def _generate_on_replicas(llms, prompts, params, adapters) -> list:
    """Every replica generates its share (each N-th request) at once, in a thread of its own (JAX releases the
    GIL while a step runs); the outputs in input order."""
    n = len(llms)
    if n == 1:
        return llms[0].generate(prompts, params, use_tqdm=False, lora_request=adapters)
    with ThreadPoolExecutor(n) as pool:
        parts = list(pool.map(lambda r: llms[r].generate(prompts[r::n], params[r::n], use_tqdm=False,
                                                         lora_request=adapters[r::n]), range(n)))
    outputs = [None] * len(prompts)
    for rank, part in enumerate(parts):
        outputs[rank::n] = part
    return outputs


GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def run_paged(model_dir: str, workload, engine_args: dict, vocab: int,
              json_fraction: float = 0.0, lora_paths: list[str] | None = None, lora_rank: int = 16,
              sampling: dict | None = None) -> tuple[float, float, dict]:
    """With data_parallel_size N, N engines (one per data_parallel_rank, on disjoint devices) share the
    requests evenly, as `paged serve` would route an offline batch; their counters are summed. `lora_paths`:
    request i runs with adapter i mod len(lora_paths), every adapter in a device slot. `sampling`: every
    request's temperature, top_p, top_k and min_p (default GREEDY)."""
    from paged import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
    adapters = [None] * len(workload.prompts)
    if lora_paths:
        engine_args = {**engine_args, "enable_lora": True, "max_loras": len(lora_paths), "max_lora_rank": lora_rank}
        requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(lora_paths)]
        adapters = [requests[i % len(requests)] for i in range(len(workload.prompts))]
    hits = _CacheHits.so_far()
    start = time.perf_counter()
    llms = [LLM(model_dir, show_progress=False, **engine_args, data_parallel_rank=rank)
            for rank in range(engine_args.get("data_parallel_size", 1))]
    startup = time.perf_counter() - start
    constraint = StructuredOutputsParams(json=JSON_SCHEMA)
    params = [SamplingParams(**(sampling or GREEDY), max_tokens=o, ignore_eos=True,
                             structured_outputs=constraint if _constrained(i, json_fraction) else None)
              for i, o in enumerate(workload.output_lens)]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    if engine_args.get("speculative_config"):  # proposals make step shapes the warm-up's prompts may not
        for llm in llms:
            llm.engine.precompile()
    # Warm-up: compiles every shape this workload produces, on other token ids (nothing to hit in a prefix cache).
    _generate_on_replicas(llms, [{"prompt_token_ids": p} for p in warmup_twin(workload, vocab).prompts], params,
                          adapters)
    warmup = time.perf_counter() - start
    engines = [llm.engine for llm in llms]
    compiles = sum(engine.num_compilations for engine in engines)
    for engine in engines:
        engine.step_timings = dict.fromkeys(engine.step_timings, 0.0)
        engine.spec_stats.reset()
    start = time.perf_counter()
    outputs = _generate_on_replicas(llms, prompts, params, adapters)
    seconds = time.perf_counter() - start
    split = {k: sum(engine.step_timings[k] for engine in engines) for k in engines[0].step_timings}
    by_kind = {k: split.pop(k) for k in ("device_decode_only", "device_with_prefill")}
    engine = engines[0]
    extra = {"dtype": _dtype_name(engine.dtype), "startup_seconds": startup,
             "compilations_in_timed_run": sum(e.num_compilations for e in engines) - compiles,
             "shapes_compiled": compiles,
             "steps": int(split.pop("steps")), "step_time_split_s": split, "device_time_by_step_kind_s": by_kind,
             "preemptions": sum(e.num_preemptions for e in engines),
             "compilation_cache_dir": engine.compilation_cache_dir,
             # Shapes loaded from the persistent cache during warm-up (a rerun's warm-up skips their compile).
             "warmup_compilation_cache_hits": _CacheHits.so_far() - hits,
             "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs)}
    if len(engines) > 1:
        extra["requests_per_replica"] = [len(range(rank, len(prompts), len(engines))) for rank in range(len(engines))]
    if lora_paths:
        extra.update(lora_adapters=len(lora_paths), lora_rank=lora_rank)
    if engine.speculative is not None:  # the timed run's
        stats = [e.spec_stats for e in engines]
        drafts, proposed = sum(s.num_drafts for s in stats), sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats)
        extra.update(spec_drafts=drafts, spec_draft_tokens=proposed, spec_accepted_tokens=accepted,
                     spec_acceptance_rate=accepted / proposed if proposed else 0.0,
                     spec_mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)
    if json_fraction:
        extra.update(json_fraction=json_fraction, grammar_compile_seconds=sum(e.grammars.compile_seconds
                                                                              for e in engines),
                     constrained_requests=sum(e.num_constrained_requests for e in engines) // 2)  # warm-up + run
    # Free the KV pool (on CPU a share of host memory) before another engine starts in the same machine.
    del llms, engines, engine
    gc.collect()
    return seconds, warmup, extra


def _hf_model(model_dir: str):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_sampling(sampling: dict | None) -> dict:
    """generate()'s arguments for `sampling` (its top_k 0 disables, as ours)."""
    sampling = sampling or GREEDY
    if not sampling["temperature"]:
        return {"do_sample": False}
    return {"do_sample": True, **sampling}


def run_hf_static(model_dir: str, workload, batch_size: int, sampling: dict | None = None
                  ) -> tuple[float, float, dict]:
    import torch
    start = time.perf_counter()
    model = _hf_model(model_dir)

    def generate(prompts, max_new):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           **_hf_sampling(sampling))

    generate(workload.prompts[:2], 4)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(workload.prompts), batch_size):
        chunk = workload.prompts[i:i + batch_size]
        longest = max(workload.output_lens[i:i + batch_size])
        generate(chunk, longest)
        generated += longest * len(chunk)
    seconds = time.perf_counter() - start
    return seconds, warmup, {"batch_size": batch_size, "tokens_generated_incl_padding": generated}


def run_hf_continuous(model_dir: str, workload, sampling: dict | None = None) -> tuple[float, float, dict] | None:
    import transformers
    model = _hf_model(model_dir)
    if not hasattr(model, "init_continuous_batching"):
        return None
    config = transformers.GenerationConfig(**_hf_sampling(sampling), max_new_tokens=max(workload.output_lens),
                                           eos_token_id=-1, pad_token_id=0)

    def run(prompts, output_lens):
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            for i, (p, o) in enumerate(zip(prompts, output_lens)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
            done = 0
            while done < len(prompts):
                result = manager.get_result(timeout=5)
                if result is not None and result.is_finished():
                    done += 1
        finally:
            manager.stop(block=True)

    start = time.perf_counter()
    run(workload.prompts[:2], [4, 4])
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    run(workload.prompts, workload.output_lens)
    return time.perf_counter() - start, warmup, {}


def run_vllm(python: str, model_dir: str, workload, dtype: str, max_model_len: int, seed: int, vocab: int,
             env: dict[str, str] | None = None, sampling: dict | None = None) -> tuple[float, float, dict] | None:
    """vLLM on the same requests, in its own interpreter (benchmarks/vllm_baseline.py); None if it failed."""
    import os
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        request, result = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(request, "w") as f:
            json.dump({"model": model_dir, "dtype": dtype,
                       "max_model_len": max_model_len, "seed": seed, "prompts": workload.prompts,
                       "warmup_prompts": warmup_twin(workload, vocab).prompts,
                       "output_lens": workload.output_lens, "sampling": sampling or GREEDY}, f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_baseline.py")
        # vLLM on CPU sizes its KV cache from the machine's total memory, not from what is free, and this
        # process still holds its own (jax's heap); 4 GiB holds every benchmark workload here many times over.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **(env or {})}
        done = subprocess.run([python, script, request, result], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, **env})
        if done.returncode or not os.path.exists(result):
            # vLLM's root cause sits above its own shutdown tracebacks: show its error lines, then the end.
            errors = [line for line in done.stdout.splitlines() if "Error" in line and not line.startswith(" ")]
            print(f"vLLM ({python}) failed with exit code {done.returncode}:\n" + "\n".join(errors[:20])
                  + f"\n...\n{done.stdout[-2000:]}", file=sys.stderr)
            return None
        with open(result) as f:
            measured = json.load(f)
    if measured["output_tokens"] != sum(workload.output_lens):
        print(f"vLLM produced {measured['output_tokens']} tokens, not {sum(workload.output_lens)}", file=sys.stderr)
        return None
    return measured.pop("seconds"), measured.pop("warmup_seconds"), measured


def plot(results: list[dict], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["system"] for r in results]
    values = [r["output_tokens_per_s"] for r in results]
    bars = ax.barh(names, values, color=["#2b6cb0" if n == "paged" else "#a0aec0" for n in names])
    for bar, r in zip(bars, results):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['output_tokens_per_s']:.0f} "
                f"({r['mfu']:.0%} MFU)", va="center", fontsize=8)
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _env_item(text: str) -> str:
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: the 30M benchmark Llama)")
    parser.add_argument("--model-shape", default=None, choices=sorted(MODEL_SHAPES),
                        help="instead of --model: a random-weight bfloat16 checkpoint with this real model's config "
                             "(benchmarks/shapes.py), built on first use")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--dataset", default=None, help="JSONL of {prompt, output_len} instead of random")
    parser.add_argument("--copy-workload", action="store_true",
                        help="prompts whose answers can copy from them (a docstring, then its first words again; "
                             "--num-requests of them, outputs of --output-len MAX tokens) instead of random")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed, and the engine's")
    parser.add_argument("--hf-batch-sizes", nargs="*", default=["16", "all"], help="static batch sizes ('all')")
    parser.add_argument("--no-hf-continuous", action="store_true")
    # vLLM's `bench serve` spellings; every system takes them (default: greedy).
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--vllm-python", default=None,
                        help="a Python interpreter with vLLM installed (e.g. vllm-cpu): adds vLLM as a baseline, "
                             "same model, requests and dtype, prefix caching off")
    parser.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE", type=_env_item,
                        help="environment for the vLLM process only, e.g. its recommended CPU setup: "
                             "LD_PRELOAD=<libtcmalloc_minimal.so.4>:<libiomp5.so>")
    # Every engine option, as `paged generate` takes it; prefix caching off by default, so that no run is
    # flattered by hits on the warm-up's blocks.
    add_engine_arguments(parser, defaults={"enable_prefix_caching": False}, exclude=("seed", "data_parallel_rank"))
    parser.add_argument("--json-fractions", type=float, nargs="*", default=[], metavar="F",
                        help="also run paged with these fractions of the requests JSON-constrained (e.g. 0.5 1)")
    parser.add_argument("--lora", type=int, nargs="*", default=[], metavar="N",
                        help="also run paged with the requests spread over N random LoRA adapters (e.g. 1 4 16)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of --lora's adapters")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from paged.models import load_model_config
    if args.model and args.model_shape:
        raise SystemExit("give --model or --model-shape, not both")
    if args.model_shape:  # with load_format dummy, the config alone (the weights are drawn on the devices)
        model_dir = (model_shape_config_dir if args.load_format == "dummy" else model_shape_dir)(args.model_shape)
    else:
        model_dir = args.model or default_model_dir()
    config = load_model_config(model_dir)
    if args.dataset or args.copy_workload:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        workload = (jsonl_workload(args.dataset, tokenizer) if args.dataset else
                    copy_workload(tokenizer, args.num_requests, args.output_len[1], config.max_position_embeddings,
                                  args.seed))
    else:
        workload = random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                                   config.vocab_size, args.seed)
    max_len = max(p + o for p, o in zip(workload.prompt_lens, workload.output_lens))
    engine_args = {**engine_kwargs_from_cli_args(args), "seed": args.seed,
                   "max_model_len": args.max_model_len or max_len}
    results = []
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    seconds, warmup, extra = run_paged(model_dir, workload, engine_args, config.vocab_size, sampling=sampling)
    # The roofs, measured in the dtype the engine ran in (auto: the checkpoint's).
    rate = matmul_rate(extra["dtype"])
    bandwidth = copy_bandwidth()
    flops = workload_flops(config, workload)
    print(f"workload {workload.describe()}; model FLOPs {flops / 1e9:.1f} G; {extra['dtype']} matmul rate "
          f"{rate / 1e9:.1f} GFLOP/s; compute floor {sum(workload.output_lens) * rate / flops:.0f} output tokens/s",
          file=sys.stderr)
    results.append(_result("paged", workload, seconds, warmup, flops, rate, **extra))
    if engine_args.get("speculative_config"):
        measured = run_paged(model_dir, workload, {**engine_args, "speculative_config": None}, config.vocab_size,
                             sampling=sampling)
        results.append(_result("paged-no-spec", workload, *measured[:2], flops, rate, **measured[2]))
        print(f"speculative decoding: acceptance rate {extra['spec_acceptance_rate']:.1%}, mean acceptance length "
              f"{extra['spec_mean_acceptance_length']:.2f} tokens a step", file=sys.stderr)
    if engine_args.get("quantization"):
        measured = run_paged(model_dir, workload, {**engine_args, "quantization": None}, config.vocab_size,
                             sampling=sampling)
        results.append(_result("paged-unquantized", workload, *measured[:2], flops, rate, **measured[2]))
    for fraction in args.json_fractions:
        if not 0 < fraction <= 1:
            raise SystemExit(f"--json-fractions must be in (0, 1], got {fraction}")
        measured = run_paged(model_dir, workload, engine_args, config.vocab_size, fraction, sampling=sampling)
        results.append(_result(f"paged-json-{fraction:.0%}", workload, *measured[:2], flops, rate, **measured[2]))
        print(f"paged with {fraction:.0%} JSON-constrained: grammar compile "
              f"{measured[2]['grammar_compile_seconds'] * 1e3:.1f} ms", file=sys.stderr)
    for count in args.lora:
        if count < 1:
            raise SystemExit(f"--lora counts must be >= 1, got {count}")
        from paged.benchmarks.lora_adapters import write_random_adapters
        paths = write_random_adapters(model_dir, count, args.lora_rank)
        measured = run_paged(model_dir, workload, engine_args, config.vocab_size, lora_paths=paths,
                             lora_rank=args.lora_rank, sampling=sampling)
        results.append(_result(f"paged-lora-{count}", workload, *measured[:2], flops, rate, **measured[2]))
    try:
        import torch
        torch.set_num_threads(max(1, torch.get_num_threads()))
        have_torch = True
    except ImportError:
        have_torch = False
        print("torch is not installed: Hugging Face baselines skipped", file=sys.stderr)
    if have_torch and args.load_format == "dummy" and (args.hf_batch_sizes or not args.no_hf_continuous):
        print("load_format dummy: no weights for transformers to load, Hugging Face baselines skipped",
              file=sys.stderr)
    elif have_torch:
        for size in args.hf_batch_sizes:
            n = len(workload.prompts) if size == "all" else int(size)
            seconds, warmup, extra = run_hf_static(model_dir, workload, n, sampling)
            results.append(_result(f"hf-static-b{n}", workload, seconds, warmup, flops, rate, **extra))
        if not args.no_hf_continuous:
            measured = run_hf_continuous(model_dir, workload, sampling)
            if measured is not None:
                results.append(_result("hf-continuous", workload, measured[0], measured[1], flops, rate,
                                       **measured[2]))
    if args.vllm_python:
        measured = run_vllm(args.vllm_python, model_dir, workload, engine_args.get("dtype", "auto"),
                            engine_args["max_model_len"], args.seed, config.vocab_size,
                            dict(item.split("=", 1) for item in args.vllm_env), sampling)
        if measured is not None:
            measured[2]["env"] = args.vllm_env
            results.append(_result("vllm", workload, measured[0], measured[1], flops, rate, **measured[2]))
    paged = results[0]["output_tokens_per_s"]
    for r in results:
        r["paged_speedup"] = paged / r["output_tokens_per_s"]
    report = {"workload": workload.describe(), "model": model_dir, "model_flops": flops, "matmul_flops_per_s": rate,
              "copy_bytes_per_s": bandwidth,
              "compute_floor_output_tokens_per_s": sum(workload.output_lens) * rate / flops, "engine": engine_args,
              "sampling": sampling,
              "results": results}
    # start-up: building the engine (weights loaded); warm-up: start-up plus the first generate call, which
    # compiles every shape the workload meets.
    print(f"{'system':<16}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}{'MFU':>7}{'paged x':>9}{'start-up s':>12}"
          f"{'warm-up s':>11}")
    for r in results:
        startup = f"{r['startup_seconds']:.1f}" if "startup_seconds" in r else "-"
        print(f"{r['system']:<16}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}"
              f"{r['total_tokens_per_s']:>11.1f}{r['mfu']:>7.1%}{r['paged_speedup']:>9.2f}{startup:>12}"
              f"{r['warmup_seconds']:>11.1f}")
    split = results[0]["step_time_split_s"]
    total = sum(split.values())
    print("paged step time split: " + ", ".join(f"{k} {v / total:.0%}" for k, v in split.items()))
    kinds = results[0]["device_time_by_step_kind_s"]
    print("paged device time: " + ", ".join(f"{k} {v:.2f} s" for k, v in kinds.items())
          + f"; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"paged warm-up: {results[0]['shapes_compiled']} shapes, {results[0]['warmup_compilation_cache_hits']} "
          f"executables loaded from the compilation cache ({results[0]['compilation_cache_dir']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

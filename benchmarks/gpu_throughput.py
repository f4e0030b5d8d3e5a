"""The engine's throughput on GPU-sized work: the last section of the prepared GPU run (benchmarks/gpu_check.py).

Each model shape (benchmarks/shapes.py) runs with random bfloat16 weights drawn on the device
(`load_format="dummy"`: no 16 GB file is written for the 8B shape) on a batch of equal requests: by default
256 requests of 512 prompt and 256 output tokens, greedy, every output token generated (`ignore_eos`). A
warm-up on other token ids compiles every step shape first; the timed run is traced (paged/trace.py).

Reported per shape: output tokens/s, and each decode step's time against its byte floor. A decode step must
read every weight once and the K/V of every position its rows attend to (the trace's `context_tokens`); over
the copy bandwidth measured in the same run that is the step's floor (at these batches the arithmetic is far
below the GPU's rate). A step's time is the gap between its tokens' read-back and the previous step's: with
async scheduling the host's work overlaps the device's, so this is the step time the engine sustains.

Everything runs against a deadline: a run cut short says so and still reports the steps it timed. The
warm-up is traced too: its decode steps (`warmup_decode`; the few that compiled a shape are outliers the
medians pass over) stand in where the timed run is cut short.
"""

from __future__ import annotations

import gc
import time

import numpy as np

# The 8B first: its decode steps against their floor are what the GPU issue's target names.
SHAPES = ("llama-3.1-8b", "qwen2.5-0.5b")


def decode_steps(records, weight_bytes: int, kv_bytes_per_token: int, copy_bytes_per_s: float) -> dict:
    """Decode-only steps that follow another decode-only step: each one's time (the gap between the two
    read-backs) over its byte floor ((weights + its rows' K/V) / copy bandwidth), as medians and a 90th
    percentile."""
    periods, floors, batches = [], [], []
    for previous, step in zip(records, records[1:]):
        if previous.read_back_at is None or step.read_back_at is None:
            continue
        if sum(previous.prefill_tokens) or sum(step.prefill_tokens):
            continue
        periods.append(step.read_back_at - previous.read_back_at)
        floors.append((weight_bytes + step.context_tokens * kv_bytes_per_token) / copy_bytes_per_s)
        batches.append(len(step.request_ids))
    if not periods:
        return {"steps": 0}
    ratio = np.asarray(periods) / np.asarray(floors)
    return dict(steps=len(periods), median_step_s=float(np.median(periods)), median_floor_s=float(np.median(floors)),
                median_over_floor=float(np.median(ratio)), p90_over_floor=float(np.percentile(ratio, 90)),
                median_batch=float(np.median(batches)))


def _drive(engine, prompts: list[list[int]], params, prefix: str, deadline: float) -> bool:
    """Runs every prompt to its end; False if the deadline came first (the rest are aborted)."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for request_id, tokens in zip(ids, prompts):
        engine.add_request(engine.make_request(request_id, None, tokens, params))
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            for request_id in ids:
                engine.abort_request(request_id)
            while engine.has_unfinished_requests():  # the step in flight
                engine.step()
            return False
        engine.step()
    return True


def run_shape(model_dir: str, name: str, requests: int, prompt_len: int, output_len: int, copy_bytes_per_s: float,
              deadline: float, progress=lambda entry: None) -> dict:
    """One shape's run (see the module's docstring); `model_dir` holds its config.json and tokenizer.
    `progress(entry)` is called with what is known so far after each stage (a run killed mid-way keeps it)."""
    from paged import LLM, SamplingParams
    from paged.benchmarks.common import random_workload, warmup_twin
    from paged.runner import kv_block_bytes
    entry = dict(shape=name, requests=requests, prompt_len=prompt_len, output_len=output_len)
    block = 16
    start = time.monotonic()
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", block_size=block, max_num_seqs=min(requests, 256),
              max_num_batched_tokens=8192, max_model_len=prompt_len + output_len, enable_prefix_caching=False,
              num_kv_blocks=requests * -(-(prompt_len + output_len) // block) + 16, show_progress=False)
    engine = llm.engine
    entry.update(startup_s=time.monotonic() - start, attention_backend=engine.attention_name,
                 weight_bytes=int(engine.weight_bytes["total"]),
                 kv_bytes_per_token=kv_block_bytes(engine.worker.model_config, 1, engine.worker.kv_dtype))
    progress(entry)
    floor = lambda records: decode_steps(records, entry["weight_bytes"], entry["kv_bytes_per_token"],
                                         copy_bytes_per_s)
    vocab = engine.worker.model_config.vocab_size
    workload = random_workload(requests, (prompt_len, prompt_len), (output_len, output_len), vocab)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Warm-up on other token ids: compiles every step shape the timed run meets.
    engine.start_trace()
    warmed = _drive(engine, warmup_twin(workload, vocab).prompts, params, "warm-up", deadline)
    entry.update(warmup_s=time.monotonic() - start - entry["startup_s"], shapes_compiled=engine.num_compilations,
                 warmup_decode=floor(engine.stop_trace().records))
    if not warmed:
        entry["cut_short"] = "during the warm-up"
    progress(entry)
    if warmed:
        compiled = engine.num_compilations
        engine.start_trace()
        begin = time.perf_counter()
        complete = _drive(engine, workload.prompts, params, "timed", deadline)
        seconds = time.perf_counter() - begin
        records = engine.stop_trace().records
        tokens = sum(sum(r.sampled) for r in records)
        entry.update(seconds=seconds, output_tokens=tokens, output_tokens_per_s=tokens / seconds,
                     compilations_in_timed_run=engine.num_compilations - compiled, decode=floor(records))
        if not complete:
            entry["cut_short"] = f"after {tokens} of {requests * output_len} output tokens"
    del llm, engine
    gc.collect()
    return entry


def summary_line(entry: dict) -> str:
    if "output_tokens_per_s" not in entry:
        line = f"throughput {entry['shape']}: cut short {entry.get('cut_short', '')}, nothing timed"
        warm = entry.get("warmup_decode", {})
        if warm.get("steps"):
            line += (f"; in the warm-up, decode step {warm['median_step_s'] * 1e3:.2f} ms, "
                     f"{warm['median_over_floor']:.2f}x its byte floor")
        return line
    decode = entry["decode"]
    line = (f"throughput {entry['shape']} ({entry['requests']} x {entry['prompt_len']}+{entry['output_len']}, "
            f"{entry['attention_backend']}): {entry['output_tokens_per_s']:.0f} output tok/s")
    if decode["steps"]:
        line += (f"; decode step {decode['median_step_s'] * 1e3:.2f} ms at batch {decode['median_batch']:.0f}, "
                 f"{decode['median_over_floor']:.2f}x its byte floor ({decode['median_floor_s'] * 1e3:.2f} ms)")
    return line + (f"; CUT SHORT {entry['cut_short']}" if "cut_short" in entry else "")

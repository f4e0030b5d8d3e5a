"""The engine trace: one record per step (what ran, for whom, how long the host and the device took).

    engine.start_trace()
    ... llm.generate(...) or engine.step() ...
    trace = engine.stop_trace()
    trace.to_dataframe()                   # one row per step (pandas)
    trace.write_chrome_trace("run.json")   # open in ui.perfetto.dev or chrome://tracing

Times are host `time.perf_counter()` seconds from the start of the trace. A step's device time is seen from
the host: from its launch to the moment its sampled tokens were read back; with async scheduling the next
step is scheduled and launched inside that interval, which is the overlap the trace makes visible.
"""

from __future__ import annotations

import dataclasses
import json
import time


@dataclasses.dataclass
class StepRecord:
    step: int  # launch order, from 0
    scheduled_at: float  # s from the trace's start: scheduling began
    schedule_s: float  # host: the scheduler
    launch_s: float  # host: preparing the inputs and launching the jitted step
    request_ids: tuple[str, ...]  # one per row (a parent request with n > 1 has a row per sample)
    prefill_tokens: tuple[int, ...]  # per row: tokens computed as a prompt (or a prompt chunk, or recompute)
    decode_tokens: tuple[int, ...]  # per row: 1 for a row that extends its output by one token, else 0
    sampled: tuple[int, ...]  # per row: 1 when the step samples its next token (decode, or a prompt's last chunk)
    prompt_tokens: int  # prompt tokens computed (not prefix-cache hits); sums to engine.num_computed_prompt_tokens
    preempted: tuple[str, ...]  # requests preempted to make room for this step
    blocks_used: int  # KV blocks held once the step was scheduled
    context_tokens: int  # K/V positions the step's attention reads, over its rows (with the new tokens')
    read_back_at: float | None = None  # s from the trace's start: its tokens were on the host
    device_wait_s: float | None = None  # host time blocked waiting for them
    postprocess_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_tokens) + sum(self.decode_tokens)


def record_step(trace: "EngineTrace", batch, blocks_used: int) -> StepRecord:
    """The record of a step just scheduled, read before its launch advances the rows' counts; the engine fills
    in its times."""
    rows = list(zip(batch.requests, batch.num_new_tokens))
    decode = tuple(int(n == 1 and r.num_computed_tokens == r.num_tokens - 1) for r, n in rows)
    record = StepRecord(
        step=len(trace.records), scheduled_at=0.0, schedule_s=0.0, launch_s=0.0,
        request_ids=tuple(r.request_id for r, _ in rows),
        prefill_tokens=tuple(0 if d else n for d, (_, n) in zip(decode, rows)), decode_tokens=decode,
        sampled=tuple(int(r.num_computed_tokens + n >= r.num_tokens) for r, n in rows),
        prompt_tokens=sum(batch.prompt_tokens_per_row()), preempted=tuple(r.request_id for r in batch.preempted),
        blocks_used=blocks_used, context_tokens=sum(r.num_computed_tokens + n for r, n in rows))
    trace.records.append(record)
    return record


class EngineTrace:
    def __init__(self):
        self.origin = time.perf_counter()
        self.records: list[StepRecord] = []

    def now(self) -> float:
        return time.perf_counter() - self.origin

    # ---- export ----------------------------------------------------------------------------------------

    def rows(self) -> list[dict]:
        """One dict per step, the record's fields plus totals (what `to_dataframe` holds)."""
        out = []
        for r in self.records:
            row = dataclasses.asdict(r)
            row.update(num_rows=len(r.request_ids), num_prefill_tokens=sum(r.prefill_tokens),
                       num_decode_tokens=sum(r.decode_tokens), num_sampled=sum(r.sampled), num_tokens=r.num_tokens,
                       num_preempted=len(r.preempted))
            out.append(row)
        return out

    def to_dataframe(self):
        try:
            import pandas as pd
        except ImportError as error:
            raise ImportError("EngineTrace.to_dataframe needs pandas (pip install pandas); rows() gives the same "
                              "records as dicts") from error
        return pd.DataFrame(self.rows())

    def chrome_trace(self) -> dict:
        """The Trace Event Format: a host track (schedule, launch, postprocess), a device track (launch to
        read-back) and one track per request (its rows' steps)."""
        us = lambda seconds: round(seconds * 1e6, 3)
        events = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "engine"}},
                  {"ph": "M", "pid": 0, "tid": 0, "name": "thread_name", "args": {"name": "host"}},
                  {"ph": "M", "pid": 0, "tid": 1, "name": "thread_name", "args": {"name": "device (launch to read-back)"}},
                  {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "requests"}}]
        request_tids: dict[str, int] = {}
        for r in self.records:
            args = {"step": r.step, "rows": len(r.request_ids), "prefill_tokens": sum(r.prefill_tokens),
                    "decode_tokens": sum(r.decode_tokens), "blocks_used": r.blocks_used,
                    "preempted": list(r.preempted)}
            events.append({"ph": "X", "pid": 0, "tid": 0, "name": "schedule", "ts": us(r.scheduled_at),
                           "dur": us(r.schedule_s), "args": args})
            launched = r.scheduled_at + r.schedule_s
            events.append({"ph": "X", "pid": 0, "tid": 0, "name": "launch", "ts": us(launched), "dur": us(r.launch_s),
                           "args": args})
            if r.read_back_at is None:
                continue
            start = launched + r.launch_s
            events.append({"ph": "X", "pid": 0, "tid": 1, "name": f"step {r.step}", "ts": us(start),
                           "dur": us(r.read_back_at - start), "args": args})
            events.append({"ph": "X", "pid": 0, "tid": 0, "name": "postprocess", "ts": us(r.read_back_at),
                           "dur": us(r.postprocess_s or 0.0), "args": args})
            for request_id, prefill, decode in zip(r.request_ids, r.prefill_tokens, r.decode_tokens):
                if request_id not in request_tids:
                    request_tids[request_id] = len(request_tids)
                    events.append({"ph": "M", "pid": 1, "tid": request_tids[request_id], "name": "thread_name",
                                   "args": {"name": request_id}})
                tid = request_tids[request_id]
                events.append({"ph": "X", "pid": 1, "tid": tid, "name": "prefill" if prefill else "decode",
                               "ts": us(start), "dur": us(r.read_back_at - start),
                               "args": {"step": r.step, "tokens": prefill + decode}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

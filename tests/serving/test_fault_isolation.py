"""One bad step costs only its own requests: fault injection into the engine, in-process and behind HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import paged.engine
from paged import LLMEngine, SamplingParams, StepFailedError
from paged.serving.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from paged.serving.metrics import EngineMetrics
from paged.serving.app import build_app

MARKER = 7  # a prompt starting with this token id makes the injected fault fire
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FLAGS = dict(block_size=8, max_model_len=128, max_num_seqs=8, num_kv_blocks=64, compilation_cache_dir=None)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, show_progress=False, **FLAGS)


def _reference(engine, prompts):
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(f"ref-{i}", None, prompt, GREEDY))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"ref-{i}"] for i in range(len(prompts))]


def _inject(monkeypatch, engine, where: str):
    """Raises once, in `where`, for the step that carries the marked request."""
    fired = []

    def marked(requests):
        return any(r.prompt_token_ids[0] == MARKER for r in requests) and not fired

    if where == "prepare":
        real = paged.engine.prepare_inputs

        def prepare(batch, *args):
            if marked(batch.requests):
                fired.append(1)
                raise RuntimeError("injected fault in prepare")
            return real(batch, *args)

        monkeypatch.setattr(paged.engine, "prepare_inputs", prepare)
    else:
        real_accept = engine.outputs._accept_token

        def accept(request, index):
            if marked([request]):
                fired.append(1)
                raise RuntimeError("injected fault in postprocess")
            return real_accept(request, index)

        monkeypatch.setattr(engine.outputs, "_accept_token", accept)
    return fired


@pytest.mark.parametrize("where", ["prepare", "postprocess"])
def test_a_failing_step_aborts_its_requests_and_the_engine_goes_on(engine, monkeypatch, where):
    prompts = [[11, 12, 13, 14], [20, 21, 22]]
    want = _reference(engine, prompts)
    free = engine.num_free_blocks
    fired = _inject(monkeypatch, engine, where)
    engine.add_request(engine.make_request("bad", None, [MARKER, 1, 2, 3], GREEDY))
    engine.add_request(engine.make_request("neighbour", None, [30, 31], GREEDY))
    with pytest.raises(StepFailedError) as caught:
        while engine.has_unfinished_requests():
            engine.step()
    assert fired and "bad" in caught.value.request_ids and "injected" in str(caught.value)
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == free  # nothing leaked
    assert _reference(engine, prompts) == want  # and the engine serves as before


def test_async_engine_fails_the_step_and_serves_the_rest(engine, monkeypatch):
    prompts = [[11, 12, 13, 14], [20, 21, 22], [5, 6, 9]]
    want = _reference(engine, prompts)
    free = engine.num_free_blocks
    _inject(monkeypatch, engine, "prepare")

    async def run():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            async def collect(request_id, prompt):
                try:
                    last = None
                    async for last in await async_engine.submit(request_id, None, prompt, GREEDY):
                        pass
                    return last.outputs[0].token_ids
                except RequestFailedError as exc:
                    return exc

            failed = await collect("bad", [MARKER, 1, 2])
            served = await asyncio.gather(*(collect(f"ok-{i}", p) for i, p in enumerate(prompts)))
            return failed, served
        finally:
            async_engine.stop()

    failed, served = asyncio.run(run())
    assert isinstance(failed, RequestFailedError) and "injected fault" in str(failed)
    assert served == want
    assert engine.num_free_blocks == free


def test_a_failing_metrics_observer_never_stops_the_engine(engine):
    prompts = [[11, 12, 13, 14], [20, 21, 22]]
    want = _reference(engine, prompts)

    class Broken(EngineMetrics):
        def on_step(self, *args):
            raise RuntimeError("a metrics bug")

    async def run():
        async_engine = AsyncEngine(engine, observer=Broken("tiny"))
        async_engine.start()
        try:
            async def collect(request_id, prompt):
                last = None
                async for last in await async_engine.submit(request_id, None, prompt, GREEDY):
                    pass
                return last.outputs[0].token_ids

            return await asyncio.gather(*(collect(f"m-{i}", p) for i, p in enumerate(prompts))), async_engine.alive
        finally:
            async_engine.stop()

    served, alive = asyncio.run(run())
    assert served == want and alive


def test_a_dead_engine_loop_fails_everything_at_once_and_nothing_hangs(engine, monkeypatch):
    """If the loop itself dies: on_death is told, every waiting request fails, new ones and /metrics are
    answered at once, and /health says 503 with Retry-After."""
    deaths = []

    def broken_step():
        raise paged.engine.EngineBrokenError("injected: the pool is gone")

    async def run():
        async_engine = AsyncEngine(engine, on_death=deaths.append)
        async_engine.start()
        app = build_app(async_engine, "tiny", EngineMetrics("tiny"))
        monkeypatch.setattr(engine, "step", broken_step)
        stream = await async_engine.submit("doomed", None, [11, 12], GREEDY)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(async_engine.submit("late", None, [1, 2], GREEDY), 2)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            metrics = await asyncio.wait_for(client.get("/metrics"), 5)
            health = await client.get("/health")
            completion = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": [1, 2]}), 5)
        return metrics, health, completion

    metrics, health, completion = asyncio.run(run())
    monkeypatch.undo()
    assert len(deaths) == 1 and isinstance(deaths[0], paged.engine.EngineBrokenError)
    assert metrics.status_code == 200
    assert health.status_code == 503 and health.headers["retry-after"] == "1"
    assert completion.status_code == 503 and completion.json()["error"]["type"] == "server_error"
    engine.abort_request("doomed")


def test_a_stream_cut_by_the_engine_dying_ends_with_an_error_event(engine, monkeypatch):
    real_step, calls = engine.step, []

    def dies_on_the_fourth_step():
        calls.append(1)
        if len(calls) >= 4:
            raise paged.engine.EngineBrokenError("injected: the pool is gone")
        return real_step()

    async def run():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        monkeypatch.setattr(engine, "step", dies_on_the_fourth_step)
        app = build_app(async_engine, "tiny")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": [11, 12, 13], "max_tokens": 50, "stream": True, "ignore_eos": True}
            response = await asyncio.wait_for(client.post("/v1/completions", json=body), 30)
        return [line for line in response.text.splitlines() if line]

    lines = asyncio.run(run())
    monkeypatch.undo()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "server_error" and "injected" in error["message"]
    assert any('"choices"' in line for line in lines[:-2])  # it had streamed tokens before the engine died

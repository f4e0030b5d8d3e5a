"""Server-sent events: the framing, the response that turns a failure mid-stream into an error event, the text
held back while it may start a stop string, and the merge of several requests' streams into one."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from paged import RequestOutput, SamplingParams
from paged.serving.async_engine import RequestStream
from paged.serving.errors import api_error_of, error_body, outcome_of


def sse(payload: dict | str) -> str:
    """One event: `data: {json}`, or `data: [DONE]`."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """A generation's server-sent events. A failure mid-stream becomes a final error event and `[DONE]`, so a
    client learns why its stream ended instead of seeing it cut; `on_end(outcome)`, when set, is called once
    the stream has ended (an outcome of paged.serving.metrics.OUTCOMES). `X-Accel-Buffering: no` keeps a proxy
    such as nginx from holding events back."""

    def __init__(self, events: AsyncIterator[str], error_events=None):
        """`error_events(err)`: the events a failure ends the stream with (default: an error chunk in the
        chat/completions shape, then [DONE])."""
        self.on_end = None
        self.error_events = error_events or (lambda err: [sse(error_body(err)), sse("[DONE]")])
        super().__init__(self._with_errors(events), media_type="text/event-stream",
                         headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache"})

    async def _with_errors(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        outcome = "aborted"  # the client left before the end
        try:
            async for event in events:
                yield event
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client, in OpenAI's error shape
            err = api_error_of(exc)
            outcome = outcome_of(err)
            for event in self.error_events(err):
                yield event
        finally:
            if self.on_end is not None:
                self.on_end(outcome)


class StreamedChoices:
    """Tracks what has been streamed per (prompt, sample), holding back text that may start a stop string."""

    def __init__(self, params: SamplingParams):
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.sent_text: dict[tuple[int, int], int] = {}
        self.sent_tokens: dict[tuple[int, int], int] = {}

    def delta(self, key, completion, finished: bool) -> tuple[str, int, int]:
        """(new text, first new token index, end token index) for one choice."""
        text = completion.text
        end = len(text) if finished else max(self.sent_text.get(key, 0), len(text) - self.holdback)
        start = self.sent_text.get(key, 0)
        self.sent_text[key] = end
        tok_start = self.sent_tokens.get(key, 0)
        self.sent_tokens[key] = len(completion.token_ids)
        return text[start:end], tok_start, len(completion.token_ids)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    # Bounded: while the client is behind, each stream's newest output waits in its own mailbox (which keeps
    # one) instead of piling up here.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i, stream):
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as exc:  # noqa: BLE001
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()

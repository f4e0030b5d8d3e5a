"""Runs an LLMEngine on its own thread and gives each request an async stream of outputs.

The engine is single-threaded by design: every engine call (validation, add, abort, step) happens on the
engine thread, which takes commands from a queue between steps. Async callers get results through futures
and asyncio queues resolved with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator

from paged import LLMEngine, LoRARequest, PoolingParams, RequestOutput, SamplingParams, StepFailedError

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served (HTTP 503)."""


class StreamStalledError(RuntimeError):
    """Its reader took nothing for longer than the stall bound while output waited: the request was aborted."""


class RequestFailedError(RuntimeError):
    """The step that carried this request raised; the request was aborted, the engine goes on (HTTP 500)."""


@dataclasses.dataclass(frozen=True)
class Add:
    """Validate and add one request; `accepted` resolves to True, or to the error that refused it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams | PoolingParams  # PoolingParams: a pooling model's request
    stream: "_Stream"
    accepted: asyncio.Future
    cache_salt: str | None = None
    tenant: str | None = None
    token_type_ids: list[int] | None = None  # a cross-encoder's pair segments
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class FailAll:
    """End every open stream with EngineDeadError(message)."""

    message: str


@dataclasses.dataclass(frozen=True)
class Call:
    """Run fn(engine) on the engine thread; `result` resolves to what it returns or raises."""

    fn: object
    result: asyncio.Future


@dataclasses.dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes the engine thread (to see that it should stop)."""


Command = Add | Abort | FailAll | Call | Wake


class _Stream:
    """One request's mailbox between the engine thread and the event loop: at most one unread output, then
    at most one error.

    Outputs are cumulative (each holds everything so far), so a newer one replaces one not yet read: a
    client that reads slowly, or not at all, costs one output's memory however long it generates, and a
    reader that catches up gets every token. An error is final: it comes after the unread output (the
    tokens made before a failure still reach the client), and nothing replaces it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stall_timeout_s: float | None = None):
        self.loop = loop
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = None  # called once, on the event loop, when the reader is found stalled
        self._output = None
        self._error: BaseException | None = None
        self._pending_since = 0.0  # when the unread output (if any) first became unread
        self._ready = asyncio.Event()
        self.num_replaced = 0  # outputs superseded before they were read (the reader was behind)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item) -> None:  # on the event loop
        if self._error is not None:
            return
        self._ready.set()
        if isinstance(item, BaseException):
            self._error = item
            return
        now = time.monotonic()
        if self._output is None:
            self._pending_since = now
            self._output = item
            return
        self.num_replaced += 1
        self._output = item
        if (self.stall_timeout_s is not None and now - self._pending_since > self.stall_timeout_s
                and not item.finished):
            self._error = StreamStalledError(
                f"the client read nothing of this stream for over {self.stall_timeout_s:g} s while output "
                "waited (--stream-stall-timeout-s): the request was aborted")
            if self.on_stall is not None:
                self.on_stall()

    async def get(self):
        await self._ready.wait()
        if self._output is not None:
            item, self._output = self._output, None
        else:
            item = self._error  # stays: an error is what every later read gets
        if self._output is None and self._error is None:
            self._ready.clear()
        return item


class RequestStream:
    """Async iterator over one request's cumulative outputs; `close()` aborts it if unfinished."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream):
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self.finished = False
        self.on_done = None  # called once, when the request finishes, fails or is closed (replica load counts)
        stream.on_stall = lambda: engine.abort(request_id)  # frees its blocks now; the reader gets the error

    def _set_finished(self) -> None:
        self.finished = True
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            done()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._stream.get()
        if isinstance(item, BaseException):
            self._set_finished()
            raise item
        if item.finished:
            self._set_finished()
        return item

    def close(self) -> None:
        if not self.finished:
            self._set_finished()
            self.engine.abort(self.request_id)


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    def set_it():
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    future.get_loop().call_soon_threadsafe(set_it)


class Generating:
    """`generate`, an async iterator over a request's outputs, on top of a class's `submit`; and what the
    server reads of the engine (its tokenizer and configs, the same on every replica), without reaching into
    it. `engine` is the LLMEngine behind (the first replica's, with several)."""

    engine: LLMEngine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        """The engine's resolved EngineConfig (max_model_len, max_num_seqs, ...)."""
        return self.engine.config

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def runner_type(self) -> str:
        """"generate", or "pooling" for a model that returns vectors (paged/pooler.py)."""
        return self.engine.runner_type

    @property
    def pooling_task(self) -> str | None:
        """A pooling model's vectors: "embed" or "classify" (None when it generates)."""
        return self.engine.pooling_task

    @property
    def grammars(self):
        """The structured-output compiler (paged/grammar.py); None without a tokenizer."""
        return self.engine.grammars

    async def submit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams | PoolingParams, cache_salt: str | None = None,
                     tenant: str | None = None, token_type_ids: list[int] | None = None,
                     lora_request: LoRARequest | None = None) -> RequestStream:
        raise NotImplementedError

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        stream = await self.submit(request_id, prompt, prompt_token_ids, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()


class AsyncEngine(Generating):
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 1024, batching_delay_ms: float = 0.0,
                 observer=None, on_death=None, stream_stall_timeout_s: float | None = None):
        """`observer` (optional) gets `on_step(engine, outputs, step_start, step_end)` on the engine thread;
        `on_death(error)` (optional) is called on the engine thread if the loop itself dies (not on stop());
        `stream_stall_timeout_s`: a request whose reader takes nothing for this long while output waits is
        aborted (its stream ends with StreamStalledError); None: never."""
        self.engine = engine
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.max_waiting_requests = max_waiting_requests
        self.batching_delay = batching_delay_ms / 1000.0
        self.observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-engine", daemon=True)
        self.error: BaseException | None = None
        self.on_death = on_death
        # Held while a command is queued and while the dying thread answers the last ones, so no command is
        # queued after that final drain and left unanswered.
        self._accepting = threading.Lock()
        self._dead = False

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is still in flight and joins the engine thread."""
        self._stopping.set()
        self._commands.put(Wake())
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def replicas(self) -> list["AsyncEngine"]:
        """Every engine behind this one (serving/replicas.py has several): here, itself."""
        return [self]

    # ---- the async API --------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams | PoolingParams, cache_salt: str | None = None,
                     tenant: str | None = None, token_type_ids: list[int] | None = None,
                     lora_request: LoRARequest | None = None) -> "RequestStream":
        """Validates and queues one request; raises ValueError (bad input), QueueFullError or EngineDeadError.

        Returns its stream of cumulative RequestOutputs (one PoolingRequestOutput for PoolingParams). Closing
        the stream early (a client disconnect) aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, self.stream_stall_timeout_s)
        accepted = loop.create_future()
        self._post(Add(request_id, prompt, prompt_token_ids, params, stream, accepted, cache_salt, tenant,
                       token_type_ids, lora_request))
        await accepted
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    def fail_all(self, message: str) -> None:
        """Ends every open stream with EngineDeadError(message) and aborts its request (e.g. before a
        shutdown's grace runs out, so clients get an error event instead of a cut connection)."""
        with self._accepting:
            if not self._dead:
                self._commands.put(FailAll(message))

    async def call(self, fn):
        """Runs fn(engine) on the engine thread (e.g. to read stats consistently); returns its result."""
        future = asyncio.get_running_loop().create_future()
        self._post(Call(fn, future))
        return await future

    def _post(self, command: Command) -> None:
        with self._accepting:
            if self._dead or not self.alive:
                raise EngineDeadError(f"the engine is not running{f': {self.error!r}' if self.error else ''}")
            self._commands.put(command)

    # ---- the engine thread ----------------------------------------------------------------------------

    def _handle(self, command: Command) -> None:
        engine = self.engine
        if isinstance(command, Add):
            try:
                waiting = engine.scheduler.waiting
                # Full, unless this tenant has nothing waiting (another's backlog never refuses it: at most
                # one request per tenant past the bound); a bound of 0 queues nothing.
                limit = self.max_waiting_requests
                if len(waiting) >= limit and (waiting.num_waiting(command.tenant) or limit == 0):
                    raise QueueFullError(f"the server is at capacity ({self.max_waiting_requests} requests "
                                         "waiting); retry later")
                if isinstance(command.params, PoolingParams):
                    parent = engine.make_pooling_request(command.request_id, command.prompt,
                                                         command.prompt_token_ids, command.params, command.tenant,
                                                         command.token_type_ids)
                else:
                    parent = engine.make_request(command.request_id, command.prompt, command.prompt_token_ids,
                                                 command.params, command.cache_salt, command.tenant,
                                                 command.lora_request)
            except (ValueError, QueueFullError) as exc:
                _resolve(command.accepted, error=exc)
                return
            engine.add_request(parent)
            self._streams[command.request_id] = command.stream
            _resolve(command.accepted, True)
        elif isinstance(command, Abort):
            self._streams.pop(command.request_id, None)
            engine.abort_request(command.request_id)
            if self.observer is not None:
                self.observer.forget(command.request_id)
        elif isinstance(command, FailAll):
            self._fail_streams(EngineDeadError(command.message))
        elif isinstance(command, Call):
            try:
                _resolve(command.result, command.fn(engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                _resolve(command.result, error=exc)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _wait_for_more_arrivals(self) -> None:
        # Trade up to `batching_delay` of latency for a fuller first step, only while nothing runs: stalling
        # a running batch for newcomers raised every running request's inter-token latency when measured
        # (docs/performance.md), for no throughput.
        engine = self.engine
        if self.batching_delay <= 0 or not engine.scheduler.waiting or engine.scheduler.running:
            return
        deadline = time.monotonic() + self.batching_delay
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                self._handle(self._commands.get(timeout=remaining))
            except queue.Empty:
                return

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._drain(block=not engine.has_unfinished_requests())
                if not engine.has_unfinished_requests():
                    continue
                self._wait_for_more_arrivals()
                start = time.monotonic()
                try:
                    outputs = engine.step()
                except StepFailedError as failure:  # only that step's requests pay: the engine goes on
                    self._fail(failure)
                    continue
                end = time.monotonic()
                if self.observer is not None:
                    try:
                        self.observer.on_step(engine, outputs, start, end)
                    except Exception:  # noqa: BLE001 - a metrics bug loses a step's counts, never the engine
                        logger.exception("the metrics observer failed on a step (the requests go on)")
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
                    if output.finished:
                        self._streams.pop(output.request_id, None)
        except BaseException as exc:  # noqa: BLE001 - an engine bug: fail every stream, keep the message
            logger.exception("engine thread crashed")
            self.error = exc
        finally:
            with self._accepting:
                self._dead = True
                self._shut_down()
        if self.error is not None and self.on_death is not None:
            self.on_death(self.error)

    def _fail(self, failure: StepFailedError) -> None:
        error = RequestFailedError(f"internal error while running this request's step: "
                                   f"{type(failure.cause).__name__}: {failure.cause}")
        for request_id in failure.request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)
            if self.observer is not None:
                self.observer.forget(request_id)

    def _fail_streams(self, error: BaseException) -> None:
        """Ends every open stream with `error` and aborts its request."""
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(error)
        self._streams.clear()

    def _shut_down(self) -> None:
        """Fails every stream and every queued command: nothing waits on a dead engine."""
        error = EngineDeadError(f"the engine stopped: {self.error!r}" if self.error else "the server is "
                                "shutting down")
        self._fail_streams(error)
        self._stopping.set()
        while True:  # answer commands that raced with the stop
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                _resolve(command.accepted, error=error)
            elif isinstance(command, Call):
                _resolve(command.result, error=error)

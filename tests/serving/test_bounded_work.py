"""One client cannot stall or exhaust the server: large replies are encoded off the event loop, a reply's
logprob entries are bounded, a stream nobody reads costs one output and is aborted, a batch whose client
leaves stops, refused requests leave nothing behind, credentials in query strings never reach the log."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from tests.serving.server_fixture import Server

FLAGS = ["--block-size", "16", "--max-model-len", "1024", "--max-num-seqs", "16", "--max-reply-logprobs", "340000",
         "--stream-stall-timeout-s", "1", "--header-timeout-s", "1"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, *FLAGS)
    yield srv
    srv.stop()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _idle(server, timeout: float = 60) -> bool:
    """Nothing running or waiting and no KV block in use, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (_metric(server, "paged:num_requests_running") == 0 and _metric(server, "paged:num_requests_waiting") == 0
                and _metric(server, "paged:kv_cache_usage_perc") == 0):
            return True
        time.sleep(0.2)
    return False


class _HealthCanary:
    """Polls /health every 50 ms on its own connection; `worst` is the slowest answer seen."""

    def __init__(self, server):
        self.url = server.url + "/health"
        self.worst = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert client.get(self.url).status_code == 200
                self.worst = max(self.worst, time.perf_counter() - start)
                self.count += 1
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_a_large_reply_never_holds_health(server):
    # The echoed prompt's logprobs in each of 16 choices: 16 x 1,000 positions x 21 entries, a ~7 MB body
    # built from one prefill. Built and encoded on the event loop, /health waited for all of it (1-2 s here);
    # in a worker, it answers throughout.
    body = {"model": "tiny", "prompt": [5 + i % 400 for i in range(1000)], "n": 16, "max_tokens": 0, "echo": True,
            "logprobs": 20}
    # The same request once before: this server compiles on first use (--enforce-eager), and a compile's
    # tracing holds the interpreter too; what is measured here is the reply alone.
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=300).status_code == 200
    with _HealthCanary(server) as canary:
        time.sleep(0.3)
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert len(reply.content) > 6_000_000
    choices = json.loads(reply.content)["choices"]
    assert len(choices) == 16 and all(len(c["logprobs"]["top_logprobs"]) == 1000 for c in choices)
    assert canary.count > 10
    print(f"worst /health {canary.worst:.3f} s over {canary.count}")
    assert canary.worst < 0.5, f"/health took {canary.worst:.2f} s while the reply was built"


def _posted_under_canary(server, raw: str, times: int) -> list[httpx.Response]:
    """Posts the JSON text `raw` `times` times while a canary polls /health; asserts /health kept answering
    within 0.45 s (generous on CI's machine) and returns the replies."""
    assert 3_500_000 < len(raw) < 4 * 2**20  # large, and under the 4 MiB body limit
    with _HealthCanary(server) as canary:
        time.sleep(0.3)
        replies = [httpx.post(server.url + "/v1/completions", content=raw, timeout=60,
                              headers={"Content-Type": "application/json"}) for _ in range(times)]
    assert canary.count > 5
    print(f"worst /health {canary.worst:.3f} s over {canary.count}")
    assert canary.worst < 0.45, f"/health took {canary.worst:.2f} s while the body was handled"
    return replies


def test_a_body_of_a_million_token_ids_is_parsed_without_holding_health(server):
    """A 3.9 MB body of token ids: validating its prompt against each of the prompt's four shapes built a
    million errors per failed shape, and the walk for lone surrogates took a Python step per id (/health
    waited 0.5-0.8 s per body here; now 0.05-0.2 s). The prompt is far past max_model_len: a 400."""
    for reply in _posted_under_canary(server, json.dumps({"model": "tiny", "prompt": [7] * 1_300_000,
                                                          "max_tokens": 1}), 3):
        assert reply.status_code == 400, reply.text


def test_a_body_of_half_a_million_short_prompts_is_decoded_off_the_loop(server):
    """4 MiB of two-token prompts (524,000 lists): json.loads of it is one 0.2-0.8 s call holding the
    interpreter, and copying the batch to count it took as long again (/health waited 2.1 s per body here).
    Decoded piecewise in a thread, refused by its length before any element is looked at: 0.03-0.2 s."""
    for reply in _posted_under_canary(server, json.dumps({"model": "tiny", "prompt": [[1, 2]] * 524_000}), 2):
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
        assert "at most 65536 prompts" in reply.json()["error"]["message"]


def test_the_piecewise_decoder_gives_json_loads_values():
    from paged.serving.json_body import decode_in_pieces
    for value in ({"a": [1, 2.5, -3e10, None, True, "\u00e9\ud83d\ude00"], "b": {"c": []}}, [[1, 2]] * 1000,
                  "x" * 10_000, {"nested": [[[[{"k": "v"}]]]]}):
        raw = json.dumps(value).encode()
        assert decode_in_pieces(raw) == json.loads(raw)
    for bad in (b'{"a": }', b'[1, 2', b'{"a": 1} x', b'\xff'):
        with pytest.raises(ValueError):  # JSONDecodeError and UnicodeDecodeError both are
            decode_in_pieces(bad)


def test_a_non_streamed_reply_past_the_logprob_bound_is_a_400_and_a_stream_is_not(server):
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "n": 16, "max_tokens": 1015, "logprobs": 20,
            "ignore_eos": True}
    refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "logprobs" and "--max-reply-logprobs" in error["message"] and "341040" in error["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 1015,
            "logprobs": True, "top_logprobs": 20}
    refused = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "max_tokens": 4},
                      timeout=60) as stream:
        assert stream.status_code == 200
        assert any(line.startswith("data: {") for line in stream.iter_lines())


def test_a_stream_nobody_reads_is_aborted_and_returns_its_blocks(server):
    # A client that sends a streamed request and never reads: the server keeps one output for it (not every
    # step's), and once nothing has been read for the stall bound (1 s here) while the socket buffers are
    # full, the request is aborted before its 16 x 1,000 tokens (~11 MB of events) are done.
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "n": 16, "max_tokens": 1000, "logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    generated_before = _metric(server, "paged:generation_tokens_total")
    finished_before = _metric(server, "paged:request_success_total")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(1.0)
        assert _metric(server, "paged:num_requests_running") > 0
        assert _idle(server, timeout=60), "the unread stream's request still holds the engine"
        generated = _metric(server, "paged:generation_tokens_total") - generated_before
        assert _metric(server, "paged:request_success_total") == finished_before, \
            f"it ran to the end instead of being aborted ({generated} tokens)"
        assert generated < 16 * 1000
    finally:
        sock.close()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_batch_whose_client_leaves_stops_being_submitted(server):
    # 4,096 prompts go in one engine round trip each (a step apart while others run): a client that leaves
    # two seconds in must not leave the server submitting and running the rest.
    prompts = [[5 + (i + j) % 300 for j in range(150)] for i in range(4096)]  # each a prefill of its own
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 32,
                                                          "ignore_eos": True}, timeout=2.0)
    left = time.monotonic()
    assert _idle(server, timeout=60)
    print(f"idle {time.monotonic() - left:.1f} s after the client left")
    assert time.monotonic() - left < 10
    too_many = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [[5]] * 4097,
                                                                 "max_tokens": 1}, timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert "--max-prompts-per-request" in too_many.json()["error"]["message"]


def _closed_by_server(sock: socket.socket, drip: bytes, within: float) -> float | None:
    """Sends `drip` a byte every 0.1 s; the seconds until the server closed the connection, or None when it
    was still open after `within` seconds."""
    start = time.monotonic()
    sock.settimeout(0.1)
    for byte in drip:
        if time.monotonic() - start > within:
            return None
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
    return None


def test_a_connection_whose_headers_never_finish_is_closed(server):
    """Slowloris: request headers a byte at a time, on a new connection and after a first response on a
    kept-alive one, are cut at --header-timeout-s (1 s here); a connection that sends nothing too. Requests
    whose headers arrive in time are untouched, however long they then run."""
    host, port = "127.0.0.1", server.port
    drip = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    with socket.create_connection((host, port)) as sock:
        closed_after = _closed_by_server(sock, drip, within=5)
    assert closed_after is not None and 0.8 < closed_after < 3, closed_after
    with socket.create_connection((host, port)) as sock:  # opened, then silent
        sock.settimeout(5)
        start = time.monotonic()
        assert sock.recv(1024) == b"" and time.monotonic() - start < 3
    with socket.create_connection((host, port)) as sock:  # one request in time, then a slow second one
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        closed_after = _closed_by_server(sock, drip, within=5)
    assert closed_after is not None and closed_after < 3, closed_after
    # A request that lasts longer than the deadline once its headers are in still completes.
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        first = next(lines)
        time.sleep(1.5)
        rest = [line for line in lines if line]
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"


def test_credentials_in_a_query_string_never_reach_the_access_log(server):
    httpx.get(server.url + "/v1/models?api_key=sekrit-123&x=1", timeout=10)
    time.sleep(0.3)
    with open(server.log.name) as log:
        text = log.read()
    assert "sekrit-123" not in text
    assert "api_key=REDACTED&x=1" in text


def test_the_query_filter_masks_only_credentials():
    from paged.serving.cli import RedactQuerySecrets
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:1", "GET", "/v1/models?token=abc&limit=3&Access_Token=zz", "1.1", 200),
                               None)
    assert RedactQuerySecrets().filter(record)
    assert record.getMessage() == '127.0.0.1:1 - "GET /v1/models?token=REDACTED&limit=3&Access_Token=REDACTED ' \
                                  'HTTP/1.1" 200'


def test_refused_requests_leave_no_per_request_state():
    import asyncio

    from paged.serving.generation import submit_all
    from paged.serving.errors import APIError
    from paged.serving.metrics import EngineMetrics
    from paged.serving.state import ServerState

    class Refusing:
        async def submit(self, *args, **kwargs):
            raise ValueError("no")

    state = ServerState(Refusing(), "tiny", metrics=EngineMetrics("tiny"))
    for i in range(50):
        with pytest.raises(APIError):
            asyncio.run(submit_all(state, [(None, [1, 2])], None, f"cmpl-{i}"))
    assert state.metrics._key_of == {}


def test_the_piecewise_encoder_gives_json_dumps_bytes():
    import math
    import random

    from paged.serving.json_body import encode

    rng = random.Random(0)

    def value(depth):
        kind = rng.randrange(7 if depth < 4 else 4)
        if kind == 0:
            return rng.choice([None, True, False, 0, -3, 2**40])
        if kind == 1:
            return rng.uniform(-1e6, 1e6)
        if kind == 2:
            return "".join(rng.choice('ab"\\\n\u00e9\u4e2d\U0001f600') for _ in range(rng.randrange(6)))
        if kind == 3:
            return -9999.0
        sizes = [0, 3, 65, 100] if depth < 2 else [0, 3]  # past both sides of the one-call bound, at the top
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.choice(sizes))]
        return {f"k{i}\u00e9": value(depth + 1) for i in range(rng.choice(sizes))}

    for _ in range(30):
        obj = {"choices": [value(0) for _ in range(5)], "n": 1}
        assert encode(obj) == json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    with pytest.raises(ValueError):
        encode({"x": [1.0] * 100 + [math.inf]})


def test_a_reader_that_is_behind_costs_one_output():
    import asyncio

    from paged.serving.async_engine import StreamStalledError, _Stream

    class Output:
        def __init__(self, i, finished=False):
            self.i, self.finished = i, finished

    async def scenario():
        stream = _Stream(asyncio.get_running_loop(), stall_timeout_s=0.2)
        stalled = []
        stream.on_stall = lambda: stalled.append(True)
        for i in range(100):
            stream._put(Output(i))
        assert (await stream.get()).i == 99 and stream.num_replaced == 99
        stream._put(Output(100))
        await asyncio.sleep(0.3)
        stream._put(Output(101))  # nothing read for 0.3 s while output waited: aborted
        stream._put(Output(102))  # an error is final
        assert (await stream.get()).i == 101  # what was made before it still arrives
        assert isinstance(await stream.get(), StreamStalledError) and stalled == [True]
        assert isinstance(await stream.get(), StreamStalledError)

    asyncio.run(scenario())


def test_one_keys_batch_does_not_starve_another_key(tiny_model_dir, tmp_path_factory):
    # Key "bulk" sends 1,024 prompts in one request; key "chat" then sends single requests. Admission takes
    # the keys' waiting requests in turn, so each single request waits for a few of bulk's, not for all.
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps([{"name": "bulk", "key": "sk-bulk"}, {"name": "chat", "key": "sk-chat"}]))
    srv = Server(tiny_model_dir, "--api-keys-file", str(path), "--block-size", "16", "--max-model-len", "256",
                 "--max-num-seqs", "8")
    try:
        single = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 24, "ignore_eos": True}
        chat_key = {"Authorization": "Bearer sk-chat"}
        assert httpx.post(srv.url + "/v1/completions", headers=chat_key, json=single, timeout=600).status_code == 200
        bulk_done = {}

        def bulk():
            start = time.monotonic()
            reply = httpx.post(srv.url + "/v1/completions", headers={"Authorization": "Bearer sk-bulk"},
                               json={"model": "tiny", "prompt": [[5 + i % 300, 6, 7] for i in range(1024)],
                                     "max_tokens": 24, "ignore_eos": True}, timeout=600)
            bulk_done["status"], bulk_done["s"] = reply.status_code, time.monotonic() - start

        thread = threading.Thread(target=bulk)
        thread.start()
        time.sleep(1.0)  # the batch is queued
        latencies = []
        for _ in range(3):
            start = time.monotonic()
            reply = httpx.post(srv.url + "/v1/completions", headers=chat_key, json=single, timeout=600)
            assert reply.status_code == 200
            latencies.append(time.monotonic() - start)
        still_running = thread.is_alive()
        thread.join()
        assert bulk_done["status"] == 200
        print(f"single requests {[round(x, 2) for x in latencies]} s; the batch {bulk_done['s']:.1f} s")
        assert still_running, "the batch finished before the single requests: nothing was measured"
        assert max(latencies) < bulk_done["s"] / 4
    finally:
        srv.stop()

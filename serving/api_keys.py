"""API keys, each with a name and optional per-minute limits on requests and tokens (`paged serve --api-key`,
`--api-keys-file`).

A limit is a token bucket holding one minute's allowance and refilling continuously at limit/60 per second, so
a key may burst up to its limit and then runs at its rate, as OpenAI's limits behave. A generation request is
admitted once its prompt is tokenized: it takes one request and its prompt tokens. Generated tokens are charged
as the engine produces them and may drive the token bucket below zero (the output length is not known at
admission); the key's next request then waits until the deficit has refilled. A refused request is a 429 in
OpenAI's shape with `Retry-After`, the whole seconds until it would be admitted.

Metrics and logs name keys by their `name`, never by the secret.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import threading
import time
from typing import Callable

# The name requests are counted under on a server without keys.
ANONYMOUS = "anonymous"


@dataclasses.dataclass(frozen=True)
class ApiKey:
    name: str  # what /metrics and the logs call it
    key: str = dataclasses.field(repr=False)  # the secret clients send as `Authorization: Bearer KEY`
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None  # prompt plus generated tokens; None: unlimited

    def __post_init__(self):
        if not self.name or not self.key:
            raise ValueError(f"an API key needs a non-empty name and key (got name={self.name!r})")
        for field in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"API key {self.name!r}: {field} must be a positive integer or absent, got {value!r}")


def parse_api_keys(flags: list[str] | None, file: str | None) -> list[ApiKey]:
    """Keys from repeated `--api-key KEY` flags (named key-0, key-1, ...) and a JSON file, a list of
    {"name": ..., "key": ..., "requests_per_minute": N, "tokens_per_minute": N} objects."""
    keys = [ApiKey(f"key-{i}", key) for i, key in enumerate(flags or [])]
    if file is not None:
        with open(file) as f:
            try:
                entries = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}: not valid JSON ({exc})") from None
        if not isinstance(entries, list):
            raise ValueError(f"{file}: expected a JSON list of keys, got {type(entries).__name__}")
        allowed = {f.name for f in dataclasses.fields(ApiKey)}
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not {"name", "key"} <= entry.keys() or entry.keys() - allowed:
                raise ValueError(f"{file}: entry {i} must be an object with name and key, and optionally "
                                 f"requests_per_minute and tokens_per_minute (got {sorted(entry) if isinstance(entry, dict) else entry!r})")
            keys.append(ApiKey(**entry))
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"API key names must be unique, got {names}")
    if len({k.key for k in keys}) != len(keys):
        raise ValueError("two API keys have the same secret")
    return keys


class RateLimited(Exception):
    """A request over one of its key's limits."""

    def __init__(self, message: str, kind: str, retry_after_s: float | None, limit: int, remaining: int):
        super().__init__(message)
        self.kind = kind  # "requests" or "tokens": the limit that refused it (OpenAI's error `type`)
        self.retry_after_s = retry_after_s  # None: the request can never fit this limit
        self.limit, self.remaining = limit, remaining


class _Bucket:
    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self.level, self.stamp = self.capacity, now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def wait_for(self, amount: float) -> float:
        """Seconds until the (refilled) level reaches `amount`."""
        return max(0.0, (amount - self.level) / self.rate)


class KeyRing:
    """The server's keys and their buckets. `identify` and `admit` run on the event loop; `charge` on the
    engine thread, hence the lock."""

    def __init__(self, keys: list[ApiKey], clock: Callable[[], float] = time.monotonic):
        self.keys = list(keys)
        self.clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._requests = {k.name: _Bucket(k.requests_per_minute, now) for k in keys if k.requests_per_minute}
        self._tokens = {k.name: _Bucket(k.tokens_per_minute, now) for k in keys if k.tokens_per_minute}

    @property
    def required(self) -> bool:
        return bool(self.keys)

    @property
    def limits_tokens(self) -> bool:
        return bool(self._tokens)

    def identify(self, token: str) -> ApiKey | None:
        """The key whose secret is `token` (every key is compared, in constant time each)."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(token.encode(), key.key.encode()):
                found = key
        return found

    def admit(self, name: str, prompt_tokens: int) -> None:
        """Takes one request and `prompt_tokens` from key `name`'s buckets, or raises RateLimited taking
        nothing."""
        with self._lock:
            now = self.clock()
            requests, tokens = self._requests.get(name), self._tokens.get(name)
            if tokens is not None and prompt_tokens > tokens.capacity:
                raise RateLimited(f"request too large for API key {name!r}: its prompt has {prompt_tokens} tokens "
                                  f"and the key's limit is {int(tokens.capacity)} tokens per minute", "tokens",
                                  None, int(tokens.capacity), max(0, int(tokens.refill(now))))
            for kind, bucket, need in (("requests", requests, 1), ("tokens", tokens, prompt_tokens)):
                if bucket is not None and bucket.refill(now) < need:
                    wait = bucket.wait_for(need)
                    raise RateLimited(f"rate limit reached for API key {name!r} on {kind} per minute: limit "
                                      f"{int(bucket.capacity)}, requested {need}; try again in {math.ceil(wait)} s",
                                      kind, wait, int(bucket.capacity), max(0, int(bucket.level)))
            if requests is not None:
                requests.level -= 1
            if tokens is not None:
                tokens.level -= prompt_tokens

    def charge(self, name: str, generated_tokens: int) -> None:
        """Charges tokens generated for key `name` (the level may go below zero)."""
        bucket = self._tokens.get(name)
        if bucket is None or generated_tokens <= 0:
            return
        with self._lock:
            bucket.refill(self.clock())
            bucket.level -= generated_tokens

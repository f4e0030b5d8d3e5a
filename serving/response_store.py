"""Stored responses (`store: true`): what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

Kept in this process's memory, bounded twice: by bytes (the JSON size of each response and the conversation it
continues; the oldest go first) and by age. A response is visible only to the API key that made it. A server
restart, or eviction, forgets them: a continuation then gets a 404 naming `previous_response_id`, as vLLM's.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as the client got it
    # The input items it answered, earlier turns included and instructions left out (a continuation does not
    # inherit them, as with OpenAI's): with its output items, the start of the next turn's conversation.
    input_items: list[dict]
    key: str  # the API key name that made it
    size: int  # bytes counted against the store's bound
    expires: float  # monotonic deadline


class ResponseStore:
    """Stored responses by id, at most `max_bytes` of them in all, each for at most `ttl_s`. max_bytes 0: off."""

    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()  # replies are built in worker threads

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def put(self, response: dict, input_items: list[dict], key: str) -> bool:
        """Keeps a finished response; False when the store is off or it alone is over the bound."""
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if not self.enabled or size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, input_items, key, size,
                                                           self.clock() + self.ttl_s)
            self._bytes += size
            self._evict()
        return True

    def get(self, response_id: str, key: str) -> StoredResponse | None:
        """The stored response, if it is there, unexpired and `key`'s."""
        with self._lock:
            self._evict()
            entry = self._entries.get(response_id)
        return entry if entry is not None and entry.key == key else None

    def delete(self, response_id: str, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.key != key:
                return False
            self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def _evict(self) -> None:
        """The expired, then the oldest until the rest fit (entries are in insertion order, so by age)."""
        now = self.clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires > now and self._bytes <= self.max_bytes:
                return
            self._drop(oldest_id)

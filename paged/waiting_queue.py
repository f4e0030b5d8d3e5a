"""The scheduler's waiting queue: first come, first served within a tenant, round-robin across tenants.

A tenant is whoever the request is accounted to (the server's API key name; None for offline use). With one
tenant this is a plain FIFO. With several, admission takes one request from each tenant in turn, so one
tenant's 1,024-prompt batch queues behind nobody's single request: it waits for its own turns. Preempted
requests go back in front of everyone (they already held their turn).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from paged.request import Request


class WaitingQueue:
    def __init__(self):
        self._resumed: deque[Request] = deque()  # preempted, ahead of every tenant's queue
        # tenant -> its waiting requests in arrival order; the first tenant is the next one served
        self._tenants: OrderedDict[str | None, deque[Request]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        yield from self._resumed
        for queue in self._tenants.values():
            yield from queue

    def __contains__(self, request: Request) -> bool:
        return any(r is request for r in self)

    def num_waiting(self, tenant: str | None) -> int:
        queue = self._tenants.get(tenant)
        return len(queue) if queue is not None else 0

    def append(self, request: Request) -> None:
        """Queues a new request behind its tenant's others."""
        queue = self._tenants.get(request.tenant)
        if queue is None:
            queue = self._tenants[request.tenant] = deque()
        queue.append(request)
        self._size += 1

    def appendleft(self, request: Request) -> None:
        """Puts a preempted request ahead of everything."""
        self._resumed.appendleft(request)
        self._size += 1

    def peek(self) -> Request:
        """The request admission takes next."""
        if self._resumed:
            return self._resumed[0]
        return next(iter(self._tenants.values()))[0]

    def popleft(self) -> Request:
        """Takes the next request; its tenant's turn passes to the next tenant."""
        if self._resumed:
            self._size -= 1
            return self._resumed.popleft()
        tenant, queue = next(iter(self._tenants.items()))
        request = queue.popleft()
        if queue:
            self._tenants.move_to_end(tenant)
        else:
            del self._tenants[tenant]
        self._size -= 1
        return request

    def remove(self, request: Request) -> None:
        if any(r is request for r in self._resumed):
            self._resumed.remove(request)
        else:
            queue = self._tenants[request.tenant]
            queue.remove(request)
            if not queue:
                del self._tenants[request.tenant]
        self._size -= 1

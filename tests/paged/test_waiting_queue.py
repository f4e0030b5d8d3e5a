"""The waiting queue: FIFO within a tenant, one request per tenant in turn, preempted requests first."""

from __future__ import annotations

from paged.request import Request
from paged.sampling_params import SamplingParams
from paged.waiting_queue import WaitingQueue


def _request(name, tenant=None):
    return Request(name, None, [1, 2], SamplingParams(), seed=0, detokenizer=None, tenant=tenant)


def _drain(queue):
    out = []
    while queue:
        assert queue.peek() is queue.peek()
        head = queue.peek()
        assert queue.popleft() is head
        out.append(head.request_id)
    return out


def test_one_tenant_is_first_come_first_served():
    queue = WaitingQueue()
    for i in range(5):
        queue.append(_request(f"r{i}"))
    assert len(queue) == 5 and [r.request_id for r in queue] == [f"r{i}" for i in range(5)]
    assert _drain(queue) == ["r0", "r1", "r2", "r3", "r4"] and len(queue) == 0


def test_tenants_take_turns_and_a_batch_waits_for_its_own():
    queue = WaitingQueue()
    for i in range(6):
        queue.append(_request(f"a{i}", "batch"))
    queue.append(_request("b0", "single"))
    queue.append(_request("c0", "other"))
    queue.append(_request("b1", "single"))
    assert queue.num_waiting("batch") == 6 and queue.num_waiting("single") == 2 and queue.num_waiting("x") == 0
    assert _drain(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_preempted_requests_go_first_and_remove_finds_anything():
    queue = WaitingQueue()
    a, b, c = _request("a", "x"), _request("b", "y"), _request("c", "x")
    for r in (a, b, c):
        queue.append(r)
    resumed = _request("resumed", "y")
    queue.appendleft(resumed)
    assert queue.peek() is resumed and resumed in queue
    queue.remove(b)
    assert b not in queue and len(queue) == 3
    queue.remove(resumed)
    assert _drain(queue) == ["a", "c"]

from __future__ import annotations

import pytest

from vllm.v1.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
)

from ..conftest import make_request


def test_fcfs_order_prepend_remove():
    q = FCFSRequestQueue()
    a, b, c = (make_request([i + 1]) for i in range(3))
    for r in (a, b, c):
        q.add_request(r)
    assert q.peek_request() is a and q.pop_request() is a
    q.prepend_request(a)  # a preempted request goes back to the front
    q.remove_request(b)
    assert list(q) == [a, c] and len(q) == 2
    other = FCFSRequestQueue()
    other.add_request(b)
    q.prepend_requests(other)
    assert list(q) == [b, a, c]
    q.remove_requests([a, c])
    assert list(q) == [b]


def test_priority_order_and_lazy_removal():
    q = PriorityRequestQueue()
    late_high = make_request([1], priority=0, arrival_time=5.0)
    early_low = make_request([2], priority=3, arrival_time=1.0)
    early_high = make_request([3], priority=0, arrival_time=1.0)
    for r in (late_high, early_low, early_high):
        q.add_request(r)
    assert list(q) == [early_high, late_high, early_low]
    q.remove_request(late_high)
    assert q.pop_request() is early_high
    assert q.pop_request() is early_low
    assert not q
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(ValueError):
        q.remove_request(late_high)

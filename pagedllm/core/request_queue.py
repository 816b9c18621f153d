"""Waiting queues: first-come-first-served and priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from pagedllm.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a new request."""

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Re-enqueue a preempted request so it runs again before newer arrivals."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to schedule (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove an arbitrary request (abort); O(n), only on the abort path."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(RequestQueue):
    """A heap ordered by ``Request.__lt__`` (priority, arrival time, id)."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def add_preempted(self, request: Request) -> None:
        # Its (priority, arrival) key already places it ahead of newer arrivals.
        heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")

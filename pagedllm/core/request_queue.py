"""Waiting queues: first-come-first-served, priority (lower value first, then arrival)
and throughput (longest ``max_tokens`` first, then arrival)."""

from __future__ import annotations

import bisect
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from itertools import chain, islice

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


# A LongestFirstQueue entry: (-tokens it will still generate, arrival time, request id,
# tokens to compute, request).  The first three are the order (request ids are unique,
# so tuples never compare further); the counts are taken when the request is queued.
_Entry = tuple[int, float, str, int, Request]
# The first field of a request whose length is not known (``Request.length_known``):
# ahead of every other, and due now whatever the horizon (no pacing plans with it).
DUE_NOW = -(1 << 60)


def _key(request: Request) -> int:
    if not request.length_known:
        return DUE_NOW
    return request.num_output_tokens - request.max_tokens


def _entry(request: Request) -> _Entry:
    return (_key(request), request.arrival_time, request.request_id, request.num_tokens,
            request)


class LongestFirstQueue(RequestQueue):
    """The throughput policy's queue: longest ``max_tokens`` first, ties by arrival then
    request id (the longest-processing-time rule for makespan); preempted requests go
    ahead of all of them, the latest preempted first, as in ``FCFSQueue``.  A request
    whose length is not known (it may stop at EOS, a stop token or string) goes first,
    by arrival, and is due now: with only such requests this is FCFS.

    ```
    _preempted (deque, LIFO) ──► _sorted (list, ascending key = longest first)
    ```

    Besides the order it keeps what the pacing rule needs (``paced_rate``): each
    entry's tokens to compute and remaining output, and their total, so the scheduler's
    per-step scan reads tuples instead of requests and can stop early.  The counts are
    taken when a request is queued (a waiting request's tokens rarely change: a token
    sampled by the step in flight when it was preempted, a beam step).  ``_sorted`` is
    kept sorted by ``bisect``: O(log n) compares and one memmove per insert or pop,
    cheap at the thousands of requests an offline batch holds.
    """

    def __init__(self) -> None:
        self._preempted: deque[_Entry] = deque()
        self._sorted: list[_Entry] = []
        self._tokens = 0  # sum of the entries' tokens to compute

    def add(self, request: Request) -> None:
        e = _entry(request)
        bisect.insort(self._sorted, e)
        self._tokens += e[3]

    def add_preempted(self, request: Request) -> None:
        e = _entry(request)
        self._preempted.appendleft(e)
        self._tokens += e[3]

    def peek(self) -> Request:
        return (self._preempted[0] if self._preempted else self._sorted[0])[4]

    def pop(self) -> Request:
        e = self._preempted.popleft() if self._preempted else self._sorted.pop(0)
        self._tokens -= e[3]
        return e[4]

    def remove(self, request: Request) -> None:
        for e in self._preempted:  # few: preempted requests run again first
            if e[4] is request:
                self._preempted.remove(e)
                break
        else:
            q = self._sorted
            i = bisect.bisect_left(q, (_key(request), request.arrival_time,
                                       request.request_id))
            if i >= len(q) or q[i][4] is not request:
                # Its output count changed since it was queued (a beam): look it up.
                i = next(k for k, x in enumerate(q) if x[4] is request)
            e = q.pop(i)
        self._tokens -= e[3]

    def longest_remaining_output(self) -> int:
        """The most tokens any waiting request of known length will still generate
        (0 when there is none)."""
        q = self._sorted
        i = bisect.bisect_left(q, (DUE_NOW + 1,))  # past the requests of unknown length
        best = -q[i][0] if i < len(q) else 0
        for e in self._preempted:
            if e[0] != DUE_NOW:
                best = max(best, -e[0])
        return best

    def paced_rate(self, running_tokens: int, horizon: int, limit: int,
                   running_slack: int = 1, scan: int = 512) -> int:
        """The smallest whole prefill rate (tokens per step) that starts every request
        in time: ``max(ceil(P / max(1, s)), max over j of ceil((P + S_j) / max(1, L -
        o_j)))`` with ``P = running_tokens`` (running requests' unfinished prompt chunks,
        computed first), ``s = running_slack`` (steps before the first of them must
        decode), ``L = horizon``, ``S_j`` the tokens of the first ``j`` requests in
        queue order and ``o_j`` the j-th's remaining output (see
        ``core/prefill_pacing.py``).  Only the first ``scan`` requests are read (a
        bounded per-step cost; later ones have the latest deadlines), and the scan stops
        once the rate reaches ``limit`` (more is never granted) or no later request can
        raise it.
        """
        total = running_tokens
        need = -(-total // running_slack) if running_slack > 1 else total
        bound = running_tokens + self._tokens  # no S_j exceeds this
        for neg_o, _, _, n, _ in islice(self._preempted, scan):
            total += n
            slack = horizon + neg_o  # steps left before it must start decoding
            x = -(-total // slack) if slack > 1 else total
            if x > need:
                need = x
        if need >= limit:
            return need
        for neg_o, _, _, n, _ in islice(self._sorted, max(0, scan - len(self._preempted))):
            total += n
            slack = horizon + neg_o
            if slack > 1:
                # Later requests have no less slack: none can need more than this.
                if bound <= need * slack:
                    break
                x = -(-total // slack)
            else:
                x = total
            if x > need:
                need = x
                if need >= limit:
                    break
        return need

    def __len__(self) -> int:
        return len(self._preempted) + len(self._sorted)

    def __iter__(self) -> Iterator[Request]:
        return (e[4] for e in chain(self._preempted, self._sorted))


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "throughput":
        return LongestFirstQueue()
    raise ValueError("scheduling_policy must be 'fcfs', 'priority' or 'throughput', "
                     f"got {policy!r}")

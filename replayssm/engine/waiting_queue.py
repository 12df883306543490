"""The scheduler's waiting queue: one FIFO per client request, admitted in fair order."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping

from replayssm.engine.request import Request


class WaitingQueue:
    """Waiting requests grouped by ``Request.parent_id``, the client request that submitted them
    (the server's request id of one HTTP request's prompts x n choices; requests added without
    one share the group ``None``).

    Within a parent: arrival order, with preempted requests back at the front. Across parents,
    ``next_fair`` picks the head of the parent that holds the fewest running requests, the older
    head first on a tie. A request of 1,024 choices therefore does not hold back a one-choice
    request behind all of its choices: the small one is the next admitted. With one parent (the
    offline API) the order is plain first-come-first-served.

        parent  running  waiting (front first)
        A       4        a5 a6 a7 ...        next_fair -> b0 (B runs fewer)
        B       0        b0
    """

    def __init__(self) -> None:
        self._by_parent: dict[Hashable, deque[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for queue in self._by_parent.values():
            yield from queue

    def parents(self) -> Iterator[Hashable]:
        """Parents with at least one waiting request."""
        return iter(self._by_parent)

    def append(self, request: Request) -> None:
        self._by_parent.setdefault(request.parent_id, deque()).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        self._by_parent.setdefault(request.parent_id, deque()).appendleft(request)
        self._len += 1

    def remove(self, request: Request) -> None:
        queue = self._by_parent[request.parent_id]
        if queue[0] is request:
            queue.popleft()  # admission takes heads: O(1)
        else:
            queue.remove(request)
        if not queue:
            del self._by_parent[request.parent_id]
        self._len -= 1

    def next_fair(self, num_running: Mapping[Hashable, int]) -> Request | None:
        """The head of the parent with the fewest running requests (then the oldest head)."""
        best, best_key = None, None
        for parent, queue in self._by_parent.items():
            key = (num_running.get(parent, 0), queue[0].arrival)
            if best_key is None or key < best_key:
                best, best_key = queue[0], key
        return best

"""Sequences waiting for admission: by priority with aging, and fair between tenants.

Each tenant keeps its own queue ordered by ``priority * aging_steps - arrival_step``: a request
gains one priority level for every ``aging_steps`` steps it waits, so an old low-priority request
eventually passes new high-priority ones and nothing starves. The next admission goes to the
tenant running the fewest sequences for its share, so tenants with equal shares get equal slots
(and so equal decode tokens) while both have work waiting; between tenants equally served, to the
one whose first request has the highest aged priority.

Priority orders a tenant's own work, not one tenant against another: a job's priority is the
tenant's choice, and if it outranked shares, any tenant could take every seat by asking for 9.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Iterator

from worker.engine.request import Sequence


class WaitingQueue:
    def __init__(self, aging_steps: int):
        self.aging_steps = aging_steps
        self.shares: dict[str, float] = {}  # tenant -> weight, 1.0 when not set
        self._queues: dict[str, list[tuple[tuple[int, int], Sequence]]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for q in self._queues.values() for _, seq in q)

    def __contains__(self, seq: Sequence) -> bool:
        return any(s is seq for _, s in self._queues.get(seq.request.tenant, ()))

    def add(self, seq: Sequence) -> None:
        key = (-(seq.priority * self.aging_steps - seq.request.arrival_step), seq.seq_id)
        bisect.insort(self._queues.setdefault(seq.request.tenant, []), (key, seq))

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[seq.request.tenant]
        queue.pop(next(i for i, (_, s) in enumerate(queue) if s is seq))

    def level(self, seq: Sequence, step: int) -> int:
        """Aged priority: one level more for every ``aging_steps`` steps waited."""
        return seq.priority + (step - seq.request.arrival_step) // self.aging_steps

    def next(self, step: int, running: Iterable[Sequence]) -> Sequence | None:
        """The sequence to admit next (it stays queued until ``remove``)."""
        load = Counter(s.request.tenant for s in running)
        best, best_rank = None, None
        for tenant, queue in self._queues.items():
            if not queue:
                continue
            key, head = queue[0]
            rank = (load[tenant] / self.shares.get(tenant, 1.0), -self.level(head, step), key)
            if best_rank is None or rank < best_rank:
                best, best_rank = head, rank
        return best

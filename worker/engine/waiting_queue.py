"""Sequences waiting for admission: a queue per tenant, by priority with aging, and seats by weight.

Each tenant keeps its own queue ordered by ``priority * aging_steps - arrival_step``: a request
gains one priority level for every ``aging_steps`` steps it waits, so an old low-priority request
eventually passes new high-priority ones and nothing starves. Which tenant admits next is the
scheduler's turn order (tokens by weight: worker/engine/fair_share.py); what this queue adds is
the seats: a tenant may take a free running seat only while the seats left still cover what every
other tenant asking for seats is owed (its weight's share of the seats, less those it holds), so a
tenant that came first cannot keep every seat when another arrives. A tenant asks for a seat when
its turn finds its running sequences served and a sequence waiting; one whose running work takes
all its turns (a long prefill) is not asking, and its share of the seats is not held back for it.

Interactive and batch sequences wait apart (a queue per class and tenant): the scheduler serves the
interactive class first (worker/engine/scheduler.py), and seats are shared by weight within a class.

Priority orders a tenant's own work, not one tenant against another: a job's priority is the
tenant's choice, and if it outranked shares, any tenant could take every seat by asking for 9.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator

from worker.engine.request import Sequence


class WaitingQueue:
    def __init__(self, aging_steps: int, shares: dict[str, float] | None = None):
        self.aging_steps = aging_steps
        self.shares = {} if shares is None else shares  # tenant -> weight, 1.0 when not set
        self._queues: dict[tuple[bool, str], list[tuple[tuple[int, int], Sequence]]] = {}  # (interactive, tenant)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for q in self._queues.values() for _, seq in q)

    def __contains__(self, seq: Sequence) -> bool:
        return any(s is seq for _, s in self._queues.get(_lane(seq), ()))

    def add(self, seq: Sequence) -> None:
        key = (-(seq.priority * self.aging_steps - seq.request.arrival_step), seq.seq_id)
        bisect.insort(self._queues.setdefault(_lane(seq), []), (key, seq))

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[_lane(seq)]
        queue.pop(next(i for i, (_, s) in enumerate(queue) if s is seq))

    def tenants(self, interactive: bool = False) -> set[str]:
        """The tenants with sequences of the class waiting."""
        return {t for (c, t), q in self._queues.items() if q and c == interactive}

    def head(self, tenant: str, interactive: bool = False) -> Sequence | None:
        """``tenant``'s sequence of the class to admit next (it stays queued until ``remove``)."""
        queue = self._queues.get((interactive, tenant))
        return queue[0][1] if queue else None

    def may_seat(self, tenant: str, seats: Counter[str], free: int, total: int, asking: set[str],
                 interactive: bool = False) -> bool:
        """Whether ``tenant`` may take one of ``free`` running seats (of ``total``; ``seats`` held per
        tenant) beside the tenants ``asking`` for seats, all in one class."""
        if free <= 0:
            return False
        others = [t for t in asking if t != tenant and self._queues.get((interactive, t))]
        if not others:
            return True
        active = {t for t, n in seats.items() if n} | set(others) | {tenant}
        weight = sum(self.shares.get(t, 1.0) for t in active)
        owed = sum(max(0, int(total * self.shares.get(t, 1.0) / weight) - seats[t]) for t in others)
        return free - 1 >= owed


def _lane(seq: Sequence) -> tuple[bool, str]:
    return seq.request.interactive, seq.request.tenant

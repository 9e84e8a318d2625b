"""Sequences waiting for admission: a queue per tenant, by deadline, then priority with aging, and
seats by weight.

Each tenant keeps its own queue ordered by its job's deadline first (``Request.deadline``, the end of
its completion window, in slots of ``DEADLINE_SLOT`` seconds: jobs whose windows end in the same slot
have the same deadline; a request without one comes after those with one), then by
``priority * aging_steps - arrival_step``: a request gains one priority level for every ``aging_steps``
steps it waits, so an old low-priority request eventually passes new high-priority ones of the same
deadline and nothing starves. Deadlines cannot starve anything either: they are absolute, so a job
submitted later with the same window ends later, and every waiting job's deadline comes first in time.

A job's tail (``worker.engine.job_tail``): when the waiting sequences of the job at a queue's head
number at most ``tail_seats`` (the running batch's seats), they fit in the batch, and the head gives the
one of them expected to run longest first; they all share the job's place in the queue. Which tenant admits next is the
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
import math
from collections import Counter
from collections.abc import Iterator

from worker.engine.job_tail import JobLengths
from worker.engine.request import Sequence

DEADLINE_SLOT = 900.0  # seconds: deadlines in one slot are the same deadline (priority orders them)


class WaitingQueue:
    def __init__(self, aging_steps: int, shares: dict[str, float] | None = None, tail_seats: int = 0,
                 lengths: JobLengths | None = None):
        """``tail_seats``: a job whose waiting sequences are at most this many starts its longest first,
        as ``lengths`` expects them (0 or no ``lengths``: in queue order)."""
        self.aging_steps = aging_steps
        self.shares = {} if shares is None else shares  # tenant -> weight, 1.0 when not set
        self.tail_seats = tail_seats if lengths is not None else 0
        self.lengths = lengths
        # (interactive, tenant) -> ((deadline slot, aged priority, seq id), sequence), in order
        self._queues: dict[tuple[bool, str], list[tuple[tuple[float, int, int], Sequence]]] = {}
        self._jobs: dict[str, list[Sequence]] = {}  # a job's waiting sequences, in arrival order (with a tail)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for q in self._queues.values() for _, seq in q)

    def __contains__(self, seq: Sequence) -> bool:
        return any(s is seq for _, s in self._queues.get(_lane(seq), ()))

    def add(self, seq: Sequence) -> None:
        deadline = seq.request.deadline
        slot = math.floor(deadline / DEADLINE_SLOT) if deadline is not None else math.inf
        key = (slot, -(seq.priority * self.aging_steps - seq.request.arrival_step), seq.seq_id)
        bisect.insort(self._queues.setdefault(_lane(seq), []), (key, seq))
        if self.tail_seats and seq.request.job is not None:
            self._jobs.setdefault(seq.request.job, []).append(seq)

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[_lane(seq)]
        queue.pop(next(i for i, (_, s) in enumerate(queue) if s is seq))
        job = seq.request.job
        if self.tail_seats and job is not None:
            waiting = self._jobs[job]
            waiting.pop(next(i for i, s in enumerate(waiting) if s is seq))
            if not waiting:
                del self._jobs[job]

    def tenants(self, interactive: bool = False) -> set[str]:
        """The tenants with sequences of the class waiting."""
        return {t for (c, t), q in self._queues.items() if q and c == interactive}

    def has(self, tenant: str, interactive: bool = False) -> bool:
        """Whether ``tenant`` has a sequence of the class waiting."""
        return bool(self._queues.get((interactive, tenant)))

    def head(self, tenant: str, interactive: bool = False) -> Sequence | None:
        """``tenant``'s sequence of the class to admit next (it stays queued until ``remove``)."""
        queue = self._queues.get((interactive, tenant))
        if not queue:
            return None
        seq = queue[0][1]
        job = seq.request.job
        if self.tail_seats and job is not None and len(tail := self._jobs[job]) <= self.tail_seats:
            expected = self.lengths.expected_left
            return max((s for s in tail if _lane(s) == _lane(seq)), key=expected)  # ties: the first to come
        return seq

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

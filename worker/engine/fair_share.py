"""Whose turn it is within a step: the tenant furthest behind its weight's share of the tokens.

Weighted fair queueing over tokens. A tenant's clock is the tokens it was given divided by its
weight; the scheduler always serves the tenant whose clock is lowest, one turn at a time, and a
turn takes at most the tenant's share of the step's budget (``budget * weight / weights of the
tenants with work``) while another tenant has work, so a long prefill is cut into chunks that
leave room for the others, and with the whole budget when it is alone (work-conserving). Decodes
and prefill chunks count alike: a token is a token.

Carried across steps, the clocks are kept as a lead: how far each tenant that still had work when
the budget ran out was ahead of the slowest of them. A tenant that got more than its share
(a chunk's rounding, a turn taken just before the budget ran out) yields at the start of the
next step. A tenant that was served everything it could take (its queue ran dry, no seat, no KV
room) carries nothing, neither credit nor debt: leaving room unused is not a claim on later
steps, or a tenant idle for an hour would then take every step for an hour.

Priority plays no part here: it orders a tenant's own sequences (the scheduler's queues), never
one tenant against another.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable


class TokenShares:
    """The tenants' weights (1.0 unless set) and the leads carried from one step to the next."""

    def __init__(self, weights: dict[str, float]):
        self.weights = weights
        self.lead: dict[str, float] = {}  # tokens / weight ahead of the slowest tenant left waiting

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def turns(self, tenants: Iterable[str], budget: int, seats: Counter[str]) -> Turns:
        return Turns(self, tenants, budget, seats)


class Turns:
    """One step's order of service. ``next`` is the tenant to serve; the scheduler advances its
    ``clock`` by ``rate`` (1 / weight) per token it gives it, or marks it ``done`` when it has
    nothing more it can run."""

    def __init__(self, shares: TokenShares, tenants: Iterable[str], budget: int, seats: Counter[str]):
        self._shares, self._seats = shares, seats
        self.clock = {t: shares.lead.get(t, 0.0) for t in tenants}
        self.rate = {t: 1.0 / shares.weight(t) for t in self.clock}
        total = sum(map(shares.weight, self.clock))
        self._quantum = {t: math.ceil(budget * shares.weight(t) / total) for t in self.clock}
        self._heap = [self._key(t) for t in self.clock]
        heapq.heapify(self._heap)

    def _key(self, tenant: str) -> tuple[float, float, str]:
        """Lowest clock first; between equal clocks, fewest running sequences for the weight."""
        return self.clock[tenant], self._seats[tenant] * self.rate[tenant], tenant

    def next(self) -> str | None:
        heap = self._heap
        while heap:
            clock, _, tenant = heap[0]
            if clock == self.clock[tenant]:
                return tenant
            heapq.heapreplace(heap, self._key(tenant))  # served since it was filed: file it again
        return None

    def cap(self, tenant: str, budget: int) -> int:
        """The most tokens one turn of ``tenant`` may take from what is left of the budget."""
        return min(budget, self._quantum[tenant]) if len(self._heap) > 1 else budget

    def done(self, tenant: str) -> None:
        """``tenant``, the one ``next`` named, can take nothing more this step."""
        heapq.heappop(self._heap)

    def end(self) -> None:
        """Carry the lead of the tenants left waiting when the budget ran out; the others start level."""
        floor = min((self.clock[t] for *_, t in self._heap), default=0.0)
        self._shares.lead = {t: self.clock[t] - floor for *_, t in self._heap if self.clock[t] > floor}

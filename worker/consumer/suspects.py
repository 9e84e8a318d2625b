"""Crash suspects, all of it: the requests that were running when a worker died run again apart from
other work, in groups halved at each death, until a request dies alone (a strike) or runs long
enough alone to be cleared. The request's standing from its row (``standing_after``, ``poison_reason``),
the groups (``Suspects``), and the worker's side (``CrashSuspects``: telling the ledger what runs before
each step, starting and watching groups, logging deaths); the engine steps an isolated group alone
(``Request.isolated``). docs/engine.md says why.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from worker.consumer.database_health import DOWN, DatabaseHealth
from worker.consumer.ledger import Claim, Ledger
from worker.consumer.outcomes import Pending
from worker.engine.engine import Engine
from worker.engine.request import Request
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.worker")

DEATHS_INTERVAL = 30.0  # seconds between readings of the rate of worker deaths
DEATHS_WINDOW = 3600.0  # ... over this many seconds
CRASH_LOOP_DEATHS = 3  # deaths of a host's workers in DEATHS_WINDOW that make the log line an error


@dataclass(frozen=True)
class Standing:
    """Where a request stands as this delivery begins."""

    suspect: int  # 0: innocent; k: runs only apart from other work, in a group of at most k suspects
    strikes: int  # deaths of its worker in a row while it ran alone, with no progress in between


def standing_after(claim: Claim, checkpointed_tokens: int) -> Standing:
    """The request's standing once this delivery begins from ``checkpointed_tokens`` output tokens."""
    if not claim.crashed:  # handed back, waiting in a dead worker's window, or a first delivery
        return Standing(claim.suspect, claim.strikes)
    if checkpointed_tokens > claim.progress:
        return Standing(0, 0)  # it made progress: whatever killed its worker, it was not this alone
    running = max(1, claim.death.running if claim.death is not None else 1)
    if running == 1:
        return Standing(1, claim.strikes + 1)  # its worker died running it alone
    return Standing((running + 1) // 2, claim.strikes)  # a group of suspects: halves


def poison_reason(claim: Claim, standing: Standing, limit: int) -> str | None:
    if standing.strikes < limit:
        return None
    return (f"it killed its worker {standing.strikes} times running alone (apart from any other request), with "
            f"no progress checkpointed in between (max_delivery_attempts {limit}); last error: "
            f"{claim.last_error or 'none recorded'}")


def suspect_group(classes: list[int]) -> list[int]:
    """Which of the waiting suspects (their size classes, in arrival order) run together next, by
    index: as many as the smallest class allows, the smallest classes first (each member's class is
    at least the group's size), the oldest first among equals."""
    if not classes:
        return []
    order = sorted(range(len(classes)), key=lambda i: (classes[i], i))
    return sorted(order[:classes[order[0]]])


CLEAR_TOKENS = 16  # tokens a suspect generates alone to be cleared, when checkpoints are off


class Held(Protocol):
    """A delivery the worker holds (``worker.consumer.loop.Inflight``)."""

    request: Request
    suspect: int


def generated(request: Request) -> int:
    """Output tokens a request has, of all its samples (resumed ones included)."""
    if request.sequences:
        return sum(seq.num_output_tokens for seq in request.sequences)
    return sum(len(out) for out in request.resume_output_ids)


@dataclass
class Group:
    """The suspects running alone now: engine id -> output tokens each had when the group began."""

    members: dict[str, int]
    size_class: int
    steps: int = 0  # engine steps it has run


@dataclass
class Suspects:
    clear_tokens: int
    waiting: list = field(default_factory=list)  # ``Held`` suspects not yet in the engine, in arrival order
    group: Group | None = None
    owed: int = 0  # ordinary steps the others get before the next group

    def wait(self, item: Held) -> None:
        self.waiting.append(item)

    def due(self, others_waiting: bool) -> bool:
        """Whether a group may start now: none running, suspects waiting, the others' share given."""
        return self.group is None and bool(self.waiting) and (self.owed <= 0 or not others_waiting)

    def take_group(self) -> list:
        """The next group (``suspect_group``), taken out of ``waiting``."""
        picked = suspect_group([item.suspect for item in self.waiting])
        chosen, taken = [self.waiting[i] for i in picked], set(picked)
        self.waiting = [item for i, item in enumerate(self.waiting) if i not in taken]
        return chosen

    def begin(self, items: list) -> None:
        self.group = Group({item.request.request_id: generated(item.request) for item in items},
                           min(item.suspect for item in items))

    def stepped(self) -> None:
        """After each engine step."""
        if self.group is not None:
            self.group.steps += 1
        elif self.owed > 0:
            self.owed -= 1

    def cleared(self, live: dict[str, Request]) -> list[str]:
        """Members that generated ``clear_tokens`` alone; ``live``: the engine's requests by id."""
        if self.group is None:
            return []
        return [rid for rid, start in self.group.members.items()
                if rid in live and generated(live[rid]) - start >= self.clear_tokens]

    def leave(self, request_ids) -> bool:
        """Members out of the group (cleared, finished, failed, dropped); whether the group is over."""
        if self.group is None:
            return False
        for rid in request_ids:
            self.group.members.pop(rid, None)
        if self.group.members:
            return False
        self.owed, self.group = self.group.steps, None
        return True

    @property
    def held(self) -> int:
        """Suspects waiting or running."""
        return len(self.waiting) + (len(self.group.members) if self.group else 0)


class CrashSuspects:
    """The worker's side of crash suspects, over its engine, ledger and held deliveries (``inflight``: the
    worker's own dict of ``Held``, by engine id)."""

    def __init__(self, name: str, clear_tokens: int, engine: Engine, ledger: Ledger,
                 call: Callable, database: DatabaseHealth, metrics: WorkerMetrics, inflight: dict):
        self.name = name
        self.state = Suspects(clear_tokens)
        self.engine = engine
        self.ledger = ledger
        self._ledger = call  # a ledger call, or ``DOWN`` while the database does not answer
        self.database = database
        self.metrics = metrics
        self.inflight = inflight
        self._deaths_seen: dict[int, None] = {}  # ids of the deaths logged, the latest last
        self._pause_at_start: list[int] | None = None  # the others, paused when a group's first step starts
        self._marked: set[str] = set()  # requests said started in the database by ``on_start`` (ids)
        self._next_deaths = 0.0

    def wait(self, item: Held) -> None:
        """A suspect runs apart, in a group of its own (``start_next``)."""
        self.state.wait(item)

    def on_start(self, request_ids: list[str]) -> None:
        """Before the engine's step that first runs these: say so, so that a crash in it counts. Before
        the first step of a group of suspects, the others stop running in the same transaction: a death
        is charged to the others until then, to the group from then on, never to nobody.

        One write says it for the requests queued in the scheduler too (not those waiting for a grammar,
        nor while a group runs alone): they start in the next steps, which then need none. A transaction
        a step was most of the job path's cost at a device's pace (benchmarks/HISTORY.md, "The job path
        at GPU speed"); the price is that a death before their first step counts them as running, so
        they run again as suspects (in groups, more slowly) though they had not run."""
        pause, self._pause_at_start = self._pause_at_start, None
        if pause:
            ids = [int(r) for r in request_ids if r in self.inflight]
            if ids and self.database.ready() and self._ledger(self.ledger.paused, pause, ids) is not DOWN:
                self._marked.difference_update(str(r) for r in pause)
                self._marked.update(str(r) for r in ids)
            return
        fresh = [r for r in request_ids if r in self.inflight and r not in self._marked]
        if not fresh or not self.database.ready():
            return
        ahead = [] if self.state.group is not None else [
            rid for rid in self.engine.queued_to_start()
            if rid in self.inflight and rid not in self._marked and not self.inflight[rid].suspect]
        if self._ledger(self.ledger.started, [int(r) for r in fresh + ahead]) is not DOWN:
            self._marked.intersection_update(self.inflight)  # those gone since
            self._marked.update(fresh + ahead)

    def may_say_started(self) -> bool:
        """Whether requests claimed now may be said running before their first step, as ``on_start`` says
        the queued ones: not while a group of suspects runs alone (the others are paused). The loop starts
        no group while such a claim is under way."""
        return self.state.group is None and self._pause_at_start is None

    def said_ahead(self, request_ids: list[str]) -> None:
        """These were said running with their claim (``EngineWorker._claim``): their first step writes nothing."""
        self._marked.update(request_ids)

    def said_started(self) -> list[int]:
        """The requests the database holds as running here: run by a step, or said ahead of their first."""
        return [int(rid) for rid, item in self.inflight.items() if item.request.started or rid in self._marked]

    def start_next(self, stopping: bool, add: Callable[[Held, list[Pending]], None],
                   record: Callable[[list[Pending]], None]) -> None:
        """Start the next group of suspects alone in the engine, when one is due and the database can
        be told that the others are paused meanwhile (as its first step starts: ``on_start``)."""
        s = self.state
        s.waiting = [item for item in s.waiting if self.inflight.get(item.request.request_id) is item]
        self._end_group_if_over()
        if stopping or not s.due(self.engine.has_unfinished()) or not self.database.ready():
            return
        others = self.said_started()
        self._pause_at_start = others
        group = s.take_group()
        log.info("worker %s: running %d suspect(s) of size class %d alone (they were running when a worker died); "
                 "%d other requests wait meanwhile", self.name, len(group), min(i.suspect for i in group),
                 len(others))
        self.metrics.suspect_groups.inc()
        failures: list[Pending] = []
        for item in group:
            item.request.isolated = True
            add(item, failures)
        s.begin([item for item in group if item.request.request_id in self.inflight])
        record(failures)
        self._end_group_if_over()

    def after_step(self) -> None:
        """After each step: clear the members that ran long enough alone; end the group when none is left."""
        s = self.state
        s.stepped()
        if s.group is None:
            return
        cleared = s.cleared(self.engine.requests)
        last = set(cleared) >= {rid for rid in s.group.members if rid in self.engine.requests}
        # the last ones keep running as the others resume (``_end_group_if_over``): only their class changes
        write = (lambda ids: self.ledger.suspect(dict.fromkeys(ids, 0))) if last else self.ledger.cleared
        if cleared and self._ledger(write, [int(rid) for rid in cleared]) is not DOWN:
            for rid in cleared:
                self.engine.release(rid)
                if rid in self.inflight:
                    self.inflight[rid].suspect = 0
        else:
            cleared = []
        self._end_group_if_over(cleared)

    def _end_group_if_over(self, cleared: list[str] = ()) -> None:
        """Members cleared, finished, failed or dropped leave the group; when none is left, the others run
        again: said before their next step (without the database they run all the same, and a death then
        is charged to none of them)."""
        s = self.state
        if s.group is not None:
            gone = [rid for rid in s.group.members if rid not in self.inflight or rid not in self.engine.requests]
            if s.leave([*cleared, *gone]):
                self._pause_at_start = None  # a group that never ran (its members refused) paused nothing
                others = [int(rid) for rid, item in self.inflight.items() if item.request.started]
                if others and self._ledger(self.ledger.started, others) is not DOWN:
                    self._marked.update(str(r) for r in others)
        self.metrics.suspects.set(s.held)

    # ---- deaths
    def note_deaths(self, claims) -> None:
        """Log each death of a worker found in these claims once, with the rate of deaths (the gauge too)."""
        deaths = {c.death.id: c.death for c in claims if c.crashed and c.death is not None
                  and c.death.id not in self._deaths_seen}
        if not deaths:
            return
        rates = self.read_death_rates()
        total = sum(rates.values()) if rates is not None else None
        for death in deaths.values():
            self._deaths_seen[death.id] = None
            host = death.worker.rpartition(":")[0] or death.worker
            on_host = rates.get(host, 0) if rates is not None else None
            crash_loop = on_host is not None and on_host >= CRASH_LOOP_DEATHS
            log.log(logging.ERROR if crash_loop else logging.WARNING,
                    "worker %s died while running %d request(s)%s: worker deaths in the last hour: %s on host %s, "
                    "%s in all; its requests that made no progress run again as suspects, apart from other work",
                    death.worker, death.running, " (crash-looping)" if crash_loop else "",
                    "?" if on_host is None else on_host, host, "?" if total is None else total)
        while len(self._deaths_seen) > 1000:
            self._deaths_seen.pop(next(iter(self._deaths_seen)))

    def death_rates_due(self) -> bool:
        return time.monotonic() >= self._next_deaths

    def read_death_rates(self) -> dict[str, int] | None:
        """host -> deaths of its workers in the last hour, read now, and set as the gauge."""
        self._next_deaths = time.monotonic() + DEATHS_INTERVAL
        rates = self._ledger(self.ledger.worker_deaths, DEATHS_WINDOW)
        if rates is DOWN:
            return None
        # this worker's own host too, at 0 when none of its workers died: a dashboard's line at 0, not "no data"
        self.metrics.set_worker_deaths({socket.gethostname(): 0, **rates})
        return rates

"""Blast radius of one inside the engine: a failed step's requests tried again in halves until the
one that fails alone is found (``probation``), and requests marked ``Request.isolated`` (a worker's
crash suspects) stepped apart from all other work (``apart``), each over the engine's KV cache
through a scheduler of their own. The engine drives it; this class only calls scheduler methods."""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("berth.engine")

Run = Callable[[SchedulerOutput, Scheduler], list]  # runs a plan of a scheduler, returns its outputs


class Isolation:
    def __init__(self, main: Scheduler, side_scheduler: Callable[[], Scheduler],
                 forget_swapped: Callable[[Sequence], None]):
        self.main = main
        self._side_scheduler = side_scheduler  # a scheduler over the engine's KV cache, stepped apart
        self._forget_swapped = forget_swapped  # drop a sequence's KV copied to host memory, if any
        self.apart = side_scheduler()  # isolated requests, over the same KV cache
        self.probation: list[list[Request]] = []  # suspects of a failed step, in groups to step alone

    def home(self, request: Request) -> Scheduler:
        """The scheduler a request's sequences belong to."""
        return self.apart if request.isolated else self.main

    def active(self, isolated_compiling: bool) -> bool:
        """While an isolated request is in the engine (scheduled, or waiting for its grammar), only they step."""
        return self.apart.has_work() or isolated_compiling

    @property
    def num_waiting(self) -> int:
        """Sequences of suspects waiting their probe step, and isolated ones waiting."""
        suspects = sum(1 for group in self.probation for r in group for seq in r.sequences if not seq.is_finished)
        return suspects + len(self.apart.waiting)

    def release(self, request: Request) -> None:
        """An isolated request rejoins the others: it runs in ordinary steps from now on (its blocks kept)."""
        request.isolated = False
        for seq in request.sequences:
            self.apart.hand_over(seq, self.main)

    def step_failed(self, scheduled: list[tuple[Sequence, int]], scheduler: Scheduler,
                    exc: Exception) -> Request | None:
        """Set the failed step's requests back to recompute; the culprit when it was alone, else None
        (they are tried again in halves)."""
        suspects = list({seq.request.request_id: seq.request for seq, _ in scheduled}.values())
        for request in suspects:
            for seq in request.sequences:
                if not seq.is_finished:
                    scheduler.set_back(seq)
                    self._forget_swapped(seq)
        if len(suspects) == 1:
            log.warning("request %s failed a step of its own: %s: %s", suspects[0].request_id, type(exc).__name__, exc)
            return suspects[0]
        log.warning("a step of %d requests failed (%s: %s); trying them again in halves to find the cause",
                    len(suspects), type(exc).__name__, exc)
        half = len(suspects) // 2
        self.probation[:0] = [suspects[:half], suspects[half:]]
        return None

    def probe_step(self, run: Run, alive: Callable[[Request], bool]) -> list:
        """A step of one group of suspects alone; those it ran rejoin the engine, the rest wait their turn."""
        group = [r for r in self.probation.pop(0) if alive(r)]
        if not group:
            return []
        probe = self._side_scheduler()
        for request in group:
            for seq in request.sequences:
                if not seq.is_finished:
                    probe.add(seq)
        plan = probe.schedule()
        outputs = run(plan, probe)
        for seq in list(probe.running):  # ran: back among the others (an isolated one: among the isolated)
            probe.hand_over(seq, self.home(seq.request))
        untried = list({seq.request.request_id: seq.request for seq in probe.waiting}.values())
        if untried:
            if plan.scheduled:
                self.probation.insert(0, untried)
            else:  # no room to try them alone: back among the others
                for request in untried:
                    for seq in request.sequences:
                        if seq.status is SeqStatus.WAITING:
                            self.home(request).add(seq)
        return outputs

    def isolated_step(self, run: Run) -> tuple[list, int]:
        """A step of the isolated requests alone, and how many others it preempted. The others keep their
        blocks while they wait, unless the isolated ones cannot get one without them: then the others'
        newest are preempted (recomputed when they run again), one at a time, until an isolated one fits."""
        apart = self.apart
        if not apart.has_work():
            return [], 0  # isolated ones still compiling their grammar (the engine waited for it)
        plan, preempted = apart.schedule(), 0
        while not plan.scheduled and apart.waiting and self.main.running:
            self.main.preempt_newest()
            preempted += 1
            plan = apart.schedule()
        return run(plan, apart), preempted

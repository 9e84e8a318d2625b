"""Crash suspects: the requests that were running when a worker died, run again apart from other work.

Why apart, and what "apart" is. A worker killed while an engine step ran a batch cannot say which
request killed it, or whether one did at all (an OOM kill, a bad node). Each of its requests that had
made no checkpointed progress is a suspect (``admission.standing_after``), and the next worker to hold
one runs it only in a group of suspects, alone in the engine: while the group runs, every other
request of the worker waits where it is (``Request.isolated``: the engine steps only isolated requests
while it has any, keeping the others' KV blocks). A death in that time is the group's alone, so the
group is halved at the next delivery, and a request whose worker dies while it runs alone is the
culprit (a strike). We chose this over a worker kept for suspects (a queue of its own, a fleet that
has one to spare) because any worker can do it, at once, with the model it has loaded, and over
running suspects beside innocent work because a death there would be charged to the innocent too.

The database knows at every moment which of a worker's requests are running (``requests.started``):
as a group's first step starts (``Engine.on_start``), one transaction marks the group started and
pauses the others (``Ledger.paused``), and when the group is done the others run again
(``Ledger.started``) before their next step. So a death is charged to the others until the group
runs, to the group from then on, and never to nobody. A member is cleared (innocent again, ``Ledger.cleared``)
once it has generated ``clear_tokens`` tokens alone, a checkpoint interval: a crash it causes at a
point of its output has had the chance to strike again from its checkpoint. Finished or failed
members leave the group too.

Throughput: innocent requests of the same job keep running at full batch between groups. A group
runs for about ``clear_tokens`` steps; the others are then owed as many ordinary steps before the next
group starts (``owed``), so while suspects wait, at most half of a worker's steps are theirs; and a
group is at most half of what died, so it fits where its batch did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from worker.consumer import admission
from worker.engine.request import Request

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
        """The next group (``admission.suspect_group``), taken out of ``waiting``."""
        picked = admission.suspect_group([item.suspect for item in self.waiting])
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

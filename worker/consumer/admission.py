"""What to do with a delivery, decided from the message and its request's row: pure functions.

A message only points at a request; its row says what the request is. A message that disagrees with
its row (another job, a model this engine does not run, another tenant's queue) or names no row is
refused (dead-lettered with the reason): any producer with broker access can publish.

Poison means "crashes the worker without making progress". A worker that dies while an engine step
runs a batch has said which requests it ran (``Engine.on_start``, before the step), but not which of
them, if any, killed it: each one whose checkpoint did not advance since the delivery before is a
suspect, not guilty (one whose checkpoint did advance is innocent: progress resets the count). A
suspect runs again only apart from all other work, in a group of at most half the requests its worker
died running (``Claim.suspect``, its size class; ``worker.consumer.suspects``): the blast-radius
bisection the engine does for an exception in one step, across deliveries. Innocent work never waits
beside a suspect, and a group that runs without its worker dying is cleared. A request is charged a
strike only when its worker dies while it runs alone (a group of one, or a batch of one), and
``max_delivery_attempts`` strikes in a row fail it with the reason. So a request that was only
waiting in a dead worker's prefetch window is never charged, a long request that keeps making
progress through any number of crashes is never poison, and a worker dying for its own reasons (an
OOM kill, a bad node) fails nobody: the suspects of each death are cleared in their groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from worker.consumer.ledger import Claim
from worker.messaging.topology import RequestRef


class Action(Enum):
    RUN = "run"
    SKIP = "skip"  # done already, or its job closed: ack it
    REFUSE = "refuse"  # not a message for this request: dead-letter it with the reason
    FAIL = "fail"  # the request cannot run: fail it with the reason


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str | None = None


def judge(ref: RequestRef, claim: Claim | None, model: str, queue_tenant: str | None) -> Verdict:
    """``queue_tenant``: the tenant of the queue the message came from, where known."""
    if claim is None:
        return Verdict(Action.REFUSE, f"request {ref.request_id} is not in the database")
    if claim.job_id != ref.job_id:
        return Verdict(Action.REFUSE, f"the message names job {ref.job_id!r}, but request {ref.request_id} "
                                      f"belongs to job {claim.job_id!r}")
    if claim.model != model:
        return Verdict(Action.REFUSE, f"request {ref.request_id} is for model {claim.model!r}; this queue's "
                                      f"engine runs {model!r}")
    if queue_tenant is not None and claim.tenant != queue_tenant:
        return Verdict(Action.REFUSE, f"request {ref.request_id} belongs to tenant {claim.tenant!r} but came "
                                      f"from the queue of tenant {queue_tenant!r}")
    if not claim.open:
        return Verdict(Action.SKIP)
    if claim.params is None:
        return Verdict(Action.FAIL, f"its parameters cannot be read: {claim.unreadable}")
    return Verdict(Action.RUN)


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


def prefetch_window(max_num_seqs: int, kv_capacity_tokens: int, mean_kv_tokens: float | None) -> int:
    """Deliveries to hold: the requests the engine can run at once, plus a quarter more waiting."""
    seats = max_num_seqs
    if mean_kv_tokens:
        seats = max(1, min(max_num_seqs, int(kv_capacity_tokens // mean_kv_tokens)))
    return seats + max(1, seats // 4)

"""What to do with a delivery, decided from the message and its request's row (pure functions): run,
skip (done, or its job closed), refuse (the message disagrees with its row or names none: any producer
with broker access can publish) or fail it; and the prefetch window. A crash suspect's
standing is judged in ``worker.consumer.suspects``."""

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


CLAIM_BATCH = 32  # deliveries claimed together at least, while the engine has enough waiting (``loop``)


def prefetch_window(max_num_seqs: int, kv_capacity_tokens: int, mean_kv_tokens: float | None,
                    committing: int = 0) -> int:
    """Deliveries to hold: the requests the engine can run at once, plus a quarter more waiting, plus
    room for the finished ones whose outcomes are being committed (a quarter more, or ``committing``,
    as many as lately were at once): their messages are unacked until then, and without room for
    them the engine would run short of waiting work while a step's results commit. (RabbitMQ applies
    a grown window to the queues consumed from then on; ``worker.consumer.broker``.)"""
    seats = max_num_seqs
    if mean_kv_tokens:
        seats = max(1, min(max_num_seqs, int(kv_capacity_tokens // mean_kv_tokens)))
    return seats + max(1, seats // 4) + max(committing, seats // 4)

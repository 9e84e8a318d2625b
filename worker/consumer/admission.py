"""What to do with a delivery, decided from the message and its request's row: pure functions.

A message only points at a request; its row says what the request is. A message that disagrees with
its row (another job, a model this engine does not run, another tenant's queue) or names no row is
refused (dead-lettered with the reason): any producer with broker access can publish.

Poison means "crashes the worker without making progress". A delivery counts against its request
(a strike) only when its worker died while an engine step was running the request and the request's
checkpoint did not advance since the delivery before; progress resets the count. So a request that
was only waiting in a dead worker's prefetch window is never charged, and a long request that keeps
making progress through any number of crashes is never poison. ``max_delivery_attempts`` strikes in a
row fail the request with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from worker.consumer.ledger import Claim
from worker.consumer.queues import RequestRef


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


def strikes_after(claim: Claim, checkpointed_tokens: int) -> int:
    """The request's strikes once this delivery begins from ``checkpointed_tokens`` output tokens."""
    if not claim.crashed:
        return claim.strikes
    return claim.strikes + 1 if checkpointed_tokens <= claim.progress else 0


def poison_reason(claim: Claim, strikes: int, limit: int) -> str | None:
    if strikes < limit:
        return None
    return (f"its worker died {strikes} times in a row while running it, with no progress checkpointed in "
            f"between (max_delivery_attempts {limit}); last error: {claim.last_error or 'none recorded'}")


def prefetch_window(max_num_seqs: int, kv_capacity_tokens: int, mean_kv_tokens: float | None) -> int:
    """Deliveries to hold: the requests the engine can run at once, plus a quarter more waiting."""
    seats = max_num_seqs
    if mean_kv_tokens:
        seats = max(1, min(max_num_seqs, int(kv_capacity_tokens // mean_kv_tokens)))
    return seats + max(1, seats // 4)

"""Job events: every change of a job's status, written by database triggers into the ``job_events``
outbox in the same transaction, and a live job's being found at risk of missing its window (written by
``jobs.records.outbox.raise_at_risk``), then published on ``<prefix>.events`` (routing key
``<tenant>.job.<status>``, ``<tenant>.job.at_risk``) by ``EventRelay`` with confirms, and POSTed to the
job's webhook. Delivery is at least once; consumers deduplicate by ``event_id`` (docs/queue.md, "Events").
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import exists, func, select, text, update
from sqlalchemy.orm import Session, aliased

from jobs.pipeline.publish import Outgoing, Publisher
from jobs.queue_door.contract import CONTRACT_VERSION, event_routing_key
from jobs.records.db import Database, open_database
from jobs.records.models import AT_RISK_EVENT, Job, JobEvent, Tenant, now
from storage import open_store
from worker.config import Settings
from worker.messaging.topology import Topology, is_embedded

log = logging.getLogger("berth.events")

BATCH = 500
POLL_SECONDS = 0.5
RELAY_LOCK = 0x62657274_01  # pg_try_advisory_xact_lock key: one relay at a time


def event_type(event: JobEvent) -> str:
    """``job.<status>`` for a change of status, ``job.at_risk`` for an at-risk event: the body's ``type``,
    the routing key after the tenant's word, the webhook's ``X-Berth-Event``."""
    return "job.at_risk" if event.kind == AT_RISK_EVENT else f"job.{event.status.value}"


def job_event_body(event: JobEvent, job: Job, tenant: str, store_url: str) -> dict:
    """The event as ``job-event.v1`` says; an at-risk event says when the job is expected to finish and
    when its window ends, as they were when it was raised."""
    def url(key: str | None) -> str | None:
        return None if key is None else f"{store_url.rstrip('/')}/{key}"

    status = event.status.value
    at_risk = {"expected_finish_at": event.expected_finish_at, "expires_at": job.expires_at} \
        if event.kind == AT_RISK_EVENT else {}
    return {
        "version": CONTRACT_VERSION, "type": event_type(event), "event_id": f"evt_{event.id}",
        "occurred_at": event.created_at, "job_id": job.id, "status": status, "tenant": tenant, "model": job.model,
        "message_id": job.submit_message_id, "metadata": dict(job.metadata_ or {}),
        "request_counts": {"total": event.total, "completed": event.completed, "failed": event.failed},
        "usage": {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens},
        "output_file": event.output_key, "error_file": event.errors_key,
        "output_url": url(event.output_key), "error_url": url(event.errors_key), "error": event.error,
        "error_code": job.error_code if event.error is not None else None, **at_risk,
    }


def rejection_body(message_id: str | None, broker_user: str | None, reason: str, dead_letter_queue: str) -> dict:
    """The event of a submit message that made no job (it went to the dead-letter queue)."""
    return {"version": CONTRACT_VERSION, "type": "submit.rejected", "event_id": f"rej_{uuid.uuid4().hex}",
            "occurred_at": now(), "message_id": message_id, "broker_user": broker_user, "reason": reason,
            "dead_letter_queue": dead_letter_queue}


def encode(body: dict) -> bytes:
    """An event's bytes: the AMQP body and the webhook body (which its signature covers)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def outgoing(topology: Topology, body: dict, tenant: str | None) -> Outgoing:
    headers = {"tenant": tenant} if tenant is not None else {}
    options = {"headers": headers, "content_type": "application/json", "content_encoding": "utf-8",
               "message_id": body["event_id"], "type": body["type"], "timestamp": int(body["occurred_at"])}
    if body.get("message_id"):
        options["correlation_id"] = body["message_id"]
    key = event_routing_key(tenant, body["type"])  # per tenant, for RabbitMQ's topic permissions
    return Outgoing(topology.events_exchange, key, encode(body), (topology.events_exchange,), options)


def pending_events(session, limit: int, where) -> list[tuple[JobEvent, Job, Tenant]]:
    return list(session.execute(
        select(JobEvent, Job, Tenant).join(Job, Job.id == JobEvent.job_id).join(Tenant, Tenant.id == Job.tenant_id)
        .where(where).order_by(JobEvent.id).limit(limit)).all())


def due_webhooks(session, at: float, per_tenant: int, limit: int) -> list[tuple[JobEvent, Job, Tenant]]:
    """The events whose webhook is due at ``at`` (not later), each the first of its job still to be
    delivered (a job's events go out in order), taken from the tenants in turn: every tenant's
    oldest, then every tenant's second, ..., at most ``per_tenant`` of one tenant, ``limit`` in all.
    A tenant with a thousand events due waits behind its own events, never another tenant's."""
    earlier = aliased(JobEvent)
    first_of_job = ~exists().where(earlier.job_id == JobEvent.job_id, earlier.id < JobEvent.id,
                                   earlier.webhook_due_at.is_not(None))
    turn = func.row_number().over(partition_by=Job.tenant_id, order_by=JobEvent.id).label("turn")
    due = (select(JobEvent.id.label("id"), turn).join(Job, Job.id == JobEvent.job_id)
           .where(JobEvent.webhook_due_at <= at, first_of_job).subquery())
    return list(session.execute(
        select(JobEvent, Job, Tenant).join(due, due.c.id == JobEvent.id).join(Job, Job.id == JobEvent.job_id)
        .join(Tenant, Tenant.id == Job.tenant_id).where(due.c.turn <= per_tenant)
        .order_by(due.c.turn, JobEvent.id).limit(limit)).all())


@contextmanager
def claimed(db: Database, key: int) -> Iterator[Session | None]:
    """A session to read the outbox in and send what it holds, or None while another process has it.

    On PostgreSQL, one transaction holding the advisory lock ``key`` to the end: what was read, sent
    and marked, one relay at a time. On SQLite a plain session: a transaction kept open there while
    the broker or a webhook answers would, in WAL mode, fail to write afterwards once any other
    writer (an engine worker) committed, so ``mark`` writes in a transaction of its own."""
    with db.session() as s:
        if db.engine.dialect.name != "postgresql":
            yield s
            return
        with s.begin():
            yield s if s.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": key}) else None


def mark(session: Session, db: Database, statement, params: list[dict] | None = None, needed: bool = True) -> None:
    """Write what was sent: in the claimed transaction on PostgreSQL, in one of its own on SQLite."""
    if not needed:
        return
    if db.engine.dialect.name == "postgresql":
        session.execute(statement, params)
        return
    session.rollback()  # end the read
    with session.begin():
        session.execute(statement, params)


class EventRelay:
    """Publishes the outbox to ``<prefix>.events``. On the embedded queue, which has no exchange
    another process could bind, the events are only marked (their webhooks still go out)."""

    def __init__(self, settings: Settings, db: Database | None = None):
        self.settings = settings
        self.db = db or open_database(settings.database_url)
        self.topology = Topology(settings.queue_prefix)
        self.store_url = open_store(settings.storage_url).url
        self.embedded = is_embedded(settings)
        self._publisher: Publisher | None = None

    def drain(self, limit: int = BATCH) -> int:
        """Publish up to ``limit`` unpublished events, oldest first; how many."""
        with claimed(self.db, RELAY_LOCK) as s:
            if s is None:
                return 0
            rows = pending_events(s, limit, JobEvent.published_at.is_(None))
            if rows and not self.embedded:
                self._publish([outgoing(self.topology, job_event_body(e, job, tenant.name, self.store_url),
                                        tenant.name) for e, job, tenant in rows])
            mark(s, self.db, update(JobEvent).where(JobEvent.id.in_([e.id for e, _, _ in rows]))
                 .values(published_at=now()), needed=bool(rows))
        return len(rows)

    def _publish(self, batch: list[Outgoing]) -> None:
        if self._publisher is None:
            self._publisher = Publisher(self.settings)
        try:
            self._publisher.send(batch)
        except BaseException:
            self.close()  # a fresh connection next time
            raise

    def run(self, stop: threading.Event) -> None:
        """Drain until ``stop`` is set (errors are logged once and retried with backoff)."""
        poll(stop, "event relay", self.drain, BATCH)
        self.close()

    def close(self) -> None:
        if self._publisher is not None:
            try:
                self._publisher.close()
            except Exception:  # noqa: BLE001 (closing a link that may be broken already: nothing left to do)
                pass
            self._publisher = None


def poll(stop: threading.Event, name: str, work, full: int) -> None:
    """Call ``work()`` until ``stop`` is set: at once again while it did ``full`` things, after
    ``POLL_SECONDS`` when less; after a failure (the broker or the database down), with backoff
    from 0.5 s doubling to 10 s, logged once until it works again."""
    backoff, failing = 0.0, False
    while not stop.is_set():
        try:
            done = work()
        except Exception:
            if not failing:
                log.exception("%s: failed; retrying, logged once until it works", name)
            failing = True
            backoff = min(max(backoff * 2, 0.5), 10.0)
            stop.wait(backoff)
            continue
        if failing:
            log.info("%s: works again", name)
        failing, backoff = False, 0.0
        if done < full:
            stop.wait(POLL_SECONDS)

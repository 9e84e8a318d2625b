"""Webhooks: each event of a job with a ``webhook_url`` is POSTed there, signed with its tenant's
secret (``X-Berth-Signature-V2`` over timestamp and body). A sender thread reads the outbox, fair across
tenants (``webhook_tenant_in_flight``), with one deadline a POST, retries with backoff up to
``webhook_max_attempts``, and a job's events in order (docs/queue.md, "Webhooks").
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from sqlalchemy import update

from jobs.queue_door.destinations import Allowed, DestinationRefused, parse_url
from jobs.queue_door.events import POLL_SECONDS, due_webhooks, encode, event_type, job_event_body
from jobs.queue_door.webhook_post import post
from jobs.records.db import Database, open_database
from jobs.records.models import JobEvent, now
from jobs.records.tenants import webhook_secret
from storage import open_store
from worker.config import ConfigError, Settings

log = logging.getLogger("berth.webhooks")

SIGNATURE_HEADER = "X-Berth-Signature"  # v1: the body alone
SIGNATURE_V2_HEADER = "X-Berth-Signature-V2"  # the timestamp and the body
TIMESTAMP_HEADER = "X-Berth-Timestamp"
REPLAY_WINDOW = 300  # seconds a receiver accepts a timestamp off its clock, by default (verify_v2)
LEASE_MARGIN = 60.0  # seconds past the POST's deadline that a claimed event stays claimed
PASS_GAP = 0.05  # seconds between passes at the most: POSTs that end together are followed by one read


def sign(secret: str, body: bytes) -> str:
    """The v1 signature: the body alone (no timestamp, so it cannot tell a replay)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, signature: str | None) -> bool:
    """Whether ``signature`` (the X-Berth-Signature header) is the tenant's for these exact bytes."""
    return signature is not None and hmac.compare_digest(sign(secret, body), signature)


def sign_v2(secret: str, timestamp: int, body: bytes) -> str:
    """The v2 signature: HMAC-SHA256 over ``b"<timestamp>." + body``, so the time is signed too."""
    return "sha256=" + hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify_v2(secret: str, body: bytes, timestamp: str | None, signature: str | None,
              window: float = REPLAY_WINDOW, at: float | None = None) -> bool:
    """Whether a POST is the tenant's and fresh: ``signature`` (X-Berth-Signature-V2) signs
    ``timestamp`` (X-Berth-Timestamp) and these bytes, and the timestamp is within ``window``
    seconds of ``at`` (now). A recorded POST played again later fails the window."""
    if not timestamp or not signature or not timestamp.isdigit() or len(timestamp) > 12:
        return False
    if abs((time.time() if at is None else at) - int(timestamp)) > window:
        return False
    return hmac.compare_digest(sign_v2(secret, int(timestamp), body), signature)


def signed_headers(secret: str, body: bytes, event_type: str, event_id: str, at: float | None = None) -> dict[str, str]:
    """The headers of a webhook POST made at ``at`` (now)."""
    timestamp = int(time.time() if at is None else at)
    return {TIMESTAMP_HEADER: str(timestamp), SIGNATURE_V2_HEADER: sign_v2(secret, timestamp, body),
            SIGNATURE_HEADER: sign(secret, body), "X-Berth-Event": event_type, "X-Berth-Event-Id": event_id}


def url_host(url: str) -> str:
    """What a log line may say of a webhook URL: its host (and port), never its path, query or user
    part, which often carry the receiver's credentials."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "(a URL that cannot be read)"
    if not host:
        return "(a URL without a host)"
    return f"{host[:100]}:{port}" if port else host[:100]


def _without_url(text: str, url: str) -> str:
    """``text`` (a reason, which may quote the URL as the tenant sent it) with the URL put as its host."""
    for quoted in (repr(url[:200]), url[:200], url):
        text = text.replace(quoted, url_host(url))
    return text


@dataclass(frozen=True)
class Delivery:
    """A claimed event on its way: what the POST needs, read while the event was claimed."""

    event_id: int
    job_id: str
    tenant_id: int
    url: str
    attempts: int  # made before this one
    secret: str
    body: bytes
    event_type: str


class WebhookSender:
    def __init__(self, settings: Settings, db: Database | None = None):
        self.settings = settings
        try:
            self.allowed = Allowed.parse(settings.webhook_allow)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.db = db or open_database(settings.database_url)
        self.store_url = open_store(settings.storage_url).url
        self.in_flight: Counter[int] = Counter()  # tenant id -> its POSTs running now, in this process
        self.finished: list[dict] = []  # what became of the POSTs that ended, not yet written
        # Threads of its own: the database's work never queues behind a slow name server, and a lookup
        # always has a thread (no more run at once than POSTs, as each holds its POST's slot to the end).
        self.database_thread = ThreadPoolExecutor(1, thread_name_prefix="berth-webhooks-db")
        self.lookup_threads = ThreadPoolExecutor(settings.webhook_senders, thread_name_prefix="berth-webhooks-dns")

    def retry_delay(self, attempts: int) -> float:
        s = self.settings
        return min(s.webhook_backoff * 2 ** (attempts - 1), s.webhook_backoff_max) * random.uniform(0.8, 1.0)

    # ---- the database side (on ``database_thread``: the loop keeps timing the POSTs meanwhile)
    def claim(self, free: int, busy: dict[int, int]) -> list[Delivery]:
        """Up to ``free`` due events, no tenant over ``webhook_tenant_in_flight`` with ``busy`` (its
        POSTs running), claimed: their ``webhook_due_at`` moved past the POST's deadline, by an update
        that takes only those still due, so that no other sender takes them meanwhile."""
        cap, at = self.settings.webhook_tenant_in_flight, now()
        with self.db.session() as s:
            rows = due_webhooks(s, at, cap, free + sum(busy.values()))  # enough to fill ``free`` past the busy
            counts, chosen = Counter(busy), []
            for event, job, tenant in rows:
                if len(chosen) < free and counts[tenant.id] < cap:
                    counts[tenant.id] += 1
                    body = encode(job_event_body(event, job, tenant.name, self.store_url))
                    chosen.append((Delivery(event.id, event.job_id, tenant.id, event.webhook_url,
                                            event.webhook_attempts, tenant.webhook_secret or "", body,
                                            event_type(event)), tenant.name))
            if not chosen:
                return []
            s.rollback()  # end the read (on SQLite the claim must be a write transaction of its own)
            with s.begin():
                taken = set(s.scalars(
                    update(JobEvent).where(JobEvent.id.in_([d.event_id for d, _ in chosen]),
                                           JobEvent.webhook_due_at <= at)
                    .values(webhook_due_at=at + self.settings.webhook_timeout + LEASE_MARGIN).returning(JobEvent.id)
                    .execution_options(synchronize_session=False)))
        return [d if d.secret else replace(d, secret=webhook_secret(self.db, tenant)) for d, tenant in chosen
                if d.event_id in taken]

    def record(self, changes: list[dict]) -> None:
        """Write what became of the POSTs (each change by the event's id)."""
        if changes:
            with self.db.session() as s, s.begin():
                s.execute(update(JobEvent), changes)

    # ---- one POST
    async def deliver(self, d: Delivery) -> None:
        """POST one event and note what became of it (``finished``, written by the next pass). Ends
        once the name's lookup has too: one the deadline cut short still holds a thread, and so this
        POST's slot, its tenant's."""
        lookups: list[Future] = []
        try:
            body_headers = signed_headers(d.secret, d.body, d.event_type, f"evt_{d.event_id}")
            error = await post(parse_url(d.url), d.url, d.body, body_headers, self.settings.webhook_timeout,
                               self.allowed, self.lookup_threads, lookups)
            refused = False
        except DestinationRefused as exc:
            error, refused = str(exc), True
        except asyncio.CancelledError:  # the sender stops: the event is due again at once, this try uncounted
            self.finished.append({"id": d.event_id, "webhook_due_at": now()})
            raise
        except Exception as exc:  # noqa: BLE001 (one webhook's bug fails that webhook, logged with its frames)
            # the frames, not exc_info: an exception's message may quote the URL
            log.error("webhook of job %s (event %d) to %s: could not be sent (%s: %s)\n%s", d.job_id, d.event_id,
                      url_host(d.url), type(exc).__name__, _without_url(str(exc)[:300], d.url),
                      "".join(traceback.format_tb(exc.__traceback__)).rstrip())
            error, refused = f"berth could not send it ({type(exc).__name__}: {str(exc)[:300]})", False
        self.finished.append(self._outcome(d, error, refused))
        lingering = [asyncio.wrap_future(job) for job in lookups if not job.done()]
        if lingering:
            await asyncio.wait(lingering)

    def _start(self, d: Delivery, running: set[asyncio.Task], ended: asyncio.Event) -> None:
        """``deliver`` as a task, counted against its tenant until it ends."""
        self.in_flight[d.tenant_id] += 1

        def done(_):
            self.in_flight[d.tenant_id] -= 1
            if not self.in_flight[d.tenant_id]:
                del self.in_flight[d.tenant_id]
            running.discard(task)
            ended.set()

        task = asyncio.create_task(self.deliver(d))
        running.add(task)
        task.add_done_callback(done)

    def _outcome(self, d: Delivery, error: str | None, refused: bool) -> dict:
        attempts = d.attempts + 1
        if error is None:
            return {"id": d.event_id, "webhook_attempts": attempts, "webhook_due_at": None, "webhook_sent_at": now(),
                    "webhook_error": None}
        give_up = refused or attempts >= self.settings.webhook_max_attempts
        log.warning("webhook of job %s (event %d) to %s: %s; %s", d.job_id, d.event_id, url_host(d.url),
                    _without_url(error, d.url),
                    "given up" if give_up else f"attempt {attempts}, trying again")
        return {"id": d.event_id, "webhook_attempts": attempts, "webhook_error": error,
                "webhook_due_at": None if give_up else now() + self.retry_delay(attempts)}

    # ---- the loop
    def send_due(self) -> int:
        """One pass, waited for: POST what is due now (as many as ``webhook_senders``), write what
        became of it; how many were tried."""
        async def once() -> int:
            deliveries = self.claim(self.settings.webhook_senders, {})
            await asyncio.gather(*(self.deliver(d) for d in deliveries))
            await self._write_finished()
            return len(deliveries)

        return asyncio.run(once())

    def run(self, stop: threading.Event) -> None:
        """Send until ``stop`` is set."""
        asyncio.run(self._serve(stop))

    async def _serve(self, stop: threading.Event) -> None:
        ended = asyncio.Event()  # set when a POST ends: a slot is free, and its job's next event may be due
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task] = set()
        backoff, failing = 0.0, False
        try:
            while not stop.is_set():
                ended.clear()
                try:
                    await self._write_finished()
                    free = self.settings.webhook_senders - len(running)
                    deliveries = (await loop.run_in_executor(self.database_thread, self.claim, free,
                                                             dict(self.in_flight)) if free > 0 else [])
                except Exception:
                    if not failing:
                        log.exception("webhooks: failed; retrying, logged once until it works")
                    failing, backoff = True, min(max(backoff * 2, 0.5), 10.0)
                    for _ in range(int(backoff / POLL_SECONDS)):
                        if not stop.is_set():
                            await asyncio.sleep(POLL_SECONDS)
                    continue
                if failing:
                    log.info("webhooks: work again")
                failing, backoff = False, 0.0
                for d in deliveries:
                    self._start(d, running, ended)
                try:
                    await asyncio.wait_for(ended.wait(), POLL_SECONDS)
                except TimeoutError:
                    pass
                await asyncio.sleep(PASS_GAP)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            try:
                await self._write_finished()
            except Exception:
                log.exception("webhooks: could not write what became of the last POSTs")

    async def _write_finished(self) -> None:
        """``record`` on ``database_thread``, of what is taken here on the loop's (where POSTs add to it)."""
        changes, self.finished = self.finished, []
        try:
            await asyncio.get_running_loop().run_in_executor(self.database_thread, self.record, changes)
        except BaseException:
            self.finished = changes + self.finished  # written next time
            raise

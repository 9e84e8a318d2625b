"""Webhooks: each event of a job that has a ``webhook_url`` (a submit message's field) is POSTed
there, the same JSON as on the events exchange, signed with its tenant's secret:

    X-Berth-Signature: sha256=<hex of HMAC-SHA256(secret, the request body's bytes)>
    X-Berth-Event: job.completed          X-Berth-Event-Id: evt_42

``berth webhook-secret TENANT`` shows the secret (made on first use). A receiver checks the
signature over the raw body before parsing it (``verify``) and deduplicates by the event id: a
POST whose answer was lost is sent again.

A job never waits for its webhook: the sender reads the outbox (``jobs.queue_door.events``) on a thread of its
own. A POST that fails (no answer in ``webhook_timeout``, a refused connection, any status but
2xx) is tried again after ``webhook_backoff`` seconds, doubling up to ``webhook_backoff_max``, at
most ``webhook_max_attempts`` times; then it is given up (``job_events.webhook_error`` says why).
A job's events go out in order: while one waits for a retry, the later ones wait behind it.
Redirects are not followed.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import random
import threading
import time
from urllib.parse import urlsplit

from sqlalchemy import update

from jobs.db import Database, open_database
from jobs.models import JobEvent, now
from jobs.queue_door.events import (WEBHOOK_LOCK, claimed, encode, job_event_body, mark, pending_events, poll)
from jobs.tenants import webhook_secret
from storage import open_store
from worker.config import Settings

log = logging.getLogger("berth.webhooks")

SIGNATURE_HEADER = "X-Berth-Signature"
BATCH = 100
PASS_SECONDS = 10.0  # a pass stops taking new POSTs after this long (a slow receiver holds no one for long)


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, signature: str | None) -> bool:
    """Whether ``signature`` (the X-Berth-Signature header) is the tenant's for these exact bytes."""
    return signature is not None and hmac.compare_digest(sign(secret, body), signature)


def post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> str | None:
    """POST ``body``; None when the receiver answered 2xx, else what went wrong."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn = kind(parts.hostname, parts.port, timeout=timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json", "User-Agent": "berth-webhook/1",
                                              **headers})
            response = conn.getresponse()
            response.read(1 << 16)
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    return None if 200 <= response.status < 300 else f"HTTP {response.status} {response.reason}"[:500]


class WebhookSender:
    def __init__(self, settings: Settings, db: Database | None = None):
        self.settings = settings
        self.db = db or open_database(settings.database_url)
        self.store_url = open_store(settings.storage_url).url

    def retry_delay(self, attempts: int) -> float:
        s = self.settings
        return min(s.webhook_backoff * 2 ** (attempts - 1), s.webhook_backoff_max) * random.uniform(0.8, 1.0)

    def send_due(self, limit: int = BATCH) -> int:
        """POST the events whose time has come, each job's in order; how many were tried."""
        started, tried, changes = time.monotonic(), 0, []
        with claimed(self.db, WEBHOOK_LOCK) as s:
            if s is None:
                return 0
            blocked: set[str] = set()  # jobs with an earlier event still to deliver
            for event, job, tenant in pending_events(s, limit, JobEvent.webhook_due_at.is_not(None)):
                if event.job_id in blocked or time.monotonic() - started > PASS_SECONDS:
                    continue
                if event.webhook_due_at > now():
                    blocked.add(event.job_id)
                    continue
                secret = tenant.webhook_secret or webhook_secret(self.db, tenant.name)
                body = encode(job_event_body(event, job, tenant.name, self.store_url))
                error = post(event.webhook_url, body, {SIGNATURE_HEADER: sign(secret, body),
                                                       "X-Berth-Event": f"job.{event.status.value}",
                                                       "X-Berth-Event-Id": f"evt_{event.id}"},
                             self.settings.webhook_timeout)
                tried += 1
                attempts = event.webhook_attempts + 1
                if error is None:
                    changes.append({"id": event.id, "webhook_attempts": attempts, "webhook_due_at": None,
                                    "webhook_sent_at": now(), "webhook_error": None})
                    continue
                blocked.add(event.job_id)
                give_up = attempts >= self.settings.webhook_max_attempts
                changes.append({"id": event.id, "webhook_attempts": attempts, "webhook_error": error,
                                "webhook_due_at": None if give_up else now() + self.retry_delay(attempts)})
                log.warning("webhook of job %s (event %d) to %s: %s; %s", event.job_id, event.id, event.webhook_url,
                            error, "given up" if give_up else f"attempt {attempts}, trying again")
            mark(s, self.db, update(JobEvent), changes, needed=bool(changes))
        return tried

    def run(self, stop: threading.Event) -> None:
        poll(stop, "webhooks", self.send_due, BATCH)

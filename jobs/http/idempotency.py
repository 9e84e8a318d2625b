"""``Idempotency-Key``: a create retried with the same key returns what the first one made.

The first request with a key claims it (a row with no object yet, unique per tenant, route and
key) before it makes anything, and writes the id of what it made when done; a failure releases
the claim, so a retry after an error runs again. A second request with the key returns the first
one's object; one arriving while the first is still at work gets ``IdempotencyInProgress`` (409:
retry shortly, as the openai client does by itself); one asking for something else with the same
key gets ``IdempotencyMismatch`` (400). A claim left by a server that died mid-request is taken over
after ``ABANDONED_SECONDS``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from jobs.records.db import Database
from jobs.records.models import IdempotencyKey, now
from jobs.records.tenants import tenant_id

ABANDONED_SECONDS = 600.0
_KEY = re.compile(r"[\x21-\x7e]{1,255}")  # printable ASCII, no spaces


class IdempotencyInProgress(RuntimeError):
    pass


class IdempotencyMismatch(ValueError):
    pass


class IdempotencyKeyInvalid(ValueError):
    pass


def fingerprint(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise IdempotencyKeyInvalid("the Idempotency-Key header must be 1-255 printable ASCII characters without "
                                    "spaces (a UUID, say)")
    return key


def idempotent(db: Database, tenant: str, route: str, key: str | None, asked: str, make: Callable[[], str]) -> str:
    """The id of the object made for (tenant, route, key): the first request's, or ``make()``'s now.
    ``asked`` fingerprints the request, so a key reused for another request is refused."""
    if key is None:
        return make()
    check_key(key)
    claim = _claim(db, tenant, route, key, asked)
    if isinstance(claim, str):
        return claim
    try:
        made = make()
    except BaseException:
        with db.session() as s, s.begin():
            s.execute(delete(IdempotencyKey).where(IdempotencyKey.id == claim, IdempotencyKey.object_id.is_(None)))
        raise
    with db.session() as s, s.begin():
        s.execute(update(IdempotencyKey).where(IdempotencyKey.id == claim).values(object_id=made))
    return made


def _claim(db: Database, tenant: str, route: str, key: str, asked: str) -> int | str:
    """The claim's row id (this request makes the object), or the id of the object already made."""
    try:
        with db.session() as s, s.begin():
            row = IdempotencyKey(tenant_id=tenant_id(s, tenant), route=route, key=key, fingerprint=asked,
                                 object_id=None, created_at=now())
            s.add(row)
            s.flush()
            return row.id
    except IntegrityError:
        pass
    with db.session() as s, s.begin():
        row = s.scalar(select(IdempotencyKey).where(IdempotencyKey.tenant_id == tenant_id(s, tenant),
                                                    IdempotencyKey.route == route, IdempotencyKey.key == key))
        if row is None:  # released by a failed first request in between
            raise IdempotencyInProgress("a request with this Idempotency-Key just failed: send it again")
        if row.fingerprint != asked:
            raise IdempotencyMismatch("this Idempotency-Key was used for a different request: use a new key for "
                                      "each distinct request")
        if row.object_id is not None:
            return row.object_id
        if row.created_at > now() - ABANDONED_SECONDS or not s.execute(
                update(IdempotencyKey).where(IdempotencyKey.id == row.id, IdempotencyKey.object_id.is_(None),
                                             IdempotencyKey.created_at == row.created_at)
                .values(created_at=now())).rowcount:
            raise IdempotencyInProgress("a request with this Idempotency-Key is still being processed: retry "
                                        "in a moment")
        return row.id

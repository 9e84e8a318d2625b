"""API keys of the HTTP API: a bearer key names its tenant.

A key is 32 random bytes (``berth-`` and 43 URL-safe characters), shown once when it is made; the
database keeps only its SHA-256. A salted slow hash would add nothing here: it protects passwords
people choose, which are guessable, and a random 256-bit key is not. Its first characters are kept
too, so that ``berth key list`` can tell keys apart and ``berth key revoke`` can name one.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update

from jobs.records.db import Database
from jobs.records.models import ApiKey, Tenant, now
from jobs.records.tenants import check_tenant_name, tenant_id

KEY_PREFIX = "berth-"
SHOWN_CHARS = 12  # of the key, kept to tell keys apart: the prefix and 6 random characters


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class KeyInfo:
    prefix: str
    tenant: str
    created_at: float
    revoked_at: float | None


def create_key(db: Database, tenant: str) -> str:
    """A new key for ``tenant`` (its row created if need be); the only time the key is seen."""
    check_tenant_name(tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with db.session() as s, s.begin():
        s.add(ApiKey(tenant_id=tenant_id(s, tenant), key_hash=key_hash(key), prefix=key[:SHOWN_CHARS],
                     created_at=now()))
    return key


def tenant_of_key(db: Database, key: str) -> str | None:
    """The tenant a key belongs to; None for a key that is unknown or revoked."""
    with db.session() as s:
        return s.scalar(select(Tenant.name).join(ApiKey, ApiKey.tenant_id == Tenant.id)
                        .where(ApiKey.key_hash == key_hash(key), ApiKey.revoked_at.is_(None)))


def any_keys(db: Database) -> bool:
    with db.session() as s:
        return s.scalar(select(ApiKey.id).where(ApiKey.revoked_at.is_(None)).limit(1)) is not None


def list_keys(db: Database, tenant: str | None = None) -> list[KeyInfo]:
    query = select(ApiKey, Tenant.name).join(Tenant).order_by(ApiKey.created_at)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    with db.session() as s:
        return [KeyInfo(k.prefix, name, k.created_at, k.revoked_at) for k, name in s.execute(query)]


def revoke_key(db: Database, key_or_prefix: str) -> int:
    """Revoke the key given whole, or the live keys whose shown prefix (all of its 12 characters, as
    ``berth key list`` shows it) is the one given; how many."""
    with db.session() as s, s.begin():
        if len(key_or_prefix) == SHOWN_CHARS:
            match = ApiKey.prefix == key_or_prefix
        else:
            match = ApiKey.key_hash == key_hash(key_or_prefix)
        return s.execute(update(ApiKey).where(match, ApiKey.revoked_at.is_(None)).values(revoked_at=now())).rowcount

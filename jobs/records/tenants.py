"""Tenants: who a job is for, and each one's share of the engines.

A tenant row is created by its first job. Its ``weight`` is its share under fair scheduling: an
engine running work of tenants with weights 2 and 1 gives the first twice the seats while both
have requests waiting. Engine workers read the weights of the tenants with live jobs about every
second (``live_tenants``), so a change applies to queued and running jobs alike.

A broker user mapped to a tenant (``allow_broker_user``) may submit jobs for it through the queue;
the AMQP ``user_id`` of a message names the user, and RabbitMQ refuses a ``user_id`` that is not the
connection's own, so the tenant is the broker's word, never the message's. Each tenant has a secret
that signs its webhooks (``webhook_secret``), made when first asked for.
"""

from __future__ import annotations

import secrets

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.records.db import Database
from jobs.records.job_errors import TenantNotFound
from jobs.records.lifecycle import LIVE
from jobs.records.models import BrokerUser, Job, Tenant, now

__all__ = ["TenantNotFound", "allow_broker_user", "check_tenant_name", "live_tenants", "remove_broker_user",
           "set_cache_group", "set_weight", "tenant_id", "tenant_of_broker_user", "webhook_secret"]

_TENANT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-@")


def tenant_id(session: Session, name: str) -> int:
    """The tenant's id, its row created if this is its first job."""
    found = session.scalar(select(Tenant.id).where(Tenant.name == name))
    if found is None:
        try:
            with session.begin_nested():
                session.add(Tenant(name=name, weight=1.0, created_at=now()))
        except IntegrityError:
            pass  # another submit created it at the same moment
        found = session.scalar(select(Tenant.id).where(Tenant.name == name))
    return found


def set_weight(db: Database, name: str, weight: float) -> None:
    if not weight > 0:
        raise ValueError(f"a tenant's weight must be positive, not {weight}")
    with db.session() as s, s.begin():
        if s.execute(update(Tenant).where(Tenant.name == name).values(weight=weight)).rowcount == 0:
            raise TenantNotFound(name)


def set_cache_group(db: Database, name: str, group: str | None) -> None:
    """Tenants with the same ``group`` share cached prompt prefixes, in each engine and through the
    fleet's prefix store: one computes a common system prompt for all. None: the tenant's are its own
    again (the default: a tenant must not learn, from cache hits or timing, what another's prompts
    begin with). Running requests keep the key they were admitted with."""
    if group is not None:
        check_tenant_name(group)
    with db.session() as s, s.begin():
        if s.execute(update(Tenant).where(Tenant.name == name).values(cache_group=group)).rowcount == 0:
            raise TenantNotFound(name)


def live_tenants(db: Database, model: str) -> dict[str, float]:
    """Tenant name -> weight, for the tenants with jobs of ``model`` not yet over."""
    with db.session() as s:
        rows = s.execute(select(Tenant.name, Tenant.weight).join(Job, Job.tenant_id == Tenant.id)
                         .where(Job.model == model, Job.status.in_(LIVE)).distinct())
        return {name: weight for name, weight in rows}


def check_tenant_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _TENANT_CHARS:
        raise ValueError(f"tenant {name!r}: use 1-64 letters, digits or _ . - @")
    return name


def allow_broker_user(db: Database, user: str, tenant: str) -> None:
    """Let broker user ``user`` submit jobs for ``tenant`` (created if new); replaces its mapping."""
    if not user or len(user) > 255:
        raise ValueError(f"broker user {user[:60]!r}: give the RabbitMQ user name (1-255 characters)")
    check_tenant_name(tenant)
    with db.session() as s, s.begin():
        target = tenant_id(s, tenant)
        if s.execute(update(BrokerUser).where(BrokerUser.name == user).values(tenant_id=target)).rowcount == 0:
            s.add(BrokerUser(name=user, tenant_id=target, created_at=now()))


def remove_broker_user(db: Database, user: str) -> bool:
    """The user may no longer submit; whether it could."""
    with db.session() as s, s.begin():
        return s.execute(delete(BrokerUser).where(BrokerUser.name == user)).rowcount > 0


def tenant_of_broker_user(db: Database, user: str) -> str | None:
    """The tenant a broker user submits for; None: it may not submit."""
    with db.session() as s:
        return s.scalar(select(Tenant.name).join(BrokerUser, BrokerUser.tenant_id == Tenant.id)
                        .where(BrokerUser.name == user))


def webhook_secret(db: Database, tenant: str, rotate: bool = False) -> str:
    """The secret that signs the tenant's webhooks, made on first use (or anew with ``rotate``)."""
    with db.session() as s, s.begin():
        row = s.execute(select(Tenant.id, Tenant.webhook_secret).where(Tenant.name == tenant)
                        .with_for_update()).one_or_none()
        if row is None:
            raise TenantNotFound(tenant)
        if row.webhook_secret and not rotate:
            return row.webhook_secret
        secret = "whsec_" + secrets.token_hex(32)
        s.execute(update(Tenant).where(Tenant.id == row.id).values(webhook_secret=secret))
        return secret

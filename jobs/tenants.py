"""Tenants: who a job is for, and each one's share of the engines.

A tenant row is created by its first job. Its ``weight`` is its share under fair scheduling: an
engine running work of tenants with weights 2 and 1 gives the first twice the seats while both
have requests waiting. Engine workers read the weights of the tenants with live jobs about every
second (``live_tenants``), so a change applies to queued and running jobs alike.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.db import Database
from jobs.lifecycle import LIVE
from jobs.models import Job, Tenant, now


class TenantNotFound(LookupError):
    def __init__(self, name: str):
        super().__init__(f"no tenant {name!r}: a tenant is created by its first job (`berth submit --tenant`)")


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


def live_tenants(db: Database, model: str) -> dict[str, float]:
    """Tenant name -> weight, for the tenants with jobs of ``model`` not yet over."""
    with db.session() as s:
        rows = s.execute(select(Tenant.name, Tenant.weight).join(Job, Job.tenant_id == Tenant.id)
                         .where(Job.model == model, Job.status.in_(LIVE)).distinct())
        return {name: weight for name, weight in rows}

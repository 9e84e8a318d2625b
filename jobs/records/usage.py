"""Tokens in and out per tenant and model over a period: what a tenant used, for a bill or a quota
review (``berth usage``, ``GET /v1/usage``). Counted from the results, one per request, by when the
result was written; a request a worker ran twice (a crash, a redelivery) still has one result, so it
counts once."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy import func, select

from jobs.records.db import Database
from jobs.records.models import Job, Result, Tenant


@dataclass(frozen=True)
class Usage:
    tenant: str
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, from a prefix cache
    completion_tokens: int

    def cost(self, input_per_million: float = 0.0, output_per_million: float = 0.0) -> float:
        return (self.prompt_tokens * input_per_million + self.completion_tokens * output_per_million) / 1e6

    def to_dict(self) -> dict:
        return asdict(self)


def usage(db: Database, tenant: str | None = None, since: float | None = None,
          until: float | None = None) -> list[Usage]:
    """Each (tenant, model) with results written in [``since``, ``until``), ``tenant`` alone if given."""
    query = (select(Tenant.name, Job.model, func.count(Result.id), func.coalesce(func.sum(Result.prompt_tokens), 0),
                    func.coalesce(func.sum(Result.cached_tokens), 0),
                    func.coalesce(func.sum(Result.completion_tokens), 0))
             .join(Job, Job.id == Result.job_id).join(Tenant, Tenant.id == Job.tenant_id)
             .group_by(Tenant.name, Job.model).order_by(Tenant.name, Job.model))
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    if since is not None:
        query = query.where(Result.created_at >= since)
    if until is not None:
        query = query.where(Result.created_at < until)
    with db.session() as s:
        return [Usage(name, model, int(n), int(p), int(c), int(o)) for name, model, n, p, c, o in s.execute(query)]

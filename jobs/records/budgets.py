"""Token budgets: a tenant's enqueued tokens per model and their limit, as OpenAI's Batch API limits an
organization's enqueued prompt tokens per model.

A line holds its prompt tokens and ``n * max_tokens`` (what it may add) from the moment its ingest
stores it until it is done (``requests.tokens``); a job holds the sum of its lines not yet done
(``jobs.enqueued_tokens``), and a tenant's enqueued tokens for a model are the sum over its jobs of
that model. The counts change only in the transactions that store the lines (``reserve``, under the
tenant's row lock, so two ingests of one tenant cannot both take the last room) and record their
outcomes (``jobs.records.results``), and a job that ends holds nothing (``jobs.pipeline.finalize``):
they cannot drift from the lines.

A tenant's limit is its own (``set_token_limit``, ``berth tenant NAME --enqueued-token-limit N``) or
``Settings.tenant_max_enqueued_tokens``; 0 is no limit. A job whose lines would pass it fails as
OpenAI's does, with ``token_limit_exceeded`` (``TokenLimitExceeded``), before any more of its lines
are queued.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from jobs.records.db import Database
from jobs.records.models import Job, Tenant
from jobs.records.status import HOLDING, Budget, budgets  # noqa: F401 (the read side, in SQLAlchemy's core)
from jobs.records.tenants import check_tenant_name, tenant_id

TOKEN_LIMIT_CODE = "token_limit_exceeded"  # OpenAI's code, in the Batch object's errors


class TokenLimitExceeded(Exception):
    """A job's lines would pass its tenant's enqueued-token limit for its model."""

    code = TOKEN_LIMIT_CODE


def line_tokens(prompt_tokens: int, params: dict) -> int:
    """What a line holds until it is done: its prompt and what it may add (``n`` choices of ``max_tokens``)."""
    return prompt_tokens + int(params.get("max_tokens") or 0) * int(params.get("n") or 1)


def enqueued_tokens(s: Session, tenant_id: int, model: str) -> int:
    return int(s.scalar(select(func.coalesce(func.sum(Job.enqueued_tokens), 0))
                        .where(Job.tenant_id == tenant_id, Job.model == model, Job.status.in_(HOLDING))))


def token_limit(s: Session, tenant_id: int, default: int) -> int:
    """The tenant's limit (0: none)."""
    own = s.scalar(select(Tenant.enqueued_token_limit).where(Tenant.id == tenant_id))
    return default if own is None else int(own)


def check_room(s: Session, job_id: str, adding: int, default_limit: int) -> None:
    """``TokenLimitExceeded`` unless ``adding`` more tokens of job ``job_id`` fit its tenant's limit.
    Holds the tenant's row until the transaction ends (PostgreSQL; SQLite's write lock is held already
    by the ingest's first statement), so the caller adds them to ``jobs.enqueued_tokens`` in it."""
    tenant_id, model = s.execute(select(Job.tenant_id, Job.model).where(Job.id == job_id)).one()
    s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    limit = token_limit(s, tenant_id, default_limit)
    if not limit:
        return
    held = enqueued_tokens(s, tenant_id, model)
    if held + adding > limit:
        name = s.scalar(select(Tenant.name).where(Tenant.id == tenant_id))
        raise TokenLimitExceeded(
            f"Enqueued token limit reached for {model} in tenant {name}. Limit: {limit:,} enqueued tokens. "
            f"Your batches not yet done hold {held:,}, and this batch's lines would add at least {adding:,} (each "
            "line's prompt tokens and max_tokens). Please try again once some in_progress batches have been "
            f"completed, or ask the operator to raise the limit (`berth tenant {name} --enqueued-token-limit N`).")


def set_interactive_limits(db: Database, name: str, **limits: int | None) -> None:
    """The tenant's own interactive limits (``live_requests``, ``tokens_per_minute``: 0 none, None the
    setting's default again), those given only; the tenant is made if it had no job yet. A running
    ``berth serve`` applies them within ``jobs.http.interactive_limits.LIMITS_TTL`` seconds."""
    columns = {"live_requests": "live_request_limit", "tokens_per_minute": "tokens_per_minute_limit"}
    for what, value in limits.items():
        if what not in columns:
            raise TypeError(f"no interactive limit {what!r} (there are {', '.join(columns)})")
        if value is not None and value < 0:
            raise ValueError(f"an interactive limit is a count (0: no limit), not {value}")
    check_tenant_name(name)
    if not limits:
        return
    with db.session() as s, s.begin():
        s.execute(update(Tenant).where(Tenant.id == tenant_id(s, name))
                  .values({columns[what]: value for what, value in limits.items()}))


def set_token_limit(db: Database, name: str, limit: int | None) -> None:
    """The tenant's own enqueued-token limit per model (0: none; None: the setting's default again); the
    tenant is made if it had no job yet."""
    if limit is not None and limit < 0:
        raise ValueError(f"an enqueued-token limit is a count of tokens (0: no limit), not {limit}")
    check_tenant_name(name)
    with db.session() as s, s.begin():  # a tenant's limit may be set before its first job
        s.execute(update(Tenant).where(Tenant.id == tenant_id(s, name)).values(enqueued_token_limit=limit))

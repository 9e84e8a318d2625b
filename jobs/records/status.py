"""A job as a user sees it: state, request counts, tokens, throughput and time left.

``get_job`` and ``list_jobs`` read the rows with SQLAlchemy's core and plain SQL, not through the ORM
models: the commands that only show jobs (``berth status``, ``list``, ``results``) then import neither
SQLAlchemy's ORM nor ``jobs.records.models``, a third of what they cost to start. ``COLUMNS`` names the job's
columns once, for these queries and for a view of an ORM ``Job`` (``JobView.of``) alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from jobs.records.db import Database
from jobs.records.job_errors import JobNotFound, TenantNotFound
from jobs.records.job_status import JobStatus

if TYPE_CHECKING:
    from jobs.records.models import Job

# JobView's fields (all but the tenant's name) and the columns of the ``jobs`` table they are read from.
COLUMNS = {
    "id": "id", "status": "status", "model": "model", "priority": "priority",
    "completion_window": "completion_window", "metadata": "metadata", "input_name": "input_name",
    "total": "total", "completed": "completed", "failed": "failed", "prompt_tokens": "prompt_tokens",
    "completion_tokens": "completion_tokens", "created_at": "created_at", "in_progress_at": "in_progress_at",
    "finalizing_at": "finalizing_at", "completed_at": "completed_at", "failed_at": "failed_at",
    "cancelling_at": "cancelling_at", "cancelled_at": "cancelled_at", "expired_at": "expired_at",
    "expires_at": "expires_at", "output_key": "output_key", "errors_key": "errors_key", "error": "error",
    "endpoint": "endpoint", "input_file_id": "input_file_id", "output_file_id": "output_file_id",
    "error_file_id": "error_file_id", "message_id": "submit_message_id",
    "output_expires_after": "output_expires_after", "cached_tokens": "cached_tokens",
    "error_code": "error_code", "enqueued_tokens": "enqueued_tokens", "output_budget": "output_budget",
    "finished_budget": "finished_budget", "at_risk_at": "at_risk_at",
}
AT_RISK_MARGIN = 0.05  # of its window: a job expected to finish later than this before it ends is at risk
FRESH = 30.0  # seconds: a worker's progress counts while its heartbeat is this recent (workers.GONE_AFTER)
_ORM_ATTRIBUTE = {"metadata": "metadata_"}  # where the model's attribute is not named as its column
_SELECT = ("SELECT " + ", ".join(f"jobs.{c}" for c in COLUMNS.values()) + ", tenants.name AS tenant_name, "
           "(SELECT COALESCE(SUM(job_progress.tokens), 0) FROM job_progress WHERE job_progress.job_id = jobs.id "
           "AND job_progress.at >= :fresh) AS tokens_in_flight FROM jobs JOIN tenants ON tenants.id = jobs.tenant_id")


@dataclass(frozen=True)
class JobView:
    id: str
    status: JobStatus
    tenant: str
    model: str
    priority: int
    completion_window: str
    metadata: dict
    input_name: str
    total: int
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    created_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    expired_at: float | None
    expires_at: float
    output_key: str | None
    errors_key: str | None
    error: str | None
    # what the HTTP API shows (None for a job submitted by the CLI, until the API first shows it)
    endpoint: str | None = None
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    message_id: str | None = None  # the AMQP message_id of a job submitted through the queue
    output_expires_after: int | None = None  # seconds its output and errors files are kept once written
    cached_tokens: int = 0  # of prompt_tokens, taken from a prefix cache (OpenAI's usage.input_tokens_details)
    error_code: str | None = None  # OpenAI's code for ``error`` (token_limit_exceeded); None: the file was bad
    enqueued_tokens: int = 0  # what its lines not yet done hold of its tenant's token budget (jobs.records.budgets)
    output_budget: int = 0  # the output tokens its good lines may make (n x max_tokens each); 0: not kept
    finished_budget: int = 0  # the part of output_budget its finished requests held
    at_risk_at: float | None = None  # when it was first found at risk and its at-risk event raised (outbox)
    tokens_in_flight: int = 0  # made so far by its requests running now, as live workers last said

    @classmethod
    def of(cls, job: Job, tenant: str) -> JobView:
        """The view of an ORM ``Job`` row."""
        return cls.of_columns({c: getattr(job, _ORM_ATTRIBUTE.get(c, c)) for c in COLUMNS.values()}, tenant)

    @classmethod
    def of_columns(cls, row: Mapping[str, Any], tenant: str) -> JobView:
        """The view of the ``jobs`` table's columns by name (``COLUMNS``), as a query or the ORM gives them:
        the status as its value or the enum, the metadata as JSON text (SQLite) or decoded."""
        values = {field: row[column] for field, column in COLUMNS.items()}
        values["tokens_in_flight"] = int(row.get("tokens_in_flight") or 0)  # a numeric sum on PostgreSQL
        values["status"] = JobStatus(values["status"])
        metadata = values["metadata"]
        values["metadata"] = dict(json.loads(metadata) if isinstance(metadata, str) else metadata or {})
        return cls(tenant=tenant, **values)

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def progress(self) -> float:
        """The fraction of requests done (0 while there are none); the SQL view ``berth_jobs`` says the same."""
        return self.done / self.total if self.total else 0.0

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.cancelled_at or self.expired_at

    @property
    def seconds_running(self) -> float:
        if self.in_progress_at is None:
            return 0.0
        return max((self.finalizing_at or self.ended_at or time.time()) - self.in_progress_at, 0.0)

    @property
    def output_tokens_per_second(self) -> float:
        s = self.seconds_running
        return self.completion_tokens / s if s else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Output tokens made a second, running requests' included (work done, not requests finished)."""
        s = self.seconds_running
        return self.tokens_made / s if s else 0.0

    @property
    def requests_per_second(self) -> float:
        s = self.seconds_running
        return self.done / s if s else 0.0

    @property
    def tokens_made(self) -> int:
        """Output tokens made: by its finished requests, and so far by those running."""
        return self.completion_tokens + self.tokens_in_flight

    @property
    def expected_tokens(self) -> int | None:
        """The output tokens it will have made (``jobs.records.work_estimate``'s rule): the finished requests'
        own, the others' budgets scaled by the share of their budgets the finished ones used, and at least
        what is made. None for a job whose budget was not kept."""
        if not self.output_budget:
            return None
        ratio = self.completion_tokens / self.finished_budget if self.finished_budget else 1.0
        expected = self.completion_tokens + ratio * max(0, self.output_budget - self.finished_budget)
        return max(round(expected), self.tokens_made)

    @property
    def eta_seconds(self) -> float | None:
        """Time left at the rate so far, from work done: tokens still expected over tokens made a second
        (requests done a second where the budget was not kept); None before there is a rate or once over."""
        if self.status.is_final:
            return None
        expected, seconds = self.expected_tokens, self.seconds_running
        if expected is not None and seconds and self.tokens_made:
            return (expected - self.tokens_made) / (self.tokens_made / seconds)
        rate = self.requests_per_second
        if not rate:
            return None
        return (self.total - self.done) / rate

    @property
    def expected_finish_at(self) -> float | None:
        """When it will have run all its requests at its measured rate (``eta_seconds`` from now); None
        where there is no rate yet, or once over."""
        eta = self.eta_seconds
        return None if eta is None else time.time() + eta

    @property
    def at_risk(self) -> bool:
        """Live, and expected to finish later than ``AT_RISK_MARGIN`` of its window before the window ends:
        it will expire with requests undone unless it speeds up."""
        finish = self.expected_finish_at
        if finish is None or self.status not in (JobStatus.VALIDATING, JobStatus.IN_PROGRESS):
            return False
        return finish > self.expires_at - AT_RISK_MARGIN * max(self.expires_at - self.created_at, 0.0)

    def to_dict(self) -> dict:
        """Shaped like OpenAI's Batch object, with berth's tenant, priority and throughput."""
        stamp = lambda t: None if t is None else int(t)  # noqa: E731
        return {
            "id": self.id, "object": "batch", "model": self.model, "status": self.status.value,
            "tenant": self.tenant, "priority": self.priority, "completion_window": self.completion_window,
            "metadata": self.metadata, "input_file": self.input_name,
            "output_file": self.output_key, "error_file": self.errors_key,
            "errors": None if self.error is None else {"data": [{"code": self.error_code or "job_failed",
                                                                  "message": self.error}]},
            "enqueued_tokens": self.enqueued_tokens,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "progress": round(self.progress, 6), "message_id": self.message_id,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_tokens": self.cached_tokens},
            "output_tokens_per_second": round(self.output_tokens_per_second, 2),
            "progress_tokens": {"made": self.tokens_made, "running": self.tokens_in_flight,
                                "expected": self.expected_tokens},
            "eta_seconds": None if self.eta_seconds is None else round(self.eta_seconds, 1),
            "expected_finish_at": stamp(self.expected_finish_at), "at_risk": self.at_risk,
            "at_risk_since": stamp(self.at_risk_at),
            **{f"{name}_at": stamp(getattr(self, f"{name}_at")) for name in (
                "created", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired",
                "expires")},
        }


def _views(db: Database, where: list[str], params: dict, tail: str = "") -> list[JobView]:
    """The jobs ``_SELECT`` finds under every condition of ``where`` (then ``tail``: order, limit)."""
    query = _SELECT + (" WHERE " + " AND ".join(where) if where else "") + tail
    with db.engine.connect() as conn:
        rows = conn.execute(text(query), {**params, "fresh": time.time() - FRESH}).mappings().all()
    return [JobView.of_columns(row, row["tenant_name"]) for row in rows]


def get_job(db: Database, job_id: str) -> JobView:
    found = _views(db, ["jobs.id = :job_id"], {"job_id": job_id})
    if not found:
        raise JobNotFound(job_id)
    return found[0]


def list_jobs(db: Database, tenant: str | None = None, status: JobStatus | None = None, limit: int = 20, *,
              since: float | None = None, until: float | None = None, metadata: Mapping[str, str] | None = None,
              input_name: str | None = None, cli_only: bool = False) -> list[JobView]:
    """The newest jobs first; each filter narrows: created in [``since``, ``until``) (epoch seconds), every
    ``metadata`` label equal, submitted from a file of that name (``cli_only``: by the CLI, not the API)."""
    where, params = [], {"limit": limit}
    if tenant is not None:
        where.append("tenants.name = :tenant")
        params["tenant"] = tenant
    if status is not None:
        where.append("jobs.status = :status")
        params["status"] = JobStatus(status).value
    if since is not None:
        where.append("jobs.created_at >= :since")
        params["since"] = since
    if until is not None:
        where.append("jobs.created_at < :until")
        params["until"] = until
    if input_name is not None:
        where.append("jobs.input_name = :input_name")
        params["input_name"] = input_name
    if cli_only:
        where.append("jobs.endpoint IS NULL")
    for i, (key, value) in enumerate((metadata or {}).items()):
        where.append(_metadata_equals(db, i))
        params[f"mk{i}"] = key if db.engine.dialect.name == "postgresql" else '$."' + key.replace('"', '""') + '"'
        params[f"mv{i}"] = value
    return _views(db, where, params, " ORDER BY jobs.created_at DESC LIMIT :limit")


def live_jobs_not_yet_at_risk(db: Database) -> list[JobView]:
    """The validating and in-progress jobs whose at-risk event was never raised (``at_risk_at`` unset)."""
    return _views(db, ["jobs.status IN (:validating, :in_progress)", "jobs.at_risk_at IS NULL"],
                  {"validating": JobStatus.VALIDATING.value, "in_progress": JobStatus.IN_PROGRESS.value})


def _metadata_equals(db: Database, i: int) -> str:
    """The SQL that holds where the job's metadata label ``:mk<i>`` is ``:mv<i>`` (a JSON column)."""
    if db.engine.dialect.name == "postgresql":
        return f"(jobs.metadata ->> :mk{i}) = :mv{i}"
    return f"json_extract(jobs.metadata, :mk{i}) = :mv{i}"


# The states of a job that may hold enqueued tokens (jobs.records.budgets): a job that ended holds none.
HOLDING = (JobStatus.VALIDATING, JobStatus.IN_PROGRESS, JobStatus.FINALIZING, JobStatus.CANCELLING)


@dataclass(frozen=True)
class InteractiveLimits:
    """A tenant's limits on berth serve's chat and completions (``jobs.http.interactive_limits``): requests
    running at once and tokens in any 60 s, each counted by every server process on its own; 0: none.
    ``own_*``: set for the tenant, not the setting's default."""

    live_requests: int
    tokens_per_minute: int
    own_live_requests: bool = False
    own_tokens_per_minute: bool = False

    @classmethod
    def of(cls, live_requests: int | None, tokens_per_minute: int | None, default_live_requests: int,
           default_tokens_per_minute: int) -> InteractiveLimits:
        """From a tenant's columns (None: the default)."""
        return cls(default_live_requests if live_requests is None else int(live_requests),
                   default_tokens_per_minute if tokens_per_minute is None else int(tokens_per_minute),
                   live_requests is not None, tokens_per_minute is not None)

    def describe(self) -> str:
        live = f"{self.live_requests:,}" if self.live_requests else "no limit"
        tokens = f"{self.tokens_per_minute:,}" if self.tokens_per_minute else "no limit"
        return (f"interactive requests at once {live}"
                f"{'' if self.own_live_requests else ' (BERTH_HTTP_TENANT_LIVE_REQUESTS)'}, tokens per minute "
                f"{tokens}{'' if self.own_tokens_per_minute else ' (BERTH_HTTP_TENANT_TOKENS_PER_MINUTE)'}, "
                "each berth serve process counting its own")


@dataclass(frozen=True)
class Budget:
    """A tenant's token budget (``jobs.records.budgets``) as ``berth tenant``, ``berth status`` and the
    metrics show it, with its interactive limits when asked for (``budgets``' ``interactive_defaults``)."""

    tenant: str
    limit: int  # its enqueued tokens per model at most; 0: none
    own_limit: bool  # set for the tenant, not BERTH_TENANT_MAX_ENQUEUED_TOKENS
    enqueued: dict[str, int]  # model -> its enqueued tokens, for the models of its jobs not yet over
    interactive: InteractiveLimits | None = None

    def describe(self, model: str | None = None) -> str:
        limit = f"{self.limit:,}" if self.limit else "no limit"
        source = "" if self.own_limit else " (BERTH_TENANT_MAX_ENQUEUED_TOKENS)"
        models = [model] if model is not None else sorted(self.enqueued)
        held = ", ".join(f"{self.enqueued.get(m, 0):,} of {m}" for m in models) or "none"
        return f"enqueued tokens {held}; limit {limit} per model{source}"


def budgets(db: Database, default_limit: int, tenant: str | None = None,
            interactive_defaults: tuple[int, int] | None = None) -> list[Budget]:
    """Each tenant's enqueued-token limit and enqueued tokens per model (only ``tenant``'s if given:
    ``TenantNotFound`` if it has none); with ``interactive_defaults`` (live requests, tokens per minute:
    the settings'), its interactive limits too."""
    holding = ", ".join(f"'{state.value}'" for state in HOLDING)
    where, params = ("WHERE tenants.name = :tenant", {"tenant": tenant}) if tenant is not None else ("", {})
    with db.engine.connect() as conn:
        tenants = conn.execute(text("SELECT id, name, enqueued_token_limit, live_request_limit, "
                                    f"tokens_per_minute_limit FROM tenants {where} ORDER BY name"), params).all()
        held: dict[int, dict[str, int]] = {}
        for tenant_id, model, tokens in conn.execute(text(
                "SELECT jobs.tenant_id, jobs.model, SUM(jobs.enqueued_tokens) FROM jobs JOIN tenants ON "
                f"tenants.id = jobs.tenant_id {where} {'AND' if where else 'WHERE'} jobs.status IN ({holding}) "
                "GROUP BY jobs.tenant_id, jobs.model"), params):
            held.setdefault(tenant_id, {})[model] = int(tokens or 0)
    if tenant is not None and not tenants:
        raise TenantNotFound(tenant)
    return [Budget(name, default_limit if limit is None else int(limit), limit is not None, held.get(tenant_id, {}),
                   None if interactive_defaults is None else InteractiveLimits.of(live, tokens, *interactive_defaults))
            for tenant_id, name, limit, live, tokens in tenants]


def interactive_limits(db: Database, tenant: str, default_live_requests: int,
                       default_tokens_per_minute: int) -> InteractiveLimits:
    """The tenant's interactive limits; the defaults for a tenant without a row."""
    with db.engine.connect() as conn:
        row = conn.execute(text("SELECT live_request_limit, tokens_per_minute_limit FROM tenants WHERE name = :tenant"),
                           {"tenant": tenant}).one_or_none()
    return InteractiveLimits.of(*(row or (None, None)), default_live_requests, default_tokens_per_minute)

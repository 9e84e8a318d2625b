"""The jobs database: tenants, jobs, their requests, results and the lines that failed validation;
the broker users allowed to submit through the queue, and the outbox of job events.

Timestamps are Unix seconds (floats), as the OpenAI Batch object reports them. The schema is made
only by the migrations in ``migrations/``; these classes are what the code reads and writes.
"""

from __future__ import annotations

import enum
import time

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from jobs.records.job_status import JobStatus

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class ResultStatus(str, enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"


def _enum(cls) -> Enum:
    return Enum(cls, native_enum=False, length=16, values_callable=lambda e: [m.value for m in e])


# What a job event (``JobEvent.kind``) says: the job's status changed, or it was found at risk of missing its window
STATUS_EVENT, AT_RISK_EVENT = "status", "at_risk"


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # its share of the engines under fair share
    created_at: Mapped[float] = mapped_column(Float, default=now)
    webhook_secret: Mapped[str | None] = mapped_column(String(128))  # signs its webhooks; made on first use
    # Tenants with the same group share cached prompt prefixes (the engine's and the fleet's prefix store);
    # None: its prefixes are its own (``jobs.records.tenants.set_cache_group``)
    cache_group: Mapped[str | None] = mapped_column(String(64))
    # Its enqueued tokens per model at most (``jobs.records.budgets``); None: BERTH_TENANT_MAX_ENQUEUED_TOKENS, 0: none
    enqueued_token_limit: Mapped[int | None] = mapped_column(BigInteger)
    # berth serve's interactive limits (``jobs.http.interactive_limits``); None: BERTH_HTTP_TENANT_LIVE_REQUESTS
    # and BERTH_HTTP_TENANT_TOKENS_PER_MINUTE, 0: none
    live_request_limit: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute_limit: Mapped[int | None] = mapped_column(BigInteger)


class Job(Base):
    __tablename__ = "jobs"
    # a queue submit's AMQP message_id, unique per tenant: the same message twice makes one job
    __table_args__ = (Index("ix_jobs_tenant_message_id", "tenant_id", "submit_message_id", unique=True),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus), index=True)
    priority: Mapped[int] = mapped_column(SmallInteger, default=0)
    completion_window: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    input_name: Mapped[str] = mapped_column(String(500))  # the file name the user gave
    input_key: Mapped[str] = mapped_column(Text)  # the input file in the job store
    output_key: Mapped[str | None] = mapped_column(Text)  # written when the job is finalized
    errors_key: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)  # why the whole job failed
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # of prompt_tokens, from a cache
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[float] = mapped_column(Float, default=now)
    in_progress_at: Mapped[float | None] = mapped_column(Float)
    finalizing_at: Mapped[float | None] = mapped_column(Float)
    completed_at: Mapped[float | None] = mapped_column(Float)
    failed_at: Mapped[float | None] = mapped_column(Float)
    cancelling_at: Mapped[float | None] = mapped_column(Float)
    cancelled_at: Mapped[float | None] = mapped_column(Float)
    expired_at: Mapped[float | None] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    ingest_seen_at: Mapped[float | None] = mapped_column(Float)  # the ingest's last sign of life
    # As the HTTP API shows the job (an OpenAI Batch): the endpoint it was created for and its files.
    endpoint: Mapped[str | None] = mapped_column(String(64))  # None: submitted by the CLI, any url per line
    input_file_id: Mapped[str | None] = mapped_column(String(40))
    output_file_id: Mapped[str | None] = mapped_column(String(40))  # given once the job is over
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    submit_message_id: Mapped[str | None] = mapped_column(String(255))  # set for jobs submitted through the queue
    webhook_url: Mapped[str | None] = mapped_column(Text)  # where its events are POSTed, if anywhere
    # OpenAI's output_expires_after: its output and errors files are deleted this long after they are written
    output_expires_after: Mapped[int | None] = mapped_column(Integer)
    # The prompt tokens and max_tokens of its lines stored and not yet done: what it holds of its tenant's
    # enqueued-token limit for its model (``jobs.records.budgets``); 0 once the job is over
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The output tokens its good lines may make (n x max_tokens each, added as they are stored): with the
    # tokens made, what its ETA counts (``jobs.records.status``); 0 for a job from before it was kept
    output_budget: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    finished_budget: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # of those done
    error_code: Mapped[str | None] = mapped_column(String(64))  # OpenAI's code for ``error`` (None: invalid_file)
    # What its copy of its input, its output and its errors file hold in the store (its tenant's storage
    # quota, ``jobs.records.storage_quota``); 0 once deleted
    input_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    output_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    errors_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # When it was first found expected to finish after its window (``jobs.records.outbox.raise_at_risk``,
    # which writes its at-risk event then); stays set once set
    at_risk_at: Mapped[float | None] = mapped_column(Float)


class RequestRow(Base):
    """One valid input line, as the engine will run it. ``published_at`` is set once its message is
    confirmed by the broker; the reconciler republishes rows left without it."""

    __tablename__ = "requests"
    __table_args__ = (Index("ix_requests_job_line", "job_id", "line"),
                      Index("ix_requests_job_custom_id", "job_id", "custom_id", unique=True))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    url: Mapped[str] = mapped_column(String(64))
    prompt_token_ids: Mapped[list] = mapped_column(JSON)
    params: Mapped[dict] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # deliveries to an engine worker
    published_at: Mapped[float | None] = mapped_column(Float, index=True)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    # The delivery in hand: the worker holding it ("host:pid"; cleared when it hands it back or records
    # its outcome), whether an engine step ran it, the checkpointed output tokens it started from, and
    # the deliveries in a row that ended with their worker dead and no checkpoint progress (poison).
    holder: Mapped[str | None] = mapped_column(String(200))
    started: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    progress: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    strikes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Crashes charged to their cause (``worker.consumer.suspects``): the life of the worker process holding
    # the delivery (a uuid: "host:pid" names come back), and, for a request that was running when a worker
    # died, its suspect size class: it runs only apart from other work, in a group of at most that many.
    holder_life: Mapped[str | None] = mapped_column(String(32), index=True)
    suspect: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Where the request's latest checkpointed state is: a segment of the checkpoint store and the byte
    # range of the state in it (``worker.checkpoint.format.StateRef``), written by the worker holding it.
    checkpoint: Mapped[str | None] = mapped_column(String(300))
    # The line's cache_salt as the engine keys it ("salt:<text>"): requests with the same one share cached
    # prefixes, whatever their tenant; None: the tenant's (or its group's) own
    cache_salt: Mapped[str | None] = mapped_column(String(300))
    # What the line holds of its tenant's enqueued tokens until it is done: its prompt tokens and n * max_tokens
    tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Result(Base):
    """The one outcome of a request: the unique ``request_id`` makes a second writer a no-op."""

    __tablename__ = "results"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    status: Mapped[ResultStatus] = mapped_column(_enum(ResultStatus))
    response: Mapped[dict | None] = mapped_column(JSON)  # the output line's "response"
    error: Mapped[dict | None] = mapped_column(JSON)  # {"code", "message"}
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # prompt tokens from a prefix cache
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    worker: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float, default=now)


class LineErrorRow(Base):
    """An input line that never became a request: its number, field and reason."""

    __tablename__ = "line_errors"
    __table_args__ = (Index("ix_line_errors_job_line", "job_id", "line"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str | None] = mapped_column(String(512))
    param: Mapped[str | None] = mapped_column(String(200))
    code: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)


class ApiKey(Base):
    """A bearer key of the HTTP API: only its SHA-256 is kept; the key itself is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the key's first characters, to tell keys apart
    created_at: Mapped[float] = mapped_column(Float, default=now)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class FileRow(Base):
    """A file of the HTTP API (OpenAI's File object): an upload, or a job's input, output or errors."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    purpose: Mapped[str] = mapped_column(String(32))  # batch (uploads, job inputs) or batch_output
    filename: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str] = mapped_column(Text)  # where the content is in the store
    job_id: Mapped[str | None] = mapped_column(String(40))  # the job it belongs to, for a job's own files
    created_at: Mapped[float] = mapped_column(Float, default=now)
    expires_at: Mapped[float | None] = mapped_column(Float, index=True)  # deleted then (jobs.records.file_removal)


class IdempotencyKey(Base):
    """A create retried with the same ``Idempotency-Key`` (same tenant and route) returns what the
    first made. ``object_id`` is None while the first is still being made."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_keys_scope", "tenant_id", "route", "key", unique=True),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    route: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(255))
    fingerprint: Mapped[str] = mapped_column(String(64))  # SHA-256 of what was asked
    object_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[float] = mapped_column(Float, default=now)


class WorkerRow(Base):
    """An engine worker's last heartbeat; one not seen for ``jobs.records.workers.GONE_AFTER`` seconds is gone."""

    __tablename__ = "workers"
    __table_args__ = (Index("ix_workers_seen_at", "seen_at"),)

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # "host:pid", as requests.holder
    host: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(32))
    running: Mapped[int] = mapped_column(Integer)
    waiting: Mapped[int] = mapped_column(Integer)
    kv_blocks_used: Mapped[int] = mapped_column(Integer)
    kv_blocks_free: Mapped[int] = mapped_column(Integer)
    output_tokens_per_second: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float] = mapped_column(Float)
    seen_at: Mapped[float] = mapped_column(Float)


class JobProgress(Base):
    """A worker's tokens made so far by the requests of a job it is running, as of its last heartbeat."""

    __tablename__ = "job_progress"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(40), primary_key=True)  # no foreign key: a beat never fails on it
    tokens: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[float] = mapped_column(Float)


class WorkerSample(Base):
    """One heartbeat's figures, kept for an hour: the dashboard's charts."""

    __tablename__ = "worker_samples"
    __table_args__ = (Index("ix_worker_samples_worker_at", "worker_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(200))
    at: Mapped[float] = mapped_column(Float)
    output_tokens_per_second: Mapped[float] = mapped_column(Float)
    kv_blocks_used: Mapped[int] = mapped_column(Integer)
    kv_blocks_free: Mapped[int] = mapped_column(Integer)


class WorkerDeath(Base):
    """A worker process found dead while running requests, by the admission of one of them elsewhere:
    once per life, with how many requests it was running. Their rate per host names a crash loop."""

    __tablename__ = "worker_deaths"
    __table_args__ = (Index("ix_worker_deaths_life", "life", unique=True), Index("ix_worker_deaths_at", "at"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    life: Mapped[str] = mapped_column(String(32))  # requests.holder_life of the dead process
    worker: Mapped[str] = mapped_column(String(200))  # "host:pid"
    host: Mapped[str] = mapped_column(String(200))
    at: Mapped[float] = mapped_column(Float)  # when it was found dead
    running: Mapped[int] = mapped_column(Integer)  # requests an engine step of it was running when it died


class BrokerUser(Base):
    """A broker (RabbitMQ) user allowed to submit jobs through the queue, and the tenant its jobs are
    for. The tenant of a submit message is its AMQP ``user_id``, which RabbitMQ checks against the
    connection's user, mapped here; a user not here may not submit."""

    __tablename__ = "broker_users"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[float] = mapped_column(Float, default=now)


class JobEvent(Base):
    """The outbox: one row per change of a job's status, written by database triggers on ``jobs`` in
    the transaction that changes it (see ``jobs.queue_door.events``), with the job's counts and files as they
    were then; and one when a live job is first found at risk of missing its window
    (``jobs.records.outbox.raise_at_risk``). The relay publishes it (``published_at``) and POSTs it to the job's webhook
    (``webhook_due_at`` is when the next try is due, None when there is none to make)."""

    __tablename__ = "job_events"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused: they are the events' ids

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # STATUS_EVENT (the triggers', which leave it to its default) or AT_RISK_EVENT; ``status`` is the job's then
    kind: Mapped[str] = mapped_column(String(16), default=STATUS_EVENT, server_default=STATUS_EVENT)
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus))
    total: Mapped[int] = mapped_column(Integer)
    completed: Mapped[int] = mapped_column(Integer)
    failed: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    output_key: Mapped[str | None] = mapped_column(Text)
    errors_key: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    webhook_url: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    published_at: Mapped[float | None] = mapped_column(Float, index=True)
    webhook_due_at: Mapped[float | None] = mapped_column(Float, index=True)
    webhook_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    webhook_sent_at: Mapped[float | None] = mapped_column(Float)
    webhook_error: Mapped[str | None] = mapped_column(Text)
    expected_finish_at: Mapped[float | None] = mapped_column(Float)  # an at-risk event's, when it was raised

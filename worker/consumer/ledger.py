"""What an engine worker needs of the jobs database, as one narrow interface.

The worker reaches the database only through a ``Ledger``: ``jobs.hosting.database_ledger`` implements it on the
jobs schema and is handed to the worker where the ``berth worker`` command is built, and the tests
hand it an in-memory fake. So ``worker/`` imports nothing of ``jobs/``, and the consumer's logic
(admission, poison, outcomes, outages) is testable without servers.

The request row is the source of truth: ``claim`` returns what the row says the request is (prompt,
parameters, job, tenant), and a message only points at it. A call that fails for want of the
database raises ``LedgerDown``; the worker then waits and tries again (``worker.consumer.database_health``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from worker.engine.request import RequestOutput, SamplingParams


class LedgerDown(Exception):
    """The jobs database did not answer; nothing was written."""


@dataclass(frozen=True)
class Death:
    """A worker process found dead while an engine step ran requests: one per death, whoever finds it."""

    id: int
    worker: str  # "host:pid", as it held requests
    running: int  # requests it was running then (a group of suspects alone, or its whole batch)
    at: float  # unix time it was found dead


@dataclass(frozen=True)
class Claim:
    """A request just delivered to this worker, as its row says it is."""

    request_id: int
    job_id: str
    model: str
    tenant: str
    priority: int
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: the row's parameters cannot be read (``unreadable`` says why)
    open: bool  # no outcome yet and its job still live: run it; otherwise ack and skip
    attempts: int  # deliveries so far, this one included
    crashed: bool  # the delivery before ended with its worker dead while an engine step ran the request
    progress: int  # output tokens checkpointed when the delivery before began
    strikes: int  # deliveries in a row that ended so without checkpoint progress
    last_error: str | None
    unreadable: str | None = None
    suspect: int = 0  # 0: innocent; k: was running when a worker died: runs apart, in a group of at most k suspects
    death: Death | None = None  # when ``crashed``: the death of the worker that was running it
    checkpoint: str | None = None  # where its latest checkpointed state is (``Ledger.checkpointed``); None: none
    # who shares its cached prefixes (``Request.cache_salt``): None, its tenant alone; else its tenant's
    # sharing group ("group:<name>") or the request's own cache_salt ("salt:<text>")
    cache_salt: str | None = None
    deadline: float | None = None  # unix time its job's completion window ends (the engine runs earlier ones first)

    @property
    def kv_tokens(self) -> int:
        """The most KV slots the request can hold: its prompt and every sample's output."""
        p = self.params
        return len(self.prompt_token_ids) + (p.n * p.max_tokens if p else 0)


@dataclass(frozen=True)
class Outcome:
    """A request's one outcome: the engine's output, or a failure with a code and a reason."""

    request_id: int
    job_id: str
    output: RequestOutput | None = None
    error_code: str | None = None
    error: str | None = None

    @classmethod
    def failure(cls, request_id: int, job_id: str, code: str, message: str) -> Outcome:
        return cls(request_id, job_id, None, code, message)

    @property
    def completed(self) -> bool:
        return self.output is not None


@dataclass(frozen=True)
class Heartbeat:
    """What a worker says of itself every few seconds (the dashboard's workers and charts)."""

    worker: str  # "host:pid", as it holds requests
    host: str
    model: str
    device: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    output_tokens_per_second: float
    started_at: float  # unix time
    at: float
    job_tokens: dict[str, int] = field(default_factory=dict)  # job id -> its running requests' tokens made so far


class Ledger(Protocol):
    def claim(self, request_ids: list[int], worker: str) -> dict[int, Claim]:
        """Count a delivery of each request, held by ``worker`` from now on; what each row says.
        Ids without a row are missing from the answer."""

    def started(self, request_ids: list[int]) -> None:
        """An engine step is about to run these requests for the first time in their delivery."""

    def begin(self, baselines: dict[int, tuple[int, int]], started: list[int] = ()) -> None:
        """request id -> (checkpointed output tokens it starts from, its strikes), before it runs; in the same
        transaction, ``started`` as ``started`` says (the claim's thread says both for fresh requests)."""

    def suspect(self, classes: dict[int, int]) -> None:
        """request id -> its suspect size class from now on (0: innocent again), before it runs."""

    def paused(self, request_ids: list[int], starting: list[int] = ()) -> None:
        """These stop running for a while, as the group ``starting`` (suspects) begins to run alone: in
        one transaction, ``request_ids`` no longer started, ``starting`` started. A worker that dies
        from now on did not die running the first. ``started`` says when they run again."""

    def cleared(self, request_ids: list[int]) -> None:
        """Suspects that ran alone without their worker dying: innocent again, paused until ``started``."""

    def worker_deaths(self, window: float) -> dict[str, int]:
        """host -> its worker processes found dead while running requests in the last ``window`` seconds."""

    def release(self, request_ids: list[int]) -> None:
        """Handed back unfinished by a worker told to stop: that delivery was no failed attempt."""

    def checkpointed(self, refs: dict[int, str], worker: str) -> None:
        """request id -> where its latest checkpointed state is now (``worker.checkpoint.format.StateRef``
        as text), kept on the row only while ``worker`` holds the request, for its next delivery's claim.
        Called from the checkpoint writer's thread (never the engine loop's), once a round; on
        ``LedgerDown`` the writer tries again later."""

    def note_error(self, request_id: int, error: str) -> None:
        """The last error seen running a request (shown if it finally fails)."""

    def record(self, outcomes: list[Outcome], worker: str) -> set[int]:
        """Commit the first outcome of each request (a second is ignored) and its job's counters, and
        have the jobs that are now complete finalized; the request ids whose outcome this call wrote."""

    def closed_jobs(self, job_ids: set[str]) -> set[str]:
        """Those of ``job_ids`` no longer live (cancelled, expired, finished)."""

    def live_tenants(self, model: str) -> dict[str, float]:
        """Tenant -> weight, for the tenants with live jobs of ``model``."""

    def token_budgets(self, model: str) -> dict[str, tuple[int, int]]:
        """Tenant -> (its enqueued tokens of ``model``, its limit; 0: none), for the tenants with live jobs of it."""

    def heartbeat(self, beat: Heartbeat) -> None:
        """The worker is alive and this is what it runs."""

    def close(self) -> None:
        """The worker stopped: release what the ledger holds of its own (no call follows)."""

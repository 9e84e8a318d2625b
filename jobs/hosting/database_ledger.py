"""The jobs database as an engine worker sees it: ``worker.consumer.ledger.Ledger`` on the jobs schema.

A delivery is claimed in one transaction: its attempt counted, the row's account of the previous
delivery read (did its worker die while running it? then that death is recorded once, with how
many requests it was running: ``jobs.records.workers.found_dead``), and this worker written as the holder,
with the life of this process (a uuid: a restarted worker in a container has the same "host:pid"). The
request's row is what the worker runs: prompt, parameters, job, tenant, priority. Outcomes become
result rows (the OpenAI Batch response line built here, where the output format lives) and job
counters in one transaction; the jobs that are then complete are handed to the finalize task.
Every call that fails for want of the database raises ``LedgerDown``.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from dataclasses import dataclass, fields

from sqlalchemy import bindparam, select, update
from sqlalchemy import exc as sql_errors

from jobs.lines.batch_format import BatchLine, response_line
from jobs.lines.tool_formats import FORMATS
from jobs.pipeline.celery_tasks import finalize_later, make_app
from jobs.records import workers
from jobs.records.db import one_of, open_database
from jobs.records.lifecycle import LIVE
from jobs.records.models import Job, RequestRow, Result, ResultStatus, Tenant, now
from jobs.records.results import ResultRecord, record_outcomes
from jobs.records.status import budgets
from jobs.records.tenants import live_tenants
from worker.config import Settings
from worker.consumer.ledger import Claim, Death, Heartbeat, LedgerDown, Outcome
from worker.engine.request import EmbeddingParams, SamplingParams, StructuredOutput

log = logging.getLogger("berth.worker")

_DOWN = (sql_errors.OperationalError, sql_errors.InterfaceError)  # not reachable (bugs are other errors)
_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
MAX_ERROR = 4000  # characters of an error kept in requests.last_error
KEPT_ROWS = 100_000  # requests whose claimed row's facts for their outcome are kept at most (``JobsLedger.kept``)


def params_from_dict(data: dict) -> SamplingParams:
    """A request row's parameters (``jobs.pipeline.request_messages.params_to_dict``); a row from before a field
    existed gets its default (no ``structured``: unconstrained). A value of the wrong shape raises
    ``TypeError`` or ``ValueError``."""
    values = {k: v for k, v in data.items() if k in _PARAM_FIELDS}
    for name in ("stop", "stop_token_ids"):
        values[name] = tuple(values.get(name, ()))
    if "logit_bias" in values:  # JSON holds the (token id, bias) pairs as lists
        values["logit_bias"] = tuple((int(t), float(b)) for t, b in values["logit_bias"])
    structured = values.get("structured")
    if structured is not None:
        if not isinstance(structured, dict) or not isinstance(structured.get("value", ""), str):
            raise TypeError(f"structured must be an object with a kind and a string value, not {structured!r:.200}")
        values["structured"] = StructuredOutput(**structured)
    embedding = values.get("embedding")
    if embedding is not None:
        if not isinstance(embedding, dict) or not isinstance(embedding.get("lengths"), list):
            raise TypeError(f"embedding must be an object with a list of lengths, not {embedding!r:.200}")
        values["embedding"] = EmbeddingParams(**{**embedding, "lengths": tuple(embedding["lengths"])})
    return SamplingParams(**values)


def _translated(method):
    """The database being unreachable becomes ``LedgerDown``, the one error the worker waits out."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except _DOWN as exc:
            raise LedgerDown(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    return call


class JobsLedger:
    def __init__(self, settings: Settings, tokenizer, model_name: str, eager_tasks: bool | None = None):
        """``eager_tasks``: run the finalize tasks in this process (default: when the broker is embedded)."""
        self.db = open_database(settings.database_url)
        self.dialect = self.db.engine.dialect.name
        self.token_limit = settings.tenant_max_enqueued_tokens
        self.tasks = make_app(settings, eager_tasks)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.life = uuid.uuid4().hex  # this process, as its rows' ``holder_life`` and its death name it
        # request id -> (url, params, tokens) as its claim read them: what its outcome's record needs of the
        # row, which never changes, so that a step's record does not read them again (a transaction less)
        self.kept: dict[int, tuple[str | None, dict | None, int]] = {}

    @_translated
    def claim(self, request_ids: list[int], worker: str) -> dict[int, Claim]:
        if not request_ids:
            return {}
        ids = one_of(RequestRow.id, request_ids, self.dialect)
        with self.db.session() as s, s.begin():
            # the write first: it takes the rows' locks (SQLite: the database's) before they are read
            s.execute(update(RequestRow).where(ids).values(attempts=RequestRow.attempts + 1, delivered_at=now()))
            rows = s.execute(
                select(RequestRow, Job.status, Job.model, Job.priority, Tenant.name, Tenant.cache_group, Job.expires_at,
                       Result.id)
                .join(Job, Job.id == RequestRow.job_id).join(Tenant, Tenant.id == Job.tenant_id)
                .outerjoin(Result, Result.request_id == RequestRow.id).where(ids)).all()
            dead = {_life(row): row.holder for row, *_, result_id in rows
                    if result_id is None and row.holder is not None and row.started}
            deaths = workers.found_dead(s, dead)
            claims = {row.id: _claim(row, status, model, priority, tenant, result_id is None and status in LIVE,
                                     deaths.get(_life(row)), group, expires_at)
                      for row, status, model, priority, tenant, group, expires_at, result_id in rows}
            s.execute(update(RequestRow).where(ids).values(holder=worker[:200], holder_life=self.life, started=False))
        self._keep({row.id: (row.url, row.params, row.tokens) for row, *_ in rows})
        return claims

    def _keep(self, facts: dict[int, tuple[str | None, dict | None, int]]) -> None:
        self.kept.update(facts)
        while len(self.kept) > KEPT_ROWS:  # requests claimed and never recorded here (handed back, closed jobs)
            del self.kept[next(iter(self.kept))]

    # ``started`` and ``begin`` run before a step (on the loop's thread, or the claims' with a claim): SQLAlchemy's
    # core on a connection, not an ORM session's bulk update, which cost several times the statement's CPU
    @_translated
    def started(self, request_ids: list[int]) -> None:
        rows = RequestRow.__table__
        with self.db.engine.begin() as connection:
            connection.execute(update(rows).where(one_of(rows.c.id, request_ids, self.dialect)).values(started=True))

    @_translated
    def begin(self, baselines: dict[int, tuple[int, int]], started: list[int] = ()) -> None:
        rows = RequestRow.__table__
        stmt = update(rows).where(rows.c.id == bindparam("rid")).values(progress=bindparam("b_progress"),
                                                                        strikes=bindparam("b_strikes"))
        with self.db.engine.begin() as connection:  # one executemany
            connection.execute(stmt, [{"rid": rid, "b_progress": tokens, "b_strikes": strikes}
                                      for rid, (tokens, strikes) in baselines.items()])
            if started:
                connection.execute(update(rows).where(one_of(rows.c.id, started, self.dialect)).values(started=True))

    @_translated
    def suspect(self, classes: dict[int, int]) -> None:
        with self.db.session() as s, s.begin():
            s.execute(update(RequestRow), [{"id": rid, "suspect": k} for rid, k in classes.items()])

    @_translated
    def paused(self, request_ids: list[int], starting: list[int] = ()) -> None:
        with self.db.session() as s, s.begin():
            s.execute(update(RequestRow).where(RequestRow.id.in_(request_ids)).values(started=False))
            if starting:
                s.execute(update(RequestRow).where(RequestRow.id.in_(starting)).values(started=True))

    @_translated
    def cleared(self, request_ids: list[int]) -> None:
        with self.db.session() as s, s.begin():
            s.execute(update(RequestRow).where(RequestRow.id.in_(request_ids)).values(started=False, suspect=0))

    @_translated
    def worker_deaths(self, window: float) -> dict[str, int]:
        return workers.deaths_by_host(self.db, window)

    @_translated
    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:  # their outcomes are another delivery's to record
            self.kept.pop(rid, None)
        with self.db.session() as s, s.begin():
            s.execute(update(RequestRow).where(RequestRow.id.in_(request_ids), RequestRow.attempts > 0)
                      .values(attempts=RequestRow.attempts - 1))
            s.execute(update(RequestRow).where(RequestRow.id.in_(request_ids)).values(holder=None, started=False))

    @_translated
    def checkpointed(self, refs: dict[int, str], worker: str) -> None:
        if not refs:
            return
        rows = RequestRow.__table__
        stmt = (update(rows).where(rows.c.id == bindparam("rid"), rows.c.holder == worker[:200])
                .values(checkpoint=bindparam("ref")))
        with self.db.session() as s, s.begin():  # one executemany: a round's refs in one round trip
            s.connection().execute(stmt, [{"rid": rid, "ref": ref} for rid, ref in refs.items()])

    @_translated
    def note_error(self, request_id: int, error: str) -> None:
        with self.db.session() as s, s.begin():
            s.execute(update(RequestRow).where(RequestRow.id == request_id).values(last_error=error[:MAX_ERROR]))

    @_translated
    def record(self, outcomes: list[Outcome], worker: str) -> set[int]:
        if not outcomes:
            return set()
        kept = self.kept
        missing = [o.request_id for o in outcomes if o.request_id not in kept]
        if missing:  # claimed by another process (a test), or forgotten: read from the rows
            with self.db.session() as s:
                self._keep({rid: (url, params, tokens) for rid, url, params, tokens in s.execute(
                    select(RequestRow.id, RequestRow.url, RequestRow.params, RequestRow.tokens)
                    .where(one_of(RequestRow.id, missing, self.dialect))).all()})
        facts = {o.request_id: kept.get(o.request_id, (None, None, 0)) for o in outcomes}
        records = [self._record_of(o, *facts[o.request_id][:2]) for o in outcomes]
        recorded = record_outcomes(self.db, records, worker, {rid: f[2] for rid, f in facts.items()})
        for o in outcomes:
            kept.pop(o.request_id, None)
        errors = {o.request_id: o.error for o in outcomes if o.error is not None}
        if errors:
            with self.db.session() as s, s.begin():  # the reason, also on the request row
                s.execute(update(RequestRow), [{"id": rid, "last_error": e[:MAX_ERROR]} for rid, e in errors.items()])
        try:
            finalize_later(self.tasks, recorded.finalize)
        except Exception:
            log.exception("could not dispatch the finalizing of jobs %s", recorded.finalize)
        return recorded.new

    def _record_of(self, outcome: Outcome, url: str | None, params: dict | None) -> ResultRecord:
        if outcome.output is None:
            return ResultRecord.failure(outcome.request_id, outcome.job_id, outcome.error_code or "failed",
                                        outcome.error or "")
        output = outcome.output
        tool_calls = params.get("tool_calls") if isinstance(params, dict) else None  # how its calls are read
        line = response_line(BatchLine(0, "", url or "", {}), output, self.model_name, self.tokenizer,
                             tool_calls if tool_calls in FORMATS else None)
        return ResultRecord(outcome.request_id, outcome.job_id, ResultStatus.COMPLETED, response=line["response"],
                            prompt_tokens=len(output.prompt_token_ids), completion_tokens=output.num_output_tokens,
                            cached_tokens=output.num_cached_prompt_tokens)

    @_translated
    def closed_jobs(self, job_ids: set[str]) -> set[str]:
        with self.db.session() as s:
            return set(s.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.status.not_in(LIVE))))

    @_translated
    def live_tenants(self, model: str) -> dict[str, float]:
        return live_tenants(self.db, model)

    @_translated
    def token_budgets(self, model: str) -> dict[str, tuple[int, int]]:
        return {b.tenant: (b.enqueued[model], b.limit) for b in budgets(self.db, self.token_limit)
                if model in b.enqueued}

    @_translated
    def heartbeat(self, beat: Heartbeat) -> None:
        workers.beat(self.db, beat)

    def warm(self) -> None:
        """The calls a worker's loop makes first (the tenants it consumes for, its jobs still open, a claim),
        made once while the worker starts: a connection opened, their statements compiled. The first job's first step
        waited 80 ms for them (its tenants' queues are looked up once the job is there)."""
        try:
            self.live_tenants(self.model_name)
            self.closed_jobs({""})
            self.claim([-1], "")  # no such request: its statements compiled, no row changed
        except Exception:  # a database down at the start, say: the loop's own calls say what is wrong
            log.debug("warming the ledger failed", exc_info=True)

    def close(self) -> None:
        """Nothing of its own to release: the database is the process's (``open_database``)."""


@dataclass(frozen=True)
class LedgerRecipe:
    """A ``JobsLedger`` as the ledger's process builds it (``worker.consumer.ledger_process``): what it
    needs, picklable; the tokenizer (the result lines' logprobs) read there from the model's files."""

    settings: Settings
    model_path: str
    model_name: str
    eager_tasks: bool | None = None

    def __call__(self) -> JobsLedger:
        from worker.model.tokenizer import load_tokenizer

        ledger = JobsLedger(self.settings, load_tokenizer(self.model_path), self.model_name, self.eager_tasks)
        # beside the worker's start, not in it (the worker waits for this ledger): its calls may come meanwhile
        threading.Thread(target=ledger.warm, name="berth-ledger-warm", daemon=True).start()
        return ledger


def _life(row: RequestRow) -> str | None:
    """The life of the process holding a row (a row claimed before lives were recorded: its holder's name)."""
    if row.holder is None:
        return None
    return row.holder_life or row.holder[:32]


def cache_salt_of(row: RequestRow, group: str | None) -> str | None:
    """Who a request shares cached prefixes with (``Request.cache_salt``): those giving its line's
    cache_salt, else its tenant's sharing group, else (None) its tenant alone."""
    if row.cache_salt:
        return row.cache_salt
    return f"group:{group}" if group else None


def _claim(row: RequestRow, status, model: str, priority: int, tenant: str, is_open: bool,
           death: Death | None, group: str | None = None, deadline: float | None = None) -> Claim:
    params, unreadable = None, None
    try:
        params = params_from_dict(dict(row.params))
    except (TypeError, ValueError) as exc:
        unreadable = f"{type(exc).__name__}: {exc}"
    return Claim(row.id, row.job_id, model, tenant, priority, list(row.prompt_token_ids), params, is_open,
                 row.attempts, crashed=row.holder is not None and row.started, progress=row.progress,
                 strikes=row.strikes, last_error=row.last_error, unreadable=unreadable, suspect=row.suspect,
                 death=death if row.holder is not None and row.started else None, checkpoint=row.checkpoint,
                 cache_salt=cache_salt_of(row, group), deadline=deadline)

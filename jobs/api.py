"""berth's jobs as a Python API: what the ``berth`` commands do.

    from jobs import api
    job = api.submit("requests.jsonl", settings, tenant="team-a", priority=5)
    api.status(job.id, settings).to_dict()
    api.results(job.id, "out.jsonl", settings=settings)

    api.run("requests.jsonl", "out.jsonl")   # everything in this process, no servers

Every function takes the ``Settings`` to use (default: from the environment).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.records.db import open_database, upgrade
from jobs.records.job_errors import JobStateError
from jobs.records.job_files import JobFiles
from jobs.records.job_status import JobStatus
from jobs.records.status import Budget, JobView, budgets, get_job
from jobs.records.status import list_jobs as query_jobs
from worker.config import Settings

# jobs.pipeline.submit (line checks: the tokenizer, the grammar library), jobs.pipeline.celery_tasks (Celery, ingest and
# finalize) and the modules that change rows through SQLAlchemy's ORM (jobs.records.lifecycle, jobs.records.tenants) are
# imported by the functions that use them: `berth status`, `list` and `results` read rows (SQLAlchemy's core) and files
# only.
if TYPE_CHECKING:
    from jobs.pipeline.submit import JobSpec


def __getattr__(name: str):
    """``api.JobSpec``, the job's options for ``submit`` and ``run``, imported when first asked for."""
    if name == "JobSpec":
        from jobs.pipeline.submit import JobSpec

        return JobSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ResultFiles:
    output: Path | None  # None: no request completed
    errors: Path | None  # None: nothing failed


def submit(path: str | Path, settings: Settings | None = None, *, spec: JobSpec | None = None,
           eager: bool | None = None) -> JobView:
    """Accept a request file as a job. Its lines are checked and queued by the ingest task: in this
    process on the embedded default (or with ``eager=True``), else on a Celery worker."""
    from jobs.pipeline.celery_tasks import INGEST, make_app
    from jobs.pipeline.submit import JobSpec, create_job, withdraw_job

    settings = settings or Settings()
    db = open_database(settings.database_url)
    app = make_app(settings, eager)
    if not app.conf.task_always_eager:  # a broker that does not answer: refused before anything is stored
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=0)
    files = JobFiles(settings.storage_url)
    job_id = create_job(db, files, path, settings.served_model_name(), spec or JobSpec(), settings)
    try:
        app.tasks[INGEST].delay(job_id)
    except Exception:
        if not app.conf.task_always_eager:  # its ingest not queued: no job (an eager ingest's failure is the job's)
            withdraw_job(db, files, job_id)
        raise
    return get_job(db, job_id)


def status(job_id: str, settings: Settings | None = None) -> JobView:
    return get_job(open_database((settings or Settings()).database_url), job_id)


def list_jobs(settings: Settings | None = None, tenant: str | None = None, status: str | None = None,
              limit: int = 20, **filters) -> list[JobView]:
    """The newest jobs; ``filters``: since, until, metadata (``jobs.records.status.list_jobs``)."""
    return query_jobs(open_database((settings or Settings()).database_url), tenant,
                      JobStatus(status) if status else None, limit, **filters)


def cancel(job_id: str, settings: Settings | None = None) -> JobView:
    """Cancel a job: running requests are aborted within a second, the rest fail as cancelled."""
    from jobs.pipeline.celery_tasks import finalize_later, make_app
    from jobs.records.lifecycle import cancel as cancel_job

    settings = settings or Settings()
    db = open_database(settings.database_url)
    cancel_job(db, job_id)
    finalize_later(make_app(settings), [job_id])
    return get_job(db, job_id)


def results(job_id: str, output: str | Path, errors: str | Path | None = None,
            settings: Settings | None = None, partial: bool = False) -> ResultFiles:
    """Copy a finished job's output (input order) to ``output`` and its errors, if any, to ``errors``
    (default: ``<output>.errors.jsonl``). ``partial``: a job still running too, its lines finished so far,
    written as the two files will hold them (``GET /v1/batches/{id}/results`` gives the same)."""
    settings = settings or Settings()
    job = status(job_id, settings)
    if partial and not job.status.is_final:
        return _partial_results(job_id, Path(output), Path(errors) if errors else None, settings)
    if not job.status.is_final:
        raise JobStateError(f"job {job_id} is {job.status.value} ({job.done} of {job.total} requests done): its "
                            "files are written when it ends; `berth status --watch` follows it")
    files = JobFiles(settings.storage_url)
    output = Path(output)
    errors = Path(errors) if errors else output.with_suffix(".errors.jsonl")
    copied = []
    for key, target in ((job.output_key, output), (job.errors_key, errors)):
        if key is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            files.get_file(key, target)
        copied.append(target if key is not None else None)
    return ResultFiles(*copied)


def _partial_results(job_id: str, output: Path, errors: Path | None, settings: Settings) -> ResultFiles:
    """The lines a running job finished so far: output lines to ``output``, error lines to ``errors``."""
    import json

    from jobs.pipeline.finalize import finished_lines

    errors = errors or output.with_suffix(".errors.jsonl")
    counts = [0, 0]
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as out, open(errors, "w", encoding="utf-8") as err:
        for line in finished_lines(open_database(settings.database_url), job_id):
            failed = line.get("error") is not None
            (err if failed else out).write(json.dumps(line, ensure_ascii=False) + "\n")
            counts[failed] += 1
    for path, count in ((output, counts[0]), (errors, counts[1])):
        if not count:  # as for a finished job: no file where no line
            path.unlink()
    return ResultFiles(output if counts[0] else None, errors if counts[1] else None)


def run(path: str | Path, output: str | Path, settings: Settings | None = None, *, errors: str | Path | None = None,
        spec: JobSpec | None = None, engine=None, on_progress: Callable[[JobView], None] | None = None,
        job_id: str | None = None) -> tuple[JobView, ResultFiles | None]:
    """Submit, work and fetch the results in this process: the ingest runs on a thread beside an engine
    worker, which consumes the requests as they are queued until the job ends, and finalize runs
    in-process (``jobs.hosting.local_run``). Zero servers on the default settings. ``job_id``: go on with
    that job (``unfinished_run``) instead of submitting the file again, its ingest too if it was stopped.
    The files are None when the worker was stopped (SIGINT, SIGTERM) before the job ended: the job stays
    queued, for ``berth worker`` (or this call again) to finish. An ingest stopped by an error (the
    database, the store, the broker) raises it, the job left to go on with likewise."""
    from jobs.hosting.engine_worker import engine_worker
    from jobs.hosting.local_run import LocalRun

    settings = settings or Settings()
    # the model loads, and the line checks' facts are read, before the job's clock starts
    worker = engine_worker(settings, engine, eager_tasks=True, checks_lines=True)
    try:
        here = LocalRun.resume(job_id, settings) if job_id else LocalRun.submit(path, settings, spec)
        job = here.work(worker, on_progress)
    finally:  # a file refused, or a job over before the worker ran: its ledger's process ends with the call
        worker.close()
    if not job.status.is_final:
        return job, None
    return job, results(job.id, output, errors, settings)


def unfinished_run(path: str | Path, settings: Settings | None = None, spec: JobSpec | None = None) -> JobView | None:
    """The newest job an earlier ``run`` of this file left unfinished (stopped, or its process killed):
    the same tenant, model, file name and number of lines (at most that many, for one stopped during its
    ingest), submitted by the CLI, not yet over."""
    from jobs.pipeline.submit import JobSpec

    settings, spec = settings or Settings(), spec or JobSpec()
    path = Path(path)
    with open(path, "rb") as f:
        lines = sum(1 for line in f if line.strip())
    for view in query_jobs(open_database(settings.database_url), spec.tenant, None, 20, input_name=path.name,
                           cli_only=True):
        if view.model == settings.served_model_name() and (
                view.status is JobStatus.IN_PROGRESS and view.total == lines
                or view.status is JobStatus.VALIDATING and view.total <= lines):
            return view
    return None


def usage(settings: Settings | None = None, tenant: str | None = None, since: float | None = None,
          until: float | None = None) -> list:
    """Tokens in and out per tenant and model over a period (``jobs.records.usage``)."""
    from jobs.records.usage import usage as usage_rows

    return usage_rows(open_database((settings or Settings()).database_url), tenant, since, until)


def live_workers(settings: Settings | None = None, model: str | None = None) -> list:
    """Engine workers seen within the hour, the newest first (``jobs.records.workers``); ``model``: its alone."""
    from jobs.records.workers import list_workers

    views = list_workers(open_database((settings or Settings()).database_url))
    return [v for v in views if model is None or v.beat.model == model]


def retry(job_id: str, settings: Settings | None = None, eager: bool | None = None) -> JobView:
    """A new job of the failed lines of a finished job (``jobs.pipeline.retry``), ingested as ``submit`` does."""
    from jobs.pipeline.celery_tasks import INGEST, make_app
    from jobs.pipeline.retry import retry_job

    settings = settings or Settings()
    db = open_database(settings.database_url)
    new_id = retry_job(db, JobFiles(settings.storage_url), settings, get_job(db, job_id))
    make_app(settings, eager).tasks[INGEST].delay(new_id)
    return get_job(db, new_id)


def set_tenant_weight(name: str, weight: float, settings: Settings | None = None) -> None:
    """A tenant's share of the engines (1 by default): with weights 2 and 1, twice the seats."""
    from jobs.records.tenants import set_weight

    set_weight(open_database((settings or Settings()).database_url), name, weight)


def set_tenant_cache_group(name: str, group: str | None, settings: Settings | None = None) -> None:
    """Tenants of one ``group`` share cached prompt prefixes (None: the tenant's are its own, the default)."""
    from jobs.records.tenants import set_cache_group

    set_cache_group(open_database((settings or Settings()).database_url), name, group)


def set_tenant_token_limit(name: str, limit: int | None, settings: Settings | None = None) -> None:
    """A tenant's enqueued tokens per model at most (0: no limit; None: BERTH_TENANT_MAX_ENQUEUED_TOKENS)."""
    from jobs.records.budgets import set_token_limit

    set_token_limit(open_database((settings or Settings()).database_url), name, limit)


def set_tenant_interactive_limits(name: str, settings: Settings | None = None, **limits: int | None) -> None:
    """A tenant's limits on berth serve's chat and completions, those given: ``live_requests`` (running at
    once) and ``tokens_per_minute``; 0: no limit, None: the setting's default (BERTH_HTTP_TENANT_LIVE_REQUESTS,
    BERTH_HTTP_TENANT_TOKENS_PER_MINUTE). Each server process counts its own use against them."""
    from jobs.records.budgets import set_interactive_limits

    set_interactive_limits(open_database((settings or Settings()).database_url), name, **limits)


def tenant_budget(name: str, settings: Settings | None = None) -> Budget:
    """The tenant's enqueued-token limit and its enqueued tokens per model, and its interactive limits (read
    with SQLAlchemy's core)."""
    settings = settings or Settings()
    [budget] = budgets(open_database(settings.database_url), settings.tenant_max_enqueued_tokens, name,
                       (settings.http_tenant_live_requests, settings.http_tenant_tokens_per_minute))
    return budget


def allow_broker_user(user: str, tenant: str, settings: Settings | None = None) -> None:
    """Let broker (RabbitMQ) user ``user`` submit jobs through the queue; they are ``tenant``'s."""
    from jobs.records.tenants import allow_broker_user as allow_user

    allow_user(open_database((settings or Settings()).database_url), user, tenant)


def remove_broker_user(user: str, settings: Settings | None = None) -> bool:
    """The broker user may no longer submit jobs; whether it could."""
    from jobs.records.tenants import remove_broker_user as remove_user

    return remove_user(open_database((settings or Settings()).database_url), user)


def webhook_secret(tenant: str, settings: Settings | None = None, rotate: bool = False) -> str:
    """The secret that signs the tenant's webhooks (made on first use; ``rotate``: a new one)."""
    from jobs.records.tenants import webhook_secret as tenant_secret

    return tenant_secret(open_database((settings or Settings()).database_url), tenant, rotate)


def upgrade_database(settings: Settings | None = None) -> str:
    """Apply the migrations; the revision the database is at."""
    return upgrade((settings or Settings()).database_url)

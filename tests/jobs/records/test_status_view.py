"""The status view ``berth_jobs`` as any SQL client sees it (psql), against ``berth status --json``,
for a running and a finished job; and migration 0004 upgrading a database made at revision 0001
with jobs in it, on PostgreSQL and SQLite, losing nothing."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from jobs import api
from jobs.cli import main
from jobs.hosting.engine_worker import engine_worker
from jobs.records.db import close_database, head_revision, open_database, upgrade
from jobs.records.models import JobStatus
from tests.support.jobs_env import AMQP_URL, tiny_settings, work_until_over, write_requests

N = 16
COLUMNS = "status, tenant, total, completed, failed, done, progress, eta_seconds, prompt_tokens, completion_tokens"


def _psql(pg_url: str, query: str) -> list[dict]:
    database = make_url(pg_url).database
    out = subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", database, "--csv", "-c", query],
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return list(csv.DictReader(io.StringIO(out)))


def _cli_status(pg_url: str, job_id: str) -> dict:
    result = CliRunner().invoke(main, ["status", job_id, "--json", "--database-url", pg_url])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _same(view: dict, shown: dict) -> None:
    assert view["status"] == shown["status"] and view["tenant"] == shown["tenant"]
    counts = shown["request_counts"]
    assert [int(view[k]) for k in ("total", "completed", "failed")] == [counts[k] for k in ("total", "completed",
                                                                                         "failed")]
    assert int(view["done"]) == counts["completed"] + counts["failed"]
    assert round(float(view["progress"]), 6) == shown["progress"]
    assert [int(view["prompt_tokens"]), int(view["completion_tokens"])] == [shown["usage"]["prompt_tokens"],
                                                                           shown["usage"]["completion_tokens"]]
    if shown["eta_seconds"] is None:
        assert view["eta_seconds"] == ""  # NULL
    else:  # computed a moment apart, at a rate that falls while the job stands still
        assert float(view["eta_seconds"]) == pytest.approx(shown["eta_seconds"], rel=0.5, abs=2.0)


@pytest.mark.slow
def test_psql_on_the_view_says_what_berth_status_says(tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=f"file://{tmp_path / 'store'}", prefetch=1)  # one request at a time
    job = api.submit(write_requests(tmp_path / "requests.jsonl", N, max_tokens=32), settings, eager=True)
    assert job.status is JobStatus.IN_PROGRESS
    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=lambda: api.status(job.id, settings).done >= 2)
    running = _cli_status(pg_url, job.id)
    assert running["status"] == "in_progress" and 2 <= running["request_counts"]["completed"] < N, running
    query = f"select {COLUMNS}, created_at, in_progress_at, completed_at from berth_jobs where id = '{job.id}'"
    [view] = _psql(pg_url, query)
    _same(view, running)
    assert running["eta_seconds"] is not None
    assert datetime.fromisoformat(view["created_at"]).timestamp() == pytest.approx(running["created_at"], abs=1)
    assert view["completed_at"] == ""

    work_until_over(settings, tiny_engine, job.id)
    finished = _cli_status(pg_url, job.id)
    assert finished["status"] == "completed" and finished["progress"] == 1.0
    [view] = _psql(pg_url, query)
    _same(view, finished)
    assert datetime.fromisoformat(view["completed_at"]).timestamp() == pytest.approx(finished["completed_at"], abs=1)
    tokens_per_second = _psql(pg_url, f"select output_tokens_per_second from berth_jobs where id = '{job.id}'")
    assert float(tokens_per_second[0]["output_tokens_per_second"]) == pytest.approx(
        finished["output_tokens_per_second"], abs=0.01)


T0 = datetime(2026, 12, 1, tzinfo=UTC).timestamp()
ROWS_0001 = [  # what a database made at revision 0001 holds, written with plain SQL
    "INSERT INTO tenants (id, name, weight, created_at) VALUES (1, 'team-a', 2.0, {t0})",
    "INSERT INTO jobs (id, tenant_id, model, status, priority, completion_window, metadata, input_name, input_key, "
    "total, completed, failed, prompt_tokens, completion_tokens, created_at, in_progress_at, expires_at) VALUES "
    "('batch_running', 1, 'm', 'in_progress', 4, '24h', '{{\"k\": \"v\"}}', 'a.jsonl', "
    "'jobs/batch_running/input.jsonl', "
    "10, 4, 1, 400, 120, {t0}, {t0} + 10, {t0} + 86400)",
    "INSERT INTO jobs (id, tenant_id, model, status, priority, completion_window, metadata, input_name, input_key, "
    "output_key, total, completed, failed, prompt_tokens, completion_tokens, created_at, in_progress_at, "
    "finalizing_at, completed_at, expires_at) VALUES ('batch_done', 1, 'm', 'completed', 0, '24h', '{{}}', 'b.jsonl', "
    "'jobs/batch_done/input.jsonl', 'jobs/batch_done/output.jsonl', 2, 2, 0, 20, 8, {t0}, {t0} + 1, {t0} + 5, "
    "{t0} + 6, {t0} + 86400)",
    "INSERT INTO requests (id, job_id, line, custom_id, url, prompt_token_ids, params, attempts, published_at, "
    "created_at) VALUES (1, 'batch_done', 1, 'r1', '/v1/completions', '[1, 2]', '{{}}', 1, {t0}, {t0})",
    "INSERT INTO results (id, request_id, job_id, status, response, prompt_tokens, completion_tokens, created_at) "
    "VALUES (1, 1, 'batch_done', 'completed', '{{\"status_code\": 200}}', 10, 4, {t0})",
    "INSERT INTO line_errors (id, job_id, line, custom_id, code, message) VALUES "
    "(1, 'batch_running', 3, NULL, 'invalid_json', 'line 3 is not JSON')",
]
TABLES = ("tenants", "jobs", "requests", "results", "line_errors")


def _snapshot(conn) -> dict:
    return {t: sorted(tuple(str(v) for v in row) for row in conn.execute(text(f"SELECT * FROM {t}")))
            for t in TABLES}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migrating_a_database_with_jobs_from_0001_to_head_loses_nothing(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    assert upgrade(url, "0001") == "0001"
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in ROWS_0001:
            conn.execute(text(statement.format(t0=T0)))
    with engine.connect() as conn:
        before = _snapshot(conn)
        columns_before = {t: list(conn.execute(text(f"SELECT * FROM {t}")).keys()) for t in TABLES}

    assert upgrade(url) == head_revision()
    with engine.connect() as conn:
        after = {t: sorted(tuple(str(v) for v in row[:len(columns_before[t])])
                           for row in conn.execute(text(f"SELECT {', '.join(columns_before[t])} FROM {t}")))
                 for t in TABLES}
        assert after == before
        assert conn.execute(text("SELECT count(*) FROM jobs WHERE submit_message_id IS NOT NULL OR webhook_url IS "
                                 "NOT NULL")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM job_events")).scalar() == 0  # the past is not replayed
        rows = {r.id: r for r in conn.execute(text("SELECT * FROM berth_jobs ORDER BY id"))}
    assert set(rows) == {"batch_done", "batch_running"}
    done, running = rows["batch_done"], rows["batch_running"]
    assert (done.tenant, done.status, done.total, done.completed, done.progress, done.eta_seconds) == (
        "team-a", "completed", 2, 2, 1.0, None)
    assert done.seconds_running == pytest.approx(4.0) and done.output_tokens_per_second == pytest.approx(2.0)
    assert (running.done, running.progress, running.priority, running.output_file) == (5, 0.5, 4, None)
    assert running.eta_seconds > 0  # at its rate since T0 + 10, the five left take as long again
    if backend == "postgresql":
        assert done.completed_at.timestamp() == T0 + 6 and done.completed_at.tzinfo is not None  # timestamptz
    else:
        assert done.completed_at == "2026-12-01 00:00:06.000" and running.completed_at is None

    with engine.begin() as conn:  # the triggers are live on the rows that were there
        conn.execute(text("UPDATE jobs SET status = 'cancelling', cancelling_at = :t WHERE id = 'batch_running'"),
                     {"t": T0 + 20})
        conn.execute(text("UPDATE jobs SET completed = completed + 1 WHERE id = 'batch_running'"))  # no status change
        events = conn.execute(text("SELECT job_id, status, total, completed, failed FROM job_events")).all()
    assert [tuple(e) for e in events] == [("batch_running", "cancelling", 10, 4, 1)]
    engine.dispose()
    open_database(url)  # at head: berth opens it
    close_database(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_at_head_the_event_triggers_and_the_view_are_there(backend, tmp_path, request):
    """A later migration that recreates ``jobs`` on SQLite drops its triggers: this says so."""
    url = f"sqlite:///{tmp_path / 'head.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    upgrade(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        if backend == "sqlite":
            triggers = set(conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger' AND "
                                             "tbl_name = 'jobs'")).scalars())
            views = set(conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'view'")).scalars())
        else:
            triggers = set(conn.execute(text("SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND "
                                             "NOT tgisinternal")).scalars())
            views = set(conn.execute(text("SELECT viewname FROM pg_views WHERE schemaname = 'public'")).scalars())
    engine.dispose()
    assert triggers == {"berth_job_event_insert", "berth_job_event_update"}
    assert views == {"berth_jobs"}

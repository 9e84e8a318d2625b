"""The worker's ledger records a step's outcomes from what its claim read of their rows (url, params,
enqueued tokens), without reading them again, and from the rows for requests another process claimed:
either way each outcome counts once and gives its tokens back to its tenant."""

from __future__ import annotations

import os
import time

import pytest
from sqlalchemy import select

from jobs.hosting.database_ledger import JobsLedger
from jobs.pipeline.ingest import ingest
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import RequestRow
from jobs.records.status import get_job
from tests.support.jobs_env import AMQP_URL, TINY_NAME, tiny_settings, write_requests
from worker.consumer.ledger import Outcome


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path, tiny_llama_dir):
    if request.param == "sqlite":
        return tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    return tiny_settings(tiny_llama_dir, database_url=request.getfixturevalue("pg_url"), broker_url=AMQP_URL,
                         queue_prefix=request.getfixturevalue("queue_prefix"),
                         storage_url=f"file://{tmp_path / 'store'}")


def _job(settings, tmp_path, lines: int) -> tuple[str, list[int]]:
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)
    job_id = create_job(db, files, write_requests(tmp_path / "requests.jsonl", lines), TINY_NAME, JobSpec(), settings)
    ingest(db, files, settings, job_id)
    with db.session() as s:
        return job_id, sorted(s.scalars(select(RequestRow.id).where(RequestRow.job_id == job_id)))


def test_outcomes_are_recorded_from_the_claims_facts_or_the_rows(settings, tmp_path):
    job_id, ids = _job(settings, tmp_path, 4)
    db = open_database(settings.database_url)
    assert get_job(db, job_id).enqueued_tokens > 0
    worker = JobsLedger(settings, None, TINY_NAME, eager_tasks=True)
    claims = worker.claim(ids[:3], "w:1")
    assert set(worker.kept) == set(ids[:3]) == set(claims)
    failed = [Outcome.failure(i, job_id, "engine_error", "x") for i in ids[:3]]
    assert worker.record(failed + failed[:1], "w:1") == set(ids[:3])  # a second outcome counts nothing
    assert not worker.kept

    other = JobsLedger(settings, None, TINY_NAME, eager_tasks=True)  # claimed nothing: reads the row
    assert other.record([Outcome.failure(ids[3], job_id, "engine_error", "x")], "w:2") == {ids[3]}
    assert worker.record(failed[:1], "w:1") == set()
    job = get_job(db, job_id)
    assert (job.failed, job.completed, job.enqueued_tokens) == (4, 0, 0)


def test_each_worker_has_a_ledger_process_of_its_own_with_its_relative_files(tmp_path, monkeypatch, tiny_llama_dir):
    """Each worker's ledger answers from a child of its own, gone once the worker stopped, and the embedded
    defaults' ``./berth.db`` and ``./berth-store`` are the files of the directory the worker was built in."""
    from jobs import api
    from jobs.hosting.engine_worker import engine_worker

    engine, children = None, set()
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        settings = tiny_settings(tiny_llama_dir, database_url="sqlite:///./berth.db",
                                 storage_url="file://./berth-store")
        job = api.submit(write_requests(folder / "requests.jsonl", 5), settings, eager=True)
        worker = engine_worker(settings, engine, eager_tasks=True)
        engine = worker.engine
        children.add(worker.ledger.pid)
        deadline = time.monotonic() + 60

        def over(job_id=job.id, settings=settings, deadline=deadline) -> bool:
            assert time.monotonic() < deadline, "the job did not end: its worker's ledger read another database"
            return api.status(job_id, settings).status.is_final

        worker.run(until=over)
        assert api.status(job.id, settings).completed == 5
        assert (folder / "berth-store").is_dir()
        assert not os.path.exists(f"/proc/{worker.ledger.pid}"), "the ledger's process outlived its worker's run"
    assert len(children) == 2 and os.getpid() not in children


def test_warming_the_ledger_changes_no_row(settings, tmp_path):
    """``warm`` (the worker's first calls, made while it starts) claims no request and counts no delivery."""
    job_id, ids = _job(settings, tmp_path, 3)
    db = open_database(settings.database_url)
    with db.session() as s:
        before = [(r.attempts, r.holder, r.delivered_at) for r in s.scalars(select(RequestRow).order_by(RequestRow.id))]
    JobsLedger(settings, None, TINY_NAME, eager_tasks=True).warm()
    with db.session() as s:
        after = [(r.attempts, r.holder, r.delivered_at) for r in s.scalars(select(RequestRow).order_by(RequestRow.id))]
    assert after == before and len(after) == 3

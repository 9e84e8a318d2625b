"""A job's ingest on a thread of this process (``jobs.pipeline.ingest_threads``, ``celery_tasks.ingest_beside``):
one a job, its error kept for the caller, stopped between chunks with what it stored published; and the
ingest's chunks, small first so that a worker beside starts early."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

import jobs.pipeline.ingest
from jobs import api
from jobs.pipeline import ingest_threads
from jobs.pipeline.celery_tasks import ingest_aside, ingest_beside, make_app
from jobs.pipeline.ingest import chunk_sizes
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import JobStatus, RequestRow
from tests.support.jobs_env import TINY_NAME, tiny_settings, write_requests


@pytest.fixture
def settings(tmp_path, tiny_llama_dir):
    return tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                         storage_url=f"file://{tmp_path / 'store'}")


def _job(settings, path) -> str:
    return create_job(open_database(settings.database_url), JobFiles(settings.storage_url), path, TINY_NAME, JobSpec())


def _stored(settings, job_id) -> list[tuple[int, bool]]:
    """(line, published) of each request row."""
    with open_database(settings.database_url).session() as s:
        return [(line, published is not None) for line, published in s.execute(
            select(RequestRow.line, RequestRow.published_at).where(RequestRow.job_id == job_id)
            .order_by(RequestRow.line))]


def test_one_thread_a_job_and_its_error_kept():
    release, calls = threading.Event(), []

    def work(aside):
        calls.append(aside)
        release.wait(10)
        raise ConnectionError("the broker went away")

    first, new = ingest_threads.start("job-a", work)
    again, second_new = ingest_threads.start("job-a", lambda aside: calls.append("a second ingest"))
    assert (new, second_new, again) == (True, False, first) and ingest_threads.running("job-a") is first
    assert not first.failed and not first.published.is_set()
    release.set()
    first.thread.join(10)
    assert first.failed and isinstance(first.error, ConnectionError) and ingest_threads.running("job-a") is None
    assert calls == [first] and first.published.is_set()  # said once it ended, whatever it published
    restarted, new = ingest_threads.start("job-a", lambda aside: None)
    assert new and restarted is not first
    restarted.thread.join(10)


def test_a_stopped_ingest_leaves_its_chunks_published_and_the_next_goes_on_after_them(settings, tmp_path, monkeypatch):
    """Asked to stop while it stores its second chunk, the ingest publishes that chunk and reads no
    third: the job stays ``validating`` with 6 lines, and an ingest run again stores the rest, once."""
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 3)
    job_id = _job(settings, write_requests(tmp_path / "requests.jsonl", 8))
    store, calls = jobs.pipeline.ingest._store_chunk, []

    def stopped_while_storing(*args):
        calls.append(len(args[3]))
        aside = ingest_threads.running(job_id)
        if len(calls) <= 2:  # the first ingest's: it says when the first chunk's messages are out
            assert aside.published.is_set() == (len(calls) == 2)
        if len(calls) == 2:
            aside.stopping.set()
        return store(*args)

    monkeypatch.setattr(jobs.pipeline.ingest, "_store_chunk", stopped_while_storing)
    aside = ingest_beside(make_app(settings, eager=True), settings, job_id)
    aside.thread.join(60)

    assert aside.done and aside.error is None and calls == [3, 3]
    job = api.status(job_id, settings)
    assert (job.status, job.total) == (JobStatus.VALIDATING, 6)
    assert _stored(settings, job_id) == [(n, True) for n in range(1, 7)]

    ingest_aside(make_app(settings, eager=True), [job_id])[0].join(60)  # as the reconciler would
    job = api.status(job_id, settings)
    assert (job.status, job.total, calls) == (JobStatus.IN_PROGRESS, 8, [3, 3, 2])
    assert _stored(settings, job_id) == [(n, True) for n in range(1, 9)]


def test_an_ingest_beside_keeps_the_error_that_stopped_it(settings, tmp_path, monkeypatch):
    """What the Celery task logs (the reconciler runs it again), ``ingest_beside`` keeps for its caller."""
    job_id = _job(settings, write_requests(tmp_path / "requests.jsonl", 2))

    def broken(*args):
        raise ConnectionError("the database went away")

    monkeypatch.setattr(jobs.pipeline.ingest, "_store_chunk", broken)
    aside = ingest_beside(make_app(settings, eager=True), settings, job_id)
    aside.thread.join(60)
    assert aside.failed and str(aside.error) == "the database went away"
    assert api.status(job_id, settings).status is JobStatus.VALIDATING


def test_chunks_start_small_and_double(monkeypatch):
    monkeypatch.setattr(jobs.pipeline.ingest, "FIRST_CHUNK_LINES", 64)
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 2000)
    sizes = chunk_sizes()
    assert [next(sizes) for _ in range(8)] == [64, 128, 256, 512, 1024, 2000, 2000, 2000]
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 3)  # the tests' small chunks: all of one size
    sizes = chunk_sizes()
    assert [next(sizes) for _ in range(3)] == [3, 3, 3]

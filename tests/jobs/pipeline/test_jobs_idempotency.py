"""Nothing lost, nothing twice, on RabbitMQ and PostgreSQL: a message delivered twice yields one
result; a request whose message keeps being handed back ends failed with its reason in the
dead-letter queue while the others complete; requests committed but never published are published
by the reconciler; cancelled and expired jobs close with every request accounted for."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import func, select

import jobs.pipeline.ingest
from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.pipeline.celery_tasks import finalize_later, make_app
from jobs.pipeline.ingest import job_target, publish
from jobs.pipeline.publish import Publisher
from jobs.pipeline.reconcile import reconcile
from jobs.pipeline.submit import JobSpec
from jobs.records.db import open_database
from jobs.records.lifecycle import JobStateError, expire_due
from jobs.records.models import JobStatus, RequestRow, Result, ResultStatus
from tests.support.jobs_env import (
    AMQP_URL,
    TINY_NAME,
    read_jsonl,
    tiny_settings,
    work_until_over,
    write_requests,
)
from worker.messaging.topology import Topology, connect, queue_depth


@pytest.fixture
def settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    return tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                         storage_url=f"file://{tmp_path / 'store'}")


def _submit_unpublished(tmp_path, settings, monkeypatch, n: int, spec: JobSpec | None = None):
    """A job whose rows are committed but whose messages never reached the broker (as if the
    submitter died between the two)."""
    with monkeypatch.context() as m:
        m.setattr(jobs.pipeline.ingest, "publish", lambda db, publisher, messages: 0)
        job = api.submit(write_requests(tmp_path / "requests.jsonl", n), settings, spec=spec, eager=True)
    db = open_database(settings.database_url)
    with db.session() as s:
        rows = list(s.scalars(select(RequestRow).where(RequestRow.job_id == job.id).order_by(RequestRow.line)))
    assert all(r.published_at is None for r in rows)
    return job, rows


def _results(settings, job_id) -> list[Result]:
    with open_database(settings.database_url).session() as s:
        return list(s.scalars(select(Result).where(Result.job_id == job_id)))


def test_a_message_delivered_twice_yields_one_result(tmp_path, settings, tiny_engine, monkeypatch):
    job, rows = _submit_unpublished(tmp_path, settings, monkeypatch, 4)
    target = job_target(open_database(settings.database_url), job.id)
    twice = [target.message(r) for r in rows for _ in range(2)]  # each message right behind itself
    with Publisher(settings) as publisher:
        publish(open_database(settings.database_url), publisher, twice)
    settings = settings.model_copy(update={"prefetch": 1})  # one at a time: the copy comes after the result
    queue = Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")
    deadline = time.monotonic() + 60

    def over_and_every_copy_acked() -> bool:  # the job ends with its last result: its copy may be behind it
        assert time.monotonic() < deadline, "the job did not end, or a copy stayed in the queue, in 60 s"
        with connect(settings) as conn:
            return api.status(job.id, settings).status.is_final and queue_depth(conn, [queue]) == 0

    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=over_and_every_copy_acked)

    job = api.status(job.id, settings)
    assert (job.status, job.total, job.completed, job.failed) == (JobStatus.COMPLETED, 4, 4, 0)
    results = _results(settings, job.id)
    assert sorted(r.request_id for r in results) == [r.id for r in rows]
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    assert [line["custom_id"] for line in read_jsonl(files.output)] == ["req-0", "req-1", "req-2", "req-3"]


def test_a_request_the_engine_cannot_admit_fails_alone_and_the_queue_keeps_flowing(tmp_path, settings,
                                                                                   tiny_engine, monkeypatch):
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 6), settings, eager=True)
    with open_database(settings.database_url).session() as s:
        bad = s.scalar(select(RequestRow.id).where(RequestRow.job_id == job.id, RequestRow.custom_id == "req-2"))
    admit = tiny_engine.add_request

    def crashing_admit(request):
        if request.request_id == str(bad):
            raise RuntimeError("simulated crash while admitting")
        return admit(request)

    monkeypatch.setattr(tiny_engine, "add_request", crashing_admit)
    job = work_until_over(settings, tiny_engine, job.id)

    assert (job.status, job.total, job.completed, job.failed) == (JobStatus.COMPLETED, 6, 5, 1)
    [failed] = [r for r in _results(settings, job.id) if r.status is ResultStatus.FAILED]
    assert failed.request_id == bad and failed.error["code"] == "engine_error"
    assert "RuntimeError: simulated crash while admitting" in failed.error["message"]
    with open_database(settings.database_url).session() as s:  # failed on its first delivery, the reason kept
        row = s.get(RequestRow, bad)
        assert row.attempts == 1 and "simulated crash" in row.last_error
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    assert [line["custom_id"] for line in read_jsonl(files.errors)] == ["req-2"]
    with connect(settings) as conn:  # every message acked
        assert queue_depth(conn, [Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")]) == 0


def test_the_reconciler_publishes_what_was_committed_but_never_published(tmp_path, settings, tiny_engine,
                                                                          monkeypatch):
    job, rows = _submit_unpublished(tmp_path, settings, monkeypatch, 5)
    db = open_database(settings.database_url)
    assert reconcile(db, settings, older_than=3600).republished == 0  # too recent: an ingest may be publishing
    assert reconcile(db, settings, older_than=0).republished == 5
    assert reconcile(db, settings, older_than=0).republished == 0  # published once

    job = work_until_over(settings, tiny_engine, job.id)
    assert (job.status, job.completed, job.failed) == (JobStatus.COMPLETED, 5, 0)


def test_cancel_and_expiry_close_jobs_with_every_request_accounted_for(tmp_path, settings, monkeypatch):
    cancelled = api.submit(write_requests(tmp_path / "a.jsonl", 3), settings, eager=True)
    assert api.cancel(cancelled.id, settings).status is JobStatus.CANCELLING
    finalize_later(make_app(settings, eager=True), [cancelled.id])  # what the Celery worker does
    cancelled = api.status(cancelled.id, settings)
    assert (cancelled.status, cancelled.completed, cancelled.failed) == (JobStatus.CANCELLED, 0, 3)
    errors = read_jsonl(api.results(cancelled.id, tmp_path / "a.out.jsonl", settings=settings).errors)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(JobStateError, match="only a validating or in-progress job can be cancelled"):
        api.cancel(cancelled.id, settings)

    expiring = api.submit(write_requests(tmp_path / "b.jsonl", 2), settings,
                          spec=JobSpec(completion_window="1s"), eager=True)
    time.sleep(1.1)
    db = open_database(settings.database_url)
    assert expire_due(db) == [expiring.id]
    finalize_later(make_app(settings, eager=True), [expiring.id])
    expiring = api.status(expiring.id, settings)
    assert (expiring.status, expiring.failed) == (JobStatus.EXPIRED, 2)
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Result).where(Result.job_id == expiring.id)) == 2


def test_cancelling_a_running_job_aborts_its_requests_in_the_engine(tmp_path, settings, tiny_engine):
    long = [{"custom_id": f"long-{i}", "url": "/v1/completions",
             "body": {"model": TINY_NAME, "prompt": f"story {i}", "max_tokens": 1500, "ignore_eos": True}}
            for i in range(4)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in long))
    job = api.submit(path, settings, eager=True)
    worker = engine_worker(settings, tiny_engine, eager_tasks=True)
    deadline = time.monotonic() + 60

    def cancel_once_running() -> bool:
        assert time.monotonic() < deadline
        view = api.status(job.id, settings)
        if view.status is JobStatus.IN_PROGRESS and worker.inflight:
            api.cancel(job.id, settings)
            finalize_later(make_app(settings, eager=True), [job.id])
        return view.status.is_final and not worker.inflight  # emptied by the worker, not at its exit

    worker.run(until=cancel_once_running)
    assert tiny_engine.num_unfinished == 0
    view = api.status(job.id, settings)
    assert (view.status, view.completed, view.failed) == (JobStatus.CANCELLED, 0, 4)

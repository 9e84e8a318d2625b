"""Deadlines end to end on the embedded defaults (issue 37): of two jobs of one tenant, the one-hour job
submitted after a 24-hour one finishes first; the 24-hour one still runs every request. And a job whose
measured rate cannot finish it in its window says so (``berth status``, the Batch object's metadata), and
raises its at-risk event once, well before its window ends, however often the chore looks."""

from __future__ import annotations

import time
from dataclasses import replace

import jsonschema
from sqlalchemy import select

import jobs.hosting.chores
import jobs.pipeline.celery_tasks
import jobs.records.outbox
from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.http.batches import batch_object
from jobs.pipeline.submit import JobSpec
from jobs.queue_door.contract import EVENT_SCHEMA, schema
from jobs.queue_door.events import job_event_body
from jobs.records.db import open_database
from jobs.records.models import Job, JobEvent, JobStatus, Result
from jobs.records.outbox import raise_at_risk
from jobs.records.progress import describe
from jobs.records.status import JobView
from tests.support.jobs_env import tiny_settings, write_requests
from worker.config import Settings


def test_a_one_hour_job_submitted_after_a_day_job_finishes_first(tmp_path, monkeypatch, tiny_llama_dir, tiny_engine):
    monkeypatch.chdir(tmp_path)
    # a window of two deliveries: the queue's order decides what the engine gets next
    settings = tiny_settings(tiny_llama_dir, storage_url=f"file://{tmp_path / 'store'}", prefetch=2)
    day = api.submit(write_requests(tmp_path / "day.jsonl", 24, max_tokens=6), settings, eager=True,
                     spec=JobSpec(completion_window="24h", priority=9))
    hour = api.submit(write_requests(tmp_path / "hour.jsonl", 8, max_tokens=6), settings, eager=True,
                      spec=JobSpec(completion_window="1h"))

    def both_over() -> bool:
        return all(api.status(j.id, settings).status.is_final for j in (day, hour))

    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=both_over)
    day, hour = api.status(day.id, settings), api.status(hour.id, settings)
    assert day.completed == 24 and hour.completed == 8
    assert hour.finalizing_at < day.finalizing_at
    # the day job's requests, but for a delivery window's, waited for all of the hour job's: counted in the order
    # the results were committed, not by the clock (a busy machine stretches either job's seconds)
    with open_database(settings.database_url).session() as s:
        order = s.scalars(select(Result.job_id).order_by(Result.id)).all()
    last_hour = max(i for i, job_id in enumerate(order) if job_id == hour.id)
    day_after = order[last_hour + 1:].count(day.id)
    assert day_after >= 24 - settings.prefetch, f"{day_after} of the day job's 24 results after the hour job's last"


def _job_that_cannot_finish_in_its_window(tmp_path, monkeypatch, tiny_llama_dir) -> tuple[Settings, JobView]:
    """On the embedded defaults, a job whose rate (a request at a time) misses its window within seconds:
    its settings and the job as submitted."""
    monkeypatch.chdir(tmp_path)
    settings = tiny_settings(tiny_llama_dir, storage_url=f"file://{tmp_path / 'store'}", prefetch=1)
    # a window shorter than 15 minutes, so the job's rate (a request at a time) misses it within seconds
    # 400 x 64 tokens a request at a time: over a minute at the few hundred tokens/s of the fastest CPUs here
    job = api.submit(write_requests(tmp_path / "in.jsonl", 400, max_tokens=64), settings, eager=True,
                     spec=JobSpec(completion_window="20s"))
    return settings, job


def test_a_job_that_cannot_finish_in_its_window_is_at_risk(tmp_path, monkeypatch, tiny_llama_dir, tiny_engine):
    settings, job = _job_that_cannot_finish_in_its_window(tmp_path, monkeypatch, tiny_llama_dir)
    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=lambda: api.status(job.id, settings).done >= 3)
    view = api.status(job.id, settings)
    assert view.at_risk and view.expected_finish_at > view.expires_at > time.time()
    assert "AT RISK" in describe(view)
    metadata = batch_object(view)["metadata"]
    assert metadata["berth_at_risk"] == "true" and int(metadata["berth_expected_finish"]) > view.expires_at
    api.cancel(job.id, settings)


def test_a_job_that_cannot_finish_in_its_window_raises_its_at_risk_event_once_well_before_it_ends(
        tmp_path, monkeypatch, tiny_llama_dir, tiny_engine):
    settings, job = _job_that_cannot_finish_in_its_window(tmp_path, monkeypatch, tiny_llama_dir)
    monkeypatch.setattr(jobs.hosting.chores, "AT_RISK_SECONDS", 0.2)  # the worker's own chore, looking often
    runs: list[list[str]] = []  # what each run of the chore raised
    real = jobs.pipeline.celery_tasks.raise_at_risk

    def counted(db):
        runs.append(real(db))
        return runs[-1]

    monkeypatch.setattr(jobs.pipeline.celery_tasks, "raise_at_risk", counted)

    window = job.expires_at - job.created_at
    well_before = job.expires_at - window / 2

    def raised_and_looked_again() -> bool:
        assert [job.id] in runs or time.time() < well_before, f"no at-risk event in half its window ({len(runs)} runs)"
        return [job.id] in runs and len(runs) - runs.index([job.id]) > 3

    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=raised_and_looked_again)
    db = open_database(settings.database_url)
    with db.session() as s:
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id)).all()
        row = s.get(Job, job.id)
        assert [(e.kind, e.status) for e in events] == [  # the triggers' rows are status events still
            ("status", JobStatus.VALIDATING), ("status", JobStatus.IN_PROGRESS), ("at_risk", JobStatus.IN_PROGRESS)]
        event = events[-1]
        body = job_event_body(event, row, "default", settings.storage_url)
    assert event.created_at < well_before
    assert row.at_risk_at == event.created_at and event.expected_finish_at > job.expires_at
    jsonschema.validate(body, schema(EVENT_SCHEMA), cls=jsonschema.Draft202012Validator)
    assert (body["type"], body["expires_at"], body["expected_finish_at"]) == (
        "job.at_risk", job.expires_at, event.expected_finish_at)

    view = api.status(job.id, settings)
    assert view.at_risk and view.to_dict()["at_risk_since"] == int(event.created_at)
    # a chore beside it that read the job before this one marked it: the job is taken once, no second event
    monkeypatch.setattr(jobs.records.outbox, "live_jobs_not_yet_at_risk", lambda db: [replace(view, at_risk_at=None)])
    assert raise_at_risk(db) == []
    with db.session() as s:
        assert len(s.scalars(select(JobEvent.id).where(JobEvent.job_id == job.id)).all()) == 3
    api.cancel(job.id, settings)

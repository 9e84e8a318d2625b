"""The embedded defaults' chores: none with a broker; on the embedded queue a request held by a dead
worker is published again by one reconcile and not by the next, a job past its window expires, the
queue's rows handed out long ago are deleted, and a failing chore logs instead of raising."""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time

from sqlalchemy import select, update

import jobs.hosting.chores
import jobs.pipeline.celery_tasks
from jobs import api
from jobs.hosting.chores import chores
from jobs.records.db import open_database
from jobs.records.models import Job, JobStatus, RequestRow, now
from tests.support.jobs_env import AMQP_URL, TINY_NAME, embedded_settings, request_line, tiny_settings, write_requests
from worker.messaging.topology import Topology, broker_url, connect


def _chore(settings, name):
    [chore] = [c.run for c in chores(settings) if c.run.__name__ == name]
    return chore


def _queue_rows(settings) -> list[tuple[int, int, str | None]]:
    """(id, visible, timestamp) of every row of the embedded queue."""
    with sqlite3.connect(broker_url(settings).removeprefix("sqla+sqlite:///")) as conn:
        return conn.execute("SELECT id, visible, timestamp FROM kombu_message ORDER BY id").fetchall()


def test_chores_run_on_the_embedded_queue_only(tmp_path, tiny_llama_dir):
    assert chores(tiny_settings(tiny_llama_dir, broker_url=AMQP_URL, database_url="postgresql://x/y")) == []
    embedded = chores(embedded_settings(tiny_llama_dir, tmp_path))
    periods = {c.run.__name__: c.period for c in embedded}
    assert set(periods) == {"reconcile", "expire", "at_risk", "expire_files", "checkpoint_gc", "queue_gc"}
    assert periods["reconcile"] <= 10 and periods["expire"] <= 10 and periods["at_risk"] <= 10
    assert periods["checkpoint_gc"] == 600
    assert [c.run.__name__ for c in embedded if c.first == 0] == ["reconcile"]  # the others wait a period
    for chore in embedded:  # nothing to do, nothing raised
        chore.run()


def test_a_request_held_by_a_dead_worker_is_published_again_once(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 3), settings)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    holders = {1: f"{host}:{dead.pid}", 2: f"{host}:{os.getpid()}", 3: f"elsewhere:{dead.pid}"}
    db = open_database(settings.database_url)
    with db.session() as s, s.begin():  # each delivered after it was published, as a worker records it
        for line, holder in holders.items():
            s.execute(update(RequestRow).where(RequestRow.job_id == job.id, RequestRow.line == line)
                      .values(holder=holder, delivered_at=now(), attempts=1))

    def published() -> dict[int, float]:
        with db.session() as s:
            return dict(s.execute(select(RequestRow.line, RequestRow.published_at)
                                  .where(RequestRow.job_id == job.id)).all())

    before = published()
    assert len(_queue_rows(settings)) == 3
    reconcile = _chore(settings, "reconcile")
    reconcile()
    after = published()
    assert after[1] > before[1] and (after[2], after[3]) == (before[2], before[3])  # only the dead pid's
    assert len(_queue_rows(settings)) == 4
    reconcile()  # the same delivery: not again
    assert published() == after and len(_queue_rows(settings)) == 4


def test_a_worker_started_after_a_dead_one_republishes_its_requests_at_once(tmp_path, tiny_llama_dir):
    """The reconcile runs as the housekeeper starts, not a period later: a killed `berth worker` started again
    takes up what the dead one held within its start-up (5 s after it, before)."""
    from worker.consumer.housekeeper import Housekeeper

    settings = embedded_settings(tiny_llama_dir, tmp_path)
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 1), settings)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open_database(settings.database_url).session() as s, s.begin():
        s.execute(update(RequestRow).where(RequestRow.job_id == job.id)
                  .values(holder=f"{socket.gethostname()}:{dead.pid}", delivered_at=now(), attempts=1))
    keeper = Housekeeper(chores(settings))
    started = time.monotonic()
    keeper.start()
    try:
        while len(_queue_rows(settings)) < 2:
            assert time.monotonic() - started < 2.5, "the dead worker's request waited for the reconcile's period"
            time.sleep(0.05)
    finally:
        keeper.stop()


def test_a_job_past_its_window_expires_through_the_chores(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 2), settings)
    with open_database(settings.database_url).session() as s, s.begin():
        s.execute(update(Job).where(Job.id == job.id).values(expires_at=now() - 1))
    _chore(settings, "expire")()
    job = api.status(job.id, settings)
    assert (job.status, job.total, job.failed) == (JobStatus.EXPIRED, 2, 2)


def test_queue_rows_handed_out_long_ago_are_deleted(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    api.submit(write_requests(tmp_path / "requests.jsonl", 3), settings)
    queue = Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")
    with connect(settings) as conn:  # two handed out and acked: kombu keeps their rows, invisible
        for _ in range(2):
            queue.bind(conn.default_channel).get().ack()
    rows = _queue_rows(settings)
    handed_out = [r for r in rows if not r[1]]
    assert len(handed_out) == 2 and all(r[2] is not None for r in handed_out)  # kombu stamps the hand-out
    path = broker_url(settings).removeprefix("sqla+sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE kombu_message SET timestamp = '2000-01-01 00:00:00.000000' WHERE id = ?",
                     (handed_out[0][0],))
    _chore(settings, "queue_gc")()
    assert [r[0] for r in _queue_rows(settings)] == [r[0] for r in rows if r[0] != handed_out[0][0]]


def test_a_failing_chore_logs_once_and_does_not_raise(tmp_path, tiny_llama_dir, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ConnectionError("the database went away")

    monkeypatch.setattr(jobs.pipeline.celery_tasks, "reconcile", broken)
    reconcile = _chore(embedded_settings(tiny_llama_dir, tmp_path), "reconcile")
    with caplog.at_level(logging.INFO, logger="berth.housekeeping"):
        reconcile()
        reconcile()
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "the database went away" in caplog.text
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="berth.housekeeping"):
        reconcile()
    assert "reconcile works again" in caplog.text


def test_housekeeping_runs_on_while_an_ingest_it_resumed_runs(tmp_path, tiny_llama_dir, monkeypatch):
    """On the embedded queue the reconcile chore resumes a silent ingest; that ingest (held here on
    its lines) runs beside the chores, which go on: another job past its window expires, and a job
    whose ingest never started is ingested by a later reconcile, all while the first still runs.
    (Before, the resumed ingest ran on the housekeeping thread itself and held every chore.) The
    periods are cut to 0.5 s so that the test takes seconds."""
    from jobs.lines.validate import LineValidator
    from jobs.pipeline.submit import JobSpec, create_job
    from jobs.records.job_files import JobFiles
    from worker.consumer.housekeeper import Housekeeper

    settings = embedded_settings(tiny_llama_dir, tmp_path)
    monkeypatch.setattr(jobs.hosting.chores, "RECONCILE_SECONDS", 0.5)
    monkeypatch.setattr(jobs.hosting.chores, "EXPIRE_SECONDS", 0.5)
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)
    release, check = threading.Event(), LineValidator.check

    def held(self, raw):
        if b'"held-' in raw.data:
            release.wait(120)
        return check(self, raw)

    monkeypatch.setattr(LineValidator, "check", held)

    def silent_job(name: str, custom_id: str) -> str:
        """A job whose submitter died before dispatching its ingest, long ago."""
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({**request_line(i), "custom_id": f"{custom_id}-{i}"}) + "\n"
                                for i in range(2)))
        job_id = create_job(db, files, path, TINY_NAME, JobSpec(tenant=name))
        with db.session() as s, s.begin():
            s.execute(update(Job).where(Job.id == job_id).values(created_at=now() - 200))
        return job_id

    def wait_for(job_id: str, status: JobStatus, what: str) -> None:
        deadline = time.monotonic() + 60
        while api.status(job_id, settings).status != status:
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    expiring = api.submit(write_requests(tmp_path / "expiring.jsonl", 2), settings).id
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == expiring).values(expires_at=now() - 1))
    held_job = silent_job("team-a", "held")
    keeper = Housekeeper(chores(settings))
    keeper.start()
    try:
        wait_for(expiring, JobStatus.EXPIRED, "the expiry waited for the ingest the reconcile resumed")
        later = silent_job("team-b", "req")
        wait_for(later, JobStatus.IN_PROGRESS, "the next reconcile waited for the ingest the last one resumed")
        assert api.status(held_job, settings).status == JobStatus.VALIDATING  # still held, still running
    finally:
        release.set()
        wait_for(held_job, JobStatus.IN_PROGRESS, "the held ingest did not finish once let go")
        keeper.stop()

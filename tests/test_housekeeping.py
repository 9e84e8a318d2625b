"""The embedded defaults' chores: none with a broker; on the embedded queue a request held by a dead
worker is published again by one reconcile and not by the next, a job past its window expires, the
queue's rows handed out long ago are deleted, and a failing chore logs instead of raising."""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import subprocess
import sys

from sqlalchemy import select, update

from jobs import api
from jobs.db import open_database
from jobs.housekeeping import chores
from jobs.models import Job, JobStatus, RequestRow, now
import jobs.tasks
from tests.jobs_support import AMQP_URL, TINY_NAME, tiny_settings, write_requests
from worker.consumer.queues import Topology, broker_url, connect


def _embedded(tmp_path, tiny_llama_dir):
    return tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                         storage_url=f"file://{tmp_path / 'store'}")


def _chore(settings, name):
    [chore] = [fn for _, fn in chores(settings) if fn.__name__ == name]
    return chore


def _queue_rows(settings) -> list[tuple[int, int, str | None]]:
    """(id, visible, timestamp) of every row of the embedded queue."""
    with sqlite3.connect(broker_url(settings).removeprefix("sqla+sqlite:///")) as conn:
        return conn.execute("SELECT id, visible, timestamp FROM kombu_message ORDER BY id").fetchall()


def test_chores_run_on_the_embedded_queue_only(tmp_path, tiny_llama_dir):
    assert chores(tiny_settings(tiny_llama_dir, broker_url=AMQP_URL, database_url="postgresql://x/y")) == []
    embedded = chores(_embedded(tmp_path, tiny_llama_dir))
    periods = {fn.__name__: period for period, fn in embedded}
    assert set(periods) == {"reconcile", "expire", "expire_files", "checkpoint_gc", "queue_gc"}
    assert periods["reconcile"] <= 10 and periods["expire"] <= 10 and periods["checkpoint_gc"] == 600
    for _, chore in embedded:  # nothing to do, nothing raised
        chore()


def test_a_request_held_by_a_dead_worker_is_published_again_once(tmp_path, tiny_llama_dir):
    settings = _embedded(tmp_path, tiny_llama_dir)
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


def test_a_job_past_its_window_expires_through_the_chores(tmp_path, tiny_llama_dir):
    settings = _embedded(tmp_path, tiny_llama_dir)
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 2), settings)
    with open_database(settings.database_url).session() as s, s.begin():
        s.execute(update(Job).where(Job.id == job.id).values(expires_at=now() - 1))
    _chore(settings, "expire")()
    job = api.status(job.id, settings)
    assert (job.status, job.total, job.failed) == (JobStatus.EXPIRED, 2, 2)


def test_queue_rows_handed_out_long_ago_are_deleted(tmp_path, tiny_llama_dir):
    settings = _embedded(tmp_path, tiny_llama_dir)
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

    monkeypatch.setattr(jobs.tasks, "reconcile", broken)
    reconcile = _chore(_embedded(tmp_path, tiny_llama_dir), "reconcile")
    with caplog.at_level(logging.INFO, logger="berth.housekeeping"):
        reconcile()
        reconcile()
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "the database went away" in caplog.text
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="berth.housekeeping"):
        reconcile()
    assert "reconcile works again" in caplog.text

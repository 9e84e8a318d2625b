"""The ingest always finishes: a line that breaks the validator or the database is that line's
error; an ingest that stopped midway is resumed by the reconciler, and two ingests of one job store
each line once; a job cancelled or expired during its ingest accounts for every input line."""

from __future__ import annotations

import json
import threading
import time

import pytest
from sqlalchemy import select, update

import jobs.pipeline.ingest
from jobs import api
from jobs.lines.validate import LineValidator
from jobs.pipeline.celery_tasks import dispatch, finalize_later, ingest_later, make_app
from jobs.pipeline.ingest import ingest
from jobs.pipeline.reconcile import reconcile
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import cancel, expire_due
from jobs.records.models import Job, JobStatus, LineErrorRow, RequestRow, now
from tests.support.jobs_env import (
    TINY_NAME,
    embedded_settings,
    read_jsonl,
    request_line,
    work_until_over,
    write_requests,
)


def _stored_lines(settings, job_id) -> tuple[list[int], list[int]]:
    """The line numbers stored as requests and as line errors."""
    with open_database(settings.database_url).session() as s:
        return (list(s.scalars(select(RequestRow.line).where(RequestRow.job_id == job_id).order_by(RequestRow.line))),
                list(s.scalars(select(LineErrorRow.line).where(LineErrorRow.job_id == job_id)
                               .order_by(LineErrorRow.line))))


def test_a_line_that_breaks_the_validator_is_that_lines_error(tmp_path, tiny_llama_dir, tiny_engine, monkeypatch):
    check = LineValidator.check

    def breaking(self, raw):
        if raw.number == 3:
            raise RuntimeError("the validator tripped")
        return check(self, raw)

    monkeypatch.setattr(LineValidator, "check", breaking)
    job, files = api.run(write_requests(tmp_path / "requests.jsonl", 6), tmp_path / "out.jsonl",
                         embedded_settings(tiny_llama_dir, tmp_path), engine=tiny_engine)

    assert (job.status, job.total, job.completed, job.failed) == (JobStatus.COMPLETED, 6, 5, 1)
    assert [line["custom_id"] for line in read_jsonl(files.output)] == ["req-0", "req-1", "req-3", "req-4", "req-5"]
    [error] = read_jsonl(files.errors)
    assert (error["custom_id"], error["error"]["code"], error["error"]["line"]) == ("req-2", "invalid_request", 3)
    assert "RuntimeError: the validator tripped" in error["error"]["message"]


def test_a_line_the_database_refuses_is_that_lines_error(any_settings, tmp_path, monkeypatch):
    """A chunk whose insert fails is stored line by line: the refused line becomes a line error.
    Here a custom_id the database cannot take: a duplicate past the validator (a unique index
    violation), and on PostgreSQL a NUL character in a text column (a DataError)."""
    check = LineValidator.check

    def duplicating(self, raw):
        custom_id, url, request = check(self, raw)
        return ("req-0" if raw.number == 4 else custom_id), url, request

    monkeypatch.setattr(LineValidator, "check", duplicating)
    lines = [json.dumps(request_line(i)) for i in range(6)]
    nul = any_settings.database_url.startswith("postgresql")
    if nul:
        lines[4] = json.dumps({**request_line(4), "custom_id": "nul\u0000id"})
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line + "\n" for line in lines))

    job = api.submit(path, any_settings, eager=True)

    refused = [4, 5] if nul else [4]
    assert (job.status, job.total, job.failed) == (JobStatus.IN_PROGRESS, 6, len(refused))
    assert _stored_lines(any_settings, job.id) == ([n for n in range(1, 7) if n not in refused], refused)
    with open_database(any_settings.database_url).session() as s:
        duplicate = s.scalar(select(LineErrorRow).where(LineErrorRow.job_id == job.id, LineErrorRow.line == 4))
    assert duplicate.message.startswith("this line could not be stored: IntegrityError: ")


def test_an_ingest_that_stopped_midway_is_resumed_by_the_reconciler(tmp_path, tiny_llama_dir, tiny_engine,
                                                                    monkeypatch):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 3)
    store, calls = jobs.pipeline.ingest._store_chunk, []

    def stopping(*args):
        calls.append(args)
        if len(calls) == 2:
            raise ConnectionError("the database went away")
        return store(*args)

    monkeypatch.setattr(jobs.pipeline.ingest, "_store_chunk", stopping)
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 8), settings)  # the error is logged, not raised
    db = open_database(settings.database_url)
    assert (job.status, job.total) == (JobStatus.VALIDATING, 3)
    assert reconcile(db, settings).ingest == []  # it showed a sign of life just now

    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == job.id).values(ingest_seen_at=now() - 200))
    reconciled = reconcile(db, settings)
    assert reconciled.ingest == [job.id]
    assert reconcile(db, settings).ingest == []  # handed out once
    dispatch(make_app(settings, eager=True), reconciled)
    assert (api.status(job.id, settings).status, api.status(job.id, settings).total) == (JobStatus.IN_PROGRESS, 8)

    job = work_until_over(settings, tiny_engine, job.id)
    assert (job.status, job.total, job.completed, job.failed) == (JobStatus.COMPLETED, 8, 8, 0)
    assert _stored_lines(settings, job.id) == (list(range(1, 9)), [])
    output = read_jsonl(api.results(job.id, tmp_path / "out.jsonl", settings=settings).output)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(8)]


def test_an_ingest_never_dispatched_is_started_by_the_reconciler(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    db = open_database(settings.database_url)
    job_id = create_job(db, JobFiles(settings.storage_url), write_requests(tmp_path / "requests.jsonl", 3),
                        TINY_NAME, JobSpec())  # as if the submitter died before dispatching the ingest
    assert reconcile(db, settings).ingest == []
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id).values(created_at=now() - 200))
    dispatch(make_app(settings, eager=True), reconcile(db, settings))
    job = api.status(job_id, settings)
    assert (job.status, job.total) == (JobStatus.IN_PROGRESS, 3)


def test_two_ingests_of_one_job_store_each_line_once(any_settings, tmp_path, monkeypatch):
    """A resumed ingest runs while the first is still alive: the first (A) validates its first chunk,
    and before it stores it the second (B) stores two chunks and stops. A then finds its lines
    stored, skips them and stores the rest."""
    settings = any_settings
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 3)
    insert, check = jobs.pipeline.ingest._insert, jobs.pipeline.ingest._check
    calls = {"check": 0, "insert": 0}

    def stopping_insert(*args, **kw):  # B's third chunk fails
        calls["insert"] += 1
        if calls["insert"] == 3:
            raise ConnectionError("B stopped")
        return insert(*args, **kw)

    def check_then_overtaken(validator, job_id, chunk):
        calls["check"] += 1
        checked = check(validator, job_id, chunk)
        if calls["check"] == 1:  # A, before storing its first chunk
            with pytest.raises(ConnectionError, match="B stopped"):
                ingest(open_database(settings.database_url), JobFiles(settings.storage_url), settings, job_id)
            assert _stored_lines(settings, job_id)[0] == [1, 2, 3, 4, 5, 6]
        return checked

    monkeypatch.setattr(jobs.pipeline.ingest, "_insert", stopping_insert)
    monkeypatch.setattr(jobs.pipeline.ingest, "_check", check_then_overtaken)
    job = api.submit(write_requests(tmp_path / "requests.jsonl", 8), settings, eager=True)

    assert (job.status, job.total, job.failed) == (JobStatus.IN_PROGRESS, 8, 0)
    assert _stored_lines(settings, job.id) == (list(range(1, 9)), [])
    with open_database(settings.database_url).session() as s:
        assert all(s.scalars(select(RequestRow.published_at).where(RequestRow.job_id == job.id)))


@pytest.mark.parametrize("finalize_at", ["once closed", "after the ingest"])
@pytest.mark.parametrize("how", ["cancelled", "expired"])
def test_a_job_closed_during_its_ingest_accounts_for_every_line(tmp_path, tiny_llama_dir, monkeypatch, how,
                                                                finalize_at):
    """Closed after the ingest stored its first chunk; finalized at once (as on the embedded queue)
    or once the ingest returned (a Celery worker's finalize may run before or after)."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    app = make_app(settings, eager=True)
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 3)
    lines = [json.dumps(request_line(i)) for i in range(8)]
    lines[1], lines[5] = "not json {", "}{"
    lines.insert(6, "")  # a blank line is no line: line 7
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    numbers = [1, 2, 3, 4, 5, 6, 8, 9]
    line_of = {f"req-{i}": n for i, n in enumerate(numbers)}
    publish, closed = jobs.pipeline.ingest.publish, []

    def publish_then_close(db, publisher, messages):
        n = publish(db, publisher, messages)
        if not closed:  # after the first chunk
            job_id = messages[0].job_id
            closed.append(job_id)
            if how == "cancelled":
                cancel(db, job_id)
            else:
                with db.session() as s, s.begin():
                    s.execute(update(Job).where(Job.id == job_id).values(expires_at=now() - 1))
                assert expire_due(db) == [job_id]
            if finalize_at == "once closed":
                finalize_later(app, [job_id])
        return n

    monkeypatch.setattr(jobs.pipeline.ingest, "publish", publish_then_close)
    job = api.submit(path, settings)
    if finalize_at == "after the ingest":
        finalize_later(app, [job.id])

    job = api.status(job.id, settings)
    assert (job.status.value, job.total, job.completed, job.failed) == (how, 8, 0, 8)
    assert _stored_lines(settings, job.id)[0] == [1, 3]  # the ingest stored nothing after the first chunk
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    assert files.output is None
    errors = read_jsonl(files.errors)
    assert sorted(e["error"].get("line") or line_of[e["custom_id"]] for e in errors) == numbers
    code = f"batch_{how}"
    by_line = {e["error"].get("line") or line_of[e["custom_id"]]: e for e in errors}
    assert by_line[2]["error"]["code"] == "invalid_request"
    assert {n: by_line[n]["error"]["code"] for n in numbers if n != 2} == {n: code for n in numbers if n != 2}
    assert [by_line[n]["custom_id"] for n in (4, 5, 6, 8, 9)] == ["req-3", "req-4", None, "req-6", "req-7"]
    assert "before this line was checked" in by_line[4]["error"]["message"]

    finalize_later(app, [job.id])  # a second finalize changes nothing
    again = api.status(job.id, settings)
    assert (again.status, again.total, again.failed) == (job.status, 8, 8)


def test_a_chunk_slower_than_the_silence_window_is_ingested_once(tmp_path, tiny_llama_dir, monkeypatch):
    """A chunk whose lines take longer to check than the reconciler's silence window (slow grammar
    compiles, say): the ingest's heartbeat stamps it by the clock, so the reconciler never hands the
    job out again, and each line is checked and stored once, by one ingest. Here the window is 2 s
    and the heartbeat 0.2 s instead of 120 s and 15 s (``test_the_heartbeat_fits_the_silence_window``)."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    monkeypatch.setattr(jobs.pipeline.ingest, "HEARTBEAT_SECONDS", 0.2, raising=False)
    check, checked = LineValidator.check, []

    def slow(self, raw):
        checked.append(raw.number)
        time.sleep(1.2)  # four lines, one chunk: 4.8 s
        return check(self, raw)

    monkeypatch.setattr(LineValidator, "check", slow)
    db, app = open_database(settings.database_url), make_app(settings, eager=True)
    submitted = {}
    first = threading.Thread(target=lambda: submitted.update(
        job=api.submit(write_requests(tmp_path / "requests.jsonl", 4), settings)))
    first.start()
    while not checked and first.is_alive():  # the ingest has begun (its submit is not what is timed here)
        time.sleep(0.05)
    handed_out, again = [], []
    while first.is_alive():
        found = reconcile(db, settings, ingest_silence=2.0).ingest
        handed_out += found
        for job_id in found:  # as the housekeeping would: a second ingest of the job
            again.append(threading.Thread(target=ingest_later, args=(app, [job_id])))
            again[-1].start()
        time.sleep(0.3)
    for t in again:
        t.join()
    assert handed_out == [], "the reconciler took a slow ingest for a dead one"
    assert sorted(checked) == [1, 2, 3, 4]
    job = api.status(submitted["job"].id, settings)
    assert (job.status, job.total, job.failed) == (JobStatus.IN_PROGRESS, 4, 0)
    assert _stored_lines(settings, job.id) == ([1, 2, 3, 4], [])


def test_the_heartbeat_fits_the_silence_window():
    """With the defaults, a running ingest stamps its sign of life several times per silence window."""
    from jobs.pipeline.reconcile import INGEST_SILENCE_SECONDS

    assert 4 * jobs.pipeline.ingest.HEARTBEAT_SECONDS <= INGEST_SILENCE_SECONDS

"""`berth run`'s path (``jobs.hosting.local_run``): the job's ingest runs beside the engine worker, which
answers the first requests while the ingest still reads the file; an ingest stopped by an error ends the
run with it, and one stopped with the worker (Ctrl-C, SIGTERM) leaves a job the same run goes on with;
either way every line is answered once. On the embedded defaults and on PostgreSQL with RabbitMQ.

The ingest is held at a chosen point by wrapping ``jobs.pipeline.ingest._store_chunk`` (the first chunk's
messages are published, the second chunk not yet stored), so what runs beside it is decided, not raced."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

import jobs.lines.validate
import jobs.pipeline.ingest
from jobs import api
from jobs.cli import EXIT_INTERRUPTED, main
from jobs.hosting.engine_worker import engine_worker
from jobs.hosting.local_run import LocalRun
from jobs.pipeline import ingest_threads
from jobs.pipeline.publish import PublishError
from jobs.records.db import open_database
from jobs.records.models import JobStatus, RequestRow, Result
from tests.support.jobs_env import TINY_NAME, embedded_settings, read_jsonl, write_requests
from worker.consumer import loop

LINES = 8  # in chunks of 3: lines 1-3, 4-6, 7-8
EXPECTED = [f"req-{i}" for i in range(LINES)]
TINY_FLAGS = ["--model-name", TINY_NAME, "--kv-memory", "64MiB", "--threads", "1", "--quiet"]
WAIT = 60.0  # seconds a held ingest waits for what it waits for before it gives up (a failure, not a timing)




@pytest.fixture
def chunks_of_three(monkeypatch):
    monkeypatch.setattr(jobs.pipeline.ingest, "CHUNK_LINES", 3)


def _answered(settings, job_id) -> list[str]:
    """The custom_id of every result row of the job (a line answered twice would be there twice)."""
    with open_database(settings.database_url).session() as s:
        return sorted(s.scalars(select(RequestRow.custom_id).join(Result, Result.request_id == RequestRow.id)
                                .where(RequestRow.job_id == job_id)))


def _wait_for_an_answer(settings, job_id) -> list[str]:
    deadline = time.monotonic() + WAIT
    while not (answered := _answered(settings, job_id)):
        if time.monotonic() > deadline:
            raise AssertionError(f"no request of {job_id} was answered while its ingest was held")
        time.sleep(0.05)
    return answered


def _hold_before_second_chunk(monkeypatch, hold) -> list[str]:
    """Call ``hold(job_id)`` on the ingest's thread before it stores its second chunk, its first one
    published (once a process); the job ids it was called for."""
    store, calls, held = jobs.pipeline.ingest._store_chunk, [], []

    def hold_then_store(db, target, *args):
        calls.append(target.job_id)
        if len(calls) == 2:
            held.append(target.job_id)
            hold(target.job_id)
        return store(db, target, *args)

    monkeypatch.setattr(jobs.pipeline.ingest, "_store_chunk", hold_then_store)
    return held


def _fail_second_chunk(monkeypatch, error: Exception) -> None:
    store, calls = jobs.pipeline.ingest._store_chunk, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise error
        return store(*args)

    monkeypatch.setattr(jobs.pipeline.ingest, "_store_chunk", failing)


def _answered_once(settings, job, files) -> None:
    assert (job.status, job.total, job.completed, job.failed) == (JobStatus.COMPLETED, LINES, LINES, 0)
    assert [line["custom_id"] for line in read_jsonl(files.output)] == EXPECTED
    assert _answered(settings, job.id) == sorted(EXPECTED)


def test_the_worker_answers_the_first_requests_while_the_ingest_reads_the_rest(any_settings, tmp_path, tiny_engine,
                                                                             chunks_of_three, monkeypatch):
    """Held before its second chunk, the ingest waits for a result of the first to be committed: it comes
    (an ingest run to its end before the worker started would wait in vain), while the job is still
    ``validating`` with 3 lines read. Its running time counts from its first chunk's messages, not from the
    ingest's end (the ETA's rate would count that work in too little time)."""
    seen = {}

    def until_answered(job_id):
        seen["answered"] = _wait_for_an_answer(any_settings, job_id)
        seen["job"] = api.status(job_id, any_settings)
        seen["at"] = time.time()

    _hold_before_second_chunk(monkeypatch, until_answered)
    job, files = api.run(write_requests(tmp_path / "requests.jsonl", LINES), tmp_path / "out.jsonl", any_settings,
                         engine=tiny_engine)

    assert set(seen["answered"]) <= set(EXPECTED[:3])
    assert (seen["job"].status, seen["job"].total) == (JobStatus.VALIDATING, 3)
    assert job.in_progress_at <= seen["at"]
    _answered_once(any_settings, job, files)


def test_submit_returns_once_the_first_chunk_is_queued(tmp_path, tiny_llama_dir, chunks_of_three, monkeypatch):
    """Not before (the embedded queue would be found empty by the worker's first look, and looked at again
    only half a second later), nor after the whole file: here the ingest is held before its second chunk."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    release = threading.Event()
    _hold_before_second_chunk(monkeypatch, lambda job_id: release.wait(WAIT))
    try:
        here = LocalRun.submit(write_requests(tmp_path / "requests.jsonl", LINES), settings)
        assert here.ingest.published.is_set() and not here.ingest.done
        with open_database(settings.database_url).session() as s:
            published = s.scalars(select(RequestRow.line).where(RequestRow.job_id == here.job_id,
                                                                RequestRow.published_at.is_not(None))).all()
        assert sorted(published) == [1, 2, 3]
    finally:
        release.set()
    here.ingest.thread.join(WAIT)
    assert (api.status(here.job_id, settings).status, api.status(here.job_id, settings).total) == (
        JobStatus.IN_PROGRESS, LINES)


def test_the_run_returns_once_its_job_is_over_not_at_the_workers_next_look(tmp_path, tiny_llama_dir, tiny_engine,
                                                                            monkeypatch):
    """The worker asks whether its job is over when it falls idle after committing outcomes, not only at
    its look every ``CONTROL_INTERVAL``: `berth run` returned up to a second after its job had ended. With
    the look made once a minute here, the run still returns within seconds of the job's end."""
    monkeypatch.setattr(loop, "CONTROL_INTERVAL", 60.0)
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    job, files = api.run(write_requests(tmp_path / "requests.jsonl", LINES), tmp_path / "out.jsonl", settings,
                         engine=tiny_engine)
    returned = time.time()
    _answered_once(settings, job, files)
    assert returned - job.completed_at < 10.0, f"returned {returned - job.completed_at:.1f} s after the job ended"


@pytest.mark.parametrize("checks_lines", [True, False])
def test_the_worker_of_a_run_reads_the_line_checks_model_facts_before_the_job(tmp_path, tiny_llama_dir, tiny_engine,
                                                                              monkeypatch, checks_lines):
    """Read on the job's clock, they would hold back the ingest's first chunk, and the worker with it."""
    monkeypatch.setattr(jobs.lines.validate, "_model_infos", {})
    engine_worker(embedded_settings(tiny_llama_dir, tmp_path), tiny_engine, eager_tasks=True,
                  checks_lines=checks_lines).close()
    assert bool(jobs.lines.validate._model_infos) is checks_lines


def test_an_ingest_stopped_by_an_error_ends_the_run_with_it_and_the_same_run_goes_on(any_settings, tmp_path,
                                                                                   tiny_engine, chunks_of_three,
                                                                                   monkeypatch):
    """The error is raised by ``run`` (before, it was logged and the run waited for the reconciler to
    ingest again 120 s later); the job is left ``validating`` with its first chunk, which
    ``unfinished_run`` finds, and ``run`` of it reads the rest."""
    path = write_requests(tmp_path / "requests.jsonl", LINES)
    _fail_second_chunk(monkeypatch, ConnectionError("the database went away"))

    with pytest.raises(ConnectionError, match="the database went away"):
        api.run(path, tmp_path / "out.jsonl", any_settings, engine=tiny_engine)

    earlier = api.unfinished_run(path, any_settings)
    assert earlier is not None and (earlier.status, earlier.total) == (JobStatus.VALIDATING, 3)
    job, files = api.run(path, tmp_path / "out.jsonl", any_settings, engine=tiny_engine, job_id=earlier.id)
    assert job.id == earlier.id
    _answered_once(any_settings, job, files)


def _berth_run(tiny_llama_dir):
    return CliRunner().invoke(main, ["run", "requests.jsonl", "-o", "out.jsonl", "--model", str(tiny_llama_dir),
                                     *TINY_FLAGS])


@pytest.mark.parametrize("error, line", [
    (OperationalError("INSERT INTO requests", {}, sqlite3.OperationalError("disk I/O error")),
     "Error: the database at sqlite:///./berth.db: disk I/O error; check that it runs and takes connections there, "
     "or set BERTH_DATABASE_URL (--database-url)"),
    (PublishError("the broker refused 3 messages (nack: out of disk or memory?); the reconciler will publish them "
                  "again"),
     "Error: the broker refused 3 messages (nack: out of disk or memory?); the reconciler will publish them again"),
], ids=["database", "broker"])
def test_berth_run_says_in_one_line_what_stopped_its_ingest(tmp_path, monkeypatch, tiny_llama_dir, chunks_of_three,
                                                            error, line):
    monkeypatch.chdir(tmp_path)
    write_requests(tmp_path / "requests.jsonl", LINES)
    _fail_second_chunk(monkeypatch, error)

    result = _berth_run(tiny_llama_dir)

    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1] == line


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_berth_run_stopped_during_its_ingest_goes_on_with_the_job(tmp_path, monkeypatch, tiny_llama_dir,
                                                                  chunks_of_three, signum):
    """The signal comes once the worker answered a request of the first chunk (its handlers are in place),
    while the ingest is held before storing its second chunk, which it goes on with only once it is asked
    to stop: it stores and publishes that chunk and reads no third. The job is left ``validating`` with 6
    lines, and the same `berth run` goes on with it to the end."""
    monkeypatch.chdir(tmp_path)
    write_requests(tmp_path / "requests.jsonl", LINES)
    settings = embedded_settings(tiny_llama_dir, tmp_path)

    def interrupt(job_id):
        _wait_for_an_answer(settings, job_id)
        os.kill(os.getpid(), signum)
        assert ingest_threads.running(job_id).stopping.wait(WAIT), "the ingest was not asked to stop"

    held = _hold_before_second_chunk(monkeypatch, interrupt)
    result = _berth_run(tiny_llama_dir)

    assert result.exit_code == EXIT_INTERRUPTED, result.output
    [job_id] = held
    job = api.status(job_id, settings)
    assert (job.status, job.total) == (JobStatus.VALIDATING, 6) and job.completed >= 1
    assert result.output.strip().splitlines()[-1] == (
        f"stopped: {job_id} left with {job.completed} of the 6 lines read so far done, the rest of its file not yet "
        f"read; `berth run requests.jsonl -o out.jsonl` again goes on with it (or `berth worker`, then "
        f"`berth results {job_id} -o out.jsonl`)")

    result = _berth_run(tiny_llama_dir)
    assert result.exit_code == 0, result.output
    assert f"going on with {job_id}, which an earlier run of requests.jsonl left unfinished" in result.output
    [listed] = api.list_jobs(settings)
    assert listed.id == job_id
    _answered_once(settings, api.status(job_id, settings), api.ResultFiles(tmp_path / "out.jsonl", None))

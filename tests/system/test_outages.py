"""The issue's outage tests: S3, RabbitMQ and PostgreSQL each go away in the middle of a job and
come back, while one engine worker process (``berth worker``) runs the job. The worker must notice
(its metrics say so), keep its engine stepping, reconnect by itself, and the job must complete with
exactly one result per request, outputs equal to a direct run, and no token computed twice.

A first test, which runs anywhere, makes the worker's database calls fail for a while in its own
process: the outcomes wait, unacked, and are committed once the calls get through again.

Outages are triggered by progress (output tokens, outcomes waiting), never by the clock, so a fast
machine cannot finish the job before the outage and a slow one still sees it.

S3 is a moto server of this test's own (the session's server is shared with other tests), stopped
and started again on the same port; moto keeps its objects in this process across the restart.
RabbitMQ and PostgreSQL are this machine's own services (Debian packages, no systemd), stopped and
started with their control commands: the tests need root and skip otherwise, and whatever happens
they start the service again and wait until it answers, since other tests share it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select

import worker.consumer.loop as consumer
from jobs import api
from jobs.hosting.generate import generate_file
from jobs.pipeline.finalize import finalize
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import JobStatus, RequestRow, Result
from tests.support.jobs_env import AMQP_URL, PG_ADMIN_URL, TINY_NAME, choices_by_custom_id, tiny_env, tiny_settings
from tests.support.processes import free_port
from tests.support.s3_server import S3_ENV
from tests.support.worker_process import metric, results_counts, start_worker

SEATS = 4  # max_num_seqs of the worker: few seats make a job long in time for few tokens
RESTORE_TIMEOUT = 120.0  # seconds a stopped service gets to answer again before the test fails loudly


# ---- the job and its checks
def _job(tmp_path: Path, lengths: list[int]) -> Path:
    """Greedy completions of exactly ``lengths[i]`` tokens each."""
    lines = [{"custom_id": f"outage-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"Chapter {i}: it was a dark and stormy night",
                       "max_tokens": n, "temperature": 0, "ignore_eos": True}} for i, n in enumerate(lengths)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:]) if log_path.exists() else ""


class Worker:
    """An engine worker process and its metrics."""

    def __init__(self, env: dict, log_path: Path):
        self.log_path = log_path
        self.proc, self.port = start_worker(env, log_path)

    def metric(self, name: str) -> float:
        return metric(self.port, name)

    def wait(self, what: str, condition, timeout: float = 90.0) -> None:
        """Until ``condition()`` holds; fails saying ``what`` did not happen, with the worker's log."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the worker died:\n{_tail(self.log_path)}"
            try:
                if condition():
                    return
            except OSError:  # its metrics are not served yet
                pass
            assert time.monotonic() < deadline, (f"{what} did not happen in {timeout:.0f}s ({self._state()}):\n"
                                                 f"{_tail(self.log_path)}")
            time.sleep(0.05)

    def _state(self) -> str:
        """The metrics a failed wait is read against, as the worker says them now."""
        try:
            return ", ".join(f"{name} {self.metric(name):g}" for name in (
                "berth_output_tokens_total", "berth_outcomes_waiting", "berth_database_up", "berth_broker_up"))
        except OSError as exc:
            return f"its metrics do not answer: {exc}"

    def tokens(self) -> float:
        return self.metric("berth_output_tokens_total")

    def run_until(self, tokens: float) -> float:
        self.wait(f"{tokens:.0f} output tokens", lambda: self.tokens() >= tokens, timeout=180)
        return self.tokens()

    def finish(self, db, n: int, timeout: float = 180.0) -> float:
        """Until the job has its ``n`` results; stops the worker; the tokens it generated."""
        self.wait(f"all {n} results", lambda: results_counts(db)[0] >= n, timeout)
        generated = self.tokens()
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, _tail(self.log_path)
        return generated

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _check_job(settings, job_id: str, requests: Path, lengths: list[int], generated: float, tmp_path: Path) -> None:
    """Exactly one result per request, every token kept and none computed twice, the job completed,
    and its output equal to the engine's own run of the same file."""
    db = open_database(settings.database_url)
    with db.session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
    assert len(per_request) == len(lengths) and all(count == 1 for _, count in per_request)
    kept = results_counts(db)[1]
    assert kept == sum(lengths)
    assert generated == kept, f"{generated - kept:.0f} tokens were computed twice"
    finalize(db, JobFiles(settings.storage_url), job_id)
    view = api.status(job_id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (len(lengths), 0)
    files = api.results(job_id, tmp_path / "out.jsonl", settings=settings)
    direct = settings.model_copy(update={"max_num_seqs": 32})  # the same greedy outputs, faster
    generate_file(requests, tmp_path / "direct.jsonl", direct, progress=False)
    assert choices_by_custom_id(files.output) == choices_by_custom_id(tmp_path / "direct.jsonl")


# ---- the database failing, simulated: runs anywhere (the real restart below needs root)
@pytest.mark.slow
def test_outcomes_wait_while_the_database_fails(tmp_path, tiny_llama_dir, monkeypatch):
    from jobs.hosting.engine_worker import engine_worker
    from worker.consumer.ledger import LedgerDown
    from worker.engine.engine import Engine

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'jobs.records.db'}",
                             storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=SEATS)
    lengths = [100 + 20 * i for i in range(8)]
    job = api.submit(_job(tmp_path, lengths), settings)  # the embedded queue: ingested here
    engine = Engine(settings)
    worker = engine_worker(settings, engine, eager_tasks=True)
    down, seen = [False], {}

    def failing(call):
        def maybe(*args, **kwargs):
            if down[0]:
                raise LedgerDown("the database is down")
            return call(*args, **kwargs)
        return maybe

    for name in ("claim", "record", "live_tenants"):
        monkeypatch.setattr(worker.ledger, name, failing(getattr(worker.ledger, name)))
    monkeypatch.setattr(consumer, "CONTROL_INTERVAL", 0.05)  # claims are async: look often for the first running

    metric = worker.metrics.registry.get_sample_value

    def until() -> bool:  # checked every CONTROL_INTERVAL
        if not seen and worker.inflight:
            down[0], seen["down_at"] = True, engine.stats.output_tokens
        elif down[0] and metric("berth_outcomes_waiting") >= 2:
            down[0], seen["waited"] = False, metric("berth_outcomes_waiting")
            seen["back_at"] = engine.stats.output_tokens
        return api.status(job.id, settings).status.is_final

    worker.run(until=until)
    assert seen.get("waited", 0) >= 2 and seen["back_at"] > seen["down_at"], seen
    assert metric("berth_database_errors_total") > 0 and metric("berth_database_up") == 1
    assert metric("berth_outcomes_waiting") == 0
    view = api.status(job.id, settings)
    assert (view.status, view.completed, view.failed) == (JobStatus.COMPLETED, len(lengths), 0)
    db = open_database(settings.database_url)
    with db.session() as s:
        assert s.scalars(select(RequestRow.attempts)).all() == [1] * len(lengths)
    assert results_counts(db) == (len(lengths), sum(lengths)) and engine.stats.output_tokens == sum(lengths)


# ---- S3 (moto)
def _moto(port: int):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def _stop_moto(server) -> None:
    server.stop()
    server._server.server_close()  # stop() leaves the socket listening: clients would hang instead of failing


def _keys(client, bucket: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


@pytest.mark.slow
def test_s3_stopped_mid_job_and_started_again(tmp_path, tiny_llama_dir, pg_url, queue_prefix, monkeypatch):
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)  # this process writes the job's files there too
    server = _moto(port)
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        bucket = f"berth-outage-{uuid.uuid4().hex[:12]}"
        s3.create_bucket(Bucket=bucket)
        lengths = [500] * 16
        total = sum(lengths)
        settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                                 storage_url=f"s3://{bucket}/outage", max_num_seqs=SEATS, drain_timeout=10)
        requests = _job(tmp_path, lengths)
        job = api.submit(requests, settings, eager=True)
        db = open_database(pg_url)
        # KV written whatever it costs (the default writes it only where it pays, never for requests this
        # short), so that the outage meets KV uploads too, and objects to find again after moto's restart;
        # a round every 16 steps however fast the tiny model makes them (the default floor is 2 s)
        env = {**os.environ, **tiny_env(settings), "BERTH_CHECKPOINT_INTERVAL": "16", "BERTH_CHECKPOINT_KV": "always",
               "BERTH_CHECKPOINT_MIN_SECONDS": "0"}
        worker = Worker(env, tmp_path / "worker.log")
        try:
            worker.run_until(0.15 * total)
            worker.wait("checkpoints written", lambda: worker.metric("berth_checkpoint_states_total") >= 8)
            worker.wait("KV written", lambda: any(k.endswith(".kv") for k in _keys(s3, bucket)))
            before = {k for k in _keys(s3, bucket) if k.endswith(".kv")}  # KV runs: never deleted
            assert before
            assert results_counts(db)[0] < len(lengths), "the job ended before the outage: make the requests longer"

            _stop_moto(server)
            worker.wait("the worker reporting the store down",
                        lambda: worker.metric("berth_checkpoint_storage_up") == 0)
            down_at = worker.tokens()
            worker.run_until(down_at + 0.08 * total)  # the engine keeps generating without its store
            assert worker.metric("berth_checkpoint_storage_up") == 0
            states_down = worker.metric("berth_checkpoint_states_total")
            assert results_counts(db)[0] < len(lengths), "the job ended during the outage: make the requests longer"

            server = _moto(port)
            assert before <= _keys(s3, bucket), "moto lost objects across its restart"
            worker.wait("the worker finding the store back", lambda: worker.metric("berth_checkpoint_storage_up") == 1)
            worker.wait("checkpoints resuming (if the job ended first, make the requests longer)",
                        lambda: worker.metric("berth_checkpoint_states_total") > states_down)
            failures = worker.metric("berth_checkpoint_failures_total")
            print(f"\nS3 down at {down_at:.0f} of {total} tokens; {failures:.0f} checkpoint writes failed; "
                  f"checkpoints resumed at {worker.tokens():.0f} tokens")
            assert failures > 0
            generated = worker.finish(db, len(lengths))
        finally:
            worker.kill()
        _check_job(settings, job.id, requests, lengths, generated, tmp_path)
    finally:
        _stop_moto(server)


# ---- the machine's own services: control, and always left running
def _pg_version() -> str:
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    return versions[-1] if versions else ""


def _require_service_control(*commands: str) -> None:
    """Skip, saying why, unless this test may stop and start the local services."""
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: this test restarts the local Debian services")
    if os.geteuid() != 0:
        pytest.skip("restarting the local PostgreSQL/RabbitMQ services needs root")
    if "pg_ctlcluster" in commands and not os.path.isdir(f"/etc/postgresql/{_pg_version()}/main"):
        pytest.skip("no PostgreSQL cluster 'main' in /etc/postgresql")


def _run(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _pg_ctl(action: str) -> subprocess.CompletedProcess:
    return _run("pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), "main", action)


def _postgres_answers() -> bool:
    import psycopg

    try:
        with psycopg.connect(PG_ADMIN_URL.replace("postgresql+psycopg", "postgresql"), connect_timeout=3) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.Error:
        return False


def _rabbitmq_answers() -> bool:
    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=0)
            conn.channel().close()
            return True
    except Exception:  # noqa: BLE001 (refused, reset, not ready: not answering)
        return False


def _wait_answering(answers, what: str, timeout: float = RESTORE_TIMEOUT) -> float:
    """Seconds until ``answers()``; a RuntimeError, loud, if it never does."""
    t0 = time.monotonic()
    while not answers():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{what} did not come back in {timeout:.0f}s: START IT BY HAND, other tests need it")
        time.sleep(0.2)
    return time.monotonic() - t0


def _restore_postgresql() -> None:
    if not _postgres_answers():
        _pg_ctl("start")  # fails harmlessly if it is already starting
        _wait_answering(_postgres_answers, "PostgreSQL (pg_ctlcluster ... main start)")


def _restore_rabbitmq() -> None:
    if not _rabbitmq_answers():
        if _run("rabbitmqctl", "-q", "ping").returncode != 0:  # the node is down, not just its app
            _run("rabbitmq-server", "-detached")
        else:
            _run("rabbitmqctl", "start_app", timeout=120)
        _wait_answering(_rabbitmq_answers, "RabbitMQ (rabbitmq-server -detached)")


def _queue_counts(prefix: str) -> dict[str, tuple[int, int]]:
    """Queue name -> (messages ready, delivered and unacked), for this test's queues."""
    out = _run("rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name", "messages_ready",
               "messages_unacknowledged")
    assert out.returncode == 0, out.stderr
    rows = (line.split() for line in out.stdout.splitlines())
    return {r[0]: (int(r[1]), int(r[2])) for r in rows if len(r) == 3 and r[0].startswith(prefix + ".")}


def _job_on_the_servers(tmp_path, tiny_llama_dir, pg_url, queue_prefix, lengths: list[int]):
    """The job queued in RabbitMQ and PostgreSQL, and a worker process started on it."""
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=SEATS, drain_timeout=10)
    requests = _job(tmp_path, lengths)
    job = api.submit(requests, settings, eager=True)
    worker = Worker({**os.environ, **tiny_env(settings)}, tmp_path / "worker.log")
    return settings, requests, job, open_database(pg_url), worker


@pytest.mark.slow
@pytest.mark.exclusive  # the service is down a while: no other test may need it
def test_rabbitmq_restarted_mid_job(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    _require_service_control("rabbitmqctl", "rabbitmq-server")
    lengths = [300] * 24  # more than the worker's window: most messages wait in the broker through the restart
    total = sum(lengths)
    settings, requests, job, db, worker = _job_on_the_servers(tmp_path, tiny_llama_dir, pg_url, queue_prefix, lengths)
    try:
        worker.run_until(0.2 * total)
        # The worker holds still while rabbitmqctl looks at the queues and stops the broker: each call
        # boots an Erlang VM, seconds of CPU on a busy machine, in which the worker finished the whole
        # job before the outage (a CI run beside two busy loops). Paused, the outage still comes at
        # this point of the job however slow the control commands are.
        worker.proc.send_signal(signal.SIGSTOP)
        try:
            waiting = sum(ready for ready, _ in _queue_counts(queue_prefix).values())
            assert waiting > 0, "every message was delivered before the restart: make the job bigger"
            assert results_counts(db)[0] < len(lengths), "the job ended before the outage: make the requests longer"
        except BaseException:
            worker.proc.send_signal(signal.SIGCONT)
            raise
        try:
            t0 = time.monotonic()
            try:
                stopped = _run("rabbitmqctl", "stop", timeout=120)
            finally:
                worker.proc.send_signal(signal.SIGCONT)
            assert stopped.returncode == 0, stopped.stderr
            worker.wait("the worker reporting the broker down", lambda: worker.metric("berth_broker_up") == 0)
            down_at = worker.tokens()
            worker.run_until(down_at + 4 * 25)  # the engine keeps stepping on what it holds
            started = _run("rabbitmq-server", "-detached")
            assert started.returncode == 0, started.stderr
            outage = time.monotonic() - t0 + _wait_answering(_rabbitmq_answers, "RabbitMQ")
        finally:
            _restore_rabbitmq()
        worker.wait("the worker reconnecting", lambda: worker.metric("berth_broker_reconnects_total") >= 1
                    and worker.metric("berth_broker_up") == 1)
        print(f"\nRabbitMQ down for {outage:.1f}s from {down_at:.0f} of {total} tokens, {waiting} messages "
              f"waiting in it; the worker reconnected at {worker.tokens():.0f} tokens")
        worker.wait(f"all {len(lengths)} results", lambda: results_counts(db)[0] >= len(lengths), 180)
        # the broker's copies of requests finished while it was down (unacked then, redelivered after) are
        # taken and acked as they come, behind the window's last requests: a worker left running empties
        # the queue; one stopped at the job's last result would hand the last few back
        deadline, left = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            left = {q: c for q, c in _queue_counts(queue_prefix).items() if not q.endswith(".tasks")}  # finalize's
            if left and all(counts == (0, 0) for counts in left.values()):
                break
            time.sleep(1)
        generated = worker.finish(db, len(lengths))
    finally:
        worker.kill()
    assert left and all(counts == (0, 0) for counts in left.values()), f"messages left behind: {left}"
    _check_job(settings, job.id, requests, lengths, generated, tmp_path)


@pytest.mark.slow
@pytest.mark.exclusive  # the service is down a while: no other test may need it
def test_postgresql_restarted_mid_job(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    _require_service_control("pg_ctlcluster")
    lengths = [300 + 25 * (i % 8) for i in range(16)]  # requests finish at different moments
    total = sum(lengths)
    settings, requests, job, db, worker = _job_on_the_servers(tmp_path, tiny_llama_dir, pg_url, queue_prefix, lengths)
    try:
        worker.run_until(0.25 * total)
        assert results_counts(db)[0] < len(lengths), "the job ended before the outage: make the requests longer"
        # The worker holds still while PostgreSQL stops (a shutdown checkpoint: seconds on a busy machine, in
        # which the worker finished all it held and made no token after it noticed; a CI run failed so), and
        # resumes with the database gone and the same work left: its tokens from then on are the outage's.
        worker.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            try:
                stopped = _pg_ctl("stop")
            finally:
                worker.proc.send_signal(signal.SIGCONT)
            assert stopped.returncode == 0, stopped.stderr
            down_at = worker.tokens()
            worker.wait("the worker reporting the database down", lambda: worker.metric("berth_database_up") == 0)
            # outcomes wait (some may have finished before the outage, still with the committer), and the
            # engine keeps stepping meanwhile
            worker.wait("requests finishing while the database is down",
                        lambda: worker.metric("berth_outcomes_waiting") >= 2 and worker.tokens() > down_at)
            assert worker.metric("berth_database_up") == 0
            waited = worker.metric("berth_outcomes_waiting")
            started = _pg_ctl("start")
            assert started.returncode == 0, started.stderr
            outage = time.monotonic() - t0 + _wait_answering(_postgres_answers, "PostgreSQL")
        finally:
            _restore_postgresql()
        worker.wait("the worker committing the waiting outcomes", lambda: worker.metric("berth_database_up") == 1
                    and worker.metric("berth_outcomes_waiting") == 0)
        errors = worker.metric("berth_database_errors_total")
        print(f"\nPostgreSQL down for {outage:.1f}s from {down_at:.0f} of {total} tokens; {waited:.0f} outcomes "
              f"waited for it; {errors:.0f} database calls failed")
        assert errors > 0
        generated = worker.finish(db, len(lengths))
    finally:
        worker.kill()
    with db.session() as s:
        attempts = s.scalars(select(RequestRow.attempts)).all()
    assert attempts == [1] * len(lengths), f"requests delivered again: {attempts}"
    _check_job(settings, job.id, requests, lengths, generated, tmp_path)

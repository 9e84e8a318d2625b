"""The engine worker under stress, on RabbitMQ and PostgreSQL: told to stop mid-job it finishes what
runs (the default 60 s drain) and hands the rest back without counting an attempt; cut off from the broker mid-job (its
own end of the link shut, or the connection closed by RabbitMQ itself, at default settings: what RabbitMQ's 30-minute
consumer_timeout does to a channel, without waiting half an hour) it reconnects, keeps its requests
running, and every request still gets exactly one result."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest
from sqlalchemy import select

from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.records.db import open_database
from jobs.records.models import JobStatus, RequestRow, Result
from tests.support.jobs_env import AMQP_URL, TINY_NAME, tiny_settings, work_until_over
from tests.support.rabbitmq import rabbitmqctl
from worker.messaging.topology import Topology, connect, queue_depth


@pytest.fixture
def settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    return tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                         storage_url=f"file://{tmp_path / 'store'}")  # drain_timeout at its default (60 s)


def _long_job(tmp_path, settings, n=4, max_tokens=300):
    lines = [{"custom_id": f"long-{i}", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"story {i}", "max_tokens": max_tokens, "ignore_eos": True}}
             for i in range(n)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return api.submit(path, settings, eager=True)


def _rows(settings, job_id):
    with open_database(settings.database_url).session() as s:
        return list(s.scalars(select(RequestRow).where(RequestRow.job_id == job_id)))


def test_a_stopped_worker_hands_its_requests_back_without_counting_an_attempt(tmp_path, settings, tiny_engine):
    # drain_timeout 0.2 s: the hand-back of what is still running when the drain ends (by default a stopped
    # worker first lets its running requests finish for up to 60 s, and these would)
    settings = settings.model_copy(update={"drain_timeout": 0.2})
    job = _long_job(tmp_path, settings, max_tokens=600)
    worker = engine_worker(settings, tiny_engine, eager_tasks=True)

    def stop_once_running() -> bool:
        if worker.inflight and not worker.stop_requested:
            worker.stop()  # what SIGTERM does
        return False

    worker.run(until=stop_once_running)
    assert tiny_engine.num_unfinished == 0
    assert [r.attempts for r in _rows(settings, job.id)] == [0, 0, 0, 0]
    with connect(settings) as conn:
        assert queue_depth(conn, [Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")]) == 4

    job = work_until_over(settings, tiny_engine, job.id)  # another worker takes them over
    assert (job.status, job.completed) == (JobStatus.COMPLETED, 4)


def test_a_stopped_worker_finishes_what_runs_at_the_default_drain_and_hands_back_the_rest(tmp_path, settings):
    """At the default drain_timeout (60 s) a stopped worker lets its running requests finish and record their
    results, and hands back at once, without counting an attempt, those it held but had not started (two run
    at a time here, so that the worker holds more than it runs)."""
    from worker.engine.engine import Engine

    assert settings.drain_timeout == 60.0
    settings = settings.model_copy(update={"max_num_seqs": 2})
    tiny_engine = Engine(settings)
    job = _long_job(tmp_path, settings, n=8)
    worker = engine_worker(settings, tiny_engine, eager_tasks=True)
    started_at_stop: set[int] = set()

    def stop_once_running() -> bool:
        started = {item.claim.request_id for item in worker.inflight.values() if item.started}
        if started and not worker.stop_requested:
            started_at_stop.update(started)
            worker.stop()  # what SIGTERM does
        return False

    worker.run(until=stop_once_running)  # returns once the drain has ended
    assert tiny_engine.num_unfinished == 0
    rows = _rows(settings, job.id)
    with open_database(settings.database_url).session() as s:
        done = set(s.scalars(select(Result.request_id).where(Result.request_id.in_([r.id for r in rows]))))
    assert started_at_stop and started_at_stop <= done, "a request running at the stop did not finish in the drain"
    assert all(r.attempts == 1 for r in rows if r.id in done)
    assert all(r.attempts == 0 for r in rows if r.id not in done), "a handed-back request counted an attempt"
    with connect(settings) as conn:
        depth = queue_depth(conn, [Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")])
    assert depth == len(rows) - len(done)

    job = work_until_over(settings, tiny_engine, job.id)  # another worker takes the rest
    assert (job.status, job.completed) == (JobStatus.COMPLETED, 8)
    with open_database(settings.database_url).session() as s:
        assert len(s.scalars(select(Result.request_id).where(Result.request_id.in_([r.id for r in rows]))).all()) == 8


def _cut_by_the_client(worker) -> None:
    """The worker's end of its broker link shut (a network failure as the worker sees it)."""
    worker.broker.connection.connection.sock.shutdown(socket.SHUT_RDWR)


def _cut_by_the_broker(worker) -> None:
    """RabbitMQ itself closes the worker's connection (``connection.close`` from the server, as when it
    gives up on a consumer), by ``rabbitmqctl``, with the broker's and berth's default settings."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed")
    port = worker.broker.connection.connection.sock.getsockname()[1]
    listed = subprocess.run(["rabbitmqctl", "list_connections", "--no-table-headers", "pid", "peer_port"], check=True,
                            capture_output=True, text=True, timeout=120).stdout
    pids = [pid for pid, peer in (line.split("\t") for line in listed.splitlines() if "\t" in line)
            if peer.strip() == str(port)]
    assert len(pids) == 1, f"the worker's connection (port {port}) is not in rabbitmqctl's list:\n{listed}"
    rabbitmqctl("close_connection", pids[0], "berth test: closed by the broker")


@pytest.mark.parametrize("cut_off", [_cut_by_the_client, _cut_by_the_broker], ids=["by-the-client", "by-the-broker"])
def test_a_worker_cut_off_from_the_broker_keeps_running_and_nothing_runs_twice(tmp_path, settings, tiny_engine,
                                                                              cut_off):
    # at the default look every second: the first look waits for the first claim, so requests run at it
    job = _long_job(tmp_path, settings)
    worker = engine_worker(settings, tiny_engine, eager_tasks=True)
    cut = []

    def cut_once_running() -> bool:
        if worker.inflight and not cut:
            cut_off(worker)
            cut.append(set(worker.inflight))
        return api.status(job.id, settings).status.is_final

    worker.run(until=cut_once_running)
    assert cut and cut[0], "the connection was cut while requests ran"
    assert worker.broker.metrics.registry.get_sample_value("berth_broker_reconnects_total") >= 1  # it was cut
    view = api.status(job.id, settings)
    assert (view.status, view.completed, view.failed) == (JobStatus.COMPLETED, 4, 0)
    with open_database(settings.database_url).session() as s:
        assert len(s.scalars(select(Result).where(Result.job_id == job.id)).all()) == 4
    assert all(r.attempts == 1 for r in _rows(settings, job.id))  # redeliveries were adopted, not rerun
    with connect(settings) as conn:
        assert queue_depth(conn, [Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")]) == 0

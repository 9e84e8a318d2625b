"""Fixtures and helpers of the jobs tests: a PostgreSQL database and RabbitMQ names of their own
for each test (skipped with the reason when a server is unreachable), settings for the tiny
model, and request files."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import pytest

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
TINY_NAME = "tiny-llama"
TENANTS = ("default", "alice", "bob", "carol")  # the tenants the tests submit for: their queues are cleaned up


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database, dropped at the end."""
    if not reachable(5432):
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    from sqlalchemy import create_engine, text

    from jobs.records.db import close_database

    name = f"berth_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)  # survives a restart
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    yield url
    close_database(url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def queue_prefix():
    """RabbitMQ names no other run uses; their queues and exchanges are deleted at the end."""
    if not reachable(5672):
        pytest.skip("RabbitMQ is not reachable on 127.0.0.1:5672")
    prefix = f"berth-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    from kombu import Connection

    from worker.messaging.topology import Topology

    topology = Topology(prefix)
    with Connection(AMQP_URL) as conn:
        channel = conn.channel()
        queues = [topology.request_queue(TINY_NAME, t).name for t in TENANTS]
        for queue in (*queues, topology.dead_queue.name, topology.celery_queue, topology.jobs_queue.name,
                      topology.interactive_queue(TINY_NAME).name):
            channel.queue_delete(queue)
        for exchange in (topology.exchange.name, topology.dead_exchange.name, topology.celery_queue,
                         topology.events_exchange.name, topology.submit_exchange.name,
                         topology.interactive_abort_exchange.name):
            channel.exchange_delete(exchange)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    """An engine on the tiny model, shared by the tests of one module."""
    from worker.engine.engine import Engine

    return Engine(tiny_settings(tiny_llama_dir))


def tiny_settings(model_dir, **overrides):
    from worker.config import Settings

    return Settings(model=str(model_dir), model_name=TINY_NAME, kv_memory="64MiB", threads=1, **overrides)


def embedded_settings(model_dir, tmp_path, **overrides):
    """``tiny_settings`` on the embedded defaults in ``tmp_path``: SQLite, the embedded queue, a local folder."""
    return tiny_settings(model_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                         storage_url=f"file://{tmp_path / 'store'}", **overrides)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_settings(request, tmp_path, tiny_llama_dir):
    """The tiny model's settings on the embedded defaults, or on PostgreSQL and RabbitMQ (a test's own
    database and queue prefix)."""
    if request.param == "sqlite":
        return embedded_settings(tiny_llama_dir, tmp_path)
    return tiny_settings(tiny_llama_dir, database_url=request.getfixturevalue("pg_url"), broker_url=AMQP_URL,
                         queue_prefix=request.getfixturevalue("queue_prefix"),
                         storage_url=f"file://{tmp_path / 'store'}")


def tiny_env(settings) -> dict[str, str]:
    """The settings as BERTH_* variables, for a worker in another process."""
    names = ("model", "model_name", "kv_memory", "threads", "max_num_seqs", "database_url", "broker_url",
             "storage_url", "queue_prefix", "max_delivery_attempts", "drain_timeout")
    return {f"BERTH_{n.upper()}": str(getattr(settings, n)) for n in names}


def request_line(i: int, model: str = TINY_NAME, max_tokens: int = 4) -> dict:
    """Chat and completion requests in turn, greedy, short."""
    if i % 2:
        body = {"model": model, "prompt": f"Item {i}: the quick brown fox", "max_tokens": max_tokens, "temperature": 0}
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}
    body = {"model": model, "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_requests(path: Path, n: int, **kw) -> Path:
    path.write_text("".join(json.dumps(request_line(i, **kw)) + "\n" for i in range(n)))
    return path


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def choices_by_custom_id(path) -> dict[str, list]:
    """What the model said, per request: the parts of an output line that do not vary between runs."""
    out = {}
    for line in read_jsonl(path):
        body = line["response"]["body"]
        usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}  # cache hits vary by order
        out[line["custom_id"]] = [body["choices"], usage]
    return out


def work_until_over(settings, engine, job_id: str, timeout: float = 60.0):
    """Run an engine worker in this process until the job ends; the job as it ended."""
    import time

    from jobs import api
    from jobs.hosting.engine_worker import engine_worker

    deadline = time.monotonic() + timeout

    def over() -> bool:
        assert time.monotonic() < deadline, f"job {job_id} did not end in {timeout}s"
        return api.status(job_id, settings).status.is_final

    engine_worker(settings, engine, eager_tasks=True).run(until=over)
    return api.status(job_id, settings)


def stop_gracefully(proc, timeout: float = 30.0) -> int:
    """SIGTERM a worker process and wait for it to drain and exit; its exit code."""
    import signal

    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def work_in_process_until_over(proc, settings, job_id: str, log_path, timeout: float = 120.0) -> None:
    """Until the job ends, while the worker process ``proc`` (logging to ``log_path``) lives; then stop
    it gracefully (exit code 0), or kill it if anything failed."""
    import time

    from jobs import api

    deadline = time.monotonic() + timeout
    try:
        while not api.status(job_id, settings).status.is_final:
            assert proc.poll() is None, f"the worker died: see {log_path}"
            assert time.monotonic() < deadline, f"job {job_id} did not end in {timeout}s: see {log_path}"
            time.sleep(0.2)
        assert stop_gracefully(proc) == 0
    finally:
        kill_if_running(proc)


def kill_if_running(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()

"""A 200-request job through RabbitMQ and PostgreSQL: ingested by a Celery worker, run by two
engine worker processes sharing the queue, finalized, and its output identical to the engine's
own greedy run of the same file."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import urllib.request

from kombu import Connection
from sqlalchemy import func, select

from jobs import api
from jobs.hosting.generate import generate_file
from jobs.records.db import open_database
from jobs.records.models import JobStatus, Result
from tests.support.jobs_env import (
    AMQP_URL,
    TINY_NAME,
    choices_by_custom_id,
    read_jsonl,
    tiny_env,
    tiny_settings,
    write_requests,
)
from tests.support.processes import free_port, spawn
from worker.messaging.topology import Topology

N = 200



def _wait_for_consumers(settings, n: int, procs) -> None:
    queue = Topology(settings.queue_prefix).request_queue(TINY_NAME, "default")
    deadline = time.monotonic() + 90
    with Connection(AMQP_URL) as conn:
        while True:
            assert all(p.poll() is None for p in procs), "a worker died at start"
            assert time.monotonic() < deadline, "the engine workers did not start consuming"
            try:
                if queue.bind(conn.channel()).queue_declare(passive=True).consumer_count >= n:
                    return
            except conn.channel_errors:  # not declared yet
                pass
            time.sleep(0.5)



def test_two_engine_workers_share_a_rabbitmq_queue(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=16, drain_timeout=10)
    requests = write_requests(tmp_path / "requests.jsonl", N)
    env = {**os.environ, **tiny_env(settings)}
    metrics_port = free_port()
    worker = [sys.executable, "-m", "jobs.cli", "worker"]
    procs = [spawn(worker + ["--metrics-port", str(metrics_port)], env, tmp_path / "worker0.log"),
             spawn(worker, env, tmp_path / "worker1.log")]
    try:
        job = api.submit(requests, settings)
        assert job.status is JobStatus.VALIDATING  # accepted at once; a Celery worker ingests it
        # Both workers follow the job's tenant queue before a line of it is queued: the Celery worker
        # that ingests it starts only then. (Started together, one worker could run all 200 short
        # requests before the other had loaded its model.)
        _wait_for_consumers(settings, 2, procs)
        procs.append(spawn([sys.executable, "-m", "celery", "-A", "jobs.pipeline.celery_tasks", "worker", "--pool=solo",
                             "--loglevel=WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                            env, tmp_path / "celery.log"))
        deadline = time.monotonic() + 150
        while not (job := api.status(job.id, settings)).status.is_final:
            assert time.monotonic() < deadline, f"job stuck in {job.status.value} at {job.done}/{job.total}"
            assert all(p.poll() is None for p in procs), "a worker died: see its log in " + str(tmp_path)
            time.sleep(0.5)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        for p in procs[:2]:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=30) for p in procs[:2]] == [0, 0]  # graceful drain
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    assert job.status is JobStatus.COMPLETED
    assert (job.total, job.completed, job.failed) == (N, N, 0)
    db = open_database(pg_url)
    with db.session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
        workers = set(s.scalars(select(Result.worker).distinct()))
    assert len(per_request) == N and all(count == 1 for _, count in per_request)
    assert len(workers) == 2, f"both engine workers should have taken requests, got {workers}"

    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    assert files.errors is None
    lines = read_jsonl(files.output)
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(N)]
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in lines)

    for name in ("berth_output_tokens_per_second", "berth_prefill_tokens_per_second", "berth_running_requests",
                 "berth_waiting_requests", "berth_kv_blocks_used", "berth_kv_blocks_free", "berth_preemptions_total",
                 "berth_step_seconds_bucket", "berth_queue_depth"):
        assert f"\n{name}" in metrics, name
    assert re.search(r'berth_requests_finished_total\{tenant="default"\} [1-9]', metrics)

    generate_file(requests, tmp_path / "direct.jsonl", settings, progress=False)
    assert choices_by_custom_id(files.output) == choices_by_custom_id(tmp_path / "direct.jsonl")

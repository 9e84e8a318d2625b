"""``berth serve`` with servers: PostgreSQL, RabbitMQ, two engine worker processes and a Celery
worker beside it (the server itself runs no engine). The openai client's batch comes out equal to
``berth generate`` of the same file, and its lines were run by the worker processes."""

from __future__ import annotations

import os
import sys

from sqlalchemy import select

from jobs.hosting.generate import generate_file
from jobs.records.db import open_database
from jobs.records.models import Result
from tests.support.jobs_env import (
    AMQP_URL,
    choices_by_custom_id,
    kill_if_running,
    stop_gracefully,
    tiny_env,
    tiny_settings,
    write_requests,
)
from tests.support.processes import spawn
from tests.support.serving import client, key_for, serving, upload, wait_for

N = 200  # the file size, as on the embedded defaults


def test_a_batch_through_postgresql_and_rabbitmq(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=8, drain_timeout=10)
    requests = write_requests(tmp_path / "requests.jsonl", N)
    key = key_for(settings, "alice")
    env = {**os.environ, **tiny_env(settings)}
    worker = [sys.executable, "-m", "jobs.cli", "worker"]
    procs = [spawn(worker, env, tmp_path / "worker0.log"), spawn(worker, env, tmp_path / "worker1.log"),
             spawn([sys.executable, "-m", "celery", "-A", "jobs.pipeline.celery_tasks", "worker",
                    "--pool=solo", "--loglevel=WARNING",
                     "--without-gossip", "--without-mingle", "--without-heartbeat"], env, tmp_path / "celery.log")]
    try:
        with serving(settings) as server:
            assert not server.run_worker  # with a broker, serve only serves
            c = client(server, key)
            batch = c.batches.create(input_file_id=upload(c, requests).id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
            batch = wait_for(c, batch.id, timeout=150)
            assert all(p.poll() is None for p in procs), f"a worker died: see its log in {tmp_path}"
            output = c.files.content(batch.output_file_id).text
            assert batch.error_file_id is None
        assert [stop_gracefully(p) for p in procs[:2]] == [0, 0]
    finally:
        for p in procs:
            kill_if_running(p)

    assert batch.status == "completed" and batch.request_counts.completed == N
    with open_database(pg_url).session() as s:
        workers = set(s.scalars(select(Result.worker).distinct()))
    assert workers and None not in workers
    (tmp_path / "out.jsonl").write_text(output)
    generate_file(requests, tmp_path / "direct.jsonl", settings, progress=False)
    assert choices_by_custom_id(tmp_path / "out.jsonl") == choices_by_custom_id(tmp_path / "direct.jsonl")

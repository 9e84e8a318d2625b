"""The engine worker with checkpoints, on RabbitMQ, PostgreSQL and S3 (moto): told to stop mid-job it
checkpoints what it hands back and records in each request's row where its state is; the next worker
resumes those requests from there, and the job's output equals an uninterrupted run. The collection
then finds every segment garbage."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.hosting.generate import generate_file
from jobs.pipeline.checkpoint_gc import collect_checkpoints
from jobs.records.db import open_database
from jobs.records.models import JobStatus, RequestRow
from storage import open_store
from tests.support.checkpoints import read_state
from tests.support.jobs_env import AMQP_URL, TINY_NAME, choices_by_custom_id, tiny_settings
from worker.checkpoint.format import SEGMENT_PREFIX
from worker.engine.engine import Engine


@pytest.mark.slow
def test_a_stopped_worker_checkpoints_and_the_next_resumes(tmp_path, tiny_llama_dir, pg_url, queue_prefix, s3_url):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=s3_url, drain_timeout=0.2)
    # 1,000 tokens: more than the 0.2 s drain can finish on a fast CPU (at 400, a Zen 5 finished all four in the
    # drain, and nothing was handed back to resume)
    lines = [{"custom_id": f"long-{i}", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"story {i}", "max_tokens": 1000, "ignore_eos": True,
                       "temperature": 0}} for i in range(4)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = api.submit(path, settings, eager=True)  # the job file goes to S3 too
    engine = Engine(settings)

    first = engine_worker(settings, engine, eager_tasks=True)
    first.run(until=lambda: engine.stats.output_tokens >= 4 * 40)  # a graceful stop, as on SIGTERM
    store = open_store(settings.storage_url)
    db = open_database(pg_url)
    with db.session() as s:
        refs = dict(s.execute(select(RequestRow.id, RequestRow.checkpoint).where(RequestRow.job_id == job.id)).all())
    states = [read_state(store, ref) for ref in refs.values()]
    assert len(states) == 4 and all(40 <= s.output_tokens < 1000 for s in states)
    assert len({ref.split("@")[0] for ref in refs.values()}) == 1, "the handed-back states went in one segment"
    segments = first.metrics.registry.get_sample_value("berth_checkpoint_segments_total")
    assert segments <= first.engine.stats.steps // 16 + 2, "more than a state object a round"

    second = engine_worker(settings, Engine(settings), eager_tasks=True)
    second.run(until=lambda: api.status(job.id, settings).status.is_final)
    metrics = second.metrics.registry
    # Each of the four resumed once, its KV read back or computed again. Whether KV "auto" wrote a request's
    # blocks is the measured cost model's call (on a quiet machine these short requests' were not worth writing;
    # on a loaded one slower steps make a crash likelier and they were): one whose state holds none is recomputed.
    restores = {kv: metrics.get_sample_value("berth_checkpoint_restores_total", {"kv": kv}) or 0
                for kv in ("loaded", "recomputed")}
    assert restores["loaded"] + restores["recomputed"] == 4, restores
    assert restores["recomputed"] >= sum(1 for s in states if not s.block_hashes()), restores
    assert metrics.get_sample_value("berth_checkpoint_restored_tokens_total") == sum(s.output_tokens for s in states)
    collected = collect_checkpoints(store, db, min_age=0)
    assert list(store.list(SEGMENT_PREFIX)) == [] and collected.segments_deleted > 0, \
        "finished requests keep their checkpoints"

    view = api.status(job.id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (4, 0)
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    generate_file(path, tmp_path / "direct.jsonl", settings, progress=False)
    # greedy: sampled requests would draw the same numbers, but over hundreds of tokens the tiny
    # float differences between batch shapes (and between prefill and decode) flip some draws
    assert choices_by_custom_id(files.output) == choices_by_custom_id(tmp_path / "direct.jsonl")

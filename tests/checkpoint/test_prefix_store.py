"""One prefix store for the fleet: two engine workers (PostgreSQL ledger, a file store, deliveries
handed to each by the test) run one job whose lines share a long system prompt. The worker that
computes the prompt first publishes it; the other loads it instead of computing it. So its blocks
are computed once for both workers (the engines' counters of computed prompt tokens against the
blocks loaded from the store), the outputs equal a run with the store off, and the result rows and
the Batch object count the cached tokens. Under two tenants that do not share, the prompt is computed
once per tenant; in one cache group, once for both.

The issue's case is 200 requests under a 1,000-token prompt; the property is the same with 8 under a
600-token one (37 shared full blocks: four full runs of 8 and the run where the shared part ends),
which keeps the test to seconds.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.hosting.generate import generate_file
from jobs.http.batches import batch_object
from jobs.records.db import open_database
from jobs.records.models import RequestRow, Result
from storage import open_store
from tests.support.consumer_fakes import FakeBroker
from tests.support.jobs_env import AMQP_URL, TINY_NAME, choices_by_custom_id, read_jsonl, tiny_settings
from worker.checkpoint.format import KV_PREFIX
from worker.engine.engine import Engine

SYSTEM = 600  # tokens of the shared prompt: 37 full blocks of 16, then each line's own 30 tokens
SHARED_BLOCKS = SYSTEM // 16
LINES = 8
RUNS = SHARED_BLOCKS // 8 + 1  # the full windows and the one where the shared part ends


class _Broker(FakeBroker):
    """The test hands each worker its deliveries (from another thread: hence the lock)."""

    def __init__(self):
        super().__init__(SimpleNamespace(events=[]))
        self._lock = threading.Lock()

    def publish(self, body, content_type="application/json", tenant="default") -> None:
        with self._lock:
            super().publish(body, content_type, tenant)

    def receive(self, limit, timeout):
        with self._lock:
            got = super().receive(limit, timeout)
        if not got:
            time.sleep(min(timeout, 0.01))
        return got


def _job_file(path, text_ids, tenant_tag: str = "") -> None:
    system = text_ids[:SYSTEM]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": system + text_ids[2000 + 40 * i:2030 + 40 * i],
                       "max_tokens": 4, "temperature": 0}} for i in range(LINES)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _requests(db, job_id) -> list[tuple[int, str]]:
    with db.session() as s:
        return [(rid, job_id) for rid in s.scalars(select(RequestRow.id).where(RequestRow.job_id == job_id)
                                                   .order_by(RequestRow.line))]


def _start(worker, jobs_over):
    thread = threading.Thread(target=worker.run, kwargs={"until": jobs_over}, daemon=True)
    thread.start()
    return thread


def _wait(condition, timeout=60.0, what=""):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _fleet(settings, tenants_jobs: list[tuple[str, list]], loaded_engine):
    """Worker A gets the first two requests of each job and runs them (its second finds the prompt in
    A's prefix cache: A publishes it); once A's runs are on the store, worker B gets the rest and A a
    share too. Both run until every job is over. The two workers, after."""
    a_broker, b_broker = _Broker(), _Broker()
    a = engine_worker(settings, loaded_engine(), eager_tasks=True, chores=False)
    b = engine_worker(settings, loaded_engine(), eager_tasks=True, chores=False)
    a.broker, b.broker = a_broker, b_broker
    a.broker.window = b.broker.window = 2
    job_ids = [job for _, reqs in tenants_jobs for _, job in reqs[:1]]
    over = lambda: all(api.status(j, settings).status.is_final for j in job_ids)  # noqa: E731
    for tenant, reqs in tenants_jobs:
        for rid, job in reqs[:2]:
            a_broker.publish_request(rid, job, tenant)
    threads = [_start(a, over)]
    store = open_store(settings.storage_url)
    _wait(lambda: (len(list(store.list(KV_PREFIX))) >= RUNS * len(tenants_jobs)
                   and a.store.checkpointer.writer.flush(0.01)), what="worker A's prefix runs on the store")
    for tenant, reqs in tenants_jobs:
        for k, (rid, job) in enumerate(reqs[2:]):
            (b_broker if k % 3 else a_broker).publish_request(rid, job, tenant)
    threads.append(_start(b, over))
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    return a, b


@pytest.fixture
def fleet_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    return tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                         storage_url=f"file://{tmp_path}/store", max_num_batched_tokens=2048,
                         interactive_prefetch=0)  # the workers' broker is swapped for a fake: no interactive queue


@pytest.fixture
def loaded_engine(tiny_loaded, fleet_settings):
    return lambda: Engine(fleet_settings, loaded=tiny_loaded)


def test_a_shared_system_prompt_is_computed_once_for_the_fleet(tmp_path, text_ids, fleet_settings, loaded_engine):
    settings = fleet_settings
    path = tmp_path / "shared.jsonl"
    _job_file(path, text_ids)
    job = api.submit(path, settings, eager=True)
    db = open_database(settings.database_url)
    a, b = _fleet(settings, [("default", _requests(db, job.id))], loaded_engine)

    prompt = SYSTEM + 30
    shared = SHARED_BLOCKS * 16
    computed = a.engine.stats.prompt_tokens_computed + b.engine.stats.prompt_tokens_computed
    assert computed == prompt + (LINES - 1) * (prompt - shared), "the shared prompt was computed more than once"
    assert b.store.prefixes.loaded_blocks == SHARED_BLOCKS and a.store.prefixes.loaded_blocks == 0
    assert b.engine.stats.prompt_tokens_computed == b.engine.stats.requests_finished * (prompt - shared)
    assert b.engine.stats.requests_finished > 0 and a.engine.stats.requests_finished > 2
    # B's were on the store already
    assert a.store.prefixes.published_runs == RUNS and b.store.prefixes.published_runs == 0
    runs = list(open_store(settings.storage_url).list(KV_PREFIX))
    assert len(runs) == RUNS, runs

    with db.session() as s:
        cached = sorted(s.scalars(select(Result.cached_tokens).where(Result.job_id == job.id)))
    assert cached == [0] + [shared] * (LINES - 1)
    view = api.status(job.id, settings)
    assert view.completed == LINES and view.cached_tokens == (LINES - 1) * shared
    assert batch_object(view)["usage"]["input_tokens_details"]["cached_tokens"] == (LINES - 1) * shared
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    lines = read_jsonl(files.output)
    assert sorted(line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for line in lines) == cached

    off = settings.model_copy(update={"prefix_store": False, "checkpoint_interval": 0})
    generate_file(path, tmp_path / "direct.jsonl", off, progress=False)
    assert choices_by_custom_id(files.output) == choices_by_custom_id(tmp_path / "direct.jsonl")


@pytest.mark.parametrize("group", [None, "lab"])
def test_tenants_share_the_prefix_store_only_within_a_cache_group(tmp_path, text_ids, fleet_settings, loaded_engine,
                                                                   group):
    settings = fleet_settings
    path = tmp_path / "shared.jsonl"
    _job_file(path, text_ids)
    db = open_database(settings.database_url)
    jobs = []
    for tenant in ("alice", "bob"):
        job = api.submit(path, settings, spec=api.JobSpec(tenant=tenant), eager=True)
        if group:
            api.set_tenant_cache_group(tenant, group, settings)
        jobs.append((tenant, _requests(db, job.id)))
    if group:  # one prompt, one set of runs for both; the second tenant's first requests load it
        _run_grouped(settings, jobs, loaded_engine, tmp_path)
        return
    a, b = _fleet(settings, jobs, loaded_engine)
    prompt, shared = SYSTEM + 30, SHARED_BLOCKS * 16
    computed = a.engine.stats.prompt_tokens_computed + b.engine.stats.prompt_tokens_computed
    assert computed == 2 * (prompt + (LINES - 1) * (prompt - shared)), "not once per tenant"
    assert b.store.prefixes.loaded_blocks == 2 * SHARED_BLOCKS  # each tenant's own runs
    assert len(list(open_store(settings.storage_url).list(KV_PREFIX))) == 2 * RUNS


def _run_grouped(settings, jobs, loaded_engine, tmp_path):
    """Alice's and Bob's jobs in one cache group: A publishes from Alice's requests, then Bob's all go
    to B, which loads Alice's runs."""
    a_broker, b_broker = _Broker(), _Broker()
    a = engine_worker(settings, loaded_engine(), eager_tasks=True, chores=False)
    b = engine_worker(settings, loaded_engine(), eager_tasks=True, chores=False)
    a.broker, b.broker = a_broker, b_broker
    a.broker.window = b.broker.window = 2
    (alice, alice_reqs), (bob, bob_reqs) = jobs
    over = lambda: all(api.status(r[0][1], settings).status.is_final for _, r in jobs)  # noqa: E731
    for rid, job in alice_reqs:
        a_broker.publish_request(rid, job, alice)
    threads = [_start(a, over)]
    store = open_store(settings.storage_url)
    _wait(lambda: len(list(store.list(KV_PREFIX))) >= RUNS and a.store.checkpointer.writer.flush(0.01), what="runs")
    for rid, job in bob_reqs:
        b_broker.publish_request(rid, job, bob)
    threads.append(_start(b, over))
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    prompt, shared = SYSTEM + 30, SHARED_BLOCKS * 16
    computed = a.engine.stats.prompt_tokens_computed + b.engine.stats.prompt_tokens_computed
    assert computed == prompt + (2 * LINES - 1) * (prompt - shared), "the group's prompt was computed more than once"
    assert b.store.prefixes.loaded_blocks == SHARED_BLOCKS
    assert len(list(store.list(KV_PREFIX))) == RUNS


def test_a_prefix_run_is_written_once_however_many_workers_publish_it(tmp_path):
    import torch

    from worker.checkpoint.writer import CheckpointWriter, KvRun
    from worker.metrics import WorkerMetrics

    store = open_store(f"file://{tmp_path}/store")
    hashes = [bytes([i]) * 16 for i in range(8)]
    data = torch.arange(2 * 2 * 8 * 4 * 1 * 2, dtype=torch.float32).reshape(2, 2, 8, 4, 1, 2)
    puts = []
    for _ in range(3):  # three workers that computed the same shared prefix
        metrics = WorkerMetrics()
        writer = CheckpointWriter(store, "fp", metrics, 1 << 20)
        writer.publish([KvRun(list(hashes), data.clone())])
        writer.publish([KvRun(list(hashes), data.clone())])  # offered twice while queued: once
        assert writer.flush(10)
        writer.close()
        puts.append(metrics.registry.get_sample_value("berth_checkpoint_kv_runs_total"))
    assert puts == [1, 0, 0]
    assert len(list(store.list(KV_PREFIX))) == 1


def test_the_prefix_store_is_on_with_checkpoints_unless_turned_off():
    from worker.config import Settings

    assert Settings().prefix_store_on() and not Settings(prefix_store=False).prefix_store_on()
    assert not Settings(checkpoint_interval=0).prefix_store_on()
    with pytest.raises(ValueError, match="needs checkpoints"):
        Settings(prefix_store=True, checkpoint_interval=0).prefix_store_on()

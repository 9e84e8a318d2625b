"""Priorities and tenants through RabbitMQ and PostgreSQL: three jobs queued together, two of one
tenant at priorities 0 and 5 and one of another tenant; a worker runs them. The higher-priority job
finishes first; the two tenants, at equal weight, get output tokens within 20% of each other while
both have requests waiting; a tenant's weight set in the database reaches the engine."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from sqlalchemy import func, select

from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.pipeline.submit import JobSpec
from jobs.records.db import open_database
from jobs.records.models import JobStatus, Result
from tests.support.jobs_env import AMQP_URL, TINY_NAME, tiny_settings
from worker.engine.engine import Engine

MAX_TOKENS = 32


@pytest.fixture
def settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    return tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                         storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=4)


def _submit(tmp_path, settings, name: str, n: int, tenant: str, priority: int):
    lines = [{"custom_id": f"{name}-{i}", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"{name} story {i}", "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}} for i in range(n)]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return api.submit(path, settings, spec=JobSpec(tenant=tenant, priority=priority), eager=True)


def _record_steps(engine: Engine) -> list[tuple[set[str], Counter]]:
    """Per engine step: the tenants with sequences waiting before it, and the tokens it gave each."""
    steps: list[tuple[set[str], Counter]] = []
    step = engine.step

    def recorded_step():
        waiting = {seq.request.tenant for seq in engine.scheduler.waiting}
        before = Counter(engine.stats.output_tokens_by_tenant)
        outputs = step()
        steps.append((waiting, engine.stats.output_tokens_by_tenant - before))
        return outputs

    engine.step = recorded_step
    return steps


def test_priority_orders_a_tenants_jobs_and_tenants_share_the_engine_equally(tmp_path, settings):
    # all queued before the worker starts: alice's low-priority job is ahead of her high-priority one,
    # and both are ahead of bob's
    low = _submit(tmp_path, settings, "alice-low", 24, "alice", priority=0)
    high = _submit(tmp_path, settings, "alice-high", 24, "alice", priority=5)
    bob = _submit(tmp_path, settings, "bob", 48, "bob", priority=0)
    engine = Engine(settings)
    steps = _record_steps(engine)
    jobs = (low.id, high.id, bob.id)
    engine_worker(settings, engine, eager_tasks=True).run(
        until=lambda: all(api.status(j, settings).status.is_final for j in jobs))

    views = [api.status(j, settings) for j in jobs]
    assert [(v.status, v.completed) for v in views] == [(JobStatus.COMPLETED, 24), (JobStatus.COMPLETED, 24),
                                                         (JobStatus.COMPLETED, 48)]
    with open_database(settings.database_url).session() as s:
        finished = dict(s.execute(select(Result.job_id, func.max(Result.created_at)).group_by(Result.job_id)).all())
    assert finished[high.id] < finished[low.id], "the priority-5 job should finish before the priority-0 one"

    both = Counter()
    for waiting, tokens in steps:
        if {"alice", "bob"} <= waiting:
            both += tokens
    total = sum(engine.stats.output_tokens_by_tenant.values())
    assert total == 96 * MAX_TOKENS
    # without a queue per tenant, bob's requests would reach the engine only after alice's
    assert sum(both.values()) >= 0.5 * total, f"both tenants were waiting for only {both} of {total} tokens"
    print(f"\nwhile both tenants were waiting: {dict(both)} output tokens of {total}")
    assert abs(both["alice"] - both["bob"]) <= 0.2 * max(both.values()), both


def test_a_tenants_weight_reaches_the_engine(tmp_path, settings):
    _submit(tmp_path, settings, "alice-job", 1, "alice", priority=0)
    _submit(tmp_path, settings, "bob-job", 1, "bob", priority=0)
    api.set_tenant_weight("bob", 3.0, settings)
    engine = Engine(settings)
    worker = engine_worker(settings, engine, eager_tasks=True)
    worker.run(until=lambda: True)  # connects, follows the live tenants once, stops
    assert engine.scheduler.waiting.shares == {"alice": 1.0, "bob": 3.0}
    assert set(worker.broker.queues) == {"alice", "bob"}

"""Worker heartbeats in the jobs database: the last one per worker, an hour of samples, gone when silent."""

from __future__ import annotations

import pytest

from jobs.records import workers
from jobs.records.db import open_database
from jobs.records.models import WorkerSample
from worker.consumer.ledger import Heartbeat


def _beat(at: float, worker: str = "host:1", tps: float = 10.0, used: int = 5) -> Heartbeat:
    return Heartbeat(worker, "host", "m", "cpu", 3, 1, used, 100 - used, tps, 1000.0, at)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_heartbeats_keep_the_last_state_and_an_hour_of_samples(backend, tmp_path, request, monkeypatch):
    url = f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    db = open_database(url)
    t = 100_000.0
    monkeypatch.setattr(workers, "now", lambda: t + 2 * workers.HISTORY)
    workers.beat(db, _beat(t))  # an old sample, dropped by a beat an hour later
    for i in range(3):
        workers.beat(db, _beat(t + workers.HISTORY + 60 + i, tps=10.0 + i, used=5 + i))
    workers.beat(db, _beat(t + 2 * workers.HISTORY - 5, worker="host:2"))
    [second, first] = workers.list_workers(db)
    assert (second.beat.worker, second.gone) == ("host:2", False)
    assert (first.beat.worker, first.beat.output_tokens_per_second, first.beat.kv_blocks_used, first.gone) == (
        "host:1", 12.0, 7, True)
    shown = first.to_dict()
    assert (shown["id"], shown["seen_at"], shown["gone"]) == ("host:1", t + workers.HISTORY + 62, True)
    series = workers.samples(db, since=0)
    assert [round(tps) for _, tps, _ in series["host:1"]] == [10, 11, 12]
    with db.session() as s:
        assert s.query(WorkerSample).count() == 4

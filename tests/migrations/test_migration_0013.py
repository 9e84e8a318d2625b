"""Migration 0013 (at-risk events: jobs.at_risk_at, job_events.kind and expected_finish_at) on a database
made at 0012 holding a job that will miss its window and one that will not, with the events the triggers
wrote for them: every row and value is kept, the old events are status events, neither job was raised at
risk; afterwards the late job raises its at-risk event once and the triggers still write status events."""

from __future__ import annotations

import time

import pytest

from jobs.records.db import close_database, make_engine, open_database
from jobs.records.lifecycle import cancel
from jobs.records.outbox import raise_at_risk
from tests.support.migration_db import dump, upgraded

LATE, ON_TIME = "batch_0123456789abcdef01234567", "batch_76543210fedcba9876543210"
JOB = {"tenant_id": 1, "model": "tiny-llama", "status": "in_progress", "priority": 0, "completion_window": "1h",
       "metadata": {}, "input_name": "in.jsonl", "total": 4, "failed": 0, "prompt_tokens": 3, "completion_tokens": 4}


def _rows(now: float) -> dict:
    return {
        "tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": now - 3000}],
        "jobs": [  # 50 minutes of its hour gone and 1 request of 4 done, against 3 of 4 done in 10 minutes
            {**JOB, "id": LATE, "input_key": f"jobs/{LATE}/in", "completed": 1, "created_at": now - 3000,
             "in_progress_at": now - 3000, "expires_at": now + 600},
            {**JOB, "id": ON_TIME, "input_key": f"jobs/{ON_TIME}/in", "completed": 3, "created_at": now - 600,
             "in_progress_at": now - 600, "expires_at": now + 3000}],
    }


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0013_keeps_every_row_and_an_old_job_raises_its_at_risk_event_once(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    now = time.time()
    after = upgraded(url, "0012", _rows(now))
    assert [r["at_risk_at"] for r in after["jobs"]] == [None, None]
    engine = make_engine(url)
    events = dump(engine, ["job_events"])["job_events"]
    assert [(e["job_id"], e["status"], e["kind"], e["expected_finish_at"]) for e in events] == [
        (LATE, "in_progress", "status", None), (ON_TIME, "in_progress", "status", None)]  # the triggers' rows
    try:
        db = open_database(url)
        assert raise_at_risk(db) == [LATE] and raise_at_risk(db) == []
        cancel(db, ON_TIME)  # a change of status: the trigger's row, a status event
        events = dump(engine, ["job_events"])["job_events"]
        assert [(e["job_id"], e["status"], e["kind"]) for e in events[2:]] == [
            (LATE, "in_progress", "at_risk"), (ON_TIME, "cancelling", "status")]
        assert events[2]["expected_finish_at"] == pytest.approx(now + 9000, abs=60)  # 3 left at 3000 s each
        assert [r["at_risk_at"] is not None for r in dump(engine, ["jobs"])["jobs"]] == [True, False]
    finally:
        engine.dispose()
        close_database(url)

"""A job's ETA from work done (issue 38): with continuous batching nearly every request finishes near the
end, so a count of finished requests promised 78 minutes for a job that ended 3.4 minutes in. Tokens made
(finished and running, as workers say at their heartbeats) against tokens expected give the time left.

Two regimes: many requests' lifetimes in a row (120 requests, 8 seats, as a long job runs), where
the ETA at a quarter and at half of the job's time is within 30% of the real time left; and 200 requests
running at once (256 seats), where a count of finished requests is off many times over (the finding) and
tokens stay within a factor of 2 (the last requests' own time, the tail, is what no rate foresees).

The first regime runs on the simulated H200 (``worker/engine/simulated_device.py``), whose steps take
the device's time whatever else the machine does: on the tiny model's CPU steps, another process's work
starting or ending mid-job changed the job's rate by half (beside two busy loops and the suite's other
process: ETA 8.6 s at a quarter with 5.1 s left), which no rate foresees. There 120 requests of 40-100
tokens take about 4 s of sleeping device at a steady 2.0 thousand tokens a second (the ETA within 3% of
the time left quiet, 4-15% over it beside two busy loops; passing beside three)."""

from __future__ import annotations

import json
import time

import pytest

from jobs import api
from tests.support.jobs_env import request_line, tiny_settings
from worker.consumer import loop

SIMULATED = {"simulated_device": "h200:llama-3-8b"}


@pytest.mark.parametrize("seats, within", [(8, 0.3), (256, 1.0)])
def test_the_eta_at_a_quarter_and_half_of_a_jobs_time(tmp_path, monkeypatch, tiny_llama_dir, seats, within):
    # a worker's heartbeat every 5 s is often against a job of hours; this job takes seconds
    monkeypatch.setattr(loop, "HEARTBEAT_INTERVAL", 0.5)
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(lines := 120 if seats == 8 else 200):  # lengths that vary, as a real job's do
            line = request_line(i, max_tokens=40 + (i * 37) % 60 if seats == 8 else 60 + (i * 37) % 120)
            line["body"]["ignore_eos"] = True
            f.write(json.dumps(line) + "\n")
    seen = []
    settings = tiny_settings(tiny_llama_dir, max_num_seqs=seats, **(SIMULATED if seats == 8 else {}))
    view, _ = api.run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", settings,
                      on_progress=lambda v: seen.append((time.time(), v.eta_seconds, _by_requests(v))))
    assert view.completed == lines
    start, end = view.in_progress_at, view.finalizing_at
    for share in (0.25, 0.5):
        moment = start + share * (end - start)
        at, eta, by_requests = min((r for r in seen if r[1] is not None), key=lambda r: abs(r[0] - moment))
        # readings come a second apart: on a fast CPU a job of 6 s has none closer than that to its 25%
        assert abs(at - moment) < max(0.15 * (end - start), 1.5), "no reading near that moment (one a second)"
        left = end - at
        # plus a heartbeat: the running requests' tokens are as of their worker's last one, so a reading just
        # before the next counts up to a heartbeat's work as still to do (a CI run: ETA 3.2 s with 2.3 s left,
        # 0.03 s past 40%, beside another process's tests)
        allowed = within * left + loop.HEARTBEAT_INTERVAL
        assert abs(eta - left) <= allowed, f"at {share:.0%}: ETA {eta:.1f} s, {left:.1f} s left in fact"
        if seats == 256 and share == 0.25:  # the finding: requests done a second say far more
            assert by_requests > 3 * left, f"the regime of the finding: requests alone said {by_requests:.1f} s"


def _by_requests(view) -> float:
    """The ETA from requests done a second, as berth said before (read when the view is: it counts time)."""
    rate = view.requests_per_second
    return (view.total - view.done) / rate if rate else float("inf")


def test_requests_recorded_leave_their_workers_in_flight_count_at_once(any_settings, tmp_path):
    """A worker's heartbeat says its running requests of a job made 700 tokens; three of them finish with
    600 and are recorded. The job's tokens made stay 700 (600 finished, 100 still running), not 1,300
    until the worker's next heartbeat: the ETA, (expected - made) over made a second, read between the two,
    was 25% low as each wave of requests finished (the dashboard's test saw it under load)."""
    from sqlalchemy import select

    from jobs.pipeline.ingest import ingest
    from jobs.pipeline.submit import JobSpec, create_job
    from jobs.records.db import open_database
    from jobs.records.job_files import JobFiles
    from jobs.records.models import RequestRow, ResultStatus
    from jobs.records.results import ResultRecord, record_outcomes
    from jobs.records.status import get_job
    from jobs.records.workers import beat
    from tests.support.jobs_env import TINY_NAME, write_requests
    from worker.consumer.ledger import Heartbeat

    settings = any_settings
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)
    job_id = create_job(db, files, write_requests(tmp_path / "r.jsonl", 4, max_tokens=300), TINY_NAME,
                        JobSpec(tenant="alice"), settings)
    ingest(db, files, settings, job_id)
    with db.session() as s:
        ids = sorted(s.scalars(select(RequestRow.id).where(RequestRow.job_id == job_id)))
    now = time.time()
    beat(db, Heartbeat("host:1", "host", TINY_NAME, "cpu", 4, 0, 8, 92, 10.0, now - 10, now, {job_id: 700}))
    beat(db, Heartbeat("host:2", "host", TINY_NAME, "cpu", 1, 0, 8, 92, 10.0, now - 10, now, {job_id: 50}))
    assert get_job(db, job_id).tokens_made == 750
    record_outcomes(db, [ResultRecord(i, job_id, ResultStatus.COMPLETED, response={"status_code": 200},
                                      prompt_tokens=5, completion_tokens=200) for i in ids[:3]], worker="host:1")
    view = get_job(db, job_id)
    assert (view.completion_tokens, view.tokens_in_flight, view.tokens_made) == (600, 150, 750)
    record_outcomes(db, [ResultRecord(ids[3], job_id, ResultStatus.COMPLETED, response={"status_code": 200},
                                      prompt_tokens=5, completion_tokens=300)], worker="host:1")
    view = get_job(db, job_id)  # more than its heartbeat said: none left, and the other worker's untouched
    assert (view.completion_tokens, view.tokens_in_flight) == (900, 50)

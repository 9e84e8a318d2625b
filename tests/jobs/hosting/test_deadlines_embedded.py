"""Deadlines end to end on the embedded defaults (issue 37): of two jobs of one tenant, the one-hour job
submitted after a 24-hour one finishes first; the 24-hour one still runs every request. And a job whose
measured rate cannot finish it in its window says so (``berth status``, the Batch object's metadata)."""

from __future__ import annotations

import time

from jobs import api
from jobs.hosting.engine_worker import engine_worker
from jobs.http.batches import batch_object
from jobs.pipeline.submit import JobSpec
from jobs.records.progress import describe
from tests.support.jobs_env import tiny_settings, write_requests


def test_a_one_hour_job_submitted_after_a_day_job_finishes_first(tmp_path, monkeypatch, tiny_llama_dir, tiny_engine):
    monkeypatch.chdir(tmp_path)
    # a window of two deliveries: the queue's order decides what the engine gets next
    settings = tiny_settings(tiny_llama_dir, storage_url=f"file://{tmp_path / 'store'}", prefetch=2)
    day = api.submit(write_requests(tmp_path / "day.jsonl", 24, max_tokens=6), settings, eager=True,
                     spec=JobSpec(completion_window="24h", priority=9))
    hour = api.submit(write_requests(tmp_path / "hour.jsonl", 8, max_tokens=6), settings, eager=True,
                      spec=JobSpec(completion_window="1h"))

    def both_over() -> bool:
        return all(api.status(j.id, settings).status.is_final for j in (day, hour))

    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=both_over)
    day, hour = api.status(day.id, settings), api.status(hour.id, settings)
    assert day.completed == 24 and hour.completed == 8
    assert hour.finalizing_at < day.finalizing_at
    # the day job's later requests waited for all of the hour job's
    assert hour.finalizing_at - hour.in_progress_at < 0.8 * (day.finalizing_at - day.in_progress_at)


def test_a_job_that_cannot_finish_in_its_window_is_at_risk(tmp_path, monkeypatch, tiny_llama_dir, tiny_engine):
    monkeypatch.chdir(tmp_path)
    settings = tiny_settings(tiny_llama_dir, storage_url=f"file://{tmp_path / 'store'}", prefetch=1)
    # a window shorter than 15 minutes, so the job's rate (a request at a time) misses it within seconds
    # 400 x 64 tokens a request at a time: over a minute at the few hundred tokens/s of the fastest CPUs here
    job = api.submit(write_requests(tmp_path / "in.jsonl", 400, max_tokens=64), settings, eager=True,
                     spec=JobSpec(completion_window="20s"))
    engine_worker(settings, tiny_engine, eager_tasks=True).run(until=lambda: api.status(job.id, settings).done >= 3)
    view = api.status(job.id, settings)
    assert view.at_risk and view.expected_finish_at > view.expires_at > time.time()
    assert "AT RISK" in describe(view)
    metadata = batch_object(view)["metadata"]
    assert metadata["berth_at_risk"] == "true" and int(metadata["berth_expected_finish"]) > view.expires_at
    api.cancel(job.id, settings)

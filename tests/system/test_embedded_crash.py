"""The embedded defaults keep the promises the servers do: `berth worker` on SQLite, the embedded queue
and a local folder, killed with SIGKILL six times mid-job with the default settings (three delivery
attempts among them; checkpoint rounds every 16 steps however fast), and started again each time.
The job completes with one result per request, equal to a run without crashes, and no request is
failed as poison: the dead workers' deliveries come back by the workers' own reconciling (no Celery
beat here), and a request that made progress before each crash is never charged for it. Every fourth
request is under a JSON schema it cannot complete within its length: its grammar's matcher is
rebuilt from the checkpointed tokens at each resume, and its output is still the uncrashed run's."""

from __future__ import annotations

import json
import os
import random
import re
import signal

import pytest
from sqlalchemy import func, select

from jobs import api
from jobs.hosting.generate import generate_file
from jobs.records.db import open_database
from jobs.records.models import JobStatus, Result
from tests.support.jobs_env import TINY_NAME, choices_by_custom_id, tiny_env, tiny_settings, work_in_process_until_over
from tests.support.worker_process import results_counts, run_until, start_worker, wait_generating

N, MAX_TOKENS, KILLS = 40, 200, 6
ENDLESS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 500}


@pytest.mark.slow
def test_an_embedded_worker_killed_six_times_loses_nothing(tmp_path, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=16)
    assert settings.max_delivery_attempts == 3 and not settings.broker_url  # the defaults a user gets
    lines = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, **({"guided_json": ENDLESS} if i % 4 == 0 else {})}}
             for i in range(N)]
    requests = tmp_path / "long.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = api.submit(requests, settings)  # the embedded queue: ingested here
    # the defaults but the floor between checkpoint rounds: the tiny model makes 16 steps in a tenth of a
    # second, as a GPU does, and lives of under 2 s would resume nothing from a checkpoint
    env = {**os.environ, **tiny_env(settings), "BERTH_CHECKPOINT_MIN_SECONDS": "0"}
    db = open_database(settings.database_url)
    rng = random.Random(7)
    for i in range(KILLS):
        proc, port = start_worker(env, tmp_path / f"worker{i}.log")
        try:
            wait_generating(proc, port)
            run_until(proc, port, rng.uniform(0.06, 0.1) * N * MAX_TOKENS)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert results_counts(db)[0] < N, "the job ended before the last crash: make the requests longer"
    proc, port = start_worker(env, tmp_path / "worker-last.log")
    work_in_process_until_over(proc, settings, job.id, tmp_path / "worker-last.log", timeout=240)

    view = api.status(job.id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (N, 0)
    with db.session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
    assert len(per_request) == N and all(count == 1 for _, count in per_request)
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    generate_file(requests, tmp_path / "direct.jsonl", settings, progress=False)
    crashed = choices_by_custom_id(files.output)
    assert crashed == choices_by_custom_id(tmp_path / "direct.jsonl")
    for i in range(0, N, 4):  # the constrained ones kept their grammar through every resume
        [choice], _usage = crashed[f"long-{i}"]
        assert re.fullmatch(r"\[(0|[1-9][0-9]{0,2})(, ?(0|[1-9][0-9]{0,2}))*(, ?)?", choice["text"]), choice["text"]

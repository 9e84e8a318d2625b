"""The issue's crash test: a job of 100 long requests through RabbitMQ, PostgreSQL and S3 (moto's
server), its engine worker killed with SIGKILL at random moments six times and started again each
time. Every request ends with exactly one result, the outputs equal a run without crashes, and the
tokens generated again after the crashes are no more than those not yet checkpointed when they struck."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
from sqlalchemy import func, select

from jobs import api
from jobs.hosting.generate import generate_file
from jobs.pipeline.finalize import finalize
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import JobStatus, Result
from tests.support.jobs_env import (
    AMQP_URL,
    TINY_NAME,
    choices_by_custom_id,
    kill_if_running,
    stop_gracefully,
    tiny_env,
    tiny_settings,
)
from tests.support.s3_server import S3_ENV
from tests.support.worker_process import metric, results_counts, run_until, start_worker, wait_generating

N, MAX_TOKENS, KILLS = 100, 240, 6


@pytest.mark.slow
def test_a_worker_killed_six_times_loses_nothing(tmp_path, tiny_llama_dir, pg_url, queue_prefix, s3_url):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=s3_url, max_num_seqs=32, drain_timeout=5)
    assert settings.max_delivery_attempts == 3  # the default a user gets: crashes after progress are no poison
    lines = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}} for i in range(N)]
    requests = tmp_path / "long.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # a round every 16 steps however fast: the tiny model makes them at a GPU's pace, where the default
    # floor of 2 s between rounds would leave most lives of this test with no checkpoint to resume from
    env = {**os.environ, **tiny_env(settings), **S3_ENV, "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
           "BERTH_CHECKPOINT_INTERVAL": "16", "BERTH_CHECKPOINT_MIN_SECONDS": "0"}
    job = api.submit(requests, settings, eager=True)  # ingested here; the messages wait in RabbitMQ
    db = open_database(pg_url)
    rng = random.Random(20240601)
    before_crashes = generated = restored = lag_at_crashes = 0
    for i in range(KILLS):
        proc, port = start_worker(env, tmp_path / f"worker{i}.log")
        try:
            wait_generating(proc, port)
            # Crash at a random point of progress, not of time, so a fast machine cannot finish the
            # job early: each life generates 8-13% of the job's tokens.
            tokens = run_until(proc, port, rng.uniform(0.08, 0.13) * N * MAX_TOKENS)
            restored += metric(port, "berth_checkpoint_restored_tokens_total")
            lag_at_crashes += metric(port, "berth_checkpoint_lag_tokens")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        before_crashes += tokens
        assert results_counts(db)[0] < N, "the job ended before the last crash: make the requests longer"
    proc, port = start_worker(env, tmp_path / "worker-last.log")
    try:
        deadline = time.monotonic() + 240
        while results_counts(db)[0] < N:
            assert proc.poll() is None, f"the last worker died: see {tmp_path / 'worker-last.log'}"
            assert time.monotonic() < deadline, f"only {results_counts(db)[0]} of {N} results"
            time.sleep(0.5)
        generated = before_crashes + metric(port, "berth_output_tokens_total")
        restored += metric(port, "berth_checkpoint_restored_tokens_total")
        assert stop_gracefully(proc) == 0
    finally:
        kill_if_running(proc)

    with db.session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
    assert len(per_request) == N and all(count == 1 for _, count in per_request)
    kept = results_counts(db)[1]
    assert kept == N * MAX_TOKENS
    regenerated = generated - kept
    share = regenerated / before_crashes
    print(f"\n{KILLS} crashes: {before_crashes:.0f} tokens generated before them, {regenerated:.0f} generated again "
          f"({share:.1%}); {restored:.0f} taken from checkpoints; {lag_at_crashes:.0f} not yet checkpointed at the "
          "crashes")
    # A crash costs the tokens not yet on the store when it struck (the lag gauge, read just before each
    # kill), and what the worker generated between that read and the kill: a step or two of every
    # running request. That share itself grows when the machine is busy (the uploads fall behind).
    allowance = KILLS * 3 * settings.max_num_seqs
    assert regenerated <= lag_at_crashes + allowance, (
        f"{regenerated:.0f} tokens generated again, more than the {lag_at_crashes:.0f} not yet checkpointed at the "
        f"crashes (+{allowance} for the steps between reading that and the kill)")

    finalize(db, JobFiles(settings.storage_url), job.id)
    view = api.status(job.id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (N, 0)
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    generate_file(requests, tmp_path / "direct.jsonl", settings, progress=False)
    assert choices_by_custom_id(files.output) == choices_by_custom_id(tmp_path / "direct.jsonl")

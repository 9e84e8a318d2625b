"""Crashes charged to their cause, through RabbitMQ, PostgreSQL and S3 (moto's server) with the default
settings. A worker process killed with SIGKILL at random times, not tied to its progress (a crash
loop: an OOM kill, a bad node), fails no request: each has one result, equal to an undisturbed run.
A request that really kills its worker whenever a step runs it (``tests/support/killer_worker.py``) is
narrowed down in groups of suspects run alone and failed as poison, naming that it killed its
worker alone, while every other request of its job completes; the deaths show as a rate per host."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select

from jobs import api
from jobs.hosting.generate import generate_file
from jobs.pipeline.finalize import finalize
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import JobStatus, RequestRow, Result, ResultStatus
from tests.support.jobs_env import (
    AMQP_URL,
    TINY_NAME,
    choices_by_custom_id,
    kill_if_running,
    stop_gracefully,
    tiny_env,
    tiny_settings,
)
from tests.support.processes import free_port
from tests.support.s3_server import S3_ENV
from tests.support.worker_process import metric, results_counts, wait_generating

N, MAX_TOKENS, KILLS = 60, 448, 5
FIRST_LIFE = (0.5, 1.0)  # seconds the first worker generates before it is killed, drawn at random
# Later lives: a random share of the time the job would still take at the fastest speed a worker has
# shown, split among the kills left, so that every kill lands before the job ends on a quiet machine
# as on a busy one; still a time drawn at random, never an amount of progress. The fastest, not the
# last: a life that ended while its worker was still restoring checkpoints generated a few hundred tokens
# where a warm worker makes thousands a second, and at that speed the job outran the next life.
LIFE_SHARE = (0.3, 1.0)


def _job(tmp_path: Path, n: int, max_tokens: int, name: str = "requests") -> Path:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"Tale {i}: in a land far away", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}} for i in range(n)]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _start(env: dict, log_path: Path, module: str = "jobs.cli"):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "worker", "--metrics-port", str(port)], env=env,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    return proc, port


def _settings(tiny_llama_dir, pg_url, queue_prefix, s3_url):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=s3_url, drain_timeout=5)
    # the defaults a user gets: three strikes, checkpoints every 16 tokens, up to 256 requests at once
    assert (settings.max_delivery_attempts, settings.checkpoint_interval, settings.max_num_seqs) == (3, 16, 256)
    return settings


def _env(settings) -> dict:
    return {**os.environ, **tiny_env(settings), **S3_ENV, "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}


def _deaths_on_this_host(port: int) -> float:
    """The worker's gauge of this host's worker deaths in the last hour."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf'^berth_worker_deaths_last_hour{{host="{re.escape(socket.gethostname())}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _outcomes(db) -> dict[str, tuple[ResultStatus, dict | None]]:
    with db.session() as s:
        rows = s.execute(select(RequestRow.custom_id, Result.status, Result.error)
                         .join(Result, Result.request_id == RequestRow.id)).all()
    return {custom_id: (status, error) for custom_id, status, error in rows}


def _one_result_each(db, n: int) -> None:
    with db.session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
    assert len(per_request) == n and all(count == 1 for _, count in per_request)


@pytest.mark.slow
def test_a_worker_killed_at_random_times_fails_no_request(tmp_path, tiny_llama_dir, pg_url, queue_prefix, s3_url):
    settings = _settings(tiny_llama_dir, pg_url, queue_prefix, s3_url)
    requests = _job(tmp_path, N, MAX_TOKENS)
    job = api.submit(requests, settings, eager=True)  # ingested here; the messages wait in RabbitMQ
    env = _env(settings)
    db = open_database(pg_url)
    rng = random.Random(21)
    lives = []
    for i in range(KILLS):
        proc, port = _start(env, tmp_path / f"worker{i}.log")
        try:
            wait_generating(proc, port, timeout=240)
            if lives:  # tokens a second of the fastest life; what the job still holds at that speed
                rate = max(max(tokens, 1.0) / seconds for seconds, tokens in lives)
                left = (N - results_counts(db)[0]) * MAX_TOKENS / rate
                life = rng.uniform(*LIFE_SHARE) * left / (KILLS - i + 1)
            else:
                life = rng.uniform(*FIRST_LIFE)
            time.sleep(life)
            assert proc.poll() is None, f"the worker died on its own: see {tmp_path / f'worker{i}.log'}"
            lives.append((life, metric(port, "berth_output_tokens_total")))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert results_counts(db)[0] < N, "the job ended before the last kill: make the requests longer"
    proc, port = _start(env, tmp_path / "worker-last.log")
    try:
        deadline = time.monotonic() + 600
        while results_counts(db)[0] < N:
            assert proc.poll() is None, f"the last worker died: see {tmp_path / 'worker-last.log'}"
            assert time.monotonic() < deadline, f"only {results_counts(db)[0]} of {N} results"
            time.sleep(0.5)
        deaths = _deaths_on_this_host(port)
        assert stop_gracefully(proc) == 0
    finally:
        kill_if_running(proc)
    print(f"\n{KILLS} kills after {', '.join(f'{t:.1f}s ({n:.0f} tokens)' for t, n in lives)} of generating; "
          f"{deaths:.0f} deaths seen")

    outcomes = _outcomes(db)
    failed = {k: error for k, (status, error) in outcomes.items() if status is not ResultStatus.COMPLETED}
    assert not failed, f"{len(failed)} of {N} requests failed, e.g. {next(iter(failed.values()))}"
    _one_result_each(db, N)
    assert deaths == KILLS  # each death found once, from a request it was running, and counted for its host
    finalize(db, JobFiles(settings.storage_url), job.id)
    view = api.status(job.id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (N, 0)
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    generate_file(requests, tmp_path / "direct.jsonl", settings, progress=False)
    assert choices_by_custom_id(files.output) == choices_by_custom_id(tmp_path / "direct.jsonl")


KILLER_JOB, KILLER_LINE, KILLER_TOKENS = 16, 9, 24


@pytest.mark.slow
def test_a_request_that_kills_its_worker_is_failed_alone(tmp_path, tiny_llama_dir, pg_url, queue_prefix, s3_url):
    settings = _settings(tiny_llama_dir, pg_url, queue_prefix, s3_url)
    requests = _job(tmp_path, KILLER_JOB, KILLER_TOKENS)
    job = api.submit(requests, settings, eager=True)
    db = open_database(pg_url)
    with db.session() as s:
        killer = s.scalar(select(RequestRow.prompt_token_ids).where(RequestRow.custom_id == f"req-{KILLER_LINE}"))
    env = {**_env(settings), "TEST_KILLER_PROMPT": json.dumps(killer)}
    # Halves until it runs alone, then max_delivery_attempts deaths alone: 16, 8, 4, 2, then 1 three times.
    most = (KILLER_JOB - 1).bit_length() + settings.max_delivery_attempts
    deaths = 0
    while results_counts(db)[0] < KILLER_JOB:
        log_path = tmp_path / f"worker{deaths}.log"
        proc, port = _start(env, log_path, "tests.support.killer_worker")
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and results_counts(db)[0] < KILLER_JOB:
                assert time.monotonic() < deadline, f"neither done nor dead: see {log_path}"
                time.sleep(0.2)
            if proc.poll() is not None:
                assert proc.returncode == 139, f"the worker died otherwise: see {log_path}"
                deaths += 1
                assert deaths <= most, f"{deaths} deaths and the killer is not found yet"
                continue
            death_rate = _deaths_on_this_host(port)
            assert stop_gracefully(proc) == 0
        finally:
            kill_if_running(proc)
    print(f"\nthe killer was failed after {deaths} deaths of its worker (at most {most})")

    outcomes = _outcomes(db)
    status, error = outcomes.pop(f"req-{KILLER_LINE}")
    failed = {k: error for k, (status, error) in outcomes.items() if status is not ResultStatus.COMPLETED}
    assert not failed, f"{len(failed)} innocent requests failed beside the killer, e.g. {next(iter(failed.values()))}"
    assert status is ResultStatus.FAILED and error["code"] == "delivery_limit"
    assert "killed its worker 3 times running alone" in error["message"], error
    _one_result_each(db, KILLER_JOB)
    assert death_rate == deaths  # the operator's view: this host's workers died so many times this hour
    assert re.search(r"crash-looping", (tmp_path / f"worker{deaths}.log").read_text())
    finalize(db, JobFiles(settings.storage_url), job.id)
    view = api.status(job.id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (KILLER_JOB - 1, 1)
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    generate_file(requests, tmp_path / "direct.jsonl", settings, progress=False)
    direct = choices_by_custom_id(tmp_path / "direct.jsonl")
    del direct[f"req-{KILLER_LINE}"]
    assert choices_by_custom_id(files.output) == direct

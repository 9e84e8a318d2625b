"""`berth worker --respawn`: the worker runs as the child of a process that imported torch and the engine
once; a child killed mid-job is replaced at once and the job ends with every result exactly once; the
parent killed with SIGKILL leaves no child behind; SIGTERM to the parent stops both with status 0. The
parent's rules (no respawn of a child that was never ready or stopped on its own, a crash loop ends it)
are checked on small work functions, in this process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from jobs import api
from jobs.hosting.respawn import Respawner
from jobs.records.db import open_database
from jobs.records.models import JobStatus, Result
from tests.support.jobs_env import TINY_NAME, kill_if_running, tiny_env, tiny_settings, work_in_process_until_over
from tests.support.processes import free_port
from tests.support.worker_process import run_until, wait_generating

N, MAX_TOKENS = 16, 200


def _start(env, log_path: Path, port: int):
    return subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker", "--respawn", "--metrics-port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))


def _children(log_path: Path) -> list[int]:
    return [int(pid) for pid in re.findall(r"worker child (\d+) started", log_path.read_text())]


def _wait_for(predicate, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_child_killed_mid_job_is_replaced_and_the_job_loses_nothing(tmp_path, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=8)
    lines = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_NAME, "prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}} for i in range(N)]
    requests = tmp_path / "long.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = api.submit(requests, settings)
    env = {**os.environ, **tiny_env(settings)}
    log_path, port = tmp_path / "worker.log", free_port()
    db = open_database(settings.database_url)
    proc = _start(env, log_path, port)
    try:
        wait_generating(proc, port, timeout=300)
        run_until(proc, port, 0.2 * N * MAX_TOKENS)
        [first] = _children(log_path)
        os.kill(first, signal.SIGKILL)
        with db.session() as s:
            assert s.scalar(select(func.count(Result.id))) < N, "the job ended before the kill: longer requests"
        _wait_for(lambda: len(_children(log_path)) == 2, f"no second child: see {log_path}")
        assert proc.poll() is None, "the parent died with its child"
        work_in_process_until_over(proc, settings, job.id, log_path, timeout=240)  # SIGTERM: exit status 0
    finally:
        kill_if_running(proc)
    log = log_path.read_text()
    assert re.search(r"worker child died \(killed by signal 9 \(SIGKILL\)\) after [0-9.]+s; respawn 1\b", log), log
    assert all(_gone(pid) for pid in _children(log_path))
    view = api.status(job.id, settings)
    assert view.status is JobStatus.COMPLETED and (view.completed, view.failed) == (N, 0)
    with db.session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
    assert len(per_request) == N and all(count == 1 for _, count in per_request)


@pytest.mark.slow
def test_the_parent_killed_leaves_no_child(tmp_path, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    log_path, port = tmp_path / "worker.log", free_port()
    proc = _start({**os.environ, **tiny_env(settings)}, log_path, port)
    try:
        _wait_for(lambda: " consuming " in log_path.read_text(), f"the child was never ready: see {log_path}")
        [child] = _children(log_path)
        assert not _gone(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _wait_for(lambda: _gone(child), f"worker child {child} outlived its parent", timeout=30)
    finally:
        kill_if_running(proc)
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def _die(sig=signal.SIGKILL):
    def work(ready) -> int:
        ready()
        os.kill(os.getpid(), sig)
        time.sleep(60)  # never reached: the signal ends it
        return 0

    return work


def test_a_crash_loop_ends_the_parent():
    respawner = Respawner(_die(), deaths=3, seconds=600)
    assert respawner.run() == 1
    assert respawner.respawns == 3  # four deaths within the window: three were respawned, the fourth is a loop


def test_a_child_never_ready_is_not_respawned():
    respawner = Respawner(lambda ready: 3)  # e.g. a bad setting: the error is the command's
    assert respawner.run() == 3 and respawner.respawns == 0


def test_a_child_that_stops_on_its_own_ends_the_parent():
    def work(ready) -> int:
        ready()
        return 0

    respawner = Respawner(work)
    assert respawner.run() == 0 and respawner.respawns == 0

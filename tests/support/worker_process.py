"""A `berth worker` process a test starts and watches: its metrics page, its progress, the job's results."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

from sqlalchemy import func, select

from jobs.records.models import Result
from tests.support.processes import free_port


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def start_worker(env, log_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker", "--metrics-port", str(port)], env=env,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    return proc, port


def wait_generating(proc, port, timeout=120) -> None:
    """Until the worker has generated its first tokens."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the worker died on its own"
        assert time.monotonic() < deadline, "the worker did not start generating"
        try:
            if metric(port, "berth_output_tokens_total") > 0:
                return
        except OSError:  # not serving yet
            pass
        time.sleep(0.2)


def run_until(proc, port, tokens: float, timeout=240) -> float:
    """Let the worker generate ``tokens`` output tokens (or a little more); returns its count."""
    deadline = time.monotonic() + timeout
    while (done := metric(port, "berth_output_tokens_total")) < tokens:
        assert proc.poll() is None, "the worker died on its own"
        assert time.monotonic() < deadline, "the worker stopped generating"
        time.sleep(0.02)
    return done


def results_counts(db) -> tuple[int, int]:
    with db.session() as s:
        return (s.scalar(select(func.count(Result.id))),
                s.scalar(select(func.coalesce(func.sum(Result.completion_tokens), 0))))

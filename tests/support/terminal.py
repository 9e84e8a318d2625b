"""A berth command on a pseudo-terminal, with Ctrl-C typed there as a user types it: the terminal sends
SIGINT to the command's foreground process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def berth_in_a_terminal(args: list[str], interrupts: Sequence[Callable[[str], bool]] = (), timeout: float = 240,
                        cwd: Path = ROOT, env: dict | None = None) -> tuple[int, str]:
    """Run ``python -m jobs.cli ARGS``; type Ctrl-C once for each of ``interrupts``, in turn, when it
    holds of the output so far. The exit status and the output."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            cwd=cwd, start_new_session=True, env={**os.environ, "TERM": "dumb", **(env or {})})
    os.close(slave)
    os.set_blocking(master, False)
    out, pending, deadline = b"", list(interrupts), time.monotonic() + timeout

    def read():
        nonlocal out
        try:
            while chunk := os.read(master, 65536):
                out += chunk
        except (BlockingIOError, OSError):
            pass

    while proc.poll() is None and time.monotonic() < deadline:
        read()
        if pending and pending[0](out.decode(errors="replace")):
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does with ^C: the foreground group
            pending.pop(0)
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        pytest.fail(f"berth {' '.join(args)} did not stop: {out.decode(errors='replace')[-2000:]}")
    read()
    os.close(master)
    return proc.returncode, out.decode(errors="replace")

"""Periodic chores beside the engine loop, on a thread of their own: on the embedded defaults the
worker itself reconciles, expires jobs and collects checkpoints (with servers, Celery beat does).
Each chore runs every ``period`` seconds, first ``first`` seconds after the start (a period unless said);
a chore that raises is logged and runs again next time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("berth.worker")

class Chore(NamedTuple):
    period: float  # seconds between runs
    run: Callable[[], None]
    first: float | None = None  # seconds from the start to its first run (None: a period)


class Housekeeper:
    def __init__(self, chores: list[Chore]):
        self.chores = list(chores)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.chores and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="berth-housekeeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        due = [start + (c.period if c.first is None else c.first) for c in self.chores]
        while not self._stop.is_set():
            now = time.monotonic()
            for i, (period, chore, _) in enumerate(self.chores):
                if now >= due[i]:
                    due[i] = now + period
                    try:
                        chore()
                    except Exception:
                        log.exception("chore %s failed; it runs again in %.0fs", getattr(chore, "__name__", chore),
                                      period)
            self._stop.wait(max(0.05, min(due) - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

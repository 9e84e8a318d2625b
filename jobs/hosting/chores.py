"""The periodic chores of the embedded defaults (reconcile, expire, at-risk events, checkpoint collection,
and the embedded queue's own clean-up), run on a thread of every engine worker where no Celery beat runs.
``chores(settings)`` gives them (``worker.consumer.housekeeper.Chore``: a period in seconds and a function);
each function logs its own errors and is safe to run beside the same chore of another worker. Why and how:
docs/operations.md.
"""

from __future__ import annotations

import datetime
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

from jobs.pipeline.celery_tasks import (
    AT_RISK,
    CHECKPOINT_GC,
    CHECKPOINT_GC_PERIOD_SECONDS,
    EXPIRE,
    EXPIRE_FILES,
    RECONCILE,
    make_app,
)
from worker.config import Settings
from worker.consumer.housekeeper import Chore
from worker.messaging.topology import broker_url, is_embedded

log = logging.getLogger("berth.housekeeping")

RECONCILE_SECONDS = 5.0
EXPIRE_SECONDS = 5.0
AT_RISK_SECONDS = 5.0
EXPIRE_FILES_SECONDS = 60.0  # files expire an hour or more after they are made: a minute late is on time
QUEUE_GC_SECONDS = 600.0
HANDED_OUT_KEEP_SECONDS = 3600.0
DELETE_BATCH = 10_000  # rows per delete: the queue's one write lock is never held long

def chores(settings: Settings) -> list[Chore]:
    """The chores of a worker on the embedded queue; none with a broker, where Celery beat runs them. The
    reconcile runs once at the worker's start too: the requests of a worker that died on this host (their
    messages handed out to it, on a queue that never hands them back by itself) run again at once, not a
    period later."""
    if not is_embedded(settings):
        return []
    tasks = make_app(settings, eager=True).tasks
    return [Chore(RECONCILE_SECONDS, _logged("reconcile", tasks[RECONCILE]), first=0.0),
            Chore(EXPIRE_SECONDS, _logged("expire", tasks[EXPIRE])),
            Chore(AT_RISK_SECONDS, _logged("at_risk", tasks[AT_RISK])),
            Chore(EXPIRE_FILES_SECONDS, _logged("expire_files", tasks[EXPIRE_FILES])),
            Chore(CHECKPOINT_GC_PERIOD_SECONDS, _logged("checkpoint_gc", tasks[CHECKPOINT_GC])),
            Chore(QUEUE_GC_SECONDS, _logged("queue_gc", lambda: delete_handed_out(settings)))]


def _logged(name: str, work: Callable[[], object]) -> Callable[[], None]:
    failing = False

    def chore() -> None:
        nonlocal failing
        try:
            work()
        except Exception:
            if not failing:
                log.exception("housekeeping: %s failed; trying again every period, logged once until it works", name)
            failing = True
            return
        if failing:
            log.info("housekeeping: %s works again", name)
        failing = False

    chore.__name__ = chore.__qualname__ = name
    return chore


def delete_handed_out(settings: Settings, keep_seconds: float = HANDED_OUT_KEEP_SECONDS) -> int:
    """Delete the embedded queue's message rows handed out over ``keep_seconds`` ago; how many.

    kombu stamps a row's ``timestamp`` (local time) when it hands it out, the one update it makes;
    a row is written without one."""
    path = Path(broker_url(settings).removeprefix("sqla+sqlite:///"))
    if not path.exists():
        return 0
    cutoff = (datetime.datetime.now() - datetime.timedelta(seconds=keep_seconds)).strftime("%Y-%m-%d %H:%M:%S.%f")
    deleted = 0
    conn = sqlite3.connect(path, timeout=60)
    try:
        while True:
            try:
                with conn:
                    n = conn.execute("DELETE FROM kombu_message WHERE id IN (SELECT id FROM kombu_message "
                                     "WHERE visible = 0 AND timestamp < ? LIMIT ?)", (cutoff, DELETE_BATCH)).rowcount
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):  # nothing was ever published
                    return deleted
                raise
            deleted += n
            if n < DELETE_BATCH:
                break
    finally:
        conn.close()
    if deleted:
        log.info("housekeeping: deleted %d queue rows handed out over %.0f s ago", deleted, keep_seconds)
    return deleted

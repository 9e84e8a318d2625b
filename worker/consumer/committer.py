"""Outcomes committed on a thread of their own, while the engine runs the next step.

On a GPU a step takes a few milliseconds and the device waits for whatever the loop does between two
steps; a step's results written to the database (each one's output line built, one transaction, a
round trip) would be such a wait. So the loop hands them here (``put``) and goes on; this thread
commits them through the ``OutcomeBook`` (which keeps them while the database is down and tries
again when due), and the loop takes back what was committed (``take``) to ack it on its own thread:
kombu's channels belong to the thread that uses them. A message is thus still acked only after its
outcome committed, and a worker killed in between leaves a message that is redelivered and skipped.
``pending`` counts what was handed in and not taken back yet: the loop holds those requests (a
redelivery is adopted, not run again) until then.

Outcomes are committed in groups: a decode step finishes one or two requests, and a commit costs
about the same CPU and round trips for one outcome as for thirty, so a small group waits for more
until ``GATHER_SECONDS`` after the commit before it began (the messages stay unacked that much longer,
which the prefetch window has room for; ``worker.consumer.admission.prefetch_window``).
"""

from __future__ import annotations

import logging
import threading
import time

from worker.consumer.outcomes import OutcomeBook, Pending

log = logging.getLogger("berth.worker")

RETRY_POLL = 0.1  # seconds between looks at a database that is down, for its next try being due
GATHER_SECONDS = 0.02  # a commit of fewer than GATHER_COUNT outcomes waits for more until this long after the last
GATHER_COUNT = 32


class Committer:
    def __init__(self, book: OutcomeBook):
        self.book = book
        self._cond = threading.Condition()
        self._todo: list[Pending] = []
        self._done: list[Pending] = []
        self._handed = 0  # put and not yet taken back
        self._running = 0  # the worker's requests when last told (for the outage's log line)
        self._stop = False
        self._flush = True  # on stopping, commit what was handed in first
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # what ended the thread, raised to the loop by ``take``
        self._last = 0.0  # monotonic time the last commit began

    @property
    def pending(self) -> int:
        """Outcomes handed in and not taken back yet (committed or not)."""
        return self._handed

    def put(self, items: list[Pending], running: int = 0) -> None:
        """Commit ``items`` (with those still waiting for the database) as soon as may be."""
        if not items:
            return
        with self._cond:
            self._todo.extend(items)
            self._handed += len(items)
            self._running = running
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="berth-committer", daemon=True)
            self._thread.start()

    def take(self) -> list[Pending]:
        """The outcomes committed since the last call, to ack (or dead-letter) now. An error that
        was not the database's (a bug) ends the thread and is raised here, in the loop's thread."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        with self._cond:
            done, self._done = self._done, []
            self._handed -= len(done)
        return done

    def close(self, flush: bool, timeout: float) -> None:
        """Stop the thread: with ``flush``, once what was handed in is committed (up to ``timeout``
        seconds; the rest stays uncommitted, its messages to be handed back), else after the commit
        under way. Nothing is committed after this returns."""
        with self._cond:
            self._stop, self._flush = True, flush
            self._cond.notify()
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():  # the database does not answer: give up the rest
            with self._cond:
                self._flush = False
                self._cond.notify()
            thread.join()
            log.warning("committer: %d outcomes left uncommitted at stop", len(self.book.waiting))

    def _due(self) -> bool:
        return bool(self._todo) or (bool(self.book.waiting) and self.book.database.ready())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due() and not self._stop:
                    self._cond.wait(RETRY_POLL if self.book.waiting else None)
                while not self._stop and 0 < len(self._todo) < GATHER_COUNT:  # a few: gather more first
                    left = self._last + GATHER_SECONDS - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._stop and (not self._flush or not (self._todo or self.book.waiting)):
                    return
                items, self._todo = self._todo, []
                running = self._running
                self._last = time.monotonic()
            if not items and not self.book.database.ready():  # stopping, the database down: wait for its try
                with self._cond:
                    self._cond.wait(RETRY_POLL)
                continue
            try:
                done = self.book.commit(items, running)
            except BaseException as exc:  # noqa: BLE001 (not the database: raised in the loop, as it was there)
                with self._cond:
                    self._error = exc
                return
            with self._cond:
                self._done.extend(done)

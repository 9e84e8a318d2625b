"""``berth worker --respawn``: a parent that has imported torch and the engine once forks the worker
as a child, and forks a new one at once when it dies, so a restart pays only the model's load. The
parent runs no torch operation, connection or thread (fork safety), passes SIGTERM and SIGINT on,
and exits with status 1 after ``CRASH_LOOP_DEATHS`` deaths within ``CRASH_LOOP_SECONDS``
(docs/operations.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable

log = logging.getLogger("berth.respawn")

CRASH_LOOP_DEATHS = 5  # deaths of ready workers ...
CRASH_LOOP_SECONDS = 60.0  # ... within this many seconds, and the parent gives up
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The worker proper: builds the worker, calls ``ready()`` once it can take work, runs it; its exit status.
Work = Callable[[Callable[[], None]], int]


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has (it died before this ran)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as exc:  # not Linux: the child outlives a SIGKILLed parent
        log.warning("the worker child will not die with its parent: %s", exc)
    if os.getppid() != parent:
        os._exit(1)


def describe(status: int) -> str:
    """A ``waitpid`` status in words."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.WEXITSTATUS(status)}"


def exit_code(status: int) -> int:
    """A child's ``waitpid`` status as a shell would give it: its exit status, or 128 + its signal."""
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Respawner:
    """Forks ``work`` as a child and again whenever a ready child dies; ``run()`` returns the exit status
    for the command."""

    def __init__(self, work: Work, deaths: int = CRASH_LOOP_DEATHS, seconds: float = CRASH_LOOP_SECONDS):
        self.work, self.deaths_allowed, self.window = work, deaths, seconds
        self.child: int | None = None
        self.stopping: int | None = None  # the signal that asked the parent to stop
        self.respawns = 0

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        deaths: deque[float] = deque()
        try:
            while True:
                started = time.monotonic()
                status, ready = self._spawn_and_wait()
                lived = time.monotonic() - started
                if self.stopping is not None:
                    return exit_code(status)
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                    log.info("worker child stopped on its own (exit status 0): not respawned")
                    return 0
                if not ready:
                    log.error("worker child died before it was ready (%s): not respawned", describe(status))
                    return exit_code(status) or 1
                now = time.monotonic()
                deaths.append(now)
                while deaths and deaths[0] < now - self.window:
                    deaths.popleft()
                if len(deaths) > self.deaths_allowed:
                    log.error("worker child died %d times within %.0fs (the last: %s): a crash loop; not respawned "
                              "(the worker's log above says why it died)", len(deaths), self.window, describe(status))
                    return 1
                self.respawns += 1
                log.warning("worker child died (%s) after %.1fs; respawn %d", describe(status), lived, self.respawns)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn_and_wait(self) -> tuple[int, bool]:
        """Fork a child, wait for it to end: its ``waitpid`` status, and whether it had said it was ready."""
        parent = os.getpid()
        ready_r, ready_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            self._child(parent, ready_w)  # never returns
        os.close(ready_w)
        self.child = pid
        log.info("worker child %d started", pid)
        if self.stopping is not None:  # a signal came while it was forked
            os.kill(pid, self.stopping)
        try:
            _, status = os.waitpid(pid, 0)  # retried after a signal's handler has passed it on (PEP 475)
        finally:
            self.child = None
        os.set_blocking(ready_r, False)
        try:
            ready = os.read(ready_r, 1) == b"r"
        except BlockingIOError:
            ready = False
        os.close(ready_r)
        return status, ready

    def _child(self, parent: int, ready_w: int) -> None:
        code = 1
        try:
            die_with_parent(parent)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)  # the worker installs its own when it runs

            def ready() -> None:
                os.write(ready_w, b"r")

            code = self.work(ready)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 (the child's end: said, then exit)
            traceback.print_exc()
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _stop(self, sig: int, _frame) -> None:
        self.stopping = sig
        if self.child is not None:
            try:
                os.kill(self.child, sig)
            except ProcessLookupError:
                pass

"""The ledger's calls answered by a process of its own, so that their CPU is not the engine loop's GIL.

On a GPU a step takes milliseconds, and while the loop's thread waits for the GIL the device waits too.
The ledger's work (a claim's reads and writes, a step's outcomes built into result lines and committed:
SQLAlchemy and the database driver in Python) cost the worker's process more CPU than the loop's own
job-path work, on threads that took the GIL from the loop. Here a child process holds the real ledger and
the worker's threads only send calls and wait for answers, the GIL released (benchmarks/HISTORY.md,
"The ledger in a process of its own").

The contract is the ``Ledger``'s: the same calls, answers and exceptions (``LedgerDown`` included), each
caller thread with a connection of its own (the standard library's managers), so a claim and a commit run
at once as they did on threads. The child is a fresh interpreter (``python -m`` this module: nothing of the
worker's threads or its main script), which builds the ledger from a picklable ``factory`` (it opens the
database, which the worker has already opened and migrated), one child a worker. Its start (~1 s of
imports) is paid by each, so the worker starts it first (``LedgerChild``): it imports the factory's module
while the worker imports its own and opens the database, beside the model's load. It answers until
``close``, or until the worker's process is gone (looked at every ``PARENT_POLL`` seconds): a killed worker's
call under way finishes, as if the worker had died just after it, and nothing more is done. It ignores
SIGINT and SIGTERM, which are the worker's (a Ctrl-C'd worker drains, committing through it). A child that
died answers no call: the call raises ``LedgerProcessGone`` and the worker stops, its messages redelivered.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client
from multiprocessing.managers import BaseManager, dispatch

from worker.consumer.ledger import Ledger

PARENT_POLL = 0.1  # seconds between the child's looks at whether the worker's process is still there
STOP_WAIT = 10.0  # seconds ``close`` waits for the child to end before killing it
GONE_WAIT = 2.0  # seconds a call whose connection broke waits to see the child ended
# what the child answers (``close`` ends the child instead)
CALLS = tuple(name for name in vars(Ledger) if not name.startswith("_") and name != "close")


class LedgerProcessGone(RuntimeError):
    """The ledger's process ended while the worker ran."""


def _build(factory: Callable[[], Ledger]) -> Ledger:
    return factory()


class _Manager(BaseManager):
    pass


_Manager.register("Ledger", _build, exposed=CALLS)


class LedgerChild:
    """The ledger's process, started and importing ``preload`` (the module of the factory it will build) while
    the worker does the rest of its start; ``LedgerProcess`` then has it serve a ledger."""

    def __init__(self, preload: str):
        self.folder = tempfile.mkdtemp(prefix="berth-ledger-")
        self.address = os.path.join(self.folder, "socket")
        self.authkey = os.urandom(32)
        root = logging.getLogger()
        fmt = root.handlers[0].formatter._fmt if root.handlers and root.handlers[0].formatter else ""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), self.address,
             str(logging.getLogger("berth").getEffectiveLevel()), fmt, preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.pid = self.process.pid
        self.process.stdin.write(self.authkey.hex().encode() + b"\n")
        self.process.stdin.close()

    def wait_ready(self) -> None:
        """Until it listens (its imports done)."""
        if self.process.stdout.closed:
            return
        if self.process.stdout.readline().strip() != b"ready":
            raise LedgerProcessGone(f"the ledger's process {self.pid} did not start (exit code "
                                    f"{self.process.wait()}): its error is above")
        self.process.stdout.close()

    def close(self) -> None:
        """End it, after the calls under way."""
        if self.process.poll() is None:
            try:
                with Client(self.address, authkey=self.authkey) as conn:
                    dispatch(conn, None, "shutdown")
                self.process.wait(STOP_WAIT)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class LedgerProcess:
    """A ``Ledger`` whose calls are answered by ``factory()``'s ledger in a child process: ``child``, started
    earlier, or one started here."""

    def __init__(self, factory: Callable[[], Ledger], child: LedgerChild | None = None):
        self._child = child or LedgerChild(type(factory).__module__)
        self.pid = self._child.pid
        try:
            self._child.wait_ready()
            manager = _Manager(address=self._child.address, authkey=self._child.authkey)
            manager.connect()
            self._ledger = manager.Ledger(factory)
        except BaseException:
            self.close()
            raise
        for name in CALLS:
            setattr(self, name, self._forward(name))

    def _forward(self, name: str) -> Callable:
        method = getattr(self._ledger, name)

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except (EOFError, OSError) as exc:  # a connection broken, refused, its socket file gone
                try:
                    self._child.process.wait(GONE_WAIT)  # a broken connection: the child is gone, or going
                except subprocess.TimeoutExpired:
                    raise exc from None  # the call's own error, raised in the child
                raise LedgerProcessGone(f"the ledger's process {self.pid} ended (exit code "
                                        f"{self._child.process.returncode}) "
                                        "while the worker ran: the worker stops; its unacked requests are "
                                        "redelivered") from exc

        call.__name__ = name
        return call

    def close(self) -> None:
        """End the child, after the calls under way."""
        self._child.close()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    os._exit(0)  # the worker is gone: its unacked messages go to another worker, which redoes what is not committed


def _serve(parent: int, address: str, level: int, fmt: str, preload: str) -> None:
    """The child: the worker's logging, its signals left to it, an end with it, the factory's module
    imported; then serve."""
    logging.basicConfig(level=level, format=fmt or None)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(parent,), name="berth-ledger-parent", daemon=True).start()
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    importlib.import_module(preload)
    server = _Manager(address=address, authkey=authkey).get_server()  # listening from here
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nobody reads the pipe any more
    try:
        server.serve_forever()  # until ``close``'s shutdown
    finally:
        logging.shutdown()
        os._exit(0)  # not the interpreter's teardown of SQLAlchemy's and Celery's modules (~0.3 s)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])

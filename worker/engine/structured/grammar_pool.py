"""Grammar compiles in processes stopped at their deadline, fair by tenant: ``compile_pool`` hands a
``CompileJob`` to a compile server (``grammar_server``) and its future back; a compile past its
deadline is killed and fails its future. docs/engine.md says why processes and how tenants share them."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path

from worker.engine.request import StructuredOutput
from worker.engine.structured.grammar_compile import COMPILE_THREADS, WHAT, CompileTimeout, GrammarError
from worker.engine.structured.schema_bounds import SchemaBounds

log = logging.getLogger("berth.grammar")

START_SECONDS = 300.0  # a compile server's start (importing xgrammar), or a slot server taking a tokenizer info
REPLY_SECONDS = 60.0  # past a compile's deadline, a slot server that has not answered is taken for dead


@dataclass(frozen=True)
class CompileRules:
    """What one compile may cost: ``Settings.structured_compile_*`` and the schema's bounds."""

    seconds: float = 60.0  # the compile itself, in its process; time queued does not count
    processes: int = 2  # compiles at once in this process's pool
    tenant_processes: int = 1  # of them, one tenant's at once
    bounds: SchemaBounds = field(default_factory=SchemaBounds)

    @classmethod
    def of(cls, settings) -> CompileRules:
        return cls(settings.structured_compile_seconds, settings.structured_compile_processes,
                   settings.structured_compile_tenant_processes, SchemaBounds.of(settings))


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer, as compile processes take it: a key and its ``TokenizerInfo`` serialised."""

    key: str
    info_json: Callable[[], str]


@dataclass
class CompileJob:
    spec: StructuredOutput
    tenant: str
    rules: CompileRules
    vocabulary: Vocabulary
    build: Callable[[], object]  # the compile in this process, once the trial passed
    future: Future = field(default_factory=Future)


@dataclass
class PoolStats:
    trials: int = 0  # compiles begun in a compile process
    killed: list[int] = field(default_factory=list)  # pids of compile processes stopped at a deadline
    lost: int = 0  # compile processes that died by themselves (out of memory, say)


class CompilePool:
    """The slots and the tenants' queues; ``submit`` a job, its future resolves when it is done."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[CompileJob]] = OrderedDict()  # least recently served first
        self._running: Counter[str] = Counter()
        self._slots: list[_Slot] = []
        self.stats = PoolStats()

    def submit(self, job: CompileJob) -> Future:
        with self._cond:
            while len(self._slots) < job.rules.processes:
                self._slots.append(_Slot(self, len(self._slots)))
            self._queues.setdefault(job.tenant, deque()).append(job)
            self._cond.notify_all()
        return job.future

    def queued(self, tenant: str) -> int:
        """How many of ``tenant``'s jobs wait for a slot."""
        with self._cond:
            return len(self._queues.get(tenant, ()))

    def withdraw(self, job: CompileJob) -> bool:
        """Take ``job`` out of its tenant's queue and cancel its future; False once a slot took it."""
        with self._cond:
            queue = self._queues.get(job.tenant)
            at = next((i for i, queued in enumerate(queue or ()) if queued is job), None)
            if at is None:
                return False
            del queue[at]
            if not queue:
                del self._queues[job.tenant]
            job.future.cancel()
            return True

    def take(self) -> CompileJob:
        """The next job a slot runs: the first waiting tenant, in turn, still under its share."""
        with self._cond:
            while True:
                for tenant, queue in self._queues.items():
                    if self._running[tenant] < queue[0].rules.tenant_processes:
                        job = queue.popleft()
                        self._running[tenant] += 1
                        if queue:
                            self._queues.move_to_end(tenant)
                        else:
                            del self._queues[tenant]
                        return job
                self._cond.wait()

    def done(self, job: CompileJob) -> None:
        with self._cond:
            self._running[job.tenant] -= 1
            if self._running[job.tenant] <= 0:
                del self._running[job.tenant]
            self._cond.notify_all()

    def count(self, trial: bool = False, killed: int | None = None, lost: bool = False) -> None:
        with self._cond:
            self.stats.trials += trial
            self.stats.lost += lost
            if killed is not None:
                self.stats.killed.append(killed)


class _Slot:
    """A thread here and its slot server: a trial, then the compile here, one job at a time."""

    def __init__(self, pool: CompilePool, index: int):
        self.pool = pool
        self.link: SlotLink | None = None
        threading.Thread(target=self._run, name=f"berth-grammar-{index}", daemon=True).start()

    def _run(self) -> None:
        try:
            self.link = compile_server().open_slot()  # ready before the first job: its start never counts
        except Exception:
            log.exception("structured outputs: could not start the compile server")
        while True:
            job = self.pool.take()
            try:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_result(self._compile(job))
            except BaseException as exc:  # noqa: BLE001 (the job's failure, whatever it is)
                if not job.future.done():
                    job.future.set_exception(exc)
            finally:
                self.pool.done(job)

    def _compile(self, job: CompileJob):
        what = WHAT[job.spec.kind]
        try:
            if self.link is None:
                self.link = compile_server().open_slot()
            self.pool.count(trial=True)
            status, pid, *detail = self.link.compile(job.vocabulary, job.spec, job.rules.seconds)
        except (EOFError, OSError, TimeoutError) as exc:  # its server is gone: the next job starts another
            if self.link is not None:
                self.link.close()
            self.link = None
            raise GrammarError(f"{what} could not be compiled: the compile server failed "
                               f"({type(exc).__name__}: {exc})") from None
        if status == "timeout":
            self.pool.count(killed=pid)
            raise CompileTimeout(job.spec, job.rules.seconds)
        if status == "died":
            self.pool.count(lost=True)
            raise GrammarError(f"{what} could not be compiled: its compile process ended by {detail[0]} "
                               "(out of memory?): simplify it")
        if status == "error":
            raise GrammarError(detail[0])
        return job.build()


class SlotLink:
    """This process's end of one slot server."""

    def __init__(self, conn: Connection, pid: int):
        self.conn, self.pid = conn, pid
        self.vocabularies: set[str] = set()

    def compile(self, vocabulary: Vocabulary, spec: StructuredOutput, seconds: float) -> tuple:
        if vocabulary.key not in self.vocabularies:
            self.conn.send(("vocabulary", vocabulary.key, vocabulary.info_json()))
            _reply(self.conn, START_SECONDS)
            self.vocabularies.add(vocabulary.key)
        self.conn.send(("compile", vocabulary.key, spec.kind, spec.value, seconds))
        return _reply(self.conn, seconds + REPLY_SECONDS)

    def close(self) -> None:
        """Hang up; a slot server that may still be running is killed."""
        self.conn.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


def _reply(conn: Connection, seconds: float):
    if not conn.poll(seconds):
        raise TimeoutError(f"no answer in {seconds:g} s")
    return conn.recv()


class CompileServer:
    """The compile server of this process (``worker/engine/structured/grammar_server.py``)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[3])  # the folder holding worker/: this very code runs there
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.engine.structured.grammar_server",
                                      str(theirs.fileno()), str(COMPILE_THREADS)], pass_fds=[theirs.fileno()], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.starter = os.getpid()
        self._lock = threading.Lock()
        _reply(self.conn, START_SECONDS)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def open_slot(self) -> SlotLink:
        with self._lock:
            ours, theirs = socket.socketpair()
            self.conn.send(("slot",))
            send_handle(self.conn, theirs.fileno(), self.proc.pid)
            theirs.close()
            _, pid = _reply(self.conn, START_SECONDS)
        return SlotLink(Connection(ours.detach()), pid)


_server: CompileServer | None = None
_server_lock = threading.Lock()


def compile_server() -> CompileServer:
    """This process's compile server, started (again) when there is none alive; it ends when this
    process does (its socket closes)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive() or _server.starter != os.getpid():
            _server = CompileServer()
        return _server


_pool: CompilePool | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def compile_pool() -> CompilePool:
    """This process's pool (a forked child gets its own: threads do not survive a fork)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = CompilePool(), os.getpid()
        return _pool

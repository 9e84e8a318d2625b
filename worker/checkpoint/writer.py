"""Checkpoint uploads, on threads of their own beside the engine loop.

The engine thread hands in a round's snapshots (``submit_round``) and never waits. A snapshot's two
parts go separately, so that the small states never wait behind anyone's KV data:

- States, on one thread, in segments: every state queued since the last segment goes into the next
  one, one PUT whatever the number of requests (a newer state of a request replaces its older one not
  yet written, keeping the time of its oldest progress). So a worker's state PUTs follow its rounds,
  not its running requests. A state is trimmed to the runs known written when it goes: it never names
  a run that is not on the store. One trimmed for runs still queued or uploading is queued again once
  they are through (unless a newer state of its request came meanwhile): when ``flush`` returns,
  every state names each of its blocks that got written.
- Where each request's state is (a ``StateRef``) is handed to ``on_durable`` after its segment's PUT,
  on the same thread (the engine worker records the refs in the requests' rows, one batched UPDATE a
  segment). A request's progress counts as durable (``durable_tokens``, and so the lag gauges) only
  once its ref is recorded: before that, a redelivered request could not find it. When recording
  fails (the database is down), the refs wait, the newest per request, and are tried again with
  backoff; segments are written all the same, and a request whose newest ref never got recorded
  resumes from the last one that did: an older state, never a torn one.
- KV runs (consecutive full blocks of one chain, ``format.encode_run``), on ``block_threads`` threads
  at the lowest CPU priority (on Linux), oldest first, each run once, at most ``max_pending_bytes`` of
  block data held (the engine side takes no new runs past that). The queued runs of a request whose
  result is in are dropped unwritten.

So when the store, the database or the CPU is slow the checkpoints fall behind the engine, never the
reverse; ``lag_seconds`` says how far, ``pending_block_bytes`` how much KV waits. A failed write marks
the store down: the warning is logged once, the write dropped, and the threads probe the store with
backoff until it takes a write; meanwhile ``up`` is false, the engine side takes no snapshots, and
what was queued waits. Every PUT's size and time go to ``rates`` (``worker.checkpoint.costs``), which
decide what KV is worth writing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from storage import ObjectStore, StorageError
from worker.checkpoint.costs import TransferRates
from worker.checkpoint.format import (
    PROBE_KEY,
    RequestCheckpoint,
    StateRef,
    encode_run,
    encode_segment,
    kv_key,
    segment_key,
)
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.checkpoint")

BLOCK_THREADS = 1  # Settings.checkpoint_kv_threads
MAX_REMEMBERED_BLOCKS = 200_000  # hashes of blocks known written; the oldest are forgotten past this
PROBE_BACKOFF = (1.0, 30.0)  # seconds between probes of a store that is down: first, most
RECORD_BACKOFF = (1.0, 30.0)  # seconds between tries to record refs while recording fails: first, most
THREAD_NAME = "berth-checkpoint-writer"  # every writer thread's name starts so


@dataclass
class KvRun:
    """Consecutive full KV blocks of one hash chain, stored as one object named by the last."""

    hashes: list[bytes]
    data: torch.Tensor  # [layers, 2, len(hashes), block_size, kv_heads, head_dim]
    shared: bool = False  # holds prompt blocks another worker may have written: ask the store first
    request_id: str = ""  # the request that brought it

    @property
    def last(self) -> bytes:
        return self.hashes[-1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class Snapshot:
    """A request's state as the engine had it, and the KV runs it names that the store lacks."""

    checkpoint: RequestCheckpoint
    runs: list[KvRun] = field(default_factory=list)
    taken: float = field(default_factory=time.monotonic)  # when the oldest progress it carries was read

    @property
    def request_id(self) -> str:
        return self.checkpoint.request_id


@dataclass
class _Unrecorded:
    """A request's state in a segment on the store, its ref not yet recorded."""

    ref: StateRef
    tokens: int
    taken: float


class _RecentMap:
    """A mapping that forgets its oldest keys past ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict[bytes, bytes] = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._items

    def get(self, key, default=None):
        return self._items.get(key, default)

    def set(self, key: bytes, value: bytes) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self.limit:
            self._items.popitem(last=False)


def _lowest_cpu_priority() -> None:
    """Nice 19 for the calling thread alone (Linux schedules threads by their own nice value)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


class CheckpointWriter:
    def __init__(self, store: ObjectStore, fingerprint: str, metrics: WorkerMetrics, max_pending_bytes: int,
                 block_threads: int = BLOCK_THREADS, on_durable: Callable[[dict[str, str]], None] | None = None,
                 rates: TransferRates | None = None):
        """``on_durable(refs)``: request id -> where its latest state is (``str(StateRef)``), called on the
        writer's thread after each segment; raising means "not recorded, try again later"."""
        self.store = store
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self.on_durable = on_durable
        self.rates = rates or TransferRates()
        self.name = uuid.uuid4().hex[:16]  # names this writer's segments: a new one each process
        self.up = True
        self.durable_tokens: dict[str, int] = {}  # request id -> output tokens in its recorded state
        self.segments = 0  # segment PUTs so far
        self._written = _RecentMap(MAX_REMEMBERED_BLOCKS)  # block hash -> last hash of the stored run holding it
        self._states: dict[str, Snapshot] = {}  # for the next segment
        self._writing: list[Snapshot] = []  # in the segment being written
        self._dropped: set[str] = set()  # deleted while their segment was being written
        self._unrecorded: dict[str, _Unrecorded] = {}
        self._record_after = 0.0  # monotonic time before which no new try to record refs is made
        self._record_wait = RECORD_BACKOFF[0]
        self._record_failing = False
        self._runs: OrderedDict[bytes, KvRun] = OrderedDict()  # queued, oldest first, by last hash
        self._uploading: dict[bytes, KvRun] = {}
        self._in_flight: dict[bytes, bytes] = {}  # block hash -> last hash of a queued or uploading run holding it
        # request id -> a state written short of some of its blocks: it, where its samples were cut
        # short, and the blocks it left out that are still queued or uploading
        self._awaiting: dict[str, tuple[Snapshot, set[bytes], set[bytes]]] = {}
        self._pending_bytes = 0  # block data queued or uploading
        self._cond = threading.Condition()
        self._closing = threading.Event()
        metrics.storage_up.set(1)
        metrics.checkpoint_unrecorded.set_function(lambda: len(self._unrecorded))
        self._threads = [threading.Thread(target=self._run_states, name=f"{THREAD_NAME}-state", daemon=True)]
        self._threads += [threading.Thread(target=self._run_blocks, name=f"{THREAD_NAME}-kv-{i}", daemon=True)
                          for i in range(block_threads)]
        for t in self._threads:
            t.start()

    # ---- the engine thread's side: none of these wait on the store or the database
    def submit_round(self, snapshots: list[Snapshot]) -> None:
        """A round's snapshots: their states go together in the next segment."""
        with self._cond:
            for snapshot in snapshots:
                for run in snapshot.runs:
                    if self.has_run(run.last):
                        continue  # the same run (its name says what it holds) is on its way or stored
                    run.request_id = snapshot.request_id
                    self._runs[run.last] = run
                    self._pending_bytes += run.nbytes
                    for h in run.hashes:
                        self._in_flight.setdefault(h, run.last)
                snapshot.runs = []  # the run queue holds them now
                self._awaiting.pop(snapshot.request_id, None)  # the newer state goes instead
                old = self._states.get(snapshot.request_id)
                if old is not None:  # not written yet: the newer state takes its place and time
                    snapshot.taken = old.taken
                    self.metrics.checkpoint_superseded.inc()
                self._states[snapshot.request_id] = snapshot
            self._cond.notify_all()

    def publish(self, runs: list[KvRun]) -> None:
        """Runs of shared prompt prefixes, for other workers to load (``worker.checkpoint.prefix_store``):
        queued like a state's runs, but no state names them and no request's end drops them; one is
        written only after asking the store whether it has it (another worker wrote it, or this one)."""
        with self._cond:
            for run in runs:
                if run.last in self._runs or run.last in self._uploading:
                    continue
                run.shared, run.request_id = True, ""
                self._runs[run.last] = run
                self._pending_bytes += run.nbytes
                for h in run.hashes:
                    self._in_flight.setdefault(h, run.last)
            self._cond.notify_all()

    def has_run(self, last: bytes) -> bool:
        """The run named ``last`` is on the store, or on its way there."""
        return last in self._runs or last in self._uploading or self._written.get(last) == last

    def submit(self, snapshot: Snapshot) -> None:
        self.submit_round([snapshot])

    def delete(self, request_id: str) -> None:
        """The request is done: write no more of its state, drop its queued runs. (Its stored states
        stay in their segments until the collection finds them no request's latest.)"""
        with self._cond:
            self._states.pop(request_id, None)
            self._unrecorded.pop(request_id, None)
            self._awaiting.pop(request_id, None)
            self.durable_tokens.pop(request_id, None)
            if any(s.request_id == request_id for s in self._writing):
                self._dropped.add(request_id)
            dropped = [last for last, run in self._runs.items() if run.request_id == request_id]
            hashes = []
            for last in dropped:
                run = self._runs.pop(last)
                self._pending_bytes -= run.nbytes
                self._forget_in_flight(run)
                hashes += run.hashes
            self._settled(hashes)
            self._cond.notify_all()

    def knows(self, block_hash: bytes) -> bool:
        """The block is on the store or on its way there."""
        return block_hash in self._written or block_hash in self._in_flight

    def mark_written(self, runs_of_blocks: dict[bytes, bytes]) -> None:
        """Blocks found on the store (a resumed request's): block hash -> the last hash of its run."""
        with self._cond:
            for h, last in runs_of_blocks.items():
                self._written.set(h, last)

    def room(self) -> int:
        """Bytes of block data the queue can still take."""
        return self.max_pending_bytes - self._pending_bytes

    @property
    def pending_block_bytes(self) -> int:
        return self._pending_bytes

    def lag_seconds(self) -> float:
        """How old the oldest progress not yet in a recorded state is (0 when every state is recorded)."""
        with self._cond:
            taken = [s.taken for s in self._writing] + [s.taken for s in self._states.values()]
            taken += [u.taken for u in self._unrecorded.values()]
            return time.monotonic() - min(taken) if taken else 0.0

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted is written and recorded (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._states or self._writing or self._unrecorded or self._runs or self._uploading:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued for up to ``timeout`` seconds (unless the store is down), then stop."""
        if self.up:
            self.flush(timeout)
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=1.0)

    # ---- the writer threads
    def _run_states(self) -> None:
        while self.up or self._wait_for_store():
            with self._cond:
                while not self._closing.is_set() and (batch := self._take_states()) is None:
                    self._cond.wait(self._record_wait_left())
            if self._closing.is_set():
                return
            try:
                if batch:
                    self._write_segment(batch)
            except StorageError as exc:
                self._went_down(exc)
            except Exception:
                log.exception("checkpoint segment write failed")
                self.metrics.checkpoint_failures.inc()
            finally:
                with self._cond:
                    self._writing = []
                    self._dropped.clear()
                    self._cond.notify_all()
            self._record()

    def _take_states(self) -> list[Snapshot] | None:
        """Every state queued (for a segment), or [] when only refs are due to be recorded, or None."""
        if self._states:
            self._writing = list(self._states.values())
            self._states = {}
            return self._writing
        if self._unrecorded and time.monotonic() >= self._record_after:
            return []
        return None

    def _record_wait_left(self) -> float | None:
        if not self._unrecorded:
            return None
        return max(0.01, self._record_after - time.monotonic())

    def _write_segment(self, batch: list[Snapshot]) -> None:
        with self._cond:  # trimmed to the runs on the store now (the KV threads add to them)
            states = [s.checkpoint.keep_blocks(self._written) for s in batch]
        raw, where = encode_segment(states)
        key = segment_key(self.name, self.segments)
        self.segments += 1
        t0 = time.perf_counter()
        self.store.put(key, raw)
        self.rates.observe_write(len(raw), time.perf_counter() - t0)
        self.metrics.checkpoint_bytes.inc(len(raw))
        self.metrics.checkpoint_segments.inc()
        self.metrics.checkpoint_states.inc(len(states))
        with self._cond:
            for snapshot, state in zip(batch, states):
                rid = snapshot.request_id
                if rid in self._dropped:
                    continue
                old = self._unrecorded.get(rid)
                taken = min(old.taken, snapshot.taken) if old is not None else snapshot.taken
                self._unrecorded[rid] = _Unrecorded(StateRef(key, *where[rid]), state.output_tokens, taken)
                self._await_runs(snapshot, state)

    def _record(self) -> None:
        """Hand the refs not yet recorded to ``on_durable``; on success their progress is durable."""
        with self._cond:
            if not self._unrecorded or time.monotonic() < self._record_after:
                return
            refs = dict(self._unrecorded)
        if self.on_durable is not None:
            try:
                self.on_durable({rid: str(u.ref) for rid, u in refs.items()})
            except Exception as exc:  # noqa: BLE001 (the database is down, or a bug: the refs wait either way)
                with self._cond:
                    self._record_after = time.monotonic() + self._record_wait
                    self._record_wait = min(self._record_wait * 2, RECORD_BACKOFF[1])
                if not self._record_failing:
                    self._record_failing = True
                    log.warning("could not record where %d requests' checkpoints are (tried again with backoff; "
                                "the checkpoints are stored, a crash meanwhile resumes from older ones): %s",
                                len(refs), exc)
                return
            if self._record_failing:
                self._record_failing = False
                log.warning("checkpoint locations are recorded again")
        with self._cond:
            for rid, u in refs.items():
                if self._unrecorded.get(rid) is u:  # not replaced by a newer ref, nor deleted, meanwhile
                    del self._unrecorded[rid]
                    self.durable_tokens[rid] = u.tokens
            self._record_after, self._record_wait = 0.0, RECORD_BACKOFF[0]
            self._cond.notify_all()

    def _await_runs(self, item: Snapshot, written: RequestCheckpoint) -> None:
        """``written``, ``item``'s state trimmed, is stored: if it left blocks out, ``item`` goes again
        once those of them still queued or uploading are through (under the lock)."""
        if item.request_id in self._states:  # a newer state came during the write: it goes instead
            return
        stops, missing = set(), set()
        for full, kept in zip(item.checkpoint.samples, written.samples):
            cut = len(kept.block_hashes)
            if cut < len(full.block_hashes):
                stops.add(full.block_hashes[cut])
                missing.update(full.block_hashes[cut:])
        pending = {h for h in missing if h in self._in_flight}
        if pending:
            self._awaiting[item.request_id] = (item, stops, pending)
        else:  # written meanwhile (or never coming): go again now if that names more
            self._write_again(item, stops)

    def _settled(self, hashes: list[bytes]) -> None:
        """Blocks written, failed or dropped: the states that waited on them go again (under the lock)."""
        if not self._awaiting:
            return
        for request_id, (item, stops, pending) in list(self._awaiting.items()):
            pending.difference_update(hashes)
            if not pending:
                del self._awaiting[request_id]
                self._write_again(item, stops)

    def _write_again(self, item: Snapshot, stops: set[bytes]) -> None:
        """Queue ``item`` again if a block where it was cut short is written now, so that each write
        names more blocks than the last (a newer state of its request, if queued, goes instead)."""
        if item.request_id not in self._states and any(h in self._written for h in stops):
            item.taken = time.monotonic()  # its tokens are stored: only blocks are behind
            self._states[item.request_id] = item
            self._cond.notify_all()

    def _run_blocks(self) -> None:
        _lowest_cpu_priority()
        while self.up or self._wait_for_store():
            with self._cond:
                while not self._closing.is_set() and not self._runs:
                    self._cond.wait()
                if self._closing.is_set():
                    return
                last, run = self._runs.popitem(last=False)
                self._uploading[last] = run
            try:
                self._write_run(run)
            except StorageError as exc:
                self._went_down(exc)
            except Exception:
                log.exception("checkpoint KV write failed")
                self.metrics.checkpoint_failures.inc()
            finally:
                with self._cond:
                    self._pending_bytes -= self._uploading.pop(last).nbytes
                    self._forget_in_flight(run)
                    self._settled(run.hashes)
                    self._cond.notify_all()

    def _write_run(self, run: KvRun) -> None:
        key = kv_key(self.fingerprint, run.last)
        if not (run.shared and self.store.exists(key)):
            raw = encode_run(run.hashes, run.data)
            t0 = time.perf_counter()
            self.store.put(key, raw)
            self.rates.observe_write(len(raw), time.perf_counter() - t0)
            self.metrics.checkpoint_bytes.inc(len(raw))
            self.metrics.checkpoint_blocks.inc(len(run.hashes))
            self.metrics.checkpoint_kv_runs.inc()
        with self._cond:
            for h in run.hashes:
                self._written.set(h, run.last)

    def _forget_in_flight(self, run: KvRun) -> None:
        for h in run.hashes:
            if self._in_flight.get(h) == run.last:
                del self._in_flight[h]

    def _went_down(self, exc: StorageError) -> None:
        self.metrics.checkpoint_failures.inc()
        with self._cond:
            if not self.up:
                return
            self.up = False
        log.warning("checkpoint store unavailable, checkpoints paused (requests keep running): %s", exc)
        self.metrics.storage_up.set(0)

    def _wait_for_store(self) -> bool:
        """Probe the store until it takes a write (True) or the writer closes (False)."""
        wait = PROBE_BACKOFF[0]
        while not self._closing.wait(wait):
            if self.up:  # another thread's probe got through
                return True
            try:
                self.store.put(PROBE_KEY, b"")
            except StorageError:
                wait = min(wait * 2, PROBE_BACKOFF[1])
                continue
            with self._cond:
                if self.up:
                    return True
                self.up = True
            log.warning("checkpoint store %s is back: checkpoints resume", self.store.url)
            self.metrics.storage_up.set(1)
            return True
        return False

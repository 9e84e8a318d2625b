"""Checkpoint uploads, on threads of their own beside the engine loop.

The engine thread hands in snapshots (``submit``) and never waits: the queue holds at most one
snapshot per request (a newer one replaces the one not yet written, keeping its blocks, its place
in line and the time of its oldest progress) and at most ``max_pending_bytes`` of KV block data
(the engine side takes no new blocks past that; the states, small, still go). So when the store
is slow the checkpoints fall behind the engine, never the reverse; ``lag_seconds`` says how far.

A writer thread takes the oldest snapshot of a request no other thread is writing (so a request's
states are written in order), writes its blocks, then its state, trimmed to the blocks known
written: a state never names a block that is not on the store. A failed write marks the store
down: the warning is logged once, the snapshot dropped, and the threads probe the store with
backoff until it takes a write; meanwhile ``up`` is false, the engine side takes no snapshots,
and what was queued waits.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from storage import ObjectStore, StorageError
from worker.checkpoint_format import PROBE_KEY, RequestCheckpoint, block_key, encode_block, state_key
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.checkpoint")

UPLOAD_THREADS = 4  # object stores answer each write after a round trip: several at once keep up
MAX_REMEMBERED_BLOCKS = 200_000  # hashes of blocks known written; the oldest are forgotten past this
PROBE_BACKOFF = (1.0, 30.0)  # seconds between probes of a store that is down: first, most


@dataclass
class Snapshot:
    """A request's state as the engine had it, and the KV blocks it names that the store lacks."""

    checkpoint: RequestCheckpoint
    blocks: dict[bytes, torch.Tensor]  # block hash -> [layers, 2, block_size, kv_heads, head_dim]
    shared: set[bytes] = field(default_factory=set)  # prompt blocks other workers may have written
    taken: float = field(default_factory=time.monotonic)  # when the oldest progress it carries was read

    @property
    def request_id(self) -> str:
        return self.checkpoint.request_id

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks.values())


@dataclass
class _Delete:
    request_id: str
    taken: float = field(default_factory=time.monotonic)


class _RecentSet:
    """A set that forgets its oldest members past ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, item) -> bool:
        return item in self._items

    def add(self, item: bytes) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        if len(self._items) > self.limit:
            self._items.popitem(last=False)


class CheckpointWriter:
    def __init__(self, store: ObjectStore, fingerprint: str, metrics: WorkerMetrics, max_pending_bytes: int,
                 threads: int = UPLOAD_THREADS):
        self.store = store
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self.up = True
        self.durable_tokens: dict[str, int] = {}  # request id -> output tokens in its state on the store
        self._written = _RecentSet(MAX_REMEMBERED_BLOCKS)
        self._queued: set[bytes] = set()
        self._pending: OrderedDict[str, Snapshot | _Delete] = OrderedDict()
        self._pending_bytes = 0
        self._writing: dict[str, Snapshot | _Delete] = {}  # by request: one write of a request at a time
        self._cond = threading.Condition()
        self._closing = threading.Event()
        metrics.storage_up.set(1)
        self._threads = [threading.Thread(target=self._run, name=f"berth-checkpoint-writer-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    # ---- the engine thread's side: none of these wait on the store
    def submit(self, snapshot: Snapshot) -> None:
        with self._cond:
            old = self._pending.get(snapshot.request_id)
            if isinstance(old, Snapshot):  # not written yet: the newer state takes its place, its blocks stay
                snapshot.blocks = {**old.blocks, **snapshot.blocks}
                snapshot.shared |= old.shared
                snapshot.taken = old.taken
                self._pending_bytes -= old.nbytes
                self.metrics.checkpoint_superseded.inc()
            else:
                self._pending.pop(snapshot.request_id, None)
            self._pending[snapshot.request_id] = snapshot
            self._pending_bytes += snapshot.nbytes
            self._queued.update(snapshot.blocks)
            self._cond.notify()

    def delete(self, request_id: str) -> None:
        """Remove a request's state, after any write of it already under way."""
        with self._cond:
            old = self._pending.pop(request_id, None)
            if isinstance(old, Snapshot):
                self._drop(old)
            self._pending[request_id] = _Delete(request_id)
            self._cond.notify()

    def knows(self, block_hash: bytes) -> bool:
        """The block is on the store or on its way there."""
        return block_hash in self._written or block_hash in self._queued

    def mark_written(self, block_hashes) -> None:
        """Blocks found on the store (read back when a request resumed)."""
        with self._cond:
            for h in block_hashes:
                self._written.add(h)

    def room(self) -> int:
        """Bytes of block data the queue can still take."""
        return self.max_pending_bytes - self._pending_bytes

    def lag_seconds(self) -> float:
        """How old the oldest progress not yet on the store is (0 when everything is written)."""
        with self._cond:
            taken = [item.taken for item in self._writing.values()]
            taken += [item.taken for item in itertools.islice(self._pending.values(), 1)]  # the oldest pending
            return time.monotonic() - min(taken) if taken else 0.0

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
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
    def _run(self) -> None:
        while self.up or self._wait_for_store():
            item = self._next()
            if item is None:
                return
            try:
                self._write(item)
            except StorageError as exc:
                self._went_down(exc)
            except Exception:  # noqa: BLE001 (a bug here must not stop checkpoints for good)
                log.exception("checkpoint of request %s failed", item.request_id)
                self.metrics.checkpoint_failures.inc()
            finally:
                with self._cond:
                    if isinstance(item, Snapshot):
                        self._queued.difference_update(item.blocks)
                    del self._writing[item.request_id]
                    self._cond.notify_all()

    def _next(self) -> Snapshot | _Delete | None:
        """The oldest pending item of a request no other thread is writing; None once closing."""
        with self._cond:
            while not self._closing.is_set():
                request_id = next((r for r in self._pending if r not in self._writing), None)
                if request_id is not None:
                    item = self._writing[request_id] = self._pending.pop(request_id)
                    if isinstance(item, Snapshot):
                        self._pending_bytes -= item.nbytes
                    return item
                self._cond.wait()
            return None

    def _write(self, item: Snapshot | _Delete) -> None:
        if isinstance(item, _Delete):
            self.store.delete(state_key(item.request_id))
            self.durable_tokens.pop(item.request_id, None)
            return
        for h, data in item.blocks.items():
            key = block_key(self.fingerprint, h)
            if h not in self._written and not (h in item.shared and self.store.exists(key)):
                raw = encode_block(data)
                self.store.put(key, raw)
                self.metrics.checkpoint_bytes.inc(len(raw))
                self.metrics.checkpoint_blocks.inc()
            with self._cond:
                self._written.add(h)
        checkpoint = item.checkpoint.keep_blocks(self._written)
        raw = checkpoint.to_json()
        self.store.put(state_key(item.request_id), raw)
        self.durable_tokens[item.request_id] = checkpoint.output_tokens
        self.metrics.checkpoint_bytes.inc(len(raw))
        self.metrics.checkpoint_states.inc()

    def _drop(self, snapshot: Snapshot) -> None:
        self._pending_bytes -= snapshot.nbytes
        self._queued.difference_update(snapshot.blocks)

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

"""Checkpoint uploads, on threads of their own beside the engine loop.

The engine thread hands in snapshots (``submit``) and never waits. A snapshot's two parts go
separately, so that a request's small state never waits behind anyone's KV data:

- States, on ``STATE_THREADS`` threads. The queue holds at most one state per request (a newer one
  replaces the one not yet written, keeping its place in line and the time of its oldest
  progress); a thread takes the oldest state of a request no other thread is writing, so a
  request's states are written in order. A state is trimmed to the blocks known written when it
  goes: it never names a block that is not on the store. One trimmed for blocks still queued or
  uploading is written again once they are through (unless a newer state of its request came
  meanwhile): when ``flush`` returns, every state names each of its blocks that got written, and a
  worker that saves its requests before stopping leaves the next nothing stored to recompute.
- KV blocks, on ``block_threads`` threads at the lowest CPU priority (on Linux), oldest first, each
  block once, at most ``max_pending_bytes`` of block data held (the engine side takes no new
  blocks past that). On a CPU worker they use the cycles the engine leaves idle: a block costs a
  resumed request nothing it could not recompute, and the engine's own threads are the throughput.
  The queued blocks of a request whose result is in are dropped unwritten.

So when the store or the CPU is slow the checkpoints fall behind the engine, never the reverse;
``lag_seconds`` says how far, ``pending_block_bytes`` how much KV waits. A failed write marks the
store down: the warning is logged once, the write dropped, and the threads probe the store with
backoff until it takes a write; meanwhile ``up`` is false, the engine side takes no snapshots,
and what was queued waits.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from storage import ObjectStore, StorageError
from worker.checkpoint.format import PROBE_KEY, RequestCheckpoint, block_key, encode_block, state_key
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.checkpoint")

STATE_THREADS = 4  # object stores answer each write after a round trip: several at once keep up
BLOCK_THREADS = 1  # Settings.checkpoint_kv_threads
MAX_REMEMBERED_BLOCKS = 200_000  # hashes of blocks known written; the oldest are forgotten past this
PROBE_BACKOFF = (1.0, 30.0)  # seconds between probes of a store that is down: first, most
THREAD_NAME = "berth-checkpoint-writer"  # every writer thread's name starts so


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


@dataclass
class _Block:
    data: torch.Tensor
    shared: bool  # another worker may have written it already: ask the store first
    request_id: str  # the request that brought it

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


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


def _lowest_cpu_priority() -> None:
    """Nice 19 for the calling thread alone (Linux schedules threads by their own nice value)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


class CheckpointWriter:
    def __init__(self, store: ObjectStore, fingerprint: str, metrics: WorkerMetrics, max_pending_bytes: int,
                 state_threads: int = STATE_THREADS, block_threads: int = BLOCK_THREADS):
        self.store = store
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self.up = True
        self.durable_tokens: dict[str, int] = {}  # request id -> output tokens in its state on the store
        self._written = _RecentSet(MAX_REMEMBERED_BLOCKS)
        self._states: OrderedDict[str, Snapshot | _Delete] = OrderedDict()
        self._writing: dict[str, Snapshot | _Delete] = {}  # by request: one state write of a request at a time
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # queued, oldest first
        self._uploading: dict[bytes, _Block] = {}
        # request id -> a state written short of some of its blocks: it, where its samples were cut
        # short, and the blocks it left out that are still queued or uploading
        self._awaiting: dict[str, tuple[Snapshot, set[bytes], set[bytes]]] = {}
        self._pending_bytes = 0  # block data queued or uploading
        self._cond = threading.Condition()
        self._closing = threading.Event()
        metrics.storage_up.set(1)
        self._threads = [threading.Thread(target=self._run_states, name=f"{THREAD_NAME}-state-{i}", daemon=True)
                         for i in range(state_threads)]
        self._threads += [threading.Thread(target=self._run_blocks, name=f"{THREAD_NAME}-kv-{i}", daemon=True)
                          for i in range(block_threads)]
        for t in self._threads:
            t.start()

    # ---- the engine thread's side: none of these wait on the store
    def submit(self, snapshot: Snapshot) -> None:
        with self._cond:
            for h, data in snapshot.blocks.items():
                if not self.knows(h):
                    block = self._blocks[h] = _Block(data, h in snapshot.shared, snapshot.request_id)
                    self._pending_bytes += block.nbytes
            snapshot.blocks, snapshot.shared = {}, set()  # the block queue holds them now
            self._awaiting.pop(snapshot.request_id, None)  # the newer state goes instead
            old = self._states.get(snapshot.request_id)
            if isinstance(old, Snapshot):  # not written yet: the newer state takes its place and time
                snapshot.taken = old.taken
                self.metrics.checkpoint_superseded.inc()
            else:
                self._states.pop(snapshot.request_id, None)
            self._states[snapshot.request_id] = snapshot
            self._cond.notify_all()

    def delete(self, request_id: str) -> None:
        """Remove a request's state, after any write of it already under way; drop its queued blocks."""
        with self._cond:
            self._states.pop(request_id, None)
            self._states[request_id] = _Delete(request_id)
            self._awaiting.pop(request_id, None)
            dropped = [h for h, b in self._blocks.items() if b.request_id == request_id]
            for h in dropped:
                self._pending_bytes -= self._blocks.pop(h).nbytes
            self._settled(dropped)
            self._cond.notify_all()

    def knows(self, block_hash: bytes) -> bool:
        """The block is on the store or on its way there."""
        return block_hash in self._written or block_hash in self._blocks or block_hash in self._uploading

    def mark_written(self, block_hashes) -> None:
        """Blocks found on the store (read back when a request resumed)."""
        with self._cond:
            for h in block_hashes:
                self._written.add(h)

    def room(self) -> int:
        """Bytes of block data the queue can still take."""
        return self.max_pending_bytes - self._pending_bytes

    @property
    def pending_block_bytes(self) -> int:
        return self._pending_bytes

    def lag_seconds(self) -> float:
        """How old the oldest progress not yet in a stored state is (0 when every state is written)."""
        with self._cond:
            taken = [item.taken for item in self._writing.values()]
            taken += [item.taken for item in itertools.islice(self._states.values(), 1)]  # the oldest pending
            return time.monotonic() - min(taken) if taken else 0.0

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._states or self._writing or self._blocks or self._uploading:
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
    def _run_states(self) -> None:
        self._run(self._take_state, self._write_state, self._state_done)

    def _run_blocks(self) -> None:
        _lowest_cpu_priority()
        self._run(self._take_block, self._write_block, self._block_done)

    def _run(self, take, write, done) -> None:
        """Until closing: ``take()`` an item (under the lock; None when there is none), ``write`` it,
        then ``done`` with it (under the lock)."""
        while self.up or self._wait_for_store():
            with self._cond:
                while not self._closing.is_set() and (item := take()) is None:
                    self._cond.wait()
            if self._closing.is_set():
                return
            try:
                write(item)
            except StorageError as exc:
                self._went_down(exc)
            except Exception:  # noqa: BLE001 (a bug here must not stop checkpoints for good)
                log.exception("checkpoint write failed")
                self.metrics.checkpoint_failures.inc()
            finally:
                with self._cond:
                    done(item)
                    self._cond.notify_all()

    def _take_state(self) -> Snapshot | _Delete | None:
        """The oldest pending state of a request no other thread is writing."""
        request_id = next((r for r in self._states if r not in self._writing), None)
        if request_id is None:
            return None
        self._writing[request_id] = self._states.pop(request_id)
        return self._writing[request_id]

    def _write_state(self, item: Snapshot | _Delete) -> None:
        if isinstance(item, _Delete):
            self.store.delete(state_key(item.request_id))
            self.durable_tokens.pop(item.request_id, None)
            return
        checkpoint = item.checkpoint.keep_blocks(self._written)
        raw = checkpoint.to_json()
        self.store.put(state_key(item.request_id), raw)
        self.durable_tokens[item.request_id] = checkpoint.output_tokens
        self.metrics.checkpoint_bytes.inc(len(raw))
        self.metrics.checkpoint_states.inc()
        with self._cond:
            self._await_blocks(item, checkpoint)

    def _await_blocks(self, item: Snapshot, written: RequestCheckpoint) -> None:
        """``written``, ``item``'s state trimmed, is stored: if it left blocks out, ``item`` goes again
        once those of them still queued or uploading are through (under the lock)."""
        if item.request_id in self._states:  # a newer state (or the delete) came during the write: it goes instead
            return
        stops, missing = set(), set()
        for full, kept in zip(item.checkpoint.samples, written.samples):
            cut = len(kept.block_hashes)
            if cut < len(full.block_hashes):
                stops.add(full.block_hashes[cut])
                missing.update(full.block_hashes[cut:])
        pending = {h for h in missing if h in self._blocks or h in self._uploading}
        if pending:
            self._awaiting[item.request_id] = (item, stops, pending)
        else:
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

    def _state_done(self, item: Snapshot | _Delete) -> None:
        del self._writing[item.request_id]

    def _take_block(self) -> bytes | None:
        """The hash of the oldest queued block."""
        if not self._blocks:
            return None
        h, block = self._blocks.popitem(last=False)
        self._uploading[h] = block
        return h

    def _write_block(self, h: bytes) -> None:
        block = self._uploading[h]
        key = block_key(self.fingerprint, h)
        if not (block.shared and self.store.exists(key)):
            raw = encode_block(block.data)
            self.store.put(key, raw)
            self.metrics.checkpoint_bytes.inc(len(raw))
            self.metrics.checkpoint_blocks.inc()
        with self._cond:
            self._written.add(h)

    def _block_done(self, h: bytes) -> None:
        self._pending_bytes -= self._uploading.pop(h).nbytes
        self._settled([h])

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

"""One prefix cache for the whole fleet: prompt prefixes' KV blocks shared through the object store.
A prefix requests found shared here is published as KV runs after the step; a new request's prompt is
looked up on the store before it is added, when reading beats computing, and the blocks found go into
the engine's prefix cache. Names chain from the tenant's cache salt. docs/engine.md says more."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from storage import ObjectNotFound, ObjectStore, StorageError
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.costs import TransferRates
from worker.checkpoint.format import RUN_BLOCKS, CorruptCheckpoint
from worker.checkpoint.kv_runs import KvRunReader, reads_faster
from worker.checkpoint.writer import KvRun
from worker.engine.engine import Engine
from worker.engine.kv_view import SharedPrefix
from worker.engine.request import Request
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.prefix_store")

THREADS = 2
REPUBLISH_SECONDS = 600.0  # a run published or loaded is offered again (one HEAD) no sooner than this
MAX_SEEN = 100_000  # runs remembered as published or loaded; the oldest are forgotten past this


@dataclass
class _Found:
    """What a lookup found: leading blocks of a prompt, after those the engine had."""

    block_hashes: list[bytes] = field(default_factory=list)
    data: torch.Tensor | None = None  # [layers, 2, len(block_hashes), block_size, kv_heads, head_dim]
    runs: dict[bytes, bytes] = field(default_factory=dict)  # block hash -> the run holding it


class PrefixStore:
    def __init__(self, engine: Engine, store: ObjectStore, checkpointer: Checkpointer, metrics: WorkerMetrics,
                 rates: TransferRates | None = None):
        """Writes through ``checkpointer``'s writer; ``rates``: by default the checkpointer's."""
        self.engine = engine
        self.store = store
        self.writer = checkpointer.writer
        self.metrics = metrics
        self.rates = rates or checkpointer.rates
        self.fingerprint = checkpointer.fingerprint
        self.block_bytes = checkpointer.block_bytes
        self.block_size = checkpointer.block_size
        self.runs = KvRunReader(engine.kv, store, self.fingerprint)
        self.loaded_blocks = 0  # put into the engine's prefix cache from the store
        self.published_runs = 0  # handed to the writer
        engine.kv.watch_shared_prefixes = True
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="berth-prefix")
        self._fetching: list[tuple[Request, Future]] = []
        self._reads: dict[bytes, Future] = {}  # run name -> its read, shared by the lookups under way
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # run name -> when last published or loaded

    @property
    def pending(self) -> int:
        return len(self._fetching)

    # ---- the engine thread
    def submit(self, request: Request) -> bool:
        """Look ``request``'s prompt up on the store in the background (``ready`` hands it back);
        False when there is nothing worth looking up: add it to the engine now."""
        hashes = self.engine.kv.prefix_block_hashes(request)
        have = self.engine.kv.cached_prefix_blocks(hashes)
        if len(hashes) < RUN_BLOCKS or not self.reads_blocks(len(hashes) - have):
            return False
        self._fetching.append((request, self._pool.submit(self._lookup, request.request_id, hashes, have)))
        return True

    def ready(self) -> list[Request]:
        """Requests whose lookup is over, their blocks found in the engine's prefix cache; call between steps."""
        done, fetching = [], []
        for item in self._fetching:
            (done if item[1].done() else fetching).append(item)
        self._fetching = fetching
        requests = []
        for request, future in done:
            try:
                found: _Found = future.result()
            except Exception:
                log.exception("request %s: looking its prompt up in the prefix store failed", request.request_id)
                found = _Found()
            if found.data is not None:
                loaded = self.engine.kv.load_blocks(found.block_hashes, found.data)
                self.loaded_blocks += loaded
                self.metrics.prefix_blocks.labels("loaded").inc(loaded)
                self.writer.mark_written(found.runs)  # on the store: no checkpoint writes them again
                for last in set(found.runs.values()):
                    self._saw(last)
            requests.append(request)
        if not self._fetching:
            with self._lock:  # what later lookups need is in the engine's cache now, or worth asking again
                self._reads = {k: f for k, f in self._reads.items() if not f.done()}
        return requests

    def after_step(self) -> None:
        """Offer the prefixes that requests shared in the last step to the other workers."""
        shared = self.engine.kv.take_shared_prefixes()
        if not shared or not self.writer.up:
            return
        chosen: list[tuple[list[bytes], list[int]]] = []
        room = self.writer.room()
        now = time.monotonic()
        for prefix in shared:
            for hashes, ids in self._windows(prefix):
                last = hashes[-1]
                seen = self._seen.get(last)
                if (seen is not None and now - seen < REPUBLISH_SECONDS) or len(hashes) * self.block_bytes > room:
                    continue
                self._saw(last, now)
                room -= len(hashes) * self.block_bytes
                chosen.append((hashes, ids))
        if not chosen:
            return
        data = self.engine.kv.read_blocks([b for _, ids in chosen for b in ids])
        runs, at = [], 0
        for hashes, _ in chosen:
            runs.append(KvRun(hashes, data[:, :, at:at + len(hashes)], shared=True))
            at += len(hashes)
        self.writer.publish(runs)
        self.published_runs += len(runs)
        self.metrics.prefix_blocks.labels("published").inc(sum(len(r.hashes) for r in runs))

    def _saw(self, last: bytes, now: float | None = None) -> None:
        self._seen[last] = time.monotonic() if now is None else now
        self._seen.move_to_end(last)
        if len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)

    def reads_blocks(self, num_blocks: int) -> bool:
        """Whether reading ``num_blocks`` blocks from the store is faster than computing them."""
        return reads_faster(self.rates, num_blocks, self.block_bytes, self.block_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _windows(self, prefix: SharedPrefix) -> list[tuple[list[bytes], list[int]]]:
        """The runs a lookup of this prefix would ask for: each full aligned window, and the window
        where the shared part ends (past the first: a lookup probes a last window only after a full one);
        none when reading them back would not beat computing them."""
        n = len(prefix.block_hashes)
        if n < RUN_BLOCKS or not self.reads_blocks(n):
            return []
        return [(prefix.block_hashes[s:min(s + RUN_BLOCKS, n)], prefix.block_ids[s:min(s + RUN_BLOCKS, n)])
                for s in range(0, n, RUN_BLOCKS)]

    # ---- the lookup threads
    def _lookup(self, rid: str, hashes: list[bytes], have: int) -> _Found:
        """The blocks of ``hashes`` after the first ``have`` that the store holds, from the start of the
        window holding block ``have``, until the first window not found."""
        found: dict[bytes, torch.Tensor] = {}
        runs: dict[bytes, bytes] = {}
        n = len(hashes)
        for start in range(have // RUN_BLOCKS * RUN_BLOCKS, n, RUN_BLOCKS):
            end = min(start + RUN_BLOCKS, n)
            # the window's own run; past the first window, where a shared prefix ended inside it (a run
            # named by one of its blocks: longest first, none that would add nothing to what the engine has)
            names = [j for j in range(end - 1, start - 1, -1) if j >= have] if start else [end - 1]
            got = None
            for j in names:
                got = self._read(rid, hashes[j])
                if got is not None:
                    break
            if got is None:
                break
            window = hashes[start:j + 1]
            if any(h not in got for h in window):
                log.warning("request %s: the prefix run %s does not hold the blocks its name says; they are "
                            "computed", rid, hashes[j].hex())
                break
            for h in window:
                found[h], runs[h] = got[h], hashes[j]
            if j < end - 1 or end - start < RUN_BLOCKS:
                break
        wanted = hashes[have:next((i for i in range(have, n) if hashes[i] not in found), n)]
        if not wanted:
            return _Found()
        log.info("request %s: %d of its prompt's KV blocks found in the prefix store", rid, len(wanted))
        return _Found(wanted, torch.stack([found[h] for h in wanted], dim=2), {h: runs[h] for h in wanted})

    def _read(self, rid: str, last: bytes) -> dict[bytes, torch.Tensor] | None:
        """The blocks of the run named ``last`` by hash (None: not on the store or unreadable); one GET
        for every lookup asking at the same time."""
        with self._lock:
            future = self._reads.get(last)
            mine = future is None
            if mine:
                future = self._reads[last] = Future()
        if mine:
            try:
                future.set_result(self._get(rid, last))
            except BaseException as exc:  # noqa: BLE001 (the waiting lookups get it too)
                future.set_exception(exc)
        return future.result()

    def _get(self, rid: str, last: bytes) -> dict[bytes, torch.Tensor] | None:
        t0 = time.perf_counter()
        try:
            run = self.runs.read(last)
        except ObjectNotFound:
            return None
        except (StorageError, CorruptCheckpoint) as exc:
            log.warning("request %s: the prefix run %s cannot be read (%s); its blocks are computed",
                        rid, last.hex(), exc)
            return None
        self.rates.observe_read(run.nbytes, time.perf_counter() - t0)
        return run.blocks()

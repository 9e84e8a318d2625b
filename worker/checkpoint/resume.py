"""Resuming a request from its checkpoint on whichever worker it is delivered to next: ``submit``
reads its state in the background, a state that does not apply is ignored (the request starts
over), and ``ready`` loads the KV blocks worth reading back and hands back the requests to add with
their generated tokens (``Request.resume_output_ids``). docs/engine.md says more."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from storage import ObjectNotFound, ObjectStore, StorageError
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.costs import TransferRates
from worker.checkpoint.format import CorruptCheckpoint, EngineLimits, RequestCheckpoint, StateRef
from worker.checkpoint.kv_runs import KvRunReader, reads_faster
from worker.engine.engine import Engine
from worker.engine.request import Request
from worker.metrics import WorkerMetrics

__all__ = ["Restorer", "TransferRates"]

log = logging.getLogger("berth.checkpoint")


@dataclass
class _Fetched:
    request: Request
    checkpoint: RequestCheckpoint | None = None  # None: start over
    block_hashes: list[bytes] = field(default_factory=list)  # read back, in the order of ``data``
    data: torch.Tensor | None = None  # [layers, 2, len(block_hashes), block_size, kv_heads, head_dim]
    bad_runs: set[bytes] = field(default_factory=set)  # runs it names that could not be read back


class Restorer:
    def __init__(self, engine: Engine, store: ObjectStore, checkpointer: Checkpointer, metrics: WorkerMetrics,
                 rates: TransferRates | None = None):
        """``rates``: by default the checkpointer's, measured by its steps and its writes."""
        self.engine = engine
        self.store = store
        self.checkpointer = checkpointer
        self.metrics = metrics
        self.rates = rates or checkpointer.rates
        self.fingerprint = checkpointer.fingerprint
        self.block_bytes = checkpointer.block_bytes
        self.block_size = checkpointer.block_size
        self.runs = KvRunReader(engine.kv, store, self.fingerprint)
        self.limits = EngineLimits(engine.model_config.vocab_size, engine.max_model_len, self.block_size,
                                   engine.long_rope_from)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="berth-restore")
        self._fetching: list[tuple[Request, Future]] = []

    @property
    def pending(self) -> int:
        return len(self._fetching)

    def submit(self, request: Request, ref: str) -> None:
        """Read ``request``'s checkpoint at ``ref`` (``str(StateRef)``) in the background; ``ready``
        hands the request back."""
        self._fetching.append((request, self._pool.submit(self._fetch, request, ref)))

    def ready(self) -> list[Request]:
        """Requests whose checkpoint is read (or absent), to add to the engine; call between steps."""
        done, fetching = [], []
        for item in self._fetching:  # done() asked once per future: one finishing meanwhile waits a turn
            (done if item[1].done() else fetching).append(item)
        self._fetching = fetching
        requests = []
        for request, future in done:
            try:
                fetched: _Fetched = future.result()
            except Exception:
                log.exception("request %s starts over: restoring its checkpoint failed", request.request_id)
                fetched = _Fetched(request)
            checkpoint = fetched.checkpoint
            if checkpoint is not None:
                if fetched.data is not None:
                    self.engine.kv.load_blocks(fetched.block_hashes, fetched.data)
                samples = sorted(checkpoint.samples, key=lambda s: s.index)
                fetched.request.resume_output_ids = [list(s.output_token_ids) for s in samples]
                self.checkpointer.resumed(checkpoint, fetched.bad_runs)
                self.metrics.restores.labels("loaded" if fetched.block_hashes else "recomputed").inc()
                self.metrics.restored_tokens.inc(checkpoint.output_tokens)
            requests.append(fetched.request)
        return requests

    def observe_step(self) -> None:
        """After a step (when the rates are the checkpointer's, its ``after_step`` measured it already)."""
        self.rates.observe_step(self.engine.stats)

    def estimate(self, num_blocks: int) -> tuple[float, float]:
        """Seconds to read ``num_blocks`` KV blocks back and to compute them again, at the rates measured so far."""
        return (self.rates.load_seconds(num_blocks, self.block_bytes),
                self.rates.recompute_seconds(num_blocks, self.block_size))

    def reads_blocks(self, num_blocks: int) -> bool:
        """Whether a request resuming with ``num_blocks`` KV blocks on the store gets them read back (True)
        or recomputed by prefill (False): the choice ``submit`` makes, asked without side effects."""
        return reads_faster(self.rates, num_blocks, self.block_bytes, self.block_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the fetching threads
    def _fetch(self, request: Request, ref: str) -> _Fetched:
        rid = request.request_id
        try:
            where = StateRef.parse(ref)
            checkpoint = RequestCheckpoint.from_json(self.store.get_range(where.key, where.offset, where.length))
        except ObjectNotFound:
            log.warning("request %s starts over: the segment of its checkpoint (%s) is gone", rid, ref)
            return _Fetched(request)
        except (StorageError, CorruptCheckpoint) as exc:
            log.warning("request %s starts over: its checkpoint cannot be read: %s", rid, exc)
            return _Fetched(request)
        reason = checkpoint.mismatch(request, self.fingerprint, self.limits)
        if reason:
            log.warning("request %s starts over: its checkpoint does not apply: %s", rid, reason)
            return _Fetched(request)
        hashes = checkpoint.block_hashes()
        load, recompute = self.estimate(len(hashes))
        read = self.reads_blocks(len(hashes))
        log.info("request %s resumes at %d generated tokens; its %d KV blocks: %s (%.3fs to read, %.3fs to compute)",
                 rid, checkpoint.output_tokens, len(hashes), "read" if read else "recomputed", load, recompute)
        if not read:
            return _Fetched(request, checkpoint)
        return _Fetched(request, checkpoint, *self._read_blocks(rid, hashes, checkpoint.kv_runs))

    def _read_blocks(self, rid: str, hashes: list[bytes],
                     runs: list[bytes]) -> tuple[list[bytes], torch.Tensor | None, set[bytes]]:
        """The blocks up to the first that cannot be read (the engine computes the rest): the runs
        are read in order until every block is found or one fails."""
        found: dict[bytes, torch.Tensor] = {}
        bad: set[bytes] = set()
        nbytes, t0 = 0, time.perf_counter()
        for last in runs:
            if all(h in found for h in hashes):
                break
            try:
                run = self.runs.read(last)
            except (ObjectNotFound, StorageError, CorruptCheckpoint) as exc:
                log.warning("request %s: the KV run %s cannot be read back (%s); the engine recomputes what it held",
                            rid, last.hex(), exc)
                bad.add(last)
                break
            nbytes += run.nbytes
            for i, h in enumerate(run.hashes):
                found.setdefault(h, run.data[:, :, i])
        self.rates.observe_read(nbytes, time.perf_counter() - t0)
        n = next((i for i, h in enumerate(hashes) if h not in found), len(hashes))
        if n < len(hashes) and n and runs:
            log.info("request %s: %d of its %d KV blocks read back, the engine computes the rest", rid, n, len(hashes))
        return hashes[:n], torch.stack([found[h] for h in hashes[:n]], dim=2) if n else None, bad

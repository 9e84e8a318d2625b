"""Checkpoints of running requests, taken in the engine thread between steps and written by the
``CheckpointWriter``'s threads, so that a request whose worker dies continues elsewhere.

After every step, a request is due when it has generated ``checkpoint_interval`` tokens since its
last snapshot, or ``checkpoint_seconds`` have passed with any progress. Its snapshot is its state
(tokens so far per sample) and a CPU copy of those of its full KV blocks that the store has not
got and that no earlier snapshot carries: one ``read_kv_blocks`` call per step for every due
request, each distinct block once. Blocks past the writer's byte budget are left for a later
snapshot; the state still goes.

Not checkpointed (they start over after a crash), because the engine cannot resume them exactly
yet: requests asking for logprobs (the engine does not take back the logprobs of restored tokens)
and requests with a finished sample among several (it would not know that sample had finished).
Their last checkpoint from before stays valid.

What is kept per request (its last snapshot's progress here, its tokens on the store in the
writer) is kept only for requests in the engine: ``finished`` and ``released`` drop it, and each
step drops what they missed (a request resumed but never added because it was dropped while its
checkpoint was read, a released request whose state was written after, a delete the store refused),
so a long-lived worker's bookkeeping is bounded by what it runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from storage import ObjectStore
from worker.checkpoint.format import RequestCheckpoint, SampleCheckpoint, request_digest
from worker.checkpoint.writer import CheckpointWriter, Snapshot
from worker.config import Settings
from worker.engine.engine import Engine, RequestState
from worker.engine.request import Request
from worker.metrics import WorkerMetrics


@dataclass
class _Progress:
    tokens: int  # output tokens at the last snapshot
    at: float  # its monotonic time


class Checkpointer:
    def __init__(self, engine: Engine, store: ObjectStore, settings: Settings, metrics: WorkerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.interval = settings.checkpoint_interval
        self.seconds = settings.checkpoint_seconds
        self.fingerprint = engine.fingerprint
        self.block_size = engine.settings.block_size
        kv = engine.kv_usage()
        self.block_bytes = kv["kv_bytes"] // kv["blocks_total"]
        self.writer = CheckpointWriter(store, self.fingerprint, metrics, settings.checkpoint_queue_bytes,
                                       block_threads=settings.checkpoint_kv_threads)
        self._progress: dict[str, _Progress] = {}

    @property
    def store_up(self) -> bool:
        """False while the store refuses writes (checkpoints paused)."""
        return self.writer.up

    # ---- the engine loop
    def after_step(self) -> None:
        """Snapshot the requests that are due (call between engine steps)."""
        now = time.monotonic()
        self._forget_ended()
        due = self._due(now, lambda tokens, last: tokens - last.tokens >= self.interval
                        or now - last.at >= self.seconds)
        self.metrics.checkpoint_lag_seconds.set(self.writer.lag_seconds())
        if due and self.writer.up:
            self._snapshot(due, now)

    def save_all(self, timeout: float) -> bool:
        """Before stopping: snapshot every running request with progress since its last snapshot, and
        wait up to ``timeout`` seconds for everything to be written (False if it was not)."""
        if not self.writer.up:
            return False
        now = time.monotonic()
        self._snapshot(self._due(now, lambda tokens, last: True), now)
        return self.writer.flush(timeout)

    def finished(self, request_id: str) -> None:
        """The request's result is committed (or it was dropped): delete its checkpoint."""
        self._progress.pop(request_id, None)
        self.writer.delete(request_id)

    def released(self, request_id: str) -> None:
        """The request left this worker unfinished: its checkpoint stays for the next one."""
        self._progress.pop(request_id, None)

    def resumed(self, checkpoint: RequestCheckpoint) -> None:
        """A request continues from ``checkpoint``: its tokens and blocks are on the store already."""
        self._progress[checkpoint.request_id] = _Progress(checkpoint.output_tokens, time.monotonic())
        self.writer.durable_tokens[checkpoint.request_id] = checkpoint.output_tokens
        self.writer.mark_written(checkpoint.block_hashes())

    def close(self, timeout: float = 5.0) -> None:
        self.writer.close(timeout)

    def _forget_ended(self) -> None:
        """Drop the bookkeeping of requests no longer in the engine (the writer's threads add to
        ``durable_tokens`` too: only single-key operations on it here)."""
        live = self.engine.requests
        for book in (self._progress, self.writer.durable_tokens):
            for request_id in [r for r in list(book) if r not in live]:
                book.pop(request_id, None)

    # ---- snapshots
    def _due(self, now: float, due) -> list[str]:
        """Requests with progress since their last snapshot for which ``due(tokens, last)`` holds
        (and, on the way, the gauge of tokens not yet on the store)."""
        found, behind = [], 0
        for request_id, request in self.engine.requests.items():
            tokens = sum(s.num_output_tokens for s in request.sequences)
            last = self._progress.setdefault(request_id, _Progress(0, now))
            behind += tokens - self.writer.durable_tokens.get(request_id, 0)
            if tokens > last.tokens and _resumable(request) and due(tokens, last):
                found.append(request_id)
        self.metrics.checkpoint_lag_tokens.set(behind)
        return found

    def _snapshot(self, request_ids: list[str], now: float) -> None:
        states = [s for s in map(self.engine.request_state, request_ids) if s is not None and s.samples]
        room = self.writer.room()
        new: dict[bytes, int] = {}  # blocks to copy out: hash -> block id, in chain order
        shared: set[bytes] = set()
        for state in states:
            prompt_blocks = len(state.prompt_token_ids) // self.block_size
            for sample in state.samples:
                for i, (h, block) in enumerate(zip(sample.block_hashes, sample.block_ids)):
                    if h in new or self.writer.knows(h):
                        continue
                    if room < self.block_bytes:
                        break
                    new[h] = block
                    room -= self.block_bytes
                    if i < prompt_blocks:
                        shared.add(h)
        data = self.engine.read_kv_blocks(list(new.values())) if new else None
        copies = {h: data[:, :, i] for i, h in enumerate(new)}
        saved_at = time.time()
        for state in states:
            checkpoint = self._checkpoint(state, saved_at)
            blocks = {h: copies.pop(h) for h in checkpoint.block_hashes() if h in copies}
            self.writer.submit(Snapshot(checkpoint, blocks, shared & blocks.keys(), now))
            self._progress[state.request_id] = _Progress(checkpoint.output_tokens, now)

    def _checkpoint(self, state: RequestState, saved_at: float) -> RequestCheckpoint:
        samples = [SampleCheckpoint(s.sample_index, s.output_token_ids, s.block_hashes) for s in state.samples]
        digest = request_digest(state.prompt_token_ids, state.params)
        return RequestCheckpoint(state.request_id, self.fingerprint, digest, len(state.prompt_token_ids), samples,
                                 saved_at, params=asdict(state.params))


def _resumable(request: Request) -> bool:
    return request.params.logprobs is None and not any(s.is_finished for s in request.sequences)

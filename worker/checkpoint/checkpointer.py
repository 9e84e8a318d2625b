"""Checkpoints of running requests, as rounds: every ``checkpoint_interval`` steps, no sooner than
``checkpoint_min_seconds`` after the last (or after ``checkpoint_seconds``), each running request with
progress is snapshotted between steps (its tokens, and the KV blocks worth writing, ``KvPolicy``, in
aligned runs named by their last block's hash), and the ``CheckpointWriter``'s threads store the
round as one segment. docs/engine.md says more."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from storage import ObjectStore
from worker.checkpoint.costs import KvPolicy, TransferRates
from worker.checkpoint.format import RUN_BLOCKS, RequestCheckpoint, SampleCheckpoint, request_digest, runs_holding
from worker.checkpoint.writer import CheckpointWriter, KvRun, Snapshot
from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.kv_view import RequestState
from worker.metrics import WorkerMetrics


@dataclass
class _Progress:
    tokens: int  # output tokens at the last snapshot
    at: float  # its monotonic time


@dataclass
class _Window:
    """A run to write: blocks ``start..end`` (inclusive) of one sample's chain."""

    hashes: list[bytes]
    block_ids: list[int]
    shared: bool
    new: int  # how many of its blocks the store has not got


class Checkpointer:
    def __init__(self, engine: Engine, store: ObjectStore, settings: Settings, metrics: WorkerMetrics,
                 on_durable: Callable[[dict[str, str]], None] | None = None, rates: TransferRates | None = None):
        """``on_durable``: where each request's latest state is, once stored (``CheckpointWriter``)."""
        self.engine = engine
        self.metrics = metrics
        self.interval = settings.checkpoint_interval
        self.seconds = settings.checkpoint_seconds
        self.min_seconds = settings.checkpoint_min_seconds
        self.policy = KvPolicy(settings.checkpoint_kv, settings.checkpoint_mtbf)
        self.rates = rates or TransferRates()
        self.fingerprint = engine.fingerprint
        self.block_size = engine.kv.block_size
        self.block_bytes = engine.kv.block_bytes
        self.writer = CheckpointWriter(store, self.fingerprint, metrics, settings.checkpoint_queue_bytes,
                                       block_threads=settings.checkpoint_kv_threads, on_durable=on_durable,
                                       rates=self.rates)
        self.rounds = 0  # rounds that snapshotted something
        self._progress: dict[str, _Progress] = {}
        self._described: dict[str, tuple[str, dict]] = {}  # request id -> its digest and parameters, once
        self._steps = 0  # since the last round
        self._round_at = time.monotonic()
        self._last_step: float | None = None
        # the lag gauges are read when scraped, not set every step: a step at a GPU's pace has no
        # time to walk every running request
        metrics.checkpoint_lag_tokens.set_function(self._lag_tokens)
        metrics.checkpoint_lag_seconds.set_function(self.writer.lag_seconds)

    @property
    def store_up(self) -> bool:
        """False while the store refuses writes (checkpoints paused)."""
        return self.writer.up

    # ---- the engine loop
    def after_step(self) -> None:
        """Count the step; on a round's step, snapshot every request with progress (call between steps)."""
        now = time.monotonic()
        if self._last_step is not None:
            self.rates.observe_step_time(now - self._last_step)
        self._last_step = now
        self.rates.observe_step(self.engine.stats)
        self._steps += 1
        since = now - self._round_at
        if (self._steps >= self.interval and since >= self.min_seconds) or since >= self.seconds:
            self._steps, self._round_at = 0, now
            self._forget_ended()
            with_progress = self._with_progress(now)
            if with_progress and self.writer.up:
                self._snapshot(with_progress, now)

    def save_all(self, timeout: float) -> bool:
        """Before stopping: snapshot every running request with progress since its last snapshot, and
        wait up to ``timeout`` seconds for everything to be written and recorded (False if it was not)."""
        if not self.writer.up:
            return False
        now = time.monotonic()
        self._snapshot(self._with_progress(now), now)
        return self.writer.flush(timeout)

    def finished(self, request_id: str) -> None:
        """The request's result is committed (or it was dropped): nothing more of it is written."""
        self._progress.pop(request_id, None)
        self._described.pop(request_id, None)
        self.writer.delete(request_id)

    def released(self, request_id: str) -> None:
        """The request left this worker unfinished: its checkpoint stays for the next one."""
        self._progress.pop(request_id, None)
        self._described.pop(request_id, None)

    def resumed(self, checkpoint: RequestCheckpoint, bad_runs: set[bytes] = frozenset()) -> None:
        """A request continues from ``checkpoint``: its tokens and runs are on the store already (but
        ``bad_runs``, found unreadable: their blocks are written again)."""
        self._progress[checkpoint.request_id] = _Progress(checkpoint.output_tokens, time.monotonic())
        self.writer.durable_tokens[checkpoint.request_id] = checkpoint.output_tokens
        held = runs_holding(checkpoint, RUN_BLOCKS)
        self.writer.mark_written({h: last for h, last in held.items() if last not in bad_runs})

    def close(self, timeout: float = 5.0) -> None:
        self.writer.close(timeout)

    def _forget_ended(self) -> None:
        """Drop the bookkeeping of requests no longer in the engine (the writer's threads add to
        ``durable_tokens`` too: only single-key operations on it here)."""
        holds = self.engine.kv.holds
        for book in (self._progress, self.writer.durable_tokens, self._described):
            for request_id in [r for r in list(book) if not holds(r)]:
                book.pop(request_id, None)

    # ---- snapshots
    def _with_progress(self, now: float) -> list[str]:
        """Requests with progress since their last snapshot that can be resumed."""
        found = []
        for request_id, tokens, resumable in self.engine.kv.progress():
            last = self._progress.setdefault(request_id, _Progress(0, now))
            if tokens > last.tokens and resumable:
                found.append(request_id)
        return found

    def _lag_tokens(self) -> float:
        """Tokens of running requests not yet in a recorded state (the scrape's thread reads the engine's
        requests while the loop changes them: a walk that meets a change is walked again)."""
        durable = self.writer.durable_tokens
        for _ in range(5):
            try:
                return float(sum(tokens - durable.get(rid, 0) for rid, tokens, _ in self.engine.kv.progress()))
            except RuntimeError:  # the loop added or removed a request during the walk
                continue
        return float("nan")

    def _snapshot(self, request_ids: list[str], now: float) -> None:
        states = [s for s in map(self.engine.kv.request_state, request_ids) if s is not None and s.samples]
        if not states:
            return
        room = self.writer.room()
        chosen: list[tuple[str, _Window]] = []
        planned: set[bytes] = set()  # last hashes of the runs chosen this round
        for state in states:
            windows = [w for w in self._windows(state) if w.hashes[-1] not in planned]
            if not windows:
                continue
            nbytes = sum(len(w.hashes) for w in windows) * self.block_bytes
            if nbytes > room or not self.policy.worth_writing(
                    self.rates, blocks=sum(w.new for w in windows), block_size=self.block_size,
                    block_bytes=self.block_bytes, written_blocks=nbytes // self.block_bytes,
                    objects=len(windows), remaining_steps=_remaining_steps(state)):
                continue
            room -= nbytes
            for w in windows:
                planned.add(w.hashes[-1])
                chosen.append((state.request_id, w))
        runs: dict[str, list[KvRun]] = {}
        if chosen:
            data = self.engine.kv.read_blocks([b for _, w in chosen for b in w.block_ids])
            at = 0
            for request_id, w in chosen:
                n = len(w.hashes)
                runs.setdefault(request_id, []).append(KvRun(w.hashes, data[:, :, at:at + n], w.shared))
                at += n
        saved_at = time.time()
        snapshots = []
        for state in states:
            checkpoint = self._checkpoint(state, saved_at)
            snapshots.append(Snapshot(checkpoint, runs.get(state.request_id, []), now))
            self._progress[state.request_id] = _Progress(checkpoint.output_tokens, now)
        self.writer.submit_round(snapshots)
        self.rounds += 1

    def _windows(self, state: RequestState) -> list[_Window]:
        """The runs that would give the store every block of ``state`` it lacks, in its samples' chain
        order: each aligned window of ``RUN_BLOCKS`` blocks with a block the store has not got, whole
        (from the window's first block), once the window is full or reaches the prompt's last full block."""
        prompt_blocks = len(state.prompt_token_ids) // self.block_size
        found: dict[bytes, _Window] = {}
        for sample in state.samples:
            hashes, ids = sample.block_hashes, sample.block_ids
            for start in range(0, len(hashes), RUN_BLOCKS):
                end = min(start + RUN_BLOCKS, len(hashes))  # exclusive
                if end - start < RUN_BLOCKS:  # the last window, not full yet
                    if not start < prompt_blocks <= end:
                        break  # generated blocks alone: they wait until the window fills
                    end = prompt_blocks  # the prompt's last full block ends a run of its own
                new = sum(not self.writer.knows(h) for h in hashes[start:end])
                if new and hashes[end - 1] not in found:
                    found[hashes[end - 1]] = _Window(hashes[start:end], ids[start:end], start < prompt_blocks, new)
        return list(found.values())

    def _checkpoint(self, state: RequestState, saved_at: float) -> RequestCheckpoint:
        samples = [SampleCheckpoint(s.sample_index, s.output_token_ids, s.block_hashes) for s in state.samples]
        described = self._described.get(state.request_id)
        if described is None:  # a request's prompt and parameters never change: hashed once, not every round
            described = self._described[state.request_id] = (request_digest(state.prompt_token_ids, state.params),
                                                              asdict(state.params))
        digest, params = described
        return RequestCheckpoint(state.request_id, self.fingerprint, digest, len(state.prompt_token_ids), samples,
                                 saved_at, params=params)


def _remaining_steps(state: RequestState) -> int:
    """Steps the request has at most left: its longest sample's tokens to go."""
    return max(state.params.max_tokens - len(s.output_token_ids) for s in state.samples)

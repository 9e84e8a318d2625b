"""Helpers of the checkpoint tests: a store the tests can slow down or take down, what the jobs
database keeps of checkpoints (each request's latest ref), and an engine loop that checkpoints as
the engine worker does."""

from __future__ import annotations

import random
import threading
from collections import Counter

from storage import ObjectStore, StorageError
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.format import KV_PREFIX, SEGMENT_PREFIX, RequestCheckpoint, StateRef
from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.request import Request, RequestOutput
from worker.metrics import WorkerMetrics


class ControlledStore(ObjectStore):
    """Another store behind stalled writes (``gate`` cleared: every put waits until it is set;
    ``kv_gate`` cleared: every put of a KV block), an outage (``down``), and a count of the writes of
    each key."""

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.url = inner.url
        self.gate = threading.Event()
        self.gate.set()
        self.kv_gate = threading.Event()
        self.kv_gate.set()
        self.down = False
        self.puts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise StorageError(f"{self.url}: connection refused (the test took the store down)")

    def put(self, key, data):
        self._check()
        self.gate.wait()
        if key.startswith(KV_PREFIX):
            self.kv_gate.wait()
        self.inner.put(key, data)
        with self._lock:
            self.puts[key] += 1

    def writer(self, key):
        self._check()
        return self.inner.writer(key)

    def get(self, key):
        self._check()
        return self.inner.get(key)

    def get_range(self, key, start, length):
        self._check()
        return self.inner.get_range(key, start, length)

    def open(self, key):
        self._check()
        return self.inner.open(key)

    def exists(self, key):
        self._check()
        return self.inner.exists(key)

    def list(self, prefix):
        self._check()
        return self.inner.list(prefix)

    def delete(self, key):
        self._check()
        self.inner.delete(key)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids: the tiny model's weights are random too, so text would mean nothing to it."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 5000) for _ in range(n)] for n in lengths]


def tiny_engine(loaded, **overrides) -> Engine:
    return Engine(loaded=loaded, **{"kv_memory": "16MiB", "block_size": 16, "threads": 1, **overrides})


class Pointers(dict):
    """What the jobs database keeps of checkpoints, for tests without one: request id -> the ref of its
    latest recorded state. Called by the writer as ``on_durable``."""

    def __call__(self, refs: dict[str, str]) -> None:
        self.update(refs)


def read_state(store: ObjectStore, ref: str) -> RequestCheckpoint:
    where = StateRef.parse(ref)
    return RequestCheckpoint.from_json(store.get_range(where.key, where.offset, where.length))


def stored_states(store: ObjectStore, pointers: dict[str, str]) -> dict[str, RequestCheckpoint]:
    """Each request's latest recorded state, by request id."""
    return {rid: read_state(store, ref) for rid, ref in dict(pointers).items()}


def segment_puts(store: ControlledStore) -> int:
    return sum(n for k, n in store.puts.items() if k.startswith(SEGMENT_PREFIX))


def kv_puts(store: ControlledStore) -> int:
    return sum(n for k, n in store.puts.items() if k.startswith(KV_PREFIX))


def checkpointer(engine: Engine, store: ObjectStore, pointers: Pointers | None = None, **settings) -> Checkpointer:
    """A checkpointer every 8 tokens however fast the steps (``settings`` override), its refs recorded
    in ``cp.pointers``."""
    pointers = Pointers() if pointers is None else pointers
    cp = Checkpointer(engine, store, Settings(**{"checkpoint_interval": 8, "checkpoint_min_seconds": 0, **settings}),
                      WorkerMetrics(),
                      on_durable=pointers)
    cp.pointers = pointers
    return cp


def run_steps(engine: Engine, checkpoints: Checkpointer | None, requests: list[Request] = (),
              until=lambda: False) -> dict[str, RequestOutput]:
    """Add ``requests``, step with checkpoints after each step until nothing is left or ``until()``."""
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished() and not until():
        for out in engine.step():
            done[out.request_id] = out
        if checkpoints is not None:
            checkpoints.after_step()
    return done


def tokens(outputs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    return {rid: [c.token_ids for c in out.completions] for rid, out in outputs.items()}

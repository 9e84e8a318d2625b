"""The engine worker's one interface to the object store, as vLLM's KV connector is its engine's: request
states and KV blocks written as requests run (``Checkpointer``), a redelivered request read back from where
its row says (``Restorer``), and prompt prefixes shared by the fleet (``PrefixStore``). The loop asks
whether a request starts now or is being read, and takes what has been read between steps."""

from __future__ import annotations

from collections.abc import Callable

from storage import open_store
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.prefix_store import PrefixStore
from worker.checkpoint.resume import Restorer
from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.request import Request
from worker.metrics import WorkerMetrics


class _NoPrefixes:
    """No prompt prefixes shared through the store (``Settings.prefix_store`` off)."""

    pending = 0

    def submit(self, request: Request) -> bool:
        return False

    def ready(self) -> list[Request]:
        return []

    def after_step(self) -> None:
        pass

    def close(self) -> None:
        pass


class StoreConnector:
    def __init__(self, checkpointer: Checkpointer, restorer: Restorer, prefixes: PrefixStore | None = None):
        self.checkpointer, self.restorer = checkpointer, restorer
        self.prefixes: PrefixStore | _NoPrefixes = prefixes or _NoPrefixes()

    @classmethod
    def open(cls, engine: Engine, settings: Settings, metrics: WorkerMetrics,
             on_durable: Callable) -> StoreConnector:
        """The three parts over the store at ``settings.storage_url``; ``on_durable`` is the checkpointer's
        (called with the requests whose state is stored)."""
        store = open_store(settings.storage_url)
        checkpointer = Checkpointer(engine, store, settings, metrics, on_durable=on_durable)
        prefixes = PrefixStore(engine, store, checkpointer, metrics) if settings.prefix_store_on() else None
        return cls(checkpointer, Restorer(engine, store, checkpointer, metrics), prefixes)

    def begin(self, request: Request, checkpoint: str | None) -> bool:
        """True while ``request`` is read from the store (its checkpoint at ``checkpoint``, or its prompt's
        prefix): ``ready`` hands it over later. False: add it to the engine now (also while the store is down)."""
        if not self.checkpointer.store_up:
            return False
        if checkpoint:
            self.restorer.submit(request, checkpoint)
            return True
        return self.prefixes.submit(request)

    @property
    def reading(self) -> bool:
        """Requests are being read from the store: checkpoints to resume, or prompt prefixes."""
        return self.restorer.pending > 0 or self.prefixes.pending > 0

    def ready(self) -> list[Request]:
        """The requests read since the last call, to add to the engine; call between steps."""
        return self.restorer.ready() + self.prefixes.ready()

    def after_step(self) -> None:
        self.checkpointer.after_step()
        self.restorer.observe_step()
        self.prefixes.after_step()

    def finished(self, request_id: str) -> None:
        self.checkpointer.finished(request_id)

    def released(self, request_id: str) -> None:
        self.checkpointer.released(request_id)

    def save_all(self, timeout: float) -> None:
        """The running requests' states stored, for another worker to resume (a graceful stop)."""
        self.checkpointer.save_all(timeout)

    def close(self, timeout: float) -> None:
        self.restorer.close()
        self.prefixes.close()
        self.checkpointer.close(timeout)

"""The engine worker's optional parts when a worker has none (null objects): no object store (no
checkpoints, restores or shared prefixes), no live callers' inbox, no interactive queue. Each does nothing, so the
loop calls its parts the same way whichever it has; ``EngineWorker.__init__`` is the one place that
decides which it has."""

from __future__ import annotations

import time

from worker.engine.engine import Engine
from worker.engine.request import Request, RequestOutput


class NoStore:
    """No object store: nothing checkpointed, restored or shared; every request starts now."""

    def begin(self, request: Request, checkpoint: str | None) -> bool:
        return False

    reading = False

    def ready(self) -> list[Request]:
        return []

    def after_step(self) -> None:
        pass

    def finished(self, request_id: str) -> None:
        pass

    def released(self, request_id: str) -> None:
        pass

    def save_all(self, timeout: float) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


class NoInbox:
    """No live callers' requests in this process: waiting is sleeping."""

    def attach(self, engine: Engine) -> None:
        pass

    def pending(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)

    def admit(self) -> None:
        pass

    def after_step(self, outputs: list[RequestOutput]) -> None:
        pass

    def fail_all(self, reason: str, close: bool = False) -> None:
        pass

    def close(self, reason: str) -> None:
        pass


class NoRemote:
    """The model's interactive queue not consumed here."""

    def admit(self) -> None:
        pass

    def keepalive(self) -> None:
        pass

    def hand_back(self) -> None:
        pass

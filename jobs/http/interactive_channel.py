"""``InteractiveChannel``: the seam between ``berth serve``'s chat and completions routes and an engine.
``open`` takes a validated request and returns a ``Subscription`` of its events (text deltas, then
``Done`` or ``Failed``) on the server's event loop, with ``abort`` for a caller that left.
``EmbeddedChannel`` runs it in this server's engine worker; ``BrokerChannel``
(``jobs.http.interactive_channel_broker``) through RabbitMQ (docs/http-api.md).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from jobs.lines.line_error import BatchLine
from jobs.lines.validate import ModelInfo
from worker.config import Settings
from worker.consumer.interactive_inbox import Done, Event, Failed, InteractiveInbox
from worker.engine.request import Request


class Subscription:
    """One request's events, read on the event loop that opened it."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort):
        self.request_id = request_id
        self._queue, self._abort = queue, abort
        self.over = False  # its last event was read, or it was aborted

    async def next(self) -> list[Event]:
        """The next events (one step's); the last holds ``Done`` or ``Failed``."""
        events = await self._queue.get()
        if any(isinstance(e, (Done, Failed)) for e in events):
            self.over = True
        return events

    def abort(self) -> None:
        """Drop the request in the engine (its KV blocks freed before the next step); nothing when it is over."""
        if not self.over:
            self.over = True
            self._abort(self.request_id)


class InteractiveChannel(Protocol):
    def model(self) -> ModelInfo | None:
        """What requests are checked against, when the channel knows its engine's (None: the settings')."""

    def ready(self) -> bool:
        """Whether an engine takes requests now."""

    def open(self, request: Request, line: BatchLine) -> Subscription:
        """Start ``request`` (made from ``line``: the body as the caller sent it, without the stream
        fields); its events come to the running event loop."""


class EmbeddedChannel:
    """Requests to the engine worker in this process (``jobs.http.server`` gives ``inbox`` to it)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.inbox = InteractiveInbox()
        self._model_info: ModelInfo | None = None

    def ready(self) -> bool:
        return self.inbox.engine is not None

    def model(self) -> ModelInfo | None:
        return self._model() if self.inbox.engine is not None else None

    def _model(self) -> ModelInfo:  # the engine's tokenizer: no second copy
        if self._model_info is None:
            self._model_info = ModelInfo.of_engine(self.inbox.engine, self.settings)
        return self._model_info

    def open(self, request: Request, line: BatchLine | None = None) -> Subscription:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(events: list[Event]) -> None:  # on the engine's thread; raises once the loop is closed
            loop.call_soon_threadsafe(queue.put_nowait, events)

        self.inbox.submit(request, sink)
        return Subscription(request.request_id, queue, self.inbox.abort)

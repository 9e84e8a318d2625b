"""``InteractiveChannel``: the seam between ``berth serve``'s chat and completions routes and an engine.
``open`` takes a validated request and returns a ``Subscription`` of its events (text deltas, then
``Done`` or ``Failed``) on the server's event loop, with ``abort`` for a caller that left.
``EmbeddedChannel`` runs it in this server's engine worker; ``BrokerChannel``
(``jobs.http.interactive_channel_broker``) through RabbitMQ (docs/http-api.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from jobs.lines.line_error import BatchLine
from jobs.lines.validate import ModelInfo
from worker.config import Settings
from worker.consumer.interactive_inbox import Delta, Done, Event, Failed, InteractiveInbox
from worker.engine.request import Request

log = logging.getLogger("berth.http")


MAX_UNREAD = 65_536  # tokens and logprobs entries of one answer made and not yet read by its caller, at most
SLOW_READER = "slow_reader"  # Failed's code for a caller that read too slowly


class Subscription:
    """One request's events, read on the event loop that opened it; the engine's thread hands them over
    with ``put`` (through ``call_soon_threadsafe``). What its caller has not read is bounded
    (``MAX_UNREAD``): past it, the request is aborted and its caller told so."""

    def __init__(self, request_id: str, abort):
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self._abort = abort
        self._unread = 0  # of MAX_UNREAD, in the queue
        self._aborted = False
        self.over = False  # its last event was read, or it was aborted

    def put(self, events: list[Event]) -> None:
        """Hand on one step's events (on the event loop's thread)."""
        if self._aborted:
            return
        weight = sum(_weight(e) for e in events)
        if self._unread and self._unread + weight > MAX_UNREAD:
            log.warning("interactive request %s: its caller left over %d tokens and logprobs entries unread: "
                        "aborted (a slow reader)", self.request_id, MAX_UNREAD)
            while not self._queue.empty():
                self._queue.get_nowait()
            self._unread = 0
            self._stop()
            events, weight = [Failed(f"the caller read the answer too slowly: over {MAX_UNREAD} tokens and "
                                     "logprobs entries made were not read, so the request was aborted", SLOW_READER)], 0
        self._unread += weight
        self._queue.put_nowait((events, weight))

    async def next(self) -> list[Event]:
        """The events not read yet (one step's at least); the last holds ``Done`` or ``Failed``."""
        events, weight = await self._queue.get()
        events = list(events)
        while not self._queue.empty():
            more, more_weight = self._queue.get_nowait()
            events += more
            weight += more_weight
        self._unread -= weight
        if any(isinstance(e, (Done, Failed)) for e in events):
            self.over = True
        return events

    def abort(self) -> None:
        """Drop the request in the engine (its KV blocks freed before the next step); nothing when it is over."""
        if not self.over:
            self.over = True
            self._stop()

    def _stop(self) -> None:
        if not self._aborted:
            self._aborted = True
            self._abort(self.request_id)


def _weight(event: Event) -> int:
    if not isinstance(event, Delta):
        return 0
    return max(1, len(event.token_ids)) + sum(1 + len(e.get("top") or ()) for e in event.logprobs or ())


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
        self._info: ModelInfo | None = None

    def ready(self) -> bool:
        return self.inbox.engine is not None

    def model(self) -> ModelInfo | None:
        return self._model() if self.inbox.engine is not None else None

    def _model(self) -> ModelInfo:  # the engine's tokenizer: no second copy
        if self._info is None:
            self._info = ModelInfo.of_engine(self.inbox.engine, self.settings)
        return self._info

    def open(self, request: Request, line: BatchLine | None = None) -> Subscription:
        loop = asyncio.get_running_loop()
        subscription = Subscription(request.request_id, self.inbox.abort)

        def sink(events: list[Event]) -> None:  # on the engine's thread; raises once the loop is closed
            loop.call_soon_threadsafe(subscription.put, events)

        self.inbox.submit(request, sink)
        return subscription

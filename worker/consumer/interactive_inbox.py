"""Interactive requests in the engine worker's loop: a live caller's request in, its text out a step at a time.

The worker side of the seam ``jobs.http.interactive_channel.InteractiveChannel``: whoever accepted a request
(the HTTP door, having checked it as a batch line is checked) hands it to ``InteractiveInbox.submit``
with a ``sink``, and the loop (``worker.consumer.loop``) does the rest on its own thread:

1. ``admit``, each iteration before the step: the requests submitted since are added to the engine
   marked ``Request.interactive`` (the scheduler serves them ahead of batch work, preempting a batch
   sequence for one when it must), and the requests whose callers left are aborted, which frees
   their KV blocks before the step;
2. ``after_step``, after each step: each live request's new text (``worker.engine.text_delta``: whole
   characters only, nothing a stop string would cut) goes to its sink as ``Delta``s, and a finished
   one's ``RequestOutput`` as ``Done`` (what a batch result is built from), or ``Failed`` with a reason.

A sink is called on the engine's thread and must not block: the embedded channel hands events to the
HTTP server's event loop with ``call_soon_threadsafe``. A sink that raises (its caller is gone) has
its request aborted. Interactive requests are never written to the jobs database and never
checkpointed: the caller holds the only claim to them, and a worker that dies loses them.

On the embedded defaults the HTTP server and this loop share a process, and a sink is a closure.
With RabbitMQ (``worker.consumer.interactive_queue``), ``submit`` is fed by a consumer of the model's interactive queue
(``<prefix>.interactive.<model>``, its own prefetch: the worker's interactive capacity), each message
checked as the request queue's are; the sink publishes each batch of events to the message's
``reply_to`` (RabbitMQ's direct reply-to) with its ``correlation_id``; an abort arrives as a message
naming the request; and the message is acked once its first event went out, so that a worker dying
before any token lets the broker give it to another worker, and one dying after ends the stream
with an error event on the server's side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.request import Request, RequestOutput
from worker.engine.text_delta import TextDelta

if TYPE_CHECKING:  # torch: imported by the loop's engine, not by the HTTP door that imports the events
    from worker.engine.engine import Engine

log = logging.getLogger("berth.worker")


@dataclass(frozen=True)
class Delta:
    """New text of one sample (``index``), the tokens it came from, their logprobs entries (when asked),
    and, on its last delta, why the sample ended."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[dict, ...] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Done:
    """The request finished: what a batch result's body is built from (``jobs.lines.batch_format``)."""

    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    """The request ended without a result: refused by the engine, failed in a step, or the worker stopping."""

    reason: str
    code: str = "server_error"


Event = Delta | Done | Failed
Sink = Callable[[list[Event]], None]  # called on the engine's thread, must not block


@dataclass
class _Live:
    request: Request
    sink: Sink
    streams: dict[int, TextDelta] = field(default_factory=dict)  # per sample
    ended: set[int] = field(default_factory=set)  # samples whose last delta went out


class InteractiveInbox:
    """Thread-safe: ``submit`` and ``abort`` from any thread; the rest from the loop's thread only."""

    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._submitted: list[_Live] = []
        self._aborted: list[str] = []
        self._closed: str | None = None
        self.live: dict[str, _Live] = {}  # in the engine (the loop's thread only)
        self.engine: Engine | None = None  # set by the loop that drains this inbox

    # ---- any thread
    def submit(self, request: Request, sink: Sink) -> None:
        """Queue ``request`` for the engine; its events go to ``sink``. Refused with ``Failed`` (through the
        sink) when the worker is stopping."""
        request.interactive = True
        request.arrival_time = time.perf_counter()  # its time to first token counts from here
        with self._lock:
            closed = self._closed
            if closed is None:
                self._submitted.append(_Live(request, sink))
        if closed is not None:
            sink([Failed(closed, "server_unavailable")])
            return
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """The caller has gone: drop the request before the next step (its KV blocks freed)."""
        with self._lock:
            self._aborted.append(request_id)
        self._wake.set()

    # ---- the loop's thread
    def attach(self, engine: Engine) -> None:
        self.engine = engine
        with self._lock:
            self._closed = None

    def pending(self) -> bool:
        return bool(self._submitted or self._aborted)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a request or an abort (the loop when idle)."""
        if self._wake.wait(timeout):
            self._wake.clear()

    def admit(self) -> None:
        from worker.engine.engine import RequestRejected

        with self._lock:
            submitted, self._submitted = self._submitted, []
            aborted, self._aborted = self._aborted, []
        for request_id in aborted:
            live = self.live.pop(request_id, None)
            if live is not None:
                self.engine.abort(request_id)
            else:  # not yet admitted: drop it from what was just taken
                submitted = [s for s in submitted if s.request.request_id != request_id]
        for live in submitted:
            request = live.request
            try:
                self.engine.add_request(request)
            except RequestRejected as exc:
                self._send(live, [Failed(str(exc), "request_rejected")])
                continue
            except Exception as exc:
                log.exception("interactive request %s could not be admitted", request.request_id)
                self._send(live, [Failed(f"{type(exc).__name__}: {exc}")])
                continue
            self.live[request.request_id] = live

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Give each live request's new text to its sink; a finished one's output too."""
        if not self.live:
            return
        finished = {o.request_id: o for o in outputs if o.request_id in self.live}
        for request_id, live in list(self.live.items()):
            output = finished.get(request_id)
            if output is not None:
                del self.live[request_id]
                self._send(live, self._last_events(live, output))
            elif request_id in self.engine.requests:
                events = self._deltas(live)
                if events:
                    self._send(live, events)
            else:  # taken out of the engine by someone else
                del self.live[request_id]
                self._send(live, [Failed("the request was dropped by the engine")])

    def fail_all(self, reason: str, close: bool = False) -> None:
        """End every live and queued request with ``reason`` (a step failed for all, the worker stopping);
        ``close``: refuse new ones from now on."""
        with self._lock:
            submitted, self._submitted, self._aborted = self._submitted, [], []
            if close:
                self._closed = reason
        for live in [*self.live.values(), *submitted]:
            if self.engine is not None:
                self.engine.abort(live.request.request_id)
            self._send(live, [Failed(reason, "server_unavailable")])
        self.live.clear()

    def close(self, reason: str) -> None:
        """Refuse new requests (the worker is draining); those running go on."""
        with self._lock:
            self._closed = reason
            submitted, self._submitted = self._submitted, []
        for live in submitted:
            self._send(live, [Failed(reason, "server_unavailable")])

    # ---- events
    def _deltas(self, live: _Live) -> list[Event]:
        events = []
        for seq in live.request.sequences:
            i = seq.sample_index
            if i in live.ended:
                continue
            stream = self._stream(live, i)
            seen = stream.tokens
            if seq.finish_reason is not None:  # one sample of several ended
                live.ended.add(i)
                text = stream.finish(self.engine.final_text(seq))
                events.append(Delta(i, text, tuple(seq.output_token_ids[seen:]), self._logprobs(live, seq, seen),
                                    seq.finish_reason))
            elif len(seq.output_token_ids) > seen:  # the tokens the host has read (one may be in flight)
                text = stream.advance(seq.output_token_ids)
                events.append(Delta(i, text, tuple(seq.output_token_ids[seen:]), self._logprobs(live, seq, seen)))
        return events

    def _last_events(self, live: _Live, output: RequestOutput) -> list[Event]:
        if output.error is not None:
            return [Failed(output.error, "request_rejected" if output.rejected else "server_error")]
        events: list[Event] = []
        for c in output.completions:
            if c.index in live.ended:
                continue
            stream = self._stream(live, c.index)
            seen = stream.tokens
            logprobs = tuple(c.logprobs[seen:]) if c.logprobs is not None else None
            events.append(Delta(c.index, stream.finish(c.text), tuple(c.token_ids[seen:]), logprobs,
                                c.finish_reason))
        events.append(Done(output))
        return events

    def _stream(self, live: _Live, index: int) -> TextDelta:
        stream = live.streams.get(index)
        if stream is None:
            stream = live.streams[index] = TextDelta(self.engine.tokenizer, live.request.params.stop)
        return stream

    @staticmethod
    def _logprobs(live: _Live, seq, seen: int) -> tuple[dict, ...] | None:
        return tuple(seq.logprobs[seen:]) if live.request.params.logprobs is not None else None

    def _send(self, live: _Live, events: list[Event]) -> None:
        try:
            live.sink(events)
        except Exception:  # noqa: BLE001 (its caller is gone: nobody reads the rest)
            log.info("interactive request %s: its caller is gone; aborting it", live.request.request_id)
            if self.live.pop(live.request.request_id, None) is not None:
                self.engine.abort(live.request.request_id)

"""An ``InteractiveChannel`` without an engine whose requests run until the test ends them, a clock the
test moves, and ``berth serve``'s app over them on uvicorn: a request stays live exactly as long as a
test of the interactive limits needs, with no engine's timing in it."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from jobs.http.app import create_app
from jobs.http.interactive_channel import Subscription
from jobs.http.interactive_limits import InteractiveLimiter
from tests.support.processes import free_port
from worker.consumer.interactive_inbox import Delta, Done
from worker.engine.request import Completion, RequestOutput

FIRST_TOKEN = 100  # the token every request's first event carries


class FakeClock:
    """Seconds that pass only when the test says (``advance``)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Open:
    loop: asyncio.AbstractEventLoop
    subscription: Subscription
    prompt: list[int]


class HeldChannel:
    """Each request opened gets one token at once (so a stream starts) and then runs until ``finish``;
    ``aborted`` lists those whose callers left."""

    def __init__(self):
        self.open_requests: dict[str, _Open] = {}
        self.aborted: list[str] = []
        self._lock = threading.Lock()

    def model(self):
        return None  # the app checks bodies against its settings' model

    def ready(self) -> bool:
        return True

    def open(self, request, line=None) -> Subscription:
        loop = asyncio.get_running_loop()
        subscription = Subscription(request.request_id, self._abort)
        with self._lock:
            self.open_requests[request.request_id] = _Open(loop, subscription, list(request.prompt_token_ids))
        subscription.put([Delta(0, "a", (FIRST_TOKEN,))])
        return subscription

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if self.open_requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self.open_requests)

    def finish(self, request_id: str, more_tokens: int = 0) -> None:
        """End the request after ``more_tokens`` more: it used its prompt and 1 + ``more_tokens`` tokens."""
        with self._lock:
            held = self.open_requests.pop(request_id)
        ids = [FIRST_TOKEN] * (1 + more_tokens)
        output = RequestOutput(request_id, held.prompt, [Completion(0, ids, "a" * len(ids), "length")])
        events = [Delta(0, "a" * more_tokens, tuple(ids[1:]), None, "length"), Done(output)]
        held.loop.call_soon_threadsafe(held.subscription.put, events)


def wait_until(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.01)
    return found


@contextmanager
def serving_app(settings, channel: HeldChannel, clock: FakeClock | None = None):
    """``berth serve``'s app over ``channel`` (limits counted on ``clock``) on uvicorn on a thread; yields
    its base URL and the app."""
    app = create_app(settings, channel=channel, limiter=InteractiveLimiter(clock or time.monotonic))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "the server started")
        assert thread.is_alive(), "the server did not start"
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)

"""``berth serve``: the HTTP API under uvicorn. With no broker it also runs an engine worker (and the
housekeeping chores) on a thread, which answers chat and completions too; with a broker it only
serves, and reaches the engine workers through RabbitMQ.

The tenants' interactive limits and their use (``worker.metrics.InteractiveLimitMetrics``) and the jobs
table's figures (``jobs.http.jobs_metrics``: jobs by state, live jobs' deadlines, webhooks waiting) are on
the engine worker's metrics page in the first case, on a page of the server's own on ``metrics_port`` in
the second.

    with Server(settings, port=0).running() as server:   # tests: uvicorn on a thread, a free port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key)
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from prometheus_client import CollectorRegistry, start_http_server

from jobs.http.app import create_app
from jobs.http.background import Tasks
from jobs.http.interactive_channel import EmbeddedChannel
from jobs.http.interactive_channel_broker import BrokerChannel
from jobs.http.interactive_limits import LIVE_REQUESTS, TOKENS_PER_MINUTE
from jobs.http.jobs_metrics import JobsMetrics
from worker.config import Settings
from worker.messaging.topology import is_embedded
from worker.metrics import InteractiveLimitMetrics

log = logging.getLogger("berth.serve")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
START_TIMEOUT = 30.0


class Server:
    def __init__(self, settings: Settings, host: str = "127.0.0.1", port: int = 8000, open_access: bool = False,
                 worker: bool | None = None, engine=None, log_level: str = "info"):
        """``worker``: run an engine worker in this process (default: on the embedded queue);
        ``engine``: the engine it runs (default: one loaded from ``settings``)."""
        if open_access and host not in LOOPBACK:
            raise ValueError(f"--open serves without API keys, so only on this machine: use --host 127.0.0.1, not "
                             f"{host}, or create keys with `berth key create --tenant NAME`")
        self.settings, self.host, self.open_access = settings, host, open_access
        self.port = port or _free_port(host)
        self.tasks = Tasks(settings)
        self.run_worker = is_embedded(settings) if worker is None else worker
        # chat and completions: in this server's engine worker, or the engine workers' through RabbitMQ
        self.channel: EmbeddedChannel | BrokerChannel | None = None
        if self.run_worker:
            self.channel = EmbeddedChannel(settings)
        elif not is_embedded(settings):
            self.channel = BrokerChannel(settings)
        self.app = create_app(settings, open_access=open_access, tasks=self.tasks, listen_host=host,
                              channel=self.channel)
        limiter = self.app.state.limiter
        self.limit_metrics = InteractiveLimitMetrics(limiter.tenants, limiter.refusals,
                                                     (LIVE_REQUESTS, TOKENS_PER_MINUTE))
        self.jobs_metrics = JobsMetrics(settings.database_url)
        self._metrics_page = None
        self._engine = engine
        self._stop = threading.Event()
        self._worker_thread: threading.Thread | None = None
        self._server = _Uvicorn(uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level,
                                                     lifespan="off"))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM, then stop the worker (a second signal: at once) and return."""
        def stop(*_) -> None:
            if self._server.should_exit:
                self._server.force_exit = True
            self._server.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._start_worker()
        try:
            self._server.run()
        finally:
            self._stop_worker()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextmanager
    def running(self) -> Iterator[Server]:
        """Serve on a thread while the block runs."""
        self._start_worker()
        thread = threading.Thread(target=self._server.run, name="berth-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self._stop_worker()
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)
        try:
            yield self
        finally:
            self._server.should_exit = True
            thread.join(timeout=30)
            self._stop_worker()

    def _start_worker(self) -> None:
        if isinstance(self.channel, BrokerChannel):
            self.channel.start()
        if not self.run_worker:
            if self.settings.metrics_port:  # no engine worker's page here: one of its own
                registry = CollectorRegistry()
                registry.register(self.limit_metrics)
                registry.register(self.jobs_metrics)
                self._metrics_page, _ = start_http_server(self.settings.metrics_port, self.settings.metrics_host,
                                                          registry)
            return
        from jobs.hosting.engine_worker import engine_worker

        # the model loads before the first request
        worker = engine_worker(self.settings, self._engine, interactive=self.channel.inbox)
        worker.metrics.registry.register(self.limit_metrics)
        worker.metrics.registry.register(self.jobs_metrics)

        def work() -> None:
            try:
                worker.run(until=self._stop.is_set)
            except Exception:
                log.exception("the engine worker of this server stopped: batches wait until `berth serve` is "
                              "restarted or a `berth worker` runs on the same settings")

        self._worker_thread = threading.Thread(target=work, name="berth-engine-worker", daemon=True)
        self._worker_thread.start()

    def _stop_worker(self) -> None:
        self._stop.set()
        if isinstance(self.channel, BrokerChannel):
            self.channel.close()
        if self._worker_thread is not None:
            self._worker_thread.join(timeout=self.settings.drain_timeout + 30)
        if self._metrics_page is not None:
            self._metrics_page.shutdown()
            self._metrics_page.server_close()
        self.tasks.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises the signal once it has shut down, which
    would end the process before the engine worker hands its requests back. ``serve_forever``
    handles the signals instead."""

    @contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets=None) -> None:
        """First end the requests waiting for a grammar's compile (``jobs.http.completions``): a compile
        may be queued for minutes, and uvicorn waits for every request it serves."""
        stopping = getattr(self.config.app.state, "stopping", None)
        if stopping is not None:
            stopping.set()
        await super().shutdown(sockets)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

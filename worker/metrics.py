"""The engine worker's Prometheus metrics, served on ``Settings.metrics_port`` (0 = off).

Counters for totals (use ``rate()`` on them), and gauges of the effective rates over the last
``RATE_WINDOW`` seconds for a glance without a query language.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RATE_WINDOW = 10.0


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.output_tokens = Counter("berth_output_tokens", "Tokens generated", registry=r)
        self.prefill_tokens = Counter("berth_prefill_tokens",
                                      "Prompt tokens computed (prefix-cache hits excluded)", registry=r)
        self.output_rate = Gauge("berth_output_tokens_per_second",
                                 f"Output tokens/s over the last {RATE_WINDOW:.0f}s", registry=r)
        self.prefill_rate = Gauge("berth_prefill_tokens_per_second",
                                  f"Prompt tokens computed/s over the last {RATE_WINDOW:.0f}s", registry=r)
        self.running = Gauge("berth_running_requests",
                             "Sequences being computed (a request asking for n samples has n)", registry=r)
        self.waiting = Gauge("berth_waiting_requests",
                             "Sequences admitted, waiting for KV blocks or a seat", registry=r)
        self.kv_used = Gauge("berth_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge("berth_kv_blocks_free", "KV cache blocks free", registry=r)
        self.preemptions = Counter("berth_preemptions", "Sequences preempted for lack of KV blocks", registry=r)
        self.step_seconds = Histogram("berth_step_seconds", "Wall time of one engine step", registry=r,
                                      buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.queue_depth = Gauge("berth_queue_depth", "Messages ready in this worker's request queue", registry=r)
        self.finished = Counter("berth_requests_finished", "Requests completed", ["tenant"], registry=r)
        self.failed = Counter("berth_requests_failed", "Requests failed", ["tenant"], registry=r)
        self._last = (0, 0, 0)  # engine totals last seen: output tokens, prompt tokens, preemptions
        self._window: deque[tuple[float, int, int]] = deque()

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def observe_step(self, engine, seconds: float) -> None:
        """After each engine step: token counters and rates, occupancy, KV blocks."""
        st = engine.stats
        totals = (st.output_tokens, st.prompt_tokens_computed, st.preemptions)
        self.output_tokens.inc(totals[0] - self._last[0])
        self.prefill_tokens.inc(totals[1] - self._last[1])
        self.preemptions.inc(totals[2] - self._last[2])
        self._last = totals
        self.step_seconds.observe(seconds)
        t = time.monotonic()
        self._window.append((t, totals[0], totals[1]))
        while len(self._window) > 2 and t - self._window[0][0] > RATE_WINDOW:
            self._window.popleft()
        t0, out0, pre0 = self._window[0]
        if t > t0:
            self.output_rate.set((totals[0] - out0) / (t - t0))
            self.prefill_rate.set((totals[1] - pre0) / (t - t0))
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)

    def observe_kv(self, engine) -> None:
        """Every second or so: ``kv_usage`` walks the block tables, too slow for every step."""
        kv = engine.kv_usage()
        self.kv_used.set(kv["blocks_used"])
        self.kv_free.set(kv["blocks_free"])

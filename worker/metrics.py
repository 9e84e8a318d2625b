"""The engine worker's Prometheus metrics, served on ``Settings.metrics_port`` (0 = off) of
``Settings.metrics_host`` (127.0.0.1 unless told otherwise: the page is unauthenticated).

Counters for totals (use ``rate()`` on them), and gauges of the effective rates over the last
``RATE_WINDOW`` seconds for a glance without a query language.

Interactive requests (``berth serve``'s chat and completions) and batch work share the engine; the
``class`` label (``interactive``, ``batch``) tells them apart:

- ``berth_time_to_first_token_seconds``: from a request's arrival in the engine worker (an interactive
  one's submit) to its first sampled token;
- ``berth_inter_token_seconds``: between a sequence's successive tokens (a preempted sequence's wait
  included: what its caller sees);
- ``berth_computed_tokens_total``: tokens run through the model, by class and ``kind`` (``prompt``;
  ``output``: a decode's input or a recomputed output token).

For example, each class's share of the tokens the steps computed, and the interactive p95 of each::

    sum by (class) (rate(berth_computed_tokens_total[1m]))
      / ignoring(class) group_left sum(rate(berth_computed_tokens_total[1m]))
    histogram_quantile(0.95, sum by (le) (rate(berth_time_to_first_token_seconds_bucket{class="interactive"}[5m])))
    histogram_quantile(0.95, sum by (le) (rate(berth_inter_token_seconds_bucket{class="interactive"}[5m])))

The engine measures these a step at a time (``Engine.latencies``): the sequences of one step mostly
share one time since their last token, so a step costs a few observations, not one per token.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

RATE_WINDOW = 10.0


TTFT_BUCKETS = (.025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
ITL_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .25, .5, 1, 2.5, 5, 10, 30)


class CountedHistogram:
    """A histogram by one label that takes several observations of one value at once
    (``observe(label, value, count)``), which prometheus_client's ``Histogram`` cannot; served by the
    registry it is registered with like any other histogram."""

    def __init__(self, name: str, documentation: str, label: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry):
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = (*buckets, float("inf"))
        self._counts: dict[str, list] = {}  # label value -> a count per bucket (not cumulative), then the sum
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, label: str, value: float, count: int = 1) -> None:
        i = bisect_left(self.bounds, value)  # the first bucket whose bound is >= value
        with self._lock:
            counts = self._counts.get(label)
            if counts is None:
                counts = self._counts[label] = [0] * len(self.bounds) + [0.0]
            counts[i] += count
            counts[-1] += value * count

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        with self._lock:
            snapshot = {k: list(v) for k, v in self._counts.items()}
        for label, counts in sorted(snapshot.items()):
            total, buckets = 0, []
            for bound, n in zip(self.bounds, counts):
                total += n
                buckets.append((floatToGoString(bound), total))
            family.add_metric([label], buckets, counts[-1])
        return [family]


class InteractiveLimitMetrics:
    """``berth serve``'s interactive limits by tenant, read from ``usage()`` when the page is served: the
    tenant -> (requests running, tokens of the last 60 s) of this server process, and ``refusals()``, the
    (tenant, reason) -> 429s so far. Registered with the page's registry: the engine worker's in ``berth
    serve``'s process, or a page of the server's own (``jobs.http.server``). ``reasons``: those a request may
    be refused for, each at 0 for a tenant holding anything until its first, so that ``rate()`` counts the
    first 429 too (a counter that appears at 1 shows no increase)."""

    def __init__(self, usage, refusals, reasons: tuple[str, ...] = ()):
        self._usage, self._refusals, self._reasons = usage, refusals, reasons

    def describe(self):
        return self._families()

    def collect(self):
        live, tokens, refused = self._families()
        usage = self._usage()
        for tenant, (running, spent) in sorted(usage.items()):
            live.add_metric([tenant], running)
            tokens.add_metric([tenant], spent)
        counts = {(tenant, reason): 0 for tenant in usage for reason in self._reasons}
        counts.update(self._refusals())
        for (tenant, reason), n in sorted(counts.items()):
            refused.add_metric([tenant, reason], n)
        return [live, tokens, refused]

    @staticmethod
    def _families():
        return [GaugeMetricFamily("berth_tenant_interactive_live_requests", "A tenant's chat and completions "
                                  "requests running on this berth serve process (its live-request limit counts "
                                  "these)", labels=["tenant"]),
                GaugeMetricFamily("berth_tenant_interactive_tokens_last_minute", "A tenant's chat and completions "
                                  "tokens of the last 60 s on this berth serve process (its tokens-per-minute "
                                  "limit counts these)", labels=["tenant"]),
                CounterMetricFamily("berth_interactive_rate_limited", "Chat and completions requests answered 429 "
                                    "for a tenant's interactive limits, by tenant and reason (live_requests, "
                                    "tokens_per_minute)", labels=["tenant", "reason"])]


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.output_tokens = Counter("berth_output_tokens", "Tokens generated", registry=r)
        self.tenant_output_tokens = Counter("berth_tenant_output_tokens", "Tokens generated, by tenant", ["tenant"],
                                            registry=r)
        self.prefill_tokens = Counter("berth_prefill_tokens",
                                      "Prompt tokens computed (prefix-cache hits excluded)", registry=r)
        self.recomputed_tokens = Counter("berth_recomputed_tokens", "Generated tokens computed again, after a "
                                         "preemption or a restore without their KV: work done twice (of "
                                         "berth_computed_tokens{kind=\"output\"})", registry=r)
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
        self.draft_tokens = Counter("berth_draft_tokens", "Speculation's draft tokens scored", registry=r)
        self.accepted_draft_tokens = Counter("berth_accepted_draft_tokens", "Speculation's draft tokens accepted "
                                             "(over berth_draft_tokens: the acceptance rate)", registry=r)
        self.draft_verifications = Counter("berth_draft_verifications", "Sequences' steps that verified a draft: "
                                           "(berth_accepted_draft_tokens + this) / this is the tokens a sequence "
                                           "made in a step that speculated", registry=r)
        self.step_seconds = Histogram("berth_step_seconds", "Wall time of one engine step", registry=r,
                                      buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.queue_depth = Gauge("berth_queue_depth", "Messages ready in this worker's request queue", registry=r)
        self.finished = Counter("berth_requests_finished", "Requests completed", ["tenant"], registry=r)
        self.failed = Counter("berth_requests_failed", "Requests failed", ["tenant"], registry=r)
        self.checkpoint_bytes = Counter("berth_checkpoint_bytes", "Checkpoint bytes written (states and KV blocks)",
                                        registry=r)
        self.checkpoint_states = Counter("berth_checkpoint_states", "Request states written", registry=r)
        self.checkpoint_blocks = Counter("berth_checkpoint_blocks", "KV blocks written", registry=r)
        self.checkpoint_segments = Counter("berth_checkpoint_segments", "Checkpoint segments written: one PUT "
                                           "each, the states of every request due in a round", registry=r)
        self.checkpoint_kv_runs = Counter("berth_checkpoint_kv_runs", "KV runs written: one PUT each, up to 8 "
                                          "consecutive blocks", registry=r)
        self.checkpoint_unrecorded = Gauge("berth_checkpoint_unrecorded", "Requests whose latest stored state "
                                           "waits to be recorded in the jobs database", registry=r)
        self.checkpoint_superseded = Counter("berth_checkpoint_superseded",
                                             "Snapshots replaced by a newer one before they were written", registry=r)
        self.checkpoint_failures = Counter("berth_checkpoint_failures", "Checkpoint writes that failed", registry=r)
        self.checkpoint_lag_seconds = Gauge("berth_checkpoint_lag_seconds",
                                            "Age of the oldest progress not yet written to the store", registry=r)
        self.checkpoint_lag_tokens = Gauge("berth_checkpoint_lag_tokens",
                                           "Tokens generated by running requests and not yet in a stored checkpoint",
                                           registry=r)
        self.storage_up = Gauge("berth_checkpoint_storage_up", "1 while the checkpoint store takes writes, else 0",
                                registry=r)
        self.restores = Counter("berth_checkpoint_restores", "Requests resumed from a checkpoint, by how their KV "
                                "came back", ["kv"], registry=r)
        for kv in ("loaded", "recomputed"):  # 0 until the first: a panel's rate of 0, not "no data"
            self.restores.labels(kv)
        self.restored_tokens = Counter("berth_checkpoint_restored_tokens",
                                       "Generated tokens taken from checkpoints instead of generated again", registry=r)
        self.prefix_blocks = Counter("berth_prefix_store_blocks", "Prompt KV blocks shared through the store: "
                                     "loaded instead of computed, or published for other workers", ["how"],
                                     registry=r)
        self.broker_up = Gauge("berth_broker_up", "1 while the worker is connected to the broker, else 0", registry=r)
        self.broker_reconnects = Counter("berth_broker_reconnects", "Connections to the broker made again after "
                                         "losing one", registry=r)
        self.database_up = Gauge("berth_database_up", "0 while the jobs database is failing, else 1", registry=r)
        self.database_errors = Counter("berth_database_errors", "Database calls that failed for want of the database",
                                       registry=r)
        self.worker_deaths = Gauge("berth_worker_deaths_last_hour", "Engine worker processes of each host found dead "
                                   "while running requests in the last hour (by any worker's admissions): a "
                                   "crash loop shows here before jobs fail", ["host"], registry=r)
        self.suspect_groups = Counter("berth_suspect_groups", "Groups of crash suspects run alone (requests that "
                                      "were running when a worker died)", registry=r)
        self.suspects = Gauge("berth_suspects", "Crash suspects held, waiting for their group or running in it",
                              registry=r)
        self.outcomes_waiting = Gauge("berth_outcomes_waiting", "Finished requests whose result waits for the "
                                      "database to come back (their messages unacked)", registry=r)
        self.interactive_live = Gauge("berth_interactive_requests", "Interactive requests from the interactive "
                                      "queue held by this worker (running, waiting or being admitted)", registry=r)
        self.interactive_taken = Counter("berth_interactive_requests_taken", "Interactive requests taken from the "
                                         "interactive queue and submitted to the engine", registry=r)
        self.interactive_refused = Counter("berth_interactive_messages_refused", "Messages on the interactive queue "
                                           "refused (unreadable, failing the checks, no reply-to address)", registry=r)
        self.time_to_first_token = CountedHistogram(
            "berth_time_to_first_token_seconds", "From a request's arrival in the engine worker (an interactive "
            "one's submit) to its first token, by class (interactive, batch)", "class", TTFT_BUCKETS, r)
        self.inter_token = CountedHistogram(
            "berth_inter_token_seconds", "Between successive tokens of a sequence, by class (interactive, batch)",
            "class", ITL_BUCKETS, r)
        self.computed_tokens = Counter("berth_computed_tokens", "Tokens run through the model, by class "
                                       "(interactive, batch) and kind (prompt; output: a decode's input or a "
                                       "recomputed output token)", ["class", "kind"], registry=r)
        self.enqueued_tokens = Gauge("berth_tenant_enqueued_tokens", "A tenant's enqueued tokens of this worker's "
                                     "model: the prompt tokens and max_tokens of its lines not yet done (its token "
                                     "budget), for the tenants with live jobs of it", ["tenant"], registry=r)
        self.enqueued_token_limit = Gauge("berth_tenant_enqueued_token_limit", "A tenant's enqueued tokens per model "
                                          "at most (0: no limit); a batch past it fails with token_limit_exceeded",
                                          ["tenant"], registry=r)
        self._last = (0, 0, 0, 0, 0, 0, 0)  # engine totals last seen: output, prompt, preemptions, drafted,
        # accepted, recomputed, verifications
        self._last_computed: dict[tuple[str, str], int] = {}
        self._last_by_tenant: dict[str, int] = {}
        self._window: deque[tuple[float, int, int]] = deque()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``host:port``; only this machine reaches the default host."""
        start_http_server(port, addr=host, registry=self.registry)

    def observe_step(self, engine, seconds: float) -> None:
        """After each engine step: token counters and rates, occupancy, KV blocks."""
        st = engine.stats
        totals = (st.output_tokens, st.prompt_tokens_computed, st.preemptions, st.draft_tokens, st.accepted_tokens,
                  st.recomputed_tokens, st.verifications)
        self.output_tokens.inc(totals[0] - self._last[0])
        self.prefill_tokens.inc(totals[1] - self._last[1])
        self.preemptions.inc(totals[2] - self._last[2])
        self.draft_tokens.inc(totals[3] - self._last[3])
        self.accepted_draft_tokens.inc(totals[4] - self._last[4])
        self.recomputed_tokens.inc(totals[5] - self._last[5])
        self.draft_verifications.inc(totals[6] - self._last[6])
        self._last = totals
        for tenant, n in st.output_tokens_by_tenant.items():
            if n != self._last_by_tenant.get(tenant, 0):
                self.tenant_output_tokens.labels(tenant).inc(n - self._last_by_tenant.get(tenant, 0))
                self._last_by_tenant[tenant] = n
        for key, n in st.computed_tokens.items():
            if n != self._last_computed.get(key, 0):
                self.computed_tokens.labels(*key).inc(n - self._last_computed.get(key, 0))
                self._last_computed[key] = n
        latencies = engine.latencies
        for label, value in latencies.first_token:
            self.time_to_first_token.observe(label, value)
        for (label, value), count in latencies.between_tokens.items():
            self.inter_token.observe(label, value, count)
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

    def recent_output_rate(self) -> float:
        """Output tokens/s over the last ``RATE_WINDOW`` seconds, as of now (0 when the engine is idle)."""
        t = time.monotonic()
        recent = [(at, out) for at, out, _ in self._window if t - at <= RATE_WINDOW]
        if len(recent) < 2:
            return 0.0
        (t0, out0), (t1, out1) = recent[0], recent[-1]
        return (out1 - out0) / max(t - t0, t1 - t0, 1e-9)

    def follow_tenants(self, tenants) -> None:
        """The tenants whose queues this worker consumes: their finished and failed counters are there at 0
        from then on, so that ``rate()`` counts a tenant's first outcome here (a counter that appears at 1
        shows no increase) and its failures read 0, not nothing."""
        for tenant in tenants:
            self.finished.labels(tenant)
            self.failed.labels(tenant)

    def set_worker_deaths(self, by_host: dict[str, int]) -> None:
        """The deaths of the last hour per host, as just read (hosts not in ``by_host`` drop out)."""
        self.worker_deaths.clear()
        for host, n in by_host.items():
            self.worker_deaths.labels(host).set(n)

    def set_budgets(self, budgets: dict[str, tuple[int, int]]) -> None:
        """Tenant -> (enqueued tokens, limit), as just read (tenants without live jobs drop out)."""
        self.enqueued_tokens.clear()
        self.enqueued_token_limit.clear()
        for tenant, (enqueued, limit) in budgets.items():
            self.enqueued_tokens.labels(tenant).set(enqueued)
            self.enqueued_token_limit.labels(tenant).set(limit)

    def observe_kv(self, engine) -> None:
        """Every second or so: ``kv_usage`` walks the block tables, too slow for every step. The occupancy
        too: a request aborted while no step follows (its caller left) would leave it stale otherwise."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        kv = engine.kv_usage()
        self.kv_used.set(kv["blocks_used"])
        self.kv_free.set(kv["blocks_free"])

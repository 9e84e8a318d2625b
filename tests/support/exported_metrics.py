"""Every metric name berth exports, as Prometheus stores it (a counter's ``_total``, a histogram's
``_bucket``/``_sum``/``_count``), and the ``berth_*`` names a PromQL text uses: a rule or a dashboard
panel over a metric no process exports is a panel that stays empty and an alert that never fires."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry

from jobs.http.jobs_metrics import JobsMetrics
from worker.metrics import InteractiveLimitMetrics, WorkerMetrics

SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
_NAME = re.compile(r"(?<![\w:$])(berth_[A-Za-z0-9_]+)(?![\w(])")


def exported_metric_names() -> set[str]:
    """The engine worker's page (``WorkerMetrics``) and ``berth serve``'s (its interactive limits and the
    jobs table's figures)."""
    registry = CollectorRegistry()
    WorkerMetrics(registry)
    families = [*registry.collect(), *InteractiveLimitMetrics(dict, dict).describe(),
                *JobsMetrics("sqlite://").describe()]
    return {f.name + suffix for f in families for suffix in SUFFIXES[f.type]}


def metric_names_in(promql: str) -> set[str]:
    """The ``berth_*`` metric names a PromQL expression reads."""
    return set(_NAME.findall(promql))

"""The jobs table on ``berth serve``'s metrics page: jobs by state, each live job's requests, tokens,
deadline and expected finish, the webhooks waiting to be sent, and whether the database answered.

The engine workers' pages say what the engines do; only the jobs database knows what the jobs still
need, so this collector reads it when the page is scraped: three indexed queries in one session, at
most once every ``MIN_INTERVAL`` seconds however many scrapers ask (the last reading is served in
between), and at most ``LIVE_JOBS_SHOWN`` jobs, those whose completion window ends first, so the
page stays small with thousands of jobs live. The alert rules in deploy/prometheus/ read it: a job that
will miss its window, webhooks backing up, the database unreachable.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from jobs.records.db import Database, open_database
from jobs.records.job_status import JobStatus
from jobs.records.lifecycle import LIVE
from jobs.records.models import Job, JobEvent, Tenant

log = logging.getLogger("berth.serve")

LIVE_JOBS_SHOWN = 100  # live jobs on the page at most: the nearest deadlines first
MIN_INTERVAL = 5.0  # seconds between two readings of the database


class JobsMetrics:
    """A prometheus_client collector over the jobs database at ``database_url`` (opened on first use)."""

    def __init__(self, database_url: str, clock=time.time, db: Database | None = None):
        self.database_url, self.clock, self._db = database_url, clock, db
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._families: list = []
        self._failing = False

    def describe(self):
        return self._empty()

    def collect(self):
        with self._lock:
            t = time.monotonic()
            if self._read_at is None or t - self._read_at >= MIN_INTERVAL:
                self._families, self._read_at = self._read(), t
            return self._families

    def _read(self) -> list:
        families = self._empty()
        by_state, requests, tokens, deadline, finish, pending, oldest_due, up = families
        try:
            db = self._db = self._db or open_database(self.database_url, migrate_if_empty=False)
            now = self.clock()
            with db.session() as s:
                counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
                live = s.execute(
                    select(Job.id, Tenant.name, Job.total, Job.completed, Job.failed, Job.prompt_tokens,
                           Job.completion_tokens, Job.cached_tokens, Job.expires_at, Job.in_progress_at)
                    .join(Tenant, Tenant.id == Job.tenant_id).where(Job.status.in_(LIVE))
                    .order_by(Job.expires_at, Job.id).limit(LIVE_JOBS_SHOWN)).all()
                waiting, first_due = s.execute(select(func.count(), func.min(JobEvent.webhook_due_at))
                                               .where(JobEvent.webhook_due_at.is_not(None))).one()
        except (SQLAlchemyError, OSError) as exc:  # the page still answers: the database is down, and that is the news
            if not self._failing:
                log.warning("the jobs metrics could not read the database: %s", exc)
            self._failing = True
            up.add_metric([], 0)
            return [up]
        if self._failing:
            log.info("the jobs metrics read the database again")
        self._failing = False
        for state in JobStatus:
            by_state.add_metric([state.value], counts.get(state, 0))
        for job_id, tenant, total, completed, failed, prompt, output, cached, expires_at, started in live:
            labels = [job_id, tenant]
            left = max(total - completed - failed, 0)
            for state, n in (("completed", completed), ("failed", failed), ("pending", left)):
                requests.add_metric([*labels, state], n)
            for kind, n in (("prompt", prompt), ("output", output), ("cached", cached)):
                tokens.add_metric([*labels, kind], n)
            deadline.add_metric(labels, expires_at)
            done = completed + failed
            if started is not None and done and now > started:
                finish.add_metric(labels, now + left * (now - started) / done)
        pending.add_metric([], waiting)
        oldest_due.add_metric([], max(now - first_due, 0.0) if first_due is not None else 0.0)
        up.add_metric([], 1)
        return families

    @staticmethod
    def _empty() -> list:
        job = ["job_id", "tenant"]
        return [
            GaugeMetricFamily("berth_jobs", "Jobs in the jobs database, by state", labels=["state"]),
            GaugeMetricFamily("berth_job_requests", f"A live job's requests by state (completed, failed, pending); "
                              f"the {LIVE_JOBS_SHOWN} live jobs whose window ends first", labels=[*job, "state"]),
            GaugeMetricFamily("berth_job_tokens", "A live job's tokens so far, by kind (prompt, output, cached)",
                              labels=[*job, "kind"]),
            GaugeMetricFamily("berth_job_deadline_timestamp_seconds", "When a live job's completion window ends "
                              "(it expires then with what is unfinished)", labels=job),
            GaugeMetricFamily("berth_job_expected_finish_timestamp_seconds", "When a live job will have run all its "
                              "requests at its average rate since it started (absent until one is done)", labels=job),
            GaugeMetricFamily("berth_webhooks_pending", "Job events whose webhook is still to be sent (due now or "
                              "waiting for a retry)"),
            GaugeMetricFamily("berth_webhooks_oldest_due_seconds", "How long ago the most overdue webhook fell due "
                              "(0: none overdue)"),
            GaugeMetricFamily("berth_jobs_database_up", "1 when this page's last reading of the jobs database "
                              "succeeded, else 0"),
        ]

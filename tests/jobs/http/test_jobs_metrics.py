"""berth serve's jobs figures (jobs.http.jobs_metrics): what the alert rules on a job's completion window
and on webhooks read, from the jobs table, and an honest 0 when the database does not answer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jobs.http import jobs_metrics
from jobs.http.jobs_metrics import JobsMetrics
from jobs.records.db import open_database
from jobs.records.job_status import JobStatus
from jobs.records.models import Job, JobEvent
from jobs.records.tenants import tenant_id

NOW = 1_000_000.0


def _samples(collector) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _key(name: str, **labels: str) -> tuple:
    return name, tuple(sorted(labels.items()))


def _job(job_id: str, tenant: int, status: JobStatus, **fields) -> Job:
    return Job(id=job_id, tenant_id=tenant, model="m", status=status, completion_window="24h", input_name="in.jsonl",
               input_key=f"jobs/{job_id}/input.jsonl", created_at=NOW - 7200, **fields)


def test_live_jobs_their_deadline_and_expected_finish_and_webhooks_waiting(tmp_path, monkeypatch):
    db = open_database(f"sqlite:///{tmp_path / 'jobs.db'}")
    with db.session() as s, s.begin():
        acme = tenant_id(s, "acme")
        # 40 of 100 done in the hour since it started: 60 more take 1.5 hours, past its deadline in one
        s.add(_job("batch_slow", acme, JobStatus.IN_PROGRESS, total=100, completed=38, failed=2, prompt_tokens=900,
                   completion_tokens=500, cached_tokens=64, in_progress_at=NOW - 3600, expires_at=NOW + 3600))
        s.add(_job("batch_new", acme, JobStatus.IN_PROGRESS, total=10, in_progress_at=NOW - 5, expires_at=NOW + 86400))
        s.add(_job("batch_done", acme, JobStatus.COMPLETED, total=5, completed=5, expires_at=NOW - 10))
    with db.session() as s, s.begin():
        s.query(JobEvent).delete()
        s.add(JobEvent(job_id="batch_done", status=JobStatus.COMPLETED, total=5, completed=5, failed=0,
                       prompt_tokens=0, completion_tokens=0, created_at=NOW - 900, webhook_due_at=NOW - 600))
        s.add(JobEvent(job_id="batch_slow", status=JobStatus.IN_PROGRESS, total=100, completed=0, failed=0,
                       prompt_tokens=0, completion_tokens=0, created_at=NOW - 60, webhook_due_at=NOW + 30))
    got = _samples(JobsMetrics(db.url, clock=lambda: NOW, db=db))

    slow, new = {"job_id": "batch_slow", "tenant": "acme"}, {"job_id": "batch_new", "tenant": "acme"}
    assert got[_key("berth_jobs_database_up")] == 1
    assert got[_key("berth_jobs", state="in_progress")] == 2
    assert got[_key("berth_jobs", state="completed")] == 1
    assert got[_key("berth_jobs", state="expired")] == 0
    assert got[_key("berth_job_requests", **slow, state="pending")] == 60
    assert got[_key("berth_job_requests", **slow, state="failed")] == 2
    assert got[_key("berth_job_tokens", **slow, kind="cached")] == 64
    assert got[_key("berth_job_deadline_timestamp_seconds", **slow)] == NOW + 3600
    assert got[_key("berth_job_expected_finish_timestamp_seconds", **slow)] == NOW + 5400
    assert _key("berth_job_expected_finish_timestamp_seconds", **new) not in got, "nothing done: no rate to project"
    assert not any(dict(labels).get("job_id") == "batch_done" for _, labels in got), "a finished job is not live"
    assert got[_key("berth_webhooks_pending")] == 2
    assert got[_key("berth_webhooks_oldest_due_seconds")] == 600

    monkeypatch.setattr(jobs_metrics, "LIVE_JOBS_SHOWN", 1)
    shown = {dict(labels)["job_id"] for name, labels in _samples(JobsMetrics(db.url, db=db))
             if name == "berth_job_deadline_timestamp_seconds"}
    assert shown == {"batch_slow"}, "the page shows the nearest deadlines first, and no more than its bound"


def test_a_database_that_does_not_answer_is_reported_not_raised(tmp_path):
    missing = f"sqlite:///{tmp_path / 'nowhere' / 'jobs.db'}"
    got = _samples(JobsMetrics(missing))
    assert got == {_key("berth_jobs_database_up"): 0}


def test_berth_serve_puts_the_jobs_figures_on_its_metrics_page(tmp_path, tiny_llama_dir):
    """With a broker ``berth serve`` serves a page of its own (the embedded settings without a worker stand
    in here): the jobs figures are on it, read from the server's database."""
    import urllib.request

    from tests.support.processes import free_port
    from tests.support.serving import embedded_settings, serving

    port = free_port()
    settings = embedded_settings(tiny_llama_dir, tmp_path, metrics_port=port)
    with serving(settings, worker=False):
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    assert "berth_jobs_database_up 1.0" in page, page
    assert 'berth_jobs{state="in_progress"} 0.0' in page

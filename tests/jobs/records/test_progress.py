"""How jobs are shown to a person: ``berth list``'s table keeps every job id whole, however narrow
the terminal."""

from __future__ import annotations

import time

from rich.console import Console

from jobs.records.models import JobStatus
from jobs.records.progress import job_table
from jobs.records.status import JobView


def _view(job_id: str, tenant: str) -> JobView:
    fields = dict.fromkeys(JobView.__dataclass_fields__)
    now = time.time()
    fields.update(id=job_id, status=JobStatus.IN_PROGRESS, tenant=tenant, priority=5, total=1000, completed=3,
                  failed=0, completion_tokens=5000, created_at=now - 60, in_progress_at=now - 50)
    return JobView(**fields)


def _table(views: list[JobView], width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    job_table(views, console=console)
    return console.export_text()


def test_a_narrow_terminal_never_cuts_a_job_id():
    ids = ["batch_43f1c2a9b8e7d6c5b4a39281", "batch_0123456789abcdef01234567"]  # as jobs.pipeline.submit makes them
    views = [_view(ids[0], "a-tenant-with-a-long-name"), _view(ids[1], "t")]
    for width in (40, 60, 80, 140):
        text = _table(views, width)
        for job_id in ids:
            assert f"│ {job_id} │" in text, f"id {job_id} cut or wrapped at width {width}:\n{text}"
    narrow, wide = _table(views, 60), _table(views, 140)
    assert all(len(line) <= 60 for line in narrow.splitlines())
    assert "done/total" in narrow and "3/1000" in narrow, "the progress gave way before the other columns"
    assert "tenant" not in narrow and "created" not in narrow
    for column in ("status", "tenant", "pri", "done/total", "failed", "tok/s", "created", "a-tenant-with-a-long-name"):
        assert column in wide, f"{column} missing from a wide terminal's table"

"""A job's progress over time, from its results: requests done and output tokens made, summed into
equal spans of time from the job's start, for the chart on its dashboard page."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from jobs.records.db import Database

SPANS = 60  # points on a chart at most


@dataclass(frozen=True)
class ProgressPoint:
    seconds: float  # since the job started, at the end of the span
    done: int  # requests with an outcome by then
    output_tokens: int  # made by then


def progress_over_time(db: Database, job_id: str, start: float, end: float, spans: int = SPANS
                       ) -> list[ProgressPoint]:
    """Cumulative points from ``start`` (0 done) to ``end``, one per span that had outcomes."""
    width = max(end - start, 1e-3) / spans
    # the span's number: FLOOR on PostgreSQL; SQLite's CAST truncates, which is the floor of what is >= 0
    span = "FLOOR((created_at - :start) / :width)" if db.engine.dialect.name == "postgresql" else \
        "CAST((MAX(created_at, :start) - :start) / :width AS INTEGER)"
    query = text(f"SELECT {span} AS span, COUNT(*) AS done, COALESCE(SUM(completion_tokens), 0) AS tokens "
                 "FROM results WHERE job_id = :job_id GROUP BY span ORDER BY span")
    with db.engine.connect() as conn:
        rows = conn.execute(query, {"job_id": job_id, "start": start, "width": width}).all()
    points, done, tokens = [ProgressPoint(0.0, 0, 0)], 0, 0
    for number, count, made in rows:
        done, tokens = done + count, tokens + int(made)
        points.append(ProgressPoint(min(max(int(number), 0) + 1, spans) * width, done, tokens))
    return points

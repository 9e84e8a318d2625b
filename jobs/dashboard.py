"""The dashboard at ``/``: jobs with live progress, each job's page with its errors, and the engine
workers with an hour of output tokens/s and KV use as charts.

Server-rendered HTML (``jobs/templates``) and a little JavaScript that polls ``/dashboard/data.json``
every two seconds to move the bars and redraw the charts (inline SVG): no front-end build step.
A tenant sees its own jobs; an open server (``berth serve --open``) shows every tenant's.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Callable

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from jobs import workers
from jobs.db import Database
from jobs.files import JobFiles
from jobs.lifecycle import JobNotFound
from jobs.models import now
from jobs.progress import duration
from jobs.status import JobView, get_job, list_jobs

JOBS_SHOWN = 50
ERRORS_SHOWN = 200
_templates = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"),
                         autoescape=select_autoescape(["html"]))


def job_summary(v: JobView) -> dict:
    return {"id": v.id, "status": v.status.value, "tenant": v.tenant, "model": v.model, "total": v.total,
            "done": v.done, "completed": v.completed, "failed": v.failed, "prompt_tokens": v.prompt_tokens,
            "completion_tokens": v.completion_tokens, "tokens_per_second": round(v.output_tokens_per_second, 1),
            "eta": duration(v.eta_seconds), "created_at": int(v.created_at), "error": v.error}


def dashboard_data(db: Database, tenant: str | None) -> dict:
    t = now()
    return {"now": t, "jobs": [job_summary(v) for v in list_jobs(db, tenant, None, JOBS_SHOWN)],
            "workers": [w.to_dict() for w in workers.list_workers(db)],
            "series": {wid: [[round(at - t, 1), tps, round(kv, 4)] for at, tps, kv in points]
                       for wid, points in workers.samples(db, t - workers.HISTORY).items()}}


def job_errors(files: JobFiles, view: JobView, limit: int = ERRORS_SHOWN) -> list[dict]:
    """The first error lines of a finished job (its errors file), for its page."""
    if view.errors_key is None:
        return []
    with files.open(view.errors_key) as f:
        return [json.loads(line) for line in islice(f, limit)]


def dashboard_router(db: Database, files: JobFiles, tenant_of: Callable[[Request], str | None]) -> APIRouter:
    """``tenant_of(request)``: whose jobs the request may see (None: everyone's, an open server);
    it raises the API's 401 for a request without a valid key."""
    router = APIRouter(include_in_schema=False)

    @router.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        data = dashboard_data(db, tenant_of(request))
        return HTMLResponse(_templates.get_template("dashboard.html").render(data=data, initial=json.dumps(data)))

    @router.get("/dashboard/data.json")
    def data(request: Request) -> JSONResponse:
        return JSONResponse(dashboard_data(db, tenant_of(request)))

    @router.get("/dashboard/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: str, request: Request) -> HTMLResponse:
        tenant = tenant_of(request)
        try:
            view = get_job(db, job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id}") from None
        if tenant is not None and view.tenant != tenant:
            raise HTTPException(404, f"no job {job_id}")
        return HTMLResponse(_templates.get_template("job.html").render(
            job=job_summary(view), view=view.to_dict(), errors=job_errors(files, view)))

    return router

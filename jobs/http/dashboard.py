"""The dashboard at ``/``: jobs with live progress, each job's errors, a tenant's interactive limits and
its use of them on this server, and the engine workers with an hour of tokens/s and KV use.
Server-rendered, polled every two seconds; a browser signs in with an API key and sees its tenant's
jobs and limits, and only them: the fleet (workers, their load, every tenant's interactive use) is the
operator's, shown on ``berth serve --open`` (the local server, everyone's jobs) to a browser without a
key. Every value is text, never markup: escaped templates, data as JSON, a Content-Security-Policy
without inline scripts (docs/http-api.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from jobs.http.job_chart import ProgressChart, progress_chart
from jobs.records import workers
from jobs.records.db import Database
from jobs.records.job_files import JobFiles
from jobs.records.job_timeline import progress_over_time
from jobs.records.lifecycle import JobNotFound
from jobs.records.models import now
from jobs.records.progress import duration
from jobs.records.status import JobView, get_job, list_jobs
from storage import ObjectNotFound

COOKIE = "berth_key"
JOBS_SHOWN = 50
ERRORS_SHOWN = 200
_templates = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"),
                         autoescape=select_autoescape(["html"]))
_STATIC = Path(__file__).parent / "static"
_STATIC_TYPES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
# No inline script or style at all (so no nonce or hash is needed): the script, the style sheet and the
# data the script reads come from this server; nothing may frame the pages or send their forms elsewhere.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "same-origin", "Cache-Control": "no-store"}
_templates.filters["utc"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def job_progress_chart(db: Database, view: JobView) -> ProgressChart | None:
    """Requests done over time since the job started; None before it started."""
    if view.in_progress_at is None:
        return None
    end = next((t for t in (view.finalizing_at, view.completed_at, view.failed_at, view.cancelled_at,
                            view.expired_at) if t), now())
    return progress_chart(progress_over_time(db, view.id, view.in_progress_at, end), view.total,
                          end - view.in_progress_at)


def job_summary(v: JobView) -> dict:
    return {"id": v.id, "status": v.status.value, "tenant": v.tenant, "model": v.model, "total": v.total,
            "done": v.done, "completed": v.completed, "failed": v.failed, "prompt_tokens": v.prompt_tokens,
            "completion_tokens": v.tokens_made, "tokens_per_second": round(v.tokens_per_second, 1),
            "eta": duration(v.eta_seconds), "created_at": int(v.created_at), "error": v.error,
            "expected_finish_at": None if v.expected_finish_at is None else int(v.expected_finish_at),
            "expires_at": int(v.expires_at), "at_risk": v.at_risk}


def dashboard_data(db: Database, tenant: str | None,
                   interactive: Callable[[str | None], list[dict]] | None = None) -> dict:
    """What ``tenant`` sees: its jobs and its interactive limits with its use of them on this server, no
    fleet (another tenant's load is none of its business, and tells it what the others run). ``None``
    (the operator, on an open server): every job, the fleet, and every tenant's interactive use.
    ``interactive(tenant)``: those rows (``jobs.http.interactive_limits.interactive_use``)."""
    t = now()
    data = {"now": t, "jobs": [job_summary(v) for v in list_jobs(db, tenant, None, JOBS_SHOWN)],
            "fleet": tenant is None, "interactive": [] if interactive is None else interactive(tenant)}
    if tenant is None:
        data["workers"] = [w.to_dict() for w in workers.list_workers(db)]
        data["series"] = {wid: [[round(at - t, 1), tps, round(kv, 4)] for at, tps, kv in points]
                          for wid, points in workers.samples(db, t - workers.HISTORY).items()}
    return data


def job_errors(files: JobFiles, view: JobView, limit: int = ERRORS_SHOWN) -> list[dict]:
    """The first error lines of a finished job (its errors file), for its page."""
    if view.errors_key is None:
        return []
    try:
        with files.open(view.errors_key) as f:
            return [json.loads(line) for line in islice(f, limit)]
    except ObjectNotFound:  # deleted a moment ago
        return []


def files_gone(view: JobView) -> list[str]:
    """The job's files that were there and are gone (expired, or deleted by the tenant)."""
    return [name for name, file_id, key in (("output", view.output_file_id, view.output_key),
                                            ("errors", view.error_file_id, view.errors_key))
            if file_id is not None and key is None]


class SignIn(Exception):
    """The dashboard needs a key: the browser is sent to the sign-in page."""


@dataclass(frozen=True)
class JobActions:
    """What a job's page may do, as the Batches API does it: ``cancel(tenant, job_id)``, and ``retry(tenant,
    job_id)`` giving the new job's id."""

    cancel: Callable[[str, str], None]
    retry: Callable[[str, str], str]


def dashboard_router(db: Database, files: JobFiles, tenant_of_key: Callable[[str], str | None],
                     open_access: bool, secure_cookies: bool = False,
                     interactive: Callable[[str | None], list[dict]] | None = None,
                     actions: JobActions | None = None) -> APIRouter:
    """``tenant_of_key(key)``: the tenant of an API key (None: no such key); ``secure_cookies``: the
    sign-in cookie only over HTTPS even when this server sees plain HTTP (behind a TLS proxy);
    ``interactive``: the rows of interactive limits and use a viewer sees (``dashboard_data``);
    ``actions``: a job page's cancel and retry buttons (none: the page has none)."""
    router = APIRouter(include_in_schema=False)

    def viewer(request: Request) -> str | None:
        """Whose jobs this browser sees: its key's tenant, or everyone's on an open server."""
        header = request.headers.get("authorization", "")
        for key in (header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else "",
                    request.cookies.get(COOKIE, "")):
            if key and (tenant := tenant_of_key(key)) is not None:
                return tenant
        if open_access:
            return None
        raise SignIn()

    def page(render: Callable[[str | None], str], request: Request) -> HTMLResponse | RedirectResponse:
        try:
            return HTMLResponse(render(viewer(request)), headers=HEADERS)
        except SignIn:
            return RedirectResponse("/dashboard/login", status_code=303, headers=HEADERS)

    def signed_in(request: Request) -> bool:
        return bool(request.cookies.get(COOKIE))

    def viewed_job(job_id: str, tenant: str | None) -> JobView:
        """The job, if this viewer may see it (its tenant's, or any on an open server); else a 404."""
        try:
            view = get_job(db, job_id)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id[:64]}") from None
        if tenant is not None and view.tenant != tenant:
            raise HTTPException(404, f"no job {job_id[:64]}")
        return view

    @router.get("/", response_class=HTMLResponse)
    def index(request: Request):
        def render(tenant):
            return _templates.get_template("dashboard.html").render(data=dashboard_data(db, tenant, interactive),
                                                                    signed_in=signed_in(request))
        return page(render, request)

    @router.get("/dashboard/data.json")
    def data(request: Request) -> JSONResponse:
        try:
            return JSONResponse(dashboard_data(db, viewer(request), interactive), headers=HEADERS)
        except SignIn:
            return JSONResponse({"error": {"message": "sign in with an API key at /dashboard/login",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}, status_code=401, headers=HEADERS)

    @router.get("/dashboard/static/{name}")
    def static(name: str) -> Response:
        if name not in _STATIC_TYPES:
            raise HTTPException(404, f"no file {name[:64]}")
        return Response((_STATIC / name).read_bytes(), media_type=_STATIC_TYPES[name],
                        headers={**HEADERS, "Cache-Control": "no-cache"})

    @router.get("/dashboard/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: str, request: Request, error: Annotated[str, Query(max_length=300)] = ""):
        def render(tenant):
            view = viewed_job(job_id, tenant)
            return _templates.get_template("job.html").render(job=job_summary(view), view=view.to_dict(),
                                                              chart=job_progress_chart(db, view),
                                                              errors=job_errors(files, view),
                                                              files_gone=files_gone(view), actions=actions is not None,
                                                              signed_in=signed_in(request), error=error)
        return page(render, request)

    @router.get("/dashboard/jobs/{job_id}/files/{kind}")
    def job_file(job_id: str, kind: str, request: Request) -> Response:
        """The job's output or errors file, to download (the browser's sign-in, not a Bearer header)."""
        try:
            view = viewed_job(job_id, viewer(request))
        except SignIn:
            return RedirectResponse("/dashboard/login", status_code=303, headers=HEADERS)
        key = {"output": view.output_key, "errors": view.errors_key}.get(kind)
        if key is None:
            raise HTTPException(404, f"job {view.id} has no {kind[:16]} file")
        body = files.open(key)
        named = {"Content-Disposition": f'attachment; filename="{view.id}.{kind}.jsonl"'}
        return StreamingResponse(iter(lambda: body.read(1 << 20), b""), media_type="application/jsonl",
                                 headers={**HEADERS, **named})

    @router.post("/dashboard/jobs/{job_id}/{action}")
    def job_action(job_id: str, action: str, request: Request) -> RedirectResponse:
        """Cancel or retry, as POST /v1/batches/{id}/cancel and /retry do; back to a job's page, with what
        went wrong said there."""
        if actions is None or action not in ("cancel", "retry"):
            raise HTTPException(404, "no such action")
        try:
            view = viewed_job(job_id, viewer(request))
        except SignIn:
            return RedirectResponse("/dashboard/login", status_code=303, headers=HEADERS)
        try:
            if action == "cancel":
                actions.cancel(view.tenant, view.id)
                target = view.id
            else:
                target = actions.retry(view.tenant, view.id)
        except Exception as exc:  # noqa: BLE001 (a job that cannot be cancelled or retried: said on its page)
            return RedirectResponse(f"/dashboard/jobs/{view.id}?{urlencode({'error': str(exc)[:300]})}",
                                    status_code=303, headers=HEADERS)
        return RedirectResponse(f"/dashboard/jobs/{target}", status_code=303, headers=HEADERS)

    @router.get("/dashboard/login", response_class=HTMLResponse)
    def login_form(error: Annotated[str, Query(max_length=200)] = "") -> HTMLResponse:
        return HTMLResponse(_templates.get_template("login.html").render(error=error), headers=HEADERS)

    @router.post("/dashboard/login")
    def login(request: Request, key: Annotated[str, Form(max_length=200)]) -> RedirectResponse:
        if tenant_of_key(key) is None:
            return RedirectResponse("/dashboard/login?error=that+key+is+unknown+or+revoked", status_code=303,
                                    headers=HEADERS)
        response = RedirectResponse("/", status_code=303, headers=HEADERS)
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict", max_age=30 * 86400,
                            secure=secure_cookies or request.url.scheme == "https")
        return response

    @router.post("/dashboard/logout")
    def logout(request: Request) -> RedirectResponse:
        """Forget the key in this browser (the key itself stays valid: `berth key revoke` ends it)."""
        response = RedirectResponse("/dashboard/login", status_code=303, headers=HEADERS)
        response.delete_cookie(COOKIE, httponly=True, samesite="strict",
                               secure=secure_cookies or request.url.scheme == "https")
        return response

    return router

"""``berth serve``'s HTTP API: OpenAI's Files and Batches API over berth's jobs, and chat and
completions answered now (``jobs.http.completions``), for the unmodified openai client.

    app = create_app(settings)              # uvicorn jobs.http.app:app serves one from the environment

Every route but the OpenAPI document needs a key, checked before the body is read (``jobs.http.guard``).
The routes are thin; the work is in the modules beside this one (docs/http-api.md).
"""


import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from jobs.http import batches
from jobs.http import files as api_files
from jobs.http.background import Tasks
from jobs.http.completions import add_completion_routes
from jobs.http.dashboard import JobActions, dashboard_router
from jobs.http.errors import ApiError, install
from jobs.http.guard import TENANT_SCOPE_KEY, RequestGuard
from jobs.http.idempotency import fingerprint, idempotent
from jobs.http.interactive_channel import InteractiveChannel
from jobs.http.interactive_limits import InteractiveLimiter, LimitsCache, interactive_use
from jobs.http.keys import tenant_of_key
from jobs.http.origin import allowed_hosts
from jobs.http.pagination import list_object
from jobs.http.schemas import (
    Batch,
    BatchList,
    CreateBatch,
    ErrorBody,
    FileDeleted,
    FileList,
    FileObject,
    Model,
    ModelList,
)
from jobs.http.upload import body_limit, read_upload
from jobs.lines.validate import model_info
from jobs.pipeline.celery_tasks import FINALIZE, INGEST
from jobs.pipeline.finalize import finished_lines
from jobs.pipeline.retry import retry_job
from jobs.records.db import Database, open_database
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import JobNotFound
from jobs.records.models import now
from jobs.records.status import interactive_limits
from jobs.records.usage import usage
from worker.config import Settings

log = logging.getLogger("berth.http")

OPEN_TENANT = "default"
ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 403, 404, 409, 413, 429)}
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": ["batch"]},
                   "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                   "expires_after[seconds]": {"type": "integer", "minimum": api_files.MIN_EXPIRY,
                                              "maximum": api_files.MAX_EXPIRY}}}}}}}


def create_app(settings: Settings | None = None, open_access: bool = False, tasks: Tasks | None = None,
               listen_host: str | None = None, channel: InteractiveChannel | None = None,
               limiter: InteractiveLimiter | None = None) -> FastAPI:
    """``listen_host``: the address an open server listens on, the one name it answers besides
    ``localhost`` and ``BERTH_HTTP_ALLOWED_HOSTS`` (default: any loopback name); ``channel``: where
    chat and completions requests run (none: they are checked, then answered 503); ``limiter``: what
    counts each tenant's chat and completions against its limits (``app.state.limiter``; tests give one
    with their own clock)."""
    settings = settings or Settings()
    db = open_database(settings.database_url)
    files = JobFiles(settings.storage_url)
    tasks = tasks or Tasks(settings)
    model_name, started = settings.served_model_name(), int(now())
    app = FastAPI(title="berth", version="0.1.0",
                  summary="OpenAI's Files and Batches API over berth's jobs, chat and completions answered now",
                  responses=ERRORS)
    app.state.tasks = tasks
    app.state.limiter = limiter = limiter or InteractiveLimiter()
    limits = LimitsCache(lambda name: interactive_limits(db, name, settings.http_tenant_live_requests,
                                                         settings.http_tenant_tokens_per_minute),
                         clock=limiter.clock)
    install(app)
    bearer = HTTPBearer(auto_error=False, description="an API key from `berth key create --tenant T`")

    def tenant_of(authorization: str | None) -> str:
        """The tenant of a request's ``Authorization`` header (run by the guard, before its body is read)."""
        scheme, key = get_authorization_scheme_param(authorization)
        given = scheme.lower() == "bearer" and bool(key)
        if given and (found := tenant_of_key(db, key)) is not None:
            return found
        if open_access:
            return OPEN_TENANT
        what = "Incorrect API key provided" if given else "No API key provided"
        raise ApiError(401, f"{what}: send 'Authorization: Bearer <key>' with a key from `berth key create "
                       "--tenant NAME`", None, "invalid_api_key")

    def tenant(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
        return request.scope[TENANT_SCOPE_KEY]  # the guard found it, or answered 401

    def route_body_limit(method: str, path: str) -> int:
        if method == "POST" and path == "/v1/files":
            return body_limit(settings.max_file_bytes)
        return settings.http_max_body_bytes

    app.add_middleware(RequestGuard, tenant_of=tenant_of, body_limit=route_body_limit,
                       open_hosts=allowed_hosts(listen_host, settings.allowed_hosts()) if open_access else None,
                       origin_hosts=frozenset(settings.allowed_hosts()))

    TenantName = Annotated[str, Depends(tenant)]
    def cancel_for(tenant_name: str, job_id: str) -> None:  # the dashboard's button, as POST .../cancel
        batches.cancel_batch(db, tenant_name, job_id)
        tasks.run(FINALIZE, job_id)

    def retry_for(tenant_name: str, job_id: str) -> str:  # the dashboard's button, as POST .../retry
        new_id = retry_job(db, files, settings, batches.tenant_job(db, tenant_name, job_id))
        tasks.run(INGEST, new_id)
        return new_id

    app.include_router(dashboard_router(db, files, lambda key: tenant_of_key(db, key), open_access,
                                        settings.http_secure_cookies, interactive_use(limiter, limits),
                                        JobActions(cancel_for, retry_for)))
    IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)]

    def batch_of(tenant_name: str, batch_id: str) -> dict:
        return batch_object(db, files, tenant_name, batch_id)

    # ---- files
    @app.post("/v1/files", response_model=FileObject, openapi_extra=_UPLOAD_BODY)
    async def upload_file(request: Request, tenant: TenantName, idempotency_key: IdempotencyKey = None) -> dict:
        await run_in_threadpool(api_files.check_quota, db, tenant, 1, settings)  # a full quota: before reading
        upload = await read_upload(request, settings.max_file_bytes, settings.http_max_form_fields)
        try:
            purpose = upload.fields.get("purpose")
            if purpose != api_files.UPLOAD_PURPOSE:
                given = "no purpose" if purpose is None else f"purpose {purpose[:40]!r}"
                raise ApiError(400, f"berth takes files for the Batch API: give purpose 'batch', not {given}",
                               "purpose")
            if upload.file is None:
                raise ApiError(400, "no file: send the requests as the form field 'file'", "file")
            try:
                expires_after = api_files.expiry_of_form(upload.fields)
            except ValueError as exc:
                raise ApiError(400, str(exc), "expires_after", "invalid_value") from None

            def save() -> str:
                return api_files.save_upload(db, files.store, tenant, upload.file, upload.filename or "upload.jsonl",
                                             settings, expires_after).id

            asked = fingerprint(purpose, upload.filename or "", upload.sha256,
                                *([] if expires_after is None else [str(expires_after)]))
            file_id = await run_in_threadpool(idempotent, db, tenant, "files.create", idempotency_key, asked, save)
        finally:
            upload.close()
        return (await run_in_threadpool(api_files.get_file, db, tenant, file_id)).to_openai()

    @app.get("/v1/files", response_model=FileList)
    def list_files(tenant: TenantName, after: Annotated[str | None, Query(max_length=64)] = None,
                   limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                   order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                   purpose: Annotated[str | None, Query(max_length=32)] = None) -> dict:
        with _cursor(after, batches.FILE_ID):
            views = api_files.list_files(db, tenant, after, limit, order == "desc", purpose)
        return list_object([v.to_openai() for v in views], limit)

    @app.get("/v1/files/{file_id}", response_model=FileObject)
    def retrieve_file(tenant: TenantName, file_id: Annotated[str, Path(max_length=64)]) -> dict:
        return _file(db, tenant, file_id).to_openai()

    @app.get("/v1/files/{file_id}/content", response_class=StreamingResponse,
             responses={200: {"content": {"application/octet-stream": {}}}})
    def file_content(tenant: TenantName, file_id: Annotated[str, Path(max_length=64)]) -> StreamingResponse:
        f = api_files.open_content(files.store, _file(db, tenant, file_id))
        return StreamingResponse(_chunks(f), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", response_model=FileDeleted)
    def delete_file(tenant: TenantName, file_id: Annotated[str, Path(max_length=64)]) -> dict:
        view = _file(db, tenant, file_id)
        api_files.delete_file(db, files.store, tenant, view.id)
        return {"id": view.id, "object": "file", "deleted": True}

    # ---- batches
    @app.post("/v1/batches", response_model=Batch)
    def create_batch(body: CreateBatch, tenant: TenantName, idempotency_key: IdempotencyKey = None) -> dict:
        def make() -> str:
            try:
                job_id = batches.create_batch(db, files, settings, tenant, body.input_file_id, body.endpoint,
                                              body.completion_window, body.metadata,
                                              body.output_expires_after and body.output_expires_after.seconds)
            except batches.InputFileMissing as exc:
                raise ApiError(400, str(exc), "input_file_id", "invalid_input_file") from None
            except ValueError as exc:  # the window, a file of another purpose, the tenant name
                raise ApiError(400, str(exc), None, "invalid_value") from None
            tasks.run(INGEST, job_id)
            return job_id

        asked = fingerprint(body.model_dump_json())
        return batch_of(tenant, idempotent(db, tenant, "batches.create", idempotency_key, asked, make))

    @app.get("/v1/batches", response_model=BatchList)
    def list_batches(tenant: TenantName, after: Annotated[str | None, Query(max_length=64)] = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict:
        with _cursor(after, batches.BATCH_ID):
            views = batches.list_batches(db, files, tenant, after, limit)
        return list_object([batches.batch_object(v) for v in views], limit)

    @app.get("/v1/usage", summary="The caller's tokens in and out per model over a period (berth's own route)")
    def get_usage(tenant: TenantName, since: Annotated[float, Query(ge=0)] = 0.0,
                  until: Annotated[float | None, Query(ge=0)] = None) -> dict:
        """``since`` and ``until``: Unix times; each request counted once, when its result was written."""
        return {"object": "list", "data": [r.to_dict() for r in usage(db, tenant, since, until)]}

    @app.get("/v1/batches/{batch_id}", response_model=Batch)
    def retrieve_batch(tenant: TenantName, batch_id: Annotated[str, Path(max_length=64)]) -> dict:
        return batch_of(tenant, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", response_model=Batch)
    def cancel_batch(tenant: TenantName, batch_id: Annotated[str, Path(max_length=64)],
                     idempotency_key: IdempotencyKey = None) -> dict:
        shown = {}

        def cancel() -> str:
            batches.cancel_batch(db, tenant, batch_id)
            shown["batch"] = batch_of(tenant, batch_id)  # cancelling: the finalize may close it at once
            tasks.run(FINALIZE, batch_id)
            return batch_id

        idempotent(db, tenant, "batches.cancel", idempotency_key, fingerprint(batch_id), cancel)
        return shown.get("batch") or batch_of(tenant, batch_id)

    @app.get("/v1/batches/{batch_id}/results", response_class=StreamingResponse,
             responses={200: {"content": {"application/jsonl": {}}}},
             summary="berth's extension: the lines finished so far, in input order (JSONL)")
    def batch_results(tenant: TenantName, batch_id: Annotated[str, Path(max_length=64)]) -> StreamingResponse:
        view = batches.tenant_job(db, tenant, batch_id)
        if view.output_file_id is not None and view.output_key is None:  # its output file expired or was deleted
            raise ApiError(404, f"the output of batch {view.id} is gone: its output file expired or was deleted")
        lines = (json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in finished_lines(db, view.id))
        return StreamingResponse(lines, media_type="application/jsonl")

    @app.post("/v1/batches/{batch_id}/retry", response_model=Batch,
              summary="berth's extension: a new batch of the failed lines of a finished batch")
    def retry_batch(tenant: TenantName, batch_id: Annotated[str, Path(max_length=64)],
                    idempotency_key: IdempotencyKey = None) -> dict:
        def retry() -> str:
            job_id = retry_job(db, files, settings, batches.tenant_job(db, tenant, batch_id))
            tasks.run(INGEST, job_id)
            return job_id

        return batch_of(tenant, idempotent(db, tenant, "batches.retry", idempotency_key, fingerprint(batch_id),
                                           retry))

    # ---- chat and completions, answered now (jobs.http.completions)
    add_completion_routes(app, channel, lambda: model_info(settings), TenantName, limiter, limits, model_name,
                          settings)

    # ---- models
    def model_object() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "berth"}

    @app.get("/v1/models", response_model=ModelList)
    def list_models(tenant: TenantName) -> dict:
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id}", response_model=Model)
    def retrieve_model(tenant: TenantName, model_id: Annotated[str, Path(max_length=200)]) -> dict:
        if model_id != model_name:
            raise ApiError(404, f"The model '{model_id[:200]}' does not exist: this server runs {model_name!r}",
                           "model", "model_not_found")
        return model_object()

    return app


def batch_object(db: Database, files: JobFiles, tenant: str, batch_id: str) -> dict:
    return batches.batch_object(batches.get_batch(db, files, tenant, batch_id))


def _file(db: Database, tenant: str, file_id: str) -> api_files.FileView:
    if not batches.FILE_ID.fullmatch(file_id):
        raise api_files.FileNotFound(file_id)
    return api_files.get_file(db, tenant, file_id)


@contextmanager
def _cursor(after: str | None, pattern: re.Pattern):
    """A list's ``after`` must be an id of that list: anything else is a 400 naming it."""
    problem = ApiError(400, f"after {(after or '')[:64]!r} is not an id of this list: give the last id of the page "
                       "before", "after")
    if after is not None and not pattern.fullmatch(after):
        raise problem
    try:
        yield
    except (api_files.FileNotFound, JobNotFound):
        raise problem from None


def _chunks(f) -> Iterator[bytes]:
    with f:
        while chunk := f.read(1 << 20):
            yield chunk


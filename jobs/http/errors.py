"""Every error of the HTTP API in OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``,
so that the openai client raises its usual exceptions (400 ``BadRequestError``, 401
``AuthenticationError``, 403 ``PermissionDeniedError``, 404 ``NotFoundError``, 409 ``ConflictError``, 413,
429 ``RateLimitError``).
FastAPI's own 422 validation errors become 400s naming the field; berth's errors become the status a
user can act on.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY

from jobs.http.files import FileNotFound
from jobs.http.idempotency import IdempotencyInProgress, IdempotencyKeyInvalid, IdempotencyMismatch
from jobs.http.quota import QuotaExceeded
from jobs.lines.validate import InputError
from jobs.pipeline.submit import JobRefused
from jobs.records.lifecycle import JobNotFound, JobStateError

log = logging.getLogger("berth.http")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """``headers``: sent with the answer (a 429's ``Retry-After``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def body_too_large(method: str, path: str, limit: int) -> JSONResponse:
    """The 413 of a body over its route's limit (FastAPI's ``max_body_size``), said before it is read
    when its Content-Length gives it away, else once the limit is passed. The connection is closed:
    the rest of the body is not read."""
    upload = path == "/v1/files"
    setting = "BERTH_MAX_FILE_BYTES (the largest file)" if upload else "BERTH_HTTP_MAX_BODY_BYTES"
    return error_response(413, f"the request body is over the limit of {limit:,} bytes for {method} {path[:100]}: "
                          f"send less, or ask the operator to raise {setting}", "file" if upload else None,
                          "request_too_large", headers={"Connection": "close"})


def _api_error(exc: Exception) -> ApiError:
    """berth's own exceptions as the API answers them."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, FileNotFound):
        return ApiError(404, f"No file found with id '{exc.file_id}'.")
    if isinstance(exc, JobNotFound):
        return ApiError(404, str(exc).replace("`berth list` shows the jobs there are", "GET /v1/batches lists your "
                                                                                       "batches"))
    if isinstance(exc, JobStateError):
        return ApiError(409, str(exc))
    if isinstance(exc, IdempotencyInProgress):
        return ApiError(409, str(exc), "Idempotency-Key", "idempotency_key_in_use")
    if isinstance(exc, IdempotencyKeyInvalid):
        return ApiError(400, str(exc), "Idempotency-Key", "invalid_idempotency_key")
    if isinstance(exc, IdempotencyMismatch):
        return ApiError(400, str(exc), "Idempotency-Key", "idempotency_key_reused")
    if isinstance(exc, JobRefused):
        return ApiError(429, str(exc), None, "too_many_batches")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), "file", "invalid_file")
    if isinstance(exc, QuotaExceeded):
        return ApiError(413, str(exc), "file", exc.code)
    raise exc


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return (f"{param}: {msg}" if param else msg), param


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error_response(404, "Unknown route: berth serves /v1/files, /v1/batches, /v1/models, "
                                  "/v1/chat/completions, /v1/completions and /v1/responses")
        if exc.status_code == 413 and (limit := request.scope.get(MAX_BODY_SIZE_SCOPE_KEY)) is not None:
            return body_too_large(request.method, request.url.path, limit)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    for kind in (ApiError, FileNotFound, JobNotFound, JobStateError, IdempotencyInProgress, IdempotencyMismatch,
                 IdempotencyKeyInvalid, JobRefused, InputError, QuotaExceeded):
        @app.exception_handler(kind)
        async def known(_: Request, exc: Exception):
            e = _api_error(exc)
            return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, "berth failed to answer this request; the server's log says why")

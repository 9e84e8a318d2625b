"""What ``berth serve`` checks of a request before any byte of its body is read: the ``Host`` of an
``--open`` server, cross-site requests (``jobs.http.origin``), the API key (401), and the body's size
against its route's limit (413). A refusal closes the connection without reading the body
(docs/http-api.md).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from jobs.http.errors import ApiError, body_too_large, error_response
from jobs.http.origin import cross_site_refusal, host_refusal

TENANT_SCOPE_KEY = "berth.tenant"
API_PREFIX = "/v1/"


class RequestGuard:
    def __init__(self, app: ASGIApp, *, tenant_of: Callable[[str | None], str], body_limit: Callable[[str, str], int],
                 open_hosts: frozenset[str] | None, origin_hosts: frozenset[str]):
        """``tenant_of(authorization header)``: the tenant, or ``ApiError`` 401; ``body_limit(method,
        path)``: the route's limit in bytes; ``open_hosts``: the Host names an open server answers
        (None: not open, any); ``origin_hosts``: names an ``Origin`` may give besides the ``Host``."""
        self.app, self.tenant_of, self.body_limit = app, tenant_of, body_limit
        self.open_hosts, self.origin_hosts = open_hosts, origin_hosts
        self._limited: dict[int, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        method, path = scope["method"], scope["path"]
        if self.open_hosts is not None and (why := host_refusal(headers, self.open_hosts)):
            return await _refuse(400, why, "invalid_host", scope, receive, send)
        if why := cross_site_refusal(method, headers, self.origin_hosts):
            return await _refuse(403, why, "cross_site_request", scope, receive, send)
        if path.startswith(API_PREFIX):
            try:
                scope[TENANT_SCOPE_KEY] = await run_in_threadpool(self.tenant_of, headers.get("authorization"))
            except ApiError as e:
                return await error_response(e.status, e.message, e.param, e.code,
                                            headers={"Connection": "close"})(scope, receive, send)
        limit = self.body_limit(method, path)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await body_too_large(method, path, limit)(scope, receive, send)
        if limit not in self._limited:
            self._limited[limit] = RequestBodyLimitMiddleware(self.app, max_body_size=limit)
        await self._limited[limit](scope, receive, send)


async def _refuse(status: int, message: str, code: str, scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(status, message, None, code, headers={"Connection": "close"})(scope, receive, send)

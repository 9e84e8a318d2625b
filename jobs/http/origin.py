"""The two checks that keep web pages from using ``berth serve`` through a visitor's browser: on an
``--open`` server, the ``Host`` must be a name it listens on (DNS rebinding); on every server, a
state-changing request a browser marks as cross-site (``Sec-Fetch-Site``, else ``Origin``) is refused.
Requests with neither header (programs) go through (docs/http-api.md).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
BROWSER_OK = frozenset({"same-origin", "none"})


def host_name(host: str) -> str:
    """``Host`` without its port, lower case: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def allowed_hosts(listen_host: str | None, extra: list[str]) -> frozenset[str]:
    """The names an open server answers: the loopback address it listens on (all of them when not
    known, or when it listens on ``localhost``, which may be either), ``localhost``, and ``extra``."""
    listen = (listen_host or "localhost").strip("[]").lower()
    own = set(LOOPBACK_NAMES) if listen == "localhost" else {listen}
    return frozenset(own | {"localhost"} | {host_name(h) for h in extra})


def host_refusal(headers: Headers, allowed: frozenset[str]) -> str | None:
    """Why the ``Host`` of a request to an open server is refused; None when it is one of ``allowed``."""
    host = headers.get("host")
    if host is not None and host_name(host) in allowed:
        return None
    return (f"Host {(host or '')[:100]!r} is not a name this server answers: `berth serve --open` answers "
            f"{', '.join(sorted(allowed))} only, so that a page elsewhere cannot read it through your browser; "
            "add a name with BERTH_HTTP_ALLOWED_HOSTS")


def cross_site_refusal(method: str, headers: Headers, allowed: frozenset[str] = frozenset()) -> str | None:
    """Why a state-changing request is refused as sent by a page elsewhere (None: it is not). ``allowed``:
    host names besides this server's ``Host`` that an ``Origin`` may name (a proxy's public name)."""
    if method.upper() in SAFE_METHODS:
        return None
    refused = ("a page on another site may not send this request through your browser ({}): use the dashboard "
               "from this server's own address, or the API from a program")
    site = headers.get("sec-fetch-site")
    if site is not None:
        return None if site.lower() in BROWSER_OK else refused.format(f"Sec-Fetch-Site: {site[:40]}")
    origin = headers.get("origin")
    if origin is None:
        return None
    netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
    if netloc and (netloc == headers.get("host", "").lower() or host_name(netloc) in allowed):
        return None
    return refused.format(f"Origin: {origin[:100]}")

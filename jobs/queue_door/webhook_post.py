"""One webhook POST, under one deadline for the whole of it.

A socket timeout bounds each read, not the answer: a receiver that sends one byte every two
seconds never trips it and holds the sender as long as it likes. So the POST runs as one asyncio
task under ``asyncio.timeout``: resolving the name, connecting, the TLS handshake, sending and
reading the answer's head all come out of the same seconds, and at the deadline the connection
is dropped, whatever the receiver is doing. The HTTP/1.1 exchange is h11's (sans-IO), over the
connection opened here to an address ``destinations.resolve`` checked, so nothing resolves the
name a second time. Only the status counts: the answer's body is not read.
"""

from __future__ import annotations

import asyncio
import ssl
from concurrent.futures import Executor, Future

import h11

from jobs.queue_door.destinations import Allowed, Destination, resolve

USER_AGENT = "berth-webhook/2"
READ_BYTES = 16 << 10


async def post(destination: Destination, url: str, body: bytes, headers: dict[str, str], timeout: float,
               allowed: Allowed, executor: Executor, lookups: list[Future]) -> str | None:
    """POST ``body``; None when the receiver answered 2xx in time, else what went wrong.
    ``DestinationRefused`` (the name resolved to an address berth does not POST to) is raised.
    The name is looked up on ``executor``, the lookup added to ``lookups`` (``destinations.resolve``)."""
    try:
        async with asyncio.timeout(timeout):
            status, reason = await _exchange(destination, url, body, headers, allowed, executor, lookups)
    except TimeoutError:
        return (f"no answer within {timeout:g} s (BERTH_WEBHOOK_TIMEOUT bounds the whole POST: resolving, "
                "connecting, sending and the answer)")
    except (OSError, ssl.SSLError, h11.ProtocolError) as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    return None if 200 <= status < 300 else f"HTTP {status} {reason}"[:500]


async def _exchange(destination: Destination, url: str, body: bytes, headers: dict[str, str], allowed: Allowed,
                    executor: Executor, lookups: list[Future]) -> tuple[int, str]:
    addresses = await resolve(destination, url, allowed, executor, lookups)
    context = ssl.create_default_context() if destination.scheme == "https" else None
    reader = writer = None
    failure: OSError | None = None
    for address in addresses:  # each one checked; connected to as it is (a literal: no lookup)
        try:
            reader, writer = await asyncio.open_connection(
                address, destination.port, ssl=context, server_hostname=destination.host if context else None)
            break
        except OSError as exc:
            failure = exc
    if writer is None:
        raise failure or OSError(f"{destination.host} resolved to no address")
    try:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="POST", target=destination.target, headers=[
            ("Host", destination.host_header), ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))), ("User-Agent", USER_AGENT), ("Connection", "close"),
            *headers.items()])
        writer.write(conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(READ_BYTES))
            elif isinstance(event, h11.Response):
                return event.status_code, event.reason.decode("latin-1")
            elif not isinstance(event, h11.InformationalResponse):  # closed, or switched protocols
                raise OSError("the receiver closed the connection without an answer")
    finally:
        writer.transport.abort()  # at once: no TLS goodbye a receiver could hold up

"""Where a webhook may go: public unicast addresses only, unless ``BERTH_WEBHOOK_ALLOW`` names the
destination. Checked when the job is made (``check_url``: the URL's form and a literal address) and
when it is sent (``resolve``: every address the name resolves to, connected to without resolving
again), reading addresses as the C library does (docs/queue.md, "Where a webhook may go").
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import string
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from urllib.parse import quote, urlsplit

Address = IPv4Address | IPv6Address

# Metadata services of the clouds: named in refusals (most are link-local, the rest not public either)
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "168.63.129.16"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")
LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}$){LABEL}(\.{LABEL})*")
NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
SETTING = "BERTH_WEBHOOK_ALLOW"


class DestinationRefused(ValueError):
    """A webhook URL berth will not POST to; the text says why and what to do."""


@dataclass(frozen=True)
class Allowed:
    """The operator's allow-list: networks whose addresses may be reached although not public, and
    host names that may be reached whatever they resolve to (the operator answers for their DNS)."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    hosts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> Allowed:
        """``BERTH_WEBHOOK_ALLOW``: comma-separated ``10.1.0.0/16``, ``127.0.0.1``, ``::1``, ``hooks.internal``."""
        networks, hosts = [], set()
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = entry.lower().rstrip(".")
            if not HOST_NAME.fullmatch(name) or _ipv4(name) is not None:
                raise ValueError(f"{SETTING}: {entry[:100]!r} is neither a network (10.1.0.0/16, 127.0.0.1, ::1) "
                                 "nor a host name (hooks.internal)")
            hosts.add(name)
        return cls(tuple(networks), frozenset(hosts))

    def permits(self, address: Address) -> bool:
        return any(address.version == n.version and address in n for n in self.networks)


PUBLIC_ONLY = Allowed()


@dataclass(frozen=True)
class Destination:
    """A webhook URL as berth reads it: ``host`` normalised (IDNA, lower case, no brackets),
    ``address`` set when the host is an IP address (in any spelling)."""

    scheme: str
    host: str
    port: int
    target: str  # path and query, what the request line names
    address: Address | None

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def parse_url(url: str) -> Destination:
    """The destination a URL names; ``DestinationRefused`` when it is no http(s) URL berth can POST to."""
    shown = url[:200]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number, a bracket left open
        raise DestinationRefused(f"webhook_url {shown!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DestinationRefused(f"webhook_url {shown!r}: give an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise DestinationRefused(f"webhook_url {shown!r}: a user name or password in the URL is not allowed (a "
                                 "receiver checks the X-Berth-Signature header instead); remove the 'user@' part")
    if port == 0:
        raise DestinationRefused(f"webhook_url {shown!r}: port 0 cannot be connected to")
    host, address = parts.hostname, None
    if ":" in host:  # urlsplit took it out of [brackets]: only an IPv6 address may be there
        try:
            address = ipaddress.IPv6Address(host.split("%")[0])
        except ValueError:
            raise DestinationRefused(f"webhook_url {shown!r}: [{host[:100]}] is not an IPv6 address") from None
        host = str(address)
    else:
        try:
            host = host.rstrip(".").encode("idna").decode("ascii").lower()
        except UnicodeError:
            raise DestinationRefused(f"webhook_url {shown!r}: {host[:100]!r} is not a valid host name") from None
        address = _ipv4(host)
        if address is not None:
            host = str(address)
        elif NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):  # what a URL parser and a resolver take as an address
            raise DestinationRefused(f"webhook_url {shown!r}: {host[:100]!r} is not a valid IPv4 address")
        elif not HOST_NAME.fullmatch(host):
            raise DestinationRefused(f"webhook_url {shown!r}: {host[:100]!r} is not a valid host name")
    target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=string.punctuation)
    return Destination(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), target, address)


def check_url(url: str, allowed: Allowed = PUBLIC_ONLY) -> Destination:
    """What a job's ``webhook_url`` is checked for when the job is made: its form, and the address
    when it is one (a name waits for ``resolve`` at send time). ``DestinationRefused`` says why not."""
    destination = parse_url(url)
    if destination.host in allowed.hosts:
        return destination
    if destination.address is not None:
        _check_address(url, destination.address, allowed)
    elif destination.host == "localhost" or destination.host.endswith(".localhost"):  # RFC 6761: always loopback
        raise DestinationRefused(_refusal(url, f"{destination.host} is a loopback name"))
    return destination


def lookup(host: str, port: int) -> list:
    """The system resolver's answer for a name (blocking: run on a thread of the sender's)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


async def resolve(destination: Destination, url: str, allowed: Allowed, executor: Executor,
                  lookups: list[Future]) -> list[str]:
    """The addresses to connect to for this destination: resolved once, each one checked
    (``DestinationRefused`` if any is refused: a name that also points inside is not trusted).

    The lookup runs on ``executor`` and is added to ``lookups``: a deadline that cancels this
    cannot stop the C resolver, so its thread runs on, and the caller waits for it before it
    counts the POST's slot free (a tenant's slow name server holds that tenant's slots only)."""
    if destination.address is not None:
        if destination.host not in allowed.hosts:
            _check_address(url, destination.address, allowed)
        return [str(destination.address)]
    job = executor.submit(lookup, destination.host, destination.port)
    lookups.append(job)
    try:
        infos = await asyncio.wrap_future(job)
    except socket.gaierror as exc:
        raise OSError(f"{destination.host} could not be resolved ({exc.strerror})") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))  # as connect takes them (a scope id kept)
    if destination.host not in allowed.hosts:
        for address in addresses:
            _check_address(url, ipaddress.ip_address(address.split("%")[0]), allowed, via=destination.host)
    return addresses


def refusal_reason(address: Address) -> str | None:
    """Why an address is not public (``a loopback address``, ...); None for a public unicast one.
    An IPv6 address that stands for an IPv4 one (IPv4-mapped, NAT64) is that one; a 6to4 one is
    refused when the IPv4 address it routes to is."""
    inner = _ipv4_inside(address)
    if inner is not None:
        return _reason(inner)
    if address.version == 6 and address.sixtofour is not None:
        reason = _reason(address.sixtofour)
        if reason is not None:
            return reason
    return _reason(address)


def _reason(address: Address) -> str | None:
    checks = (
        (address in METADATA, "a cloud metadata address"),
        (address.is_unspecified, "the unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_private, "a private address"),
        (address.is_reserved, "a reserved address"),
        (not address.is_global, "an address that is not public"),  # 100.64.0.0/10 and the like
    )
    return next((reason for hit, reason in checks if hit), None)


def _ipv4_inside(address: Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 one is another spelling of: IPv4-mapped (``::ffff:a.b.c.d``), NAT64."""
    if address.version == 4:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return IPv4Address(int(address) & 0xFFFFFFFF) if address in NAT64 else None


def _check_address(url: str, address: Address, allowed: Allowed, via: str | None = None) -> None:
    inner = _ipv4_inside(address)
    if allowed.permits(address) or (inner is not None and allowed.permits(inner)):
        return
    reason = refusal_reason(address)
    if reason is not None:
        shown = str(address) if inner is None else f"{address} ({inner})"
        why = f"{via} resolves to {shown}, {reason}" if via else f"{shown} is {reason}"
        raise DestinationRefused(_refusal(url, why))


def _refusal(url: str, why: str) -> str:
    return (f"webhook_url {url[:200]!r}: {why}; berth POSTs webhooks to public addresses only. "
            f"Give a public receiver, or ask the operator to name it in {SETTING}")


def _ipv4(host: str) -> IPv4Address | None:
    """The IPv4 address a host is to ``inet_aton`` (1 to 4 parts, each decimal, 0x-hex or 0-octal,
    the last filling the bytes left), or None when it is a name."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    numbers = []
    for part in parts:
        if re.fullmatch(r"0[xX][0-9a-fA-F]*", part):
            numbers.append(int(part[2:] or "0", 16))
        elif re.fullmatch(r"0[0-7]*", part):
            numbers.append(int(part, 8))
        elif re.fullmatch(r"[1-9][0-9]*", part):
            numbers.append(int(part))
        else:
            return None
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 1 << (8 * (4 - len(head))):
        return None  # inet_aton refuses it, and so does a resolver: no address
    value = 0
    for n in head:
        value = value << 8 | n
    return IPv4Address(value << (8 * (4 - len(head))) | last)

"""A tenant's interactive limits on ``berth serve``: chat, completions and responses requests running at once, and
their tokens in any 60 s (``InteractiveLimits``: the tenant's own or the settings' defaults).

    held = limiter.enter(tenant, limits)     # 429 past its live requests
    held.reserve(prompt + n * max_tokens)    # 429 past its tokens per minute (400: more than the limit alone)
    ...                                      # the request runs
    held.end(used)                           # its place back, its tokens corrected to what it used

A request holds its place from the moment its body is read until its answer ends, fails or its caller
leaves; its tokens stay in the window for 60 s from its admission, as what it reserved until it ends and
as what it used after. Past either limit the answer is a 429 in OpenAI's body with ``Retry-After``: the
seconds until the tokens it needs leave the window, or a second for a place (a running request's end
cannot be foreseen).

The counts live in this process's memory, so each ``berth serve`` process counts its own: behind a
balancer over N servers a tenant may hold N times its limits. That is the price of no shared state on
the request's path (docs/tenants.md). The limits are read from the tenant's row at most every
``LIMITS_TTL`` seconds (``LimitsCache``), so a change with ``berth tenant`` applies within that.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from jobs.http.errors import ApiError
from jobs.records.status import InteractiveLimits

WINDOW = 60.0  # seconds of the tokens-per-minute window
LIMITS_TTL = 5.0  # seconds a tenant's limits are kept before they are read again
PLACE_RETRY = 1  # Retry-After, in seconds, of a request refused for want of a place
LIVE_REQUESTS, TOKENS_PER_MINUTE = "live_requests", "tokens_per_minute"  # why a request was refused


class _Spent:
    """Tokens a request holds in its tenant's window since ``at``; ``tokens`` changes once, when it ends."""

    __slots__ = ("at", "tokens")

    def __init__(self, at: float, tokens: int):
        self.at, self.tokens = at, tokens


@dataclass
class _Tenant:
    live: int = 0  # requests running
    window: deque[_Spent] = field(default_factory=deque)  # oldest first


class InteractiveLimiter:
    """Each tenant's live requests and tokens of the last ``WINDOW`` seconds, in this process. Thread-safe
    (the dashboard reads it from a pool thread); ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}
        self.refused: Counter[tuple[str, str]] = Counter()  # (tenant, why) -> requests answered 429

    def enter(self, tenant: str, limits: InteractiveLimits) -> Held:
        """A place for one request of ``tenant``; 429 when it holds ``limits.live_requests`` already."""
        with self._lock:
            state = self._tenants.setdefault(tenant, _Tenant())
            if limits.live_requests and state.live >= limits.live_requests:
                self.refused[tenant, LIVE_REQUESTS] += 1
                raise _too_many(f"this tenant has {state.live:,} interactive requests running on this "
                                f"server, its limit of requests at once ({_source(limits, LIVE_REQUESTS)}): retry "
                                "once one has ended", PLACE_RETRY)
            state.live += 1
        return Held(self, tenant, limits)

    def _reserve(self, tenant: str, limits: InteractiveLimits, tokens: int) -> _Spent:
        with self._lock:
            state = self._tenants[tenant]
            now = self.clock()
            used = self._used(state, now)
            limit = limits.tokens_per_minute
            if limit and tokens > limit:  # never fits: the caller's to change, not a rate
                raise ApiError(400, f"max_tokens: this request holds {tokens:,} tokens (its prompt and n x "
                               f"max_tokens), over this tenant's {limit:,} tokens per minute "
                               f"({_source(limits, TOKENS_PER_MINUTE)}) on its own: ask for fewer tokens",
                               "max_tokens", "tokens_per_minute_exceeded")
            if limit and used + tokens > limit:
                self.refused[tenant, TOKENS_PER_MINUTE] += 1
                wait = self._room_in(state, now, used + tokens - limit)
                raise _too_many(f"Rate limit reached for this tenant on tokens per min (TPM): Limit {limit:,}, "
                                f"Used {used:,}, Requested {tokens:,} (its prompt and n x max_tokens; "
                                f"{_source(limits, TOKENS_PER_MINUTE)}). Please try again in {wait}s.", wait)
            spent = _Spent(now, tokens)
            state.window.append(spent)
            return spent

    def _leave(self, tenant: str) -> None:
        with self._lock:
            state = self._tenants[tenant]
            state.live -= 1
            self._forget_idle(tenant, state, self.clock())

    def _used(self, state: _Tenant, now: float) -> int:
        while state.window and state.window[0].at <= now - WINDOW:
            state.window.popleft()
        return sum(s.tokens for s in state.window)

    @staticmethod
    def _room_in(state: _Tenant, now: float, over: int) -> int:
        """Whole seconds until ``over`` tokens have left the window (at least 1)."""
        freed = 0
        for spent in state.window:
            freed += spent.tokens
            if freed >= over:
                return max(1, math.ceil(spent.at + WINDOW - now))
        return math.ceil(WINDOW)

    def _forget_idle(self, tenant: str, state: _Tenant, now: float) -> None:
        if not state.live and not self._used(state, now):
            del self._tenants[tenant]

    def usage(self, tenant: str) -> tuple[int, int]:
        """(requests running, tokens of the last 60 s) of ``tenant`` now."""
        with self._lock:
            state = self._tenants.get(tenant)
            return (0, 0) if state is None else (state.live, self._used(state, self.clock()))

    def tenants(self) -> dict[str, tuple[int, int]]:
        """``usage`` of every tenant holding anything now."""
        with self._lock:
            now = self.clock()
            for tenant, state in list(self._tenants.items()):
                self._forget_idle(tenant, state, now)
            return {tenant: (state.live, self._used(state, now)) for tenant, state in self._tenants.items()}

    def refusals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.refused)


class Held:
    """One request's place, and its tokens once reserved; ``end`` gives the place back (once)."""

    def __init__(self, limiter: InteractiveLimiter, tenant: str, limits: InteractiveLimits):
        self._limiter, self.tenant, self.limits = limiter, tenant, limits
        self._spent: _Spent | None = None
        self._ended = False

    def reserve(self, tokens: int) -> None:
        """Hold ``tokens`` in the tenant's window; 429 (400 when they are over the limit alone) if they do not fit."""
        self._spent = self._limiter._reserve(self.tenant, self.limits, tokens)

    def end(self, used: int | None = None) -> None:
        """The request is over: its place back; the tokens it reserved become ``used`` (None: as reserved)."""
        if self._ended:
            return
        self._ended = True
        if self._spent is not None and used is not None:
            with self._limiter._lock:
                self._spent.tokens = max(0, used)
        self._limiter._leave(self.tenant)


class LimitsCache:
    """Each tenant's ``InteractiveLimits``, read by ``read(tenant)`` (the database) at most every ``ttl``
    seconds: the row is not read on every request."""

    def __init__(self, read: Callable[[str], InteractiveLimits], ttl: float = LIMITS_TTL,
                 clock: Callable[[], float] = time.monotonic):
        self._read, self._ttl, self._clock = read, ttl, clock
        self._kept: dict[str, tuple[float, InteractiveLimits]] = {}
        self._lock = threading.Lock()

    def cached(self, tenant: str) -> InteractiveLimits | None:
        with self._lock:
            kept = self._kept.get(tenant)
        return kept[1] if kept is not None and self._clock() < kept[0] else None

    def read(self, tenant: str) -> InteractiveLimits:
        """The tenant's limits, read now if not kept (a database read: call it off the event loop)."""
        if (found := self.cached(tenant)) is not None:
            return found
        limits = self._read(tenant)
        with self._lock:
            if len(self._kept) > 10_000:  # tenants come and go: never more than this kept
                self._kept.clear()
            self._kept[tenant] = (self._clock() + self._ttl, limits)
        return limits


def _too_many(message: str, retry_after: int) -> ApiError:
    return ApiError(429, message, None, "rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def _source(limits: InteractiveLimits, why: str) -> str:
    if why == LIVE_REQUESTS:
        own, setting, flag = limits.own_live_requests, "BERTH_HTTP_TENANT_LIVE_REQUESTS", "--live-requests"
    else:
        own, setting, flag = limits.own_tokens_per_minute, "BERTH_HTTP_TENANT_TOKENS_PER_MINUTE", "--tokens-per-minute"
    return f"set by `berth tenant NAME {flag}`" if own else f"{setting}, or `berth tenant NAME {flag}`"


def interactive_use(limiter: InteractiveLimiter, limits: LimitsCache) -> Callable[[str | None], list[dict]]:
    """What the dashboard shows of the interactive limits: a tenant its own limits and use on this server;
    the operator (None) every tenant holding requests or tokens now. Reads the database (call it off the
    event loop)."""

    def row(tenant: str, use: tuple[int, int]) -> dict:
        own = limits.read(tenant)
        return {"tenant": tenant, "live": use[0], "live_limit": own.live_requests, "tokens": use[1],
                "tokens_per_minute": own.tokens_per_minute}

    def shown(tenant: str | None) -> list[dict]:
        if tenant is not None:
            return [row(tenant, limiter.usage(tenant))]
        return [row(name, use) for name, use in sorted(limiter.tenants().items())]

    return shown

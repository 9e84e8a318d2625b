"""When to try again a service that stopped answering: the one backoff of the engine worker.

The worker's loop never sleeps on a service that is down: it asks ``ready()`` before a call, reports
``failed()`` or ``succeeded()`` after it, and keeps stepping the engine meanwhile.
"""

from __future__ import annotations

import time

RECONNECT = (1.0, 5.0)  # seconds between tries to reach a broker that went away: first, most


class Backoff:
    def __init__(self, first: float, most: float):
        self.first, self.most = first, most
        self.down_since: float | None = None  # monotonic time of the first failure in a row
        self._delay = first
        self._retry_at = 0.0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def ready(self) -> bool:
        """True while the service is up, or when its next try is due."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def failed(self) -> bool:
        """Another failure; True if it is the first of an outage (log it then, once)."""
        first = self.down_since is None
        if first:
            self.down_since, self._delay = time.monotonic(), self.first
        else:
            self._delay = min(2 * self._delay, self.most)
        self._retry_at = time.monotonic() + self._delay
        return first

    def succeeded(self) -> float | None:
        """A call got through; the seconds the outage lasted if one just ended."""
        if self.down_since is None:
            return None
        lasted, self.down_since = time.monotonic() - self.down_since, None
        return lasted

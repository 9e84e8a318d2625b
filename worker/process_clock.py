"""Seconds since this process started, for the start-up log lines: a worker restarted after a crash
does nothing useful until it is ready, and its log should say how long that took, interpreter and
imports included (they are most of it), not just the part after ``main`` began."""

from __future__ import annotations

import os
import time

_IMPORTED = time.monotonic()


def seconds_since_start() -> float:
    """From the kernel's start time of this process (Linux), else from when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED

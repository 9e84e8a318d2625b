"""What the CPU can do, read from /proc/cpuinfo: the vector paths and multiplies berth picks from."""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def cpu_signature() -> str:
    """The CPU's flags line (an identity for what a native build targets), or the machine's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx2``, ``avx512f``, ``amx_bf16``, ...); empty where none can be read."""
    line = cpu_signature()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") and ":" in line else set()

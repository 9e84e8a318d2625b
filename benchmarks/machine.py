"""The machine a benchmark ran on, described one way for every benchmark.

``machine_info`` is the dict a JSON report keeps under ``machine``: the CPU's model name, family and
model numbers (the first processor of ``/proc/cpuinfo``), which of ``FEATURES`` it has, the flags that
decide which matmul and attention code runs, the core count, the threads the run used, and the versions
of torch, transformers and Python. ``machine_line`` is that dict as the one line a printed header
carries, e.g. ``Intel Xeon (family 6 model 167; AVX-512 BF16, AMX), 2 cores, 2 threads``.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# the features that pick berth's and PyTorch's CPU paths: /proc/cpuinfo's flag, and its name in a header
FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16", "amx_tile": "AMX"}
VECTOR_LADDER = ("avx2", "avx512f", "avx512_bf16")  # each implies the ones before it: a header names the top one
# the flags a report lists (AVX2, FMA, F16C, AVX-512 and its BF16/VNNI parts, AMX, SSE4)
FLAG_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4", "vnni")


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (``model name``, ``cpu family``, ``model``,
    ``flags``, ...); empty where that file cannot be read."""
    try:
        first = CPUINFO.read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in first.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields


def machine_info(threads: int | None = None) -> dict:
    """The machine, for a JSON report. ``threads``: the threads the run's engine uses; torch's own count
    where None."""
    import torch

    fields = cpu_fields()
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name") or platform.processor() or "unknown CPU",
            "cpu_family": _number(fields.get("cpu family")), "cpu_model_number": _number(fields.get("model")),
            "cpu_features": {flag: flag in flags for flag in FEATURES},
            "cpu_flags": sorted(f for f in flags if f.startswith(FLAG_PREFIXES)),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads() if threads is None else threads,
            "torch": torch.__version__, "transformers": _version("transformers"),
            "python": platform.python_version(), "platform": platform.platform()}


def machine_line(info: dict | None = None) -> str:
    """``info`` (a ``machine_info`` dict; this machine's, with torch's threads, where None) in one line:
    the model name without its trademarks, family and model, the features it has (the top of the vector
    ladder, and AMX), cores and threads."""
    m = machine_info() if info is None else info
    name = " ".join(re.sub(r"\((?:R|TM|tm)\)|\bProcessor\b", " ", m["cpu_model"]).split()) or m["cpu_model"]
    has = m["cpu_features"]
    shown = [next((FEATURES[f] for f in reversed(VECTOR_LADDER) if has.get(f)), "no AVX2")]
    shown += [FEATURES["amx_tile"]] if has.get("amx_tile") else []
    numbers = f"family {m['cpu_family']} model {m['cpu_model_number']}; " if m["cpu_family"] is not None else ""
    threads = m["threads"]
    return (f"{name} ({numbers}{', '.join(shown)}), {m['cpu_count']} cores, "
            f"{threads} thread{'' if threads == 1 else 's'}")


def _number(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None

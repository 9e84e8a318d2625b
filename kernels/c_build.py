"""Building a C kernel with the system compiler, once per source, compiler, CPU and flags.

Each kernel (``cpu_attention``'s decode attention, ``int8_linear``'s multiply) is one C file compiled
for the CPU it runs on (``-march=native``, OpenMP shared with PyTorch's runtime) into the folder its
caller names, under a name that hashes everything the build depends on, so a changed source, compiler
or CPU builds anew and an unchanged one loads the file already there.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kernels.cpu_features import cpu_signature

log = logging.getLogger(__name__)

ISAS = {None: [], "avx2": ["-mno-avx512f"]}  # "avx2": leave AVX-512 out of a native build


def isa_flags(isa: str | None) -> list[str]:
    """The flags that build ``isa``'s vector path: None, what the CPU has; "avx2", the AVX2 path even
    where the CPU has AVX-512 (tests run the other kind of CPU's path so)."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(k for k in ISAS if k)} or None, not {isa!r}")
    return ISAS[isa]


def build(source: Path, folder: Path, flags: list[str] = (), without: str = "") -> ctypes.CDLL | None:
    """``source`` compiled into a shared library in ``folder`` and loaded; None, with a warning that
    ends with ``without`` (what the caller does instead), where no compiler is found or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s cannot be built%s", source.name, without and f"; {without}")
        return None
    text = source.read_bytes()
    key = hashlib.sha256(text + compiler.encode() + cpu_signature().encode() + " ".join(flags).encode())
    folder = Path(folder)
    target = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        log.info("building %s for this CPU: once, about 2-10 s, kept in %s for the runs after", source.name, folder)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(built),
                   str(source), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building %s failed (%s)%s\n%s", source.name, " ".join(cmd), without and f": {without}",
                            result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: a concurrent build never leaves a torn file
        log.info("built %s in %.1f s", source.name, time.monotonic() - started)
    return ctypes.CDLL(str(target))

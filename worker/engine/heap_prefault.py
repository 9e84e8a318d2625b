"""Fault in, on a thread of its own, the heap memory the model's build is about to fill.

Building the model on the CPU copies every linear weight into oneDNN's blocked layout
(``worker.model.linear``): for the default model in float32 about 540 MiB of new memory, every page
of it faulted in by the copy that first writes it. On the 2-core KVM machines of benchmarks/HISTORY.md
("Start-up") those 135,000 faults were most of the build's time. Meanwhile, while the process
imports torch (a second of work holding the GIL, on one core), the other core is idle.

So ``start(settings)``, called before torch's import, takes from glibc's heap what the last build of
the same model took (``record``, a hint under ``cache_dir("heap")``; nothing on a first start), and a
thread faults it in and frees it. The blocks are taken in the calling thread, so that they come from
the main arena, the one the build's allocations come from; the trim threshold
(``worker.engine.step_heap``) keeps them in the process once freed, and the build's copies then land
on pages already present: those under glibc's mapping threshold, and larger ones too (the LM head's
copy is 113 MiB) while a free block in the heap holds them. ``build(...)`` waits for the thread first
(what it has not faulted yet the build would fault itself), and records the heap the build took for
the next start. Nothing is done where the C library is not glibc (no ``mallinfo2``), off the CPU, or
where the hint is missing or unreadable: the build then faults its pages as before. What the weights
hold, and so the numbers, are the same either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from worker.config import ConfigError, Settings, cache_dir
from worker.engine.step_heap import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_step_temporaries_in_heap

log = logging.getLogger("berth.engine")

PIECE = MMAP_THRESHOLD - 2**20  # under glibc's mapping threshold: each piece comes from the heap
LIMIT = TRIM_THRESHOLD * 3 // 4  # more, freed at the heap's top, could be trimmed away again
# Faults a range's pages in with one call, without the trap per page that writing them costs: on the
# 2-core KVM machines 0.21-0.27 s for 500 MiB against 0.26-0.42 for memset, and 0.23-0.28 against 0.5-0.7
# beside torch's import (Linux 5.14 and later)
MADV_POPULATE_WRITE = 23

_started: dict[int, threading.Thread | None] = {}  # by process id (None: nothing to fault in yet)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    """glibc's malloc, free, memset, madvise and mallinfo2 (glibc 2.33+), typed; None elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        functions = libc.malloc, libc.free, libc.memset, libc.mallinfo2
    except (AttributeError, OSError):
        return None
    malloc, free, memset, mallinfo2 = functions
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    memset.argtypes, memset.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], ctypes.c_void_p
    mallinfo2.argtypes, mallinfo2.restype = [], _MallInfo2
    return libc


def hint_file(model_path: str, dtype: str, weight_dtype: str) -> Path:
    """Where the heap a build of this model file, dtype and weight dtype took is written down."""
    source = Path(model_path).resolve()
    try:
        stat = source.stat()
        version = f"{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        version = "-"
    key = "\n".join((str(source), version, dtype, weight_dtype))
    return cache_dir("heap") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _hinted_bytes(path: Path) -> int:
    try:
        nbytes = json.loads(path.read_text())["heap_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return min(nbytes, LIMIT) if isinstance(nbytes, int) and nbytes > 0 else 0


def start(settings: Settings) -> None:
    """Start faulting in the heap that ``settings``' model will take, once per process; call it before
    importing torch, whose import then runs beside it. Where the engine may run elsewhere than on the
    CPU, no hint is ever recorded and nothing starts."""
    if os.getpid() in _started or settings.device not in ("auto", "cpu"):
        return
    libc = _libc()
    if libc is None or not keep_step_temporaries_in_heap():
        return
    try:
        model_path = settings.model_path()
    except ConfigError:  # no model: the engine's load says so, with what to do
        return
    nbytes = _hinted_bytes(hint_file(model_path, settings.dtype, settings.weight_dtype))
    _started[os.getpid()] = None  # this process's build records its heap, for the next start
    if nbytes == 0:
        return
    pieces = [p for p in (libc.malloc(PIECE) for _ in range(-(-nbytes // PIECE))) if p]
    thread = threading.Thread(target=_fault_and_free, args=(libc, pieces), name="berth-heap-prefault", daemon=True)
    _started[os.getpid()] = thread
    thread.start()


def _fault_and_free(libc, pieces: list[int]) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    for p in pieces:  # ctypes lets go of the GIL for each call
        start, end = -(-p // page) * page, (p + PIECE) // page * page
        if libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:  # Linux before 5.14: EINVAL
            libc.memset(p, 0, PIECE)
    for p in pieces:
        libc.free(p)


@contextlib.contextmanager
def build(model_path: str, dtype: str, weight_dtype: str):
    """Around the model's build on the CPU, in a process that called ``start``: waits for its thread, and
    records the heap the build took, for the next start. Elsewhere (an engine built by the Python API or
    a test, a ``--respawn`` child) it does nothing: what those take is not what a start takes."""
    if os.getpid() not in _started:
        yield
        return
    thread = _started[os.getpid()]
    if thread is not None:
        thread.join()
    libc = _libc()
    before = libc.mallinfo2().uordblks if libc is not None else 0
    yield
    if libc is not None:
        record(hint_file(model_path, dtype, weight_dtype), libc.mallinfo2().uordblks - before)


def record(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` as the hint at ``path`` (whole, by a rename), unless it says that already, within
    an eighth (what else the process allocated meanwhile moves it a little); a cache that cannot be
    written only costs the next start its head start."""
    old = _hinted_bytes(path)
    if nbytes <= 0 or abs(min(nbytes, LIMIT) - old) <= old // 8:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        temp.write_text(json.dumps({"heap_bytes": nbytes}))
        os.replace(temp, path)
    except OSError as exc:
        log.debug("the heap hint %s was not written (%s)", path, exc)

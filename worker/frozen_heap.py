"""The heap as a run starts, frozen for the run (``gc.freeze``), as vLLM's engine core does after its
start-up: the collector's full collections then walk only the objects made since, not torch's,
transformers' and the model's millions. One such walk stopped the engine loop for 190-210 ms in the
middle of a 1,000-request job at a simulated H200's pace (AMD EPYC, benchmarks/HISTORY.md, "The
collector's full walks"): 40 device steps waiting.

Freezing is O(1) and collects nothing: garbage already there stays until the run ends, when the heap is
unfrozen (``gc.unfreeze``) and the collector takes it all back, so that a process running several
engines one after another (tests, notebooks) leaks nothing. Runs nested or side by side in one process
share one freeze, given back when the last ends.

A command that starts an engine runs in ``start_up``: the collector stays off until its first run
begins (or the command ends without one), as the objects start-up makes (torch's import, the model's
load, the database's modules) are meant to live; the collector's full walks over them as the heap grew
were 0.33 s of a worker's 2.4 s start (benchmarks/HISTORY.md, "A worker's start without the
collector"). The run's freeze then takes them, and the collector is turned back on.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_runs = 0
_starting = False  # ``start_up`` turned the collector off: the first run turns it on


@contextmanager
def start_up() -> Iterator[None]:
    """No collection until the first run inside begins (``frozen_heap``), which freezes what start-up made and
    turns the collector back on; on again at the end where no run began (an error, a command called in a
    test's process). A no-op inside a run, or where the collector is off already."""
    global _starting
    with _lock:
        mine = _runs == 0 and gc.isenabled()
        if mine:
            gc.disable()
            _starting = True
    try:
        yield
    finally:
        with _lock:
            if mine and _starting:
                gc.enable()
                _starting = False


@contextmanager
def frozen_heap() -> Iterator[None]:
    global _runs, _starting
    with _lock:
        _runs += 1
        if _runs == 1:
            gc.freeze()
        if _starting:
            gc.enable()
            _starting = False
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                gc.unfreeze()

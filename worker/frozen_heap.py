"""The heap as a run starts, frozen for the run (``gc.freeze``), as vLLM's engine core does after its
start-up: the collector's full collections then walk only the objects made since, not torch's,
transformers' and the model's millions. One such walk stopped the engine loop for 190-210 ms in the
middle of a 1,000-request job at a simulated H200's pace (AMD EPYC, benchmarks/HISTORY.md, "The
collector's full walks"): 40 device steps waiting.

Freezing is O(1) and collects nothing: garbage already there stays until the run ends, when the heap is
unfrozen (``gc.unfreeze``) and the collector takes it all back, so that a process running several
engines one after another (tests, notebooks) leaks nothing. Runs nested or side by side in one process
share one freeze, given back when the last ends.

A command that starts an engine calls ``start_up`` first: the collector stays off until its first run
begins, as the objects start-up makes (torch's import, the model's load, the database's modules) are
meant to live; the collector's full walks over them as the heap grew were 0.33 s of a worker's 2.4 s
start (benchmarks/HISTORY.md, "A worker's start without the collector"). The run's freeze then takes
them, and the collector is turned back on.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_runs = 0
_starting = False  # ``start_up`` turned the collector off: the first run turns it on


def start_up() -> None:
    """No collection until the process's first run begins (``frozen_heap``), which freezes what start-up made
    and turns the collector back on. For a command that runs an engine, or exits (an error) before."""
    global _starting
    with _lock:
        if _runs == 0 and gc.isenabled():
            gc.disable()
            _starting = True


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

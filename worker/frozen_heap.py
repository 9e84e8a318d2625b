"""The heap as a run starts, frozen for the run (``gc.freeze``), as vLLM's engine core does after its
start-up: the collector's full collections then walk only the objects made since, not torch's,
transformers' and the model's millions. One such walk stopped the engine loop for 190-210 ms in the
middle of a 1,000-request job at a simulated H200's pace (AMD EPYC, benchmarks/HISTORY.md, "The
collector's full walks"): 40 device steps waiting.

Freezing is O(1) and collects nothing: garbage already there stays until the run ends, when the heap is
unfrozen (``gc.unfreeze``) and the collector takes it all back, so that a process running several
engines one after another (tests, notebooks) leaks nothing. Runs nested or side by side in one process
share one freeze, given back when the last ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_runs = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    global _runs
    with _lock:
        _runs += 1
        if _runs == 1:
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                gc.unfreeze()

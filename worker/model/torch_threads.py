"""Run a stretch of short torch operations on one thread.

Loading a model is a few thousand short operations (dequantising GGUF blocks, reordering each
weight for oneDNN and probing it): on two threads each operation waits at its end for the other
thread, and where another process holds that core, the wait is that process's time slice. On the
2-core machines (benchmarks/HISTORY.md, start-up) two threads were a third faster when the machine was
quiet and several times slower beside one busy process; a worker restarted after a crash usually
starts beside busy ones, so loading runs on one thread and the engine's steps on ``--threads``.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

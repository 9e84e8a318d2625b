"""Keep a CPU step's temporaries in the heap, not in a fresh memory mapping each time.

A step on the CPU makes hundreds of tensors of megabytes each (a layer's projections, its norms and
activations: a 2,048-token step's gate/up output alone is 25 MB) and frees them within milliseconds.
glibc's ``malloc`` serves a block of 128 KiB or more with its own ``mmap`` and gives it back with
``munmap`` when freed (the threshold grows with what is freed, but only up to the size last freed),
so a step's tensor larger than the last one freed comes from new pages, each one a page fault that
the kernel answers with a zeroed page. On the 2-core AMD EPYC of benchmarks/HISTORY.md ("The step's
temporaries in the heap"), 64 requests of the throughput workload took 0.54-0.66 million page faults
and 3.6-4.9 s of system time in a 58 s run; with the blocks kept in the heap, 0.26 million (most of
them the KV cache's first touches) and 2.3-3.4 s, and 1.03-1.04 times the useful tokens/s.

So the engine raises glibc's mapping threshold to its largest (32 MiB on 64-bit) and its trim
threshold to 1 GiB: blocks up to 32 MiB come from the heap and stay there when freed, for the next
step to reuse. What a worker keeps is the most its steps held at once (the heap does not grow
beyond that); blocks over 32 MiB (the logits of more than about 170 rows of a 49,152-token
vocabulary) are still mapped and unmapped. Nothing is done where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("berth.engine")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30


@functools.cache
def keep_step_temporaries_in_heap() -> bool:
    """Set glibc's thresholds once per process; False (and nothing changed) where it is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        glibc = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        log.debug("not glibc: the C library's malloc thresholds left as they are")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if done:
        log.debug("glibc %s: blocks up to %d MiB kept in the heap for the next step", glibc, MMAP_THRESHOLD >> 20)
    else:
        log.warning("glibc %s refused the malloc thresholds: each CPU step's temporaries come from new pages", glibc)
    return done

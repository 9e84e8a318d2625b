"""A CPU step's temporaries come from the heap, and stay there for the next step once the engine has
set glibc's thresholds (worker.engine.step_heap): read from glibc's own counts (``mallinfo2``), in a
process of its own for each case, as the thresholds are process-wide."""

import json
import subprocess
import sys

import pytest

from worker.engine.step_heap import keep_step_temporaries_in_heap

STEPS = r"""
import json, sys
import torch
from worker.engine.heap_prefault import _libc  # glibc's functions, typed (mallinfo2 among them); sets nothing
from worker.engine.step_heap import keep_step_temporaries_in_heap

libc = _libc()
if sys.argv[1] == "kept":
    assert keep_step_temporaries_in_heap()
SIZES_MIB = (30, 28, 24, 20, 16)  # larger than anything importing torch maps and frees

def step():  # a step's tensors, held together for a while, then all freed (as a layer's are)
    held = [torch.empty(mib * 2**18) for mib in SIZES_MIB]
    mapped = libc.mallinfo2().hblkhd
    del held
    return mapped

before = libc.mallinfo2()
mapped = step()
print(json.dumps({"mapped_while_held": mapped - before.hblkhd, "heap_kept": libc.mallinfo2().arena - before.arena}))
"""


def heap_figures(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not keep_step_temporaries_in_heap(), reason="glibc's malloc only")
def test_a_steps_temporaries_come_from_the_heap_and_stay_for_the_next_step():
    step_bytes = (30 + 28 + 24 + 20 + 16) * 2**20
    default = heap_figures("default")
    assert default["mapped_while_held"] >= 30 * 2**20, default  # glibc maps the larger blocks, then unmaps them
    kept = heap_figures("kept")
    assert kept["mapped_while_held"] == 0, kept
    assert kept["heap_kept"] >= 0.9 * step_bytes, kept  # freed, but held by the heap for the next step
    assert default["heap_kept"] < 0.1 * step_bytes, default

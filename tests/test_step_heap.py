"""A CPU step's temporaries come back from the heap: tensors of a few MiB freed and made again, as
every step does, cost no new page faults once the engine has set glibc's thresholds
(worker.engine.step_heap). Each case runs in a process of its own: the thresholds are process-wide."""

import subprocess
import sys

import pytest

from worker.engine.step_heap import keep_step_temporaries_in_heap

STEPS = r"""
import resource, sys
import torch
from worker.engine.step_heap import keep_step_temporaries_in_heap
if sys.argv[1] == "kept":
    assert keep_step_temporaries_in_heap()

def step():  # tensors of a step's sizes, growing, each freed before the next (as a layer's are)
    for mib in (4, 6, 8, 12, 16, 20, 24, 28):
        torch.empty(mib * 2**18).fill_(1.0)

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_later_steps(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not keep_step_temporaries_in_heap(), reason="glibc's malloc only")
def test_a_steps_temporaries_are_reused_not_faulted_in_again():
    pages = sum((4, 6, 8, 12, 16, 20, 24, 28)) * 2**20 // 4096  # one step's tensors, in 4 KiB pages
    default = faults_of_later_steps("default")
    kept = faults_of_later_steps("kept")
    assert default > pages, f"glibc's defaults should map some of these anew every step: {default} faults"
    assert kept < pages // 4, f"{kept} page faults in five steps whose tensors the heap already held"

"""The ledger's calls answered by a process of its own (worker/consumer/ledger_process.py): the same answers
and errors, callers on several threads at once, the worker's signals left to the worker, and no child
outliving its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.ledger_child import PidLedgerRecipe
from worker.consumer.ledger import LedgerDown, Outcome
from worker.consumer.ledger_process import LedgerChild, LedgerProcess, LedgerProcessGone
from worker.engine.request import Completion, RequestOutput

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def ledger():
    ledger = LedgerProcess(PidLedgerRecipe())
    yield ledger
    ledger.close()


def test_calls_are_answered_by_the_child_with_their_values(ledger):
    assert ledger.pid != os.getpid()
    assert ledger.live_tenants("m") == {"pid": float(ledger.pid)}
    output = RequestOutput("r", [1, 2], [Completion(0, [5, 6], "hello", "stop")])
    outcomes = [Outcome(7, "job", output), Outcome(8, "job", None, "engine_error", "it failed")]
    assert ledger.record(outcomes, "w") == {7}  # the outcomes crossed whole, the answer came back


def test_callers_on_two_threads_are_answered_at_once(ledger):
    slow = threading.Thread(target=ledger.note_error, args=(1, "1.5"))
    slow.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert ledger.live_tenants("m")  # not queued behind the slow call of the other thread
    assert time.monotonic() - t0 < 1.0
    slow.join()


def test_the_ledgers_errors_reach_the_caller_as_they_are():
    ledger = LedgerProcess(PidLedgerRecipe(down=True))
    try:
        with pytest.raises(LedgerDown, match="the database is down"):
            ledger.live_tenants("m")
    finally:
        ledger.close()


def test_it_leaves_interrupts_to_the_worker(ledger):
    os.kill(ledger.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group: the worker drains through it
    os.kill(ledger.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert ledger.live_tenants("m") == {"pid": float(ledger.pid)}


def test_each_ledger_has_a_child_of_its_own_which_ends_on_close(ledger):
    other = LedgerProcess(PidLedgerRecipe(down=True))
    try:
        assert other.pid not in (ledger.pid, os.getpid())
        with pytest.raises(LedgerDown):
            other.live_tenants("m")
        assert ledger.live_tenants("m") == {"pid": float(ledger.pid)}
    finally:
        t0 = time.monotonic()
        other.close()
    assert time.monotonic() - t0 < 2.0 and gone_within(other.pid, 2.0)
    assert ledger.live_tenants("m") == {"pid": float(ledger.pid)}  # one closed, the other answers


def test_a_dead_child_stops_the_worker_with_an_error_that_says_so(ledger):
    os.kill(ledger.pid, signal.SIGKILL)
    assert gone_within(ledger.pid, 5.0)
    with pytest.raises(LedgerProcessGone, match=r"ended \(exit code -?\d+\) while the worker ran"):
        ledger.live_tenants("m")
    again = LedgerProcess(PidLedgerRecipe())  # the next worker of this process gets a new child
    try:
        assert again.pid != ledger.pid and again.live_tenants("m") == {"pid": float(again.pid)}
    finally:
        again.close()


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_no_ledger_process_outlives_its_worker(end):
    script = ("import sys; from tests.support.ledger_child import PidLedgerRecipe\n"
              "from worker.consumer.ledger_process import LedgerProcess\n"
              "ledger = LedgerProcess(PidLedgerRecipe()); print(ledger.pid, flush=True); sys.stdin.readline()\n")
    worker = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        assert alive(child)
        if end == "kill":
            worker.kill()  # SIGKILL: the worker runs no cleanup
        else:
            worker.communicate("\n", timeout=10)  # the worker's process exits, its ledger not closed
        worker.wait()
        assert gone_within(child, 3.0), "the ledger's process outlived its worker"
    finally:
        worker.kill()


def test_a_child_started_ahead_serves_once_the_factory_comes_and_one_that_cannot_import_says_so():
    child = LedgerChild("tests.support.ledger_child")  # started first: its imports beside the worker's start
    ledger = LedgerProcess(PidLedgerRecipe(), child)
    try:
        assert ledger.pid == child.pid and ledger.live_tenants("m") == {"pid": float(child.pid)}
    finally:
        ledger.close()
    assert gone_within(child.pid, 2.0)
    broken = LedgerChild("tests.support.no_such_module")
    with pytest.raises(LedgerProcessGone, match=r"did not start \(exit code 1\): its error is above"):
        LedgerProcess(PidLedgerRecipe(), broken)
    assert gone_within(broken.pid, 2.0)

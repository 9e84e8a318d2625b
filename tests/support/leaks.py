"""A test leaves no ledger process behind: each worker a test builds ends its ledger's process (a child of
the test's process, ``worker.consumer.ledger_process``) when it ends or is closed. One left alive is a
worker never closed, which in a user's process (``jobs.api.run`` called again and again) would keep a
process and a database connection per call."""

from __future__ import annotations

import pytest

from worker.consumer.ledger_process import LedgerChild


@pytest.fixture(autouse=True)
def _no_ledger_process_left(monkeypatch):
    started: list[LedgerChild] = []
    real = LedgerChild.__init__

    def counted(self, *args, **kwargs):
        real(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(LedgerChild, "__init__", counted)
    yield
    left = [child for child in started if child.process.poll() is None]
    for child in left:  # not left for the next tests either
        child.close()
    assert not left, f"the test left {len(left)} ledger process(es) running: a worker built and never closed"

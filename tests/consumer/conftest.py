"""The consumer tests' fakes (``tests/support/consumer_fakes.py``) as fixtures, and ``fast_loop``: a worker loop that
does not wait between its turns (modules of fake-driven tests use it with ``pytestmark``)."""

from __future__ import annotations

import pytest

import worker.consumer.loop as consumer
from tests.support.consumer_fakes import FakeBroker, FakeLedger


@pytest.fixture
def fast_loop(monkeypatch):
    monkeypatch.setattr(consumer, "CONTROL_INTERVAL", 0.0)
    monkeypatch.setattr(consumer, "IDLE_WAIT", 0.001)


@pytest.fixture
def ledger():
    return FakeLedger()


@pytest.fixture
def broker(ledger):
    return FakeBroker(ledger)

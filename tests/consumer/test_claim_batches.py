"""A claim is a few round trips to the database on the loop's thread: while the engine has waiting
work enough, deliveries gather into a batch (or wait ``ADMIT_DELAY`` at most) before they are claimed;
and the prefetch window has room for the finished requests whose outcomes are being committed."""

from __future__ import annotations

import time

import pytest

import worker.consumer.loop as consumer
from tests.support.consumer_fakes import FakeEngine, Row, make_worker
from worker.config import Settings
from worker.consumer import admission


class BusyEngine(FakeEngine):
    """An engine that says it has ``waiting`` requests waiting for seats."""

    waiting = 0

    @property
    def num_waiting(self) -> int:
        return self.waiting


def _worker(ledger, broker, waiting: int):
    engine = BusyEngine(Settings(checkpoint_interval=0))
    engine.waiting = waiting
    worker = make_worker(ledger, broker, engine)
    worker.broker.window = 1000
    return worker


def _claimed(ledger) -> int:
    return sum(r.attempts for r in ledger.rows.values())


def _deliver(ledger, broker, worker, ids) -> None:
    for i in ids:
        ledger.rows[i] = Row("batch_a")
        broker.publish_request(i, "batch_a")
    worker._receive(0)


def test_deliveries_gather_while_the_engine_has_waiting_work(ledger, broker, monkeypatch):
    monkeypatch.setattr(consumer, "ADMIT_DELAY", 60.0)
    worker = _worker(ledger, broker, waiting=admission.CLAIM_BATCH)
    _deliver(ledger, broker, worker, range(1, 4))
    worker._admit()
    assert _claimed(ledger) == 0 and len(worker.incoming) == 3  # a few, and the engine has work: they wait
    _deliver(ledger, broker, worker, range(4, 4 + admission.CLAIM_BATCH))
    worker._admit()
    assert _claimed(ledger) == 3 + admission.CLAIM_BATCH and not worker.incoming  # a batch: claimed together


def test_a_delivery_waits_no_longer_than_the_admit_delay(ledger, broker, monkeypatch):
    monkeypatch.setattr(consumer, "ADMIT_DELAY", 0.05)
    worker = _worker(ledger, broker, waiting=admission.CLAIM_BATCH)
    _deliver(ledger, broker, worker, [1])
    worker._admit()
    assert _claimed(ledger) == 0
    time.sleep(0.06)
    worker._admit()
    assert _claimed(ledger) == 1


@pytest.mark.parametrize("waiting", [0, admission.CLAIM_BATCH - 1])
def test_an_engine_short_of_waiting_work_gets_what_came_at_once(ledger, broker, monkeypatch, waiting):
    monkeypatch.setattr(consumer, "ADMIT_DELAY", 60.0)
    worker = _worker(ledger, broker, waiting=waiting)
    _deliver(ledger, broker, worker, [1])
    worker._admit()
    assert _claimed(ledger) == 1


def test_the_window_has_room_for_the_outcomes_being_committed():
    assert admission.prefetch_window(256, 10**9, None) == 256 + 64 + 64
    assert admission.prefetch_window(256, 10**9, None, committing=200) == 256 + 64 + 200
    assert admission.prefetch_window(256, 1000, 100.0) == 10 + 2 + 2  # the KV cache fits ten

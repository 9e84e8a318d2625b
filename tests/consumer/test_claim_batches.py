"""A claim is a few round trips to the database: it runs on a thread of its own while the loop steps
the engine on, and while the engine has waiting work enough, deliveries gather into a batch (or wait
``ADMIT_DELAY`` at most) before they are claimed; a claim under way when the worker stops has its
deliveries handed back. The prefetch window has room for the finished requests whose outcomes are
being committed."""

from __future__ import annotations

import json
import threading
import time

import pytest

import worker.consumer.loop as consumer
from tests.support.consumer_fakes import FakeEngine, Row, make_worker, run_until_done
from worker.config import Settings
from worker.consumer import admission
from worker.engine.request import SamplingParams
from worker.messaging.topology import request_body


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


def _admit_all(worker) -> None:
    """Admit what came, the claim (on its thread) answered."""
    worker._admit()
    if worker.claiming is not None:
        worker.claiming[1].result(10)
        worker._admit()


def _deliver(ledger, broker, worker, ids) -> None:
    for i in ids:
        ledger.rows[i] = Row("batch_a")
        broker.publish_request(i, "batch_a")
    worker._receive(0)


def test_deliveries_gather_while_the_engine_has_waiting_work(ledger, broker, monkeypatch):
    monkeypatch.setattr(consumer, "ADMIT_DELAY", 60.0)
    worker = _worker(ledger, broker, waiting=admission.CLAIM_BATCH)
    _deliver(ledger, broker, worker, range(1, 4))
    _admit_all(worker)
    assert _claimed(ledger) == 0 and len(worker.incoming) == 3  # a few, and the engine has work: they wait
    _deliver(ledger, broker, worker, range(4, 4 + admission.CLAIM_BATCH))
    _admit_all(worker)
    assert _claimed(ledger) == 3 + admission.CLAIM_BATCH and not worker.incoming  # a batch: claimed together


def test_a_delivery_waits_no_longer_than_the_admit_delay(ledger, broker, monkeypatch):
    monkeypatch.setattr(consumer, "ADMIT_DELAY", 0.05)
    worker = _worker(ledger, broker, waiting=admission.CLAIM_BATCH)
    _deliver(ledger, broker, worker, [1])
    _admit_all(worker)
    assert _claimed(ledger) == 0
    time.sleep(0.06)
    _admit_all(worker)
    assert _claimed(ledger) == 1


@pytest.mark.parametrize("waiting", [0, admission.CLAIM_BATCH - 1])
def test_an_engine_short_of_waiting_work_gets_what_came_at_once(ledger, broker, monkeypatch, waiting):
    monkeypatch.setattr(consumer, "ADMIT_DELAY", 60.0)
    worker = _worker(ledger, broker, waiting=waiting)
    _deliver(ledger, broker, worker, [1])
    _admit_all(worker)
    assert _claimed(ledger) == 1


def test_the_window_has_room_for_the_outcomes_being_committed():
    assert admission.prefetch_window(256, 10**9, None) == 256 + 64 + 64
    assert admission.prefetch_window(256, 10**9, None, committing=200) == 256 + 64 + 200
    assert admission.prefetch_window(256, 1000, 100.0) == 10 + 2 + 2  # the KV cache fits ten


def test_the_loop_steps_on_while_a_claim_is_under_way(ledger, broker):
    ledger.rows[1] = Row("batch_a", params=SamplingParams(max_tokens=8, temperature=0))
    broker.publish_request(1, "batch_a")
    gate, stepped_meanwhile, claim = threading.Event(), [], ledger.claim
    engine = FakeEngine(Settings(checkpoint_interval=0))

    def slow_claim(ids, name):  # the database takes its time over request 2's claim
        if 2 in ids:
            gate.wait(10)
            stepped_meanwhile.append(len(engine.tokens["1"][0]))
        return claim(ids, name)

    ledger.claim = slow_claim
    worker = make_worker(ledger, broker, engine)

    def hook(call: int) -> None:
        if call == 2:  # request 2 comes while request 1 runs
            ledger.rows[2] = Row("batch_a")
            broker.publish_request(2, "batch_a")
        if len(engine.tokens.get("1", [[]])[0]) >= 8:
            gate.set()

    run_until_done(worker, ledger, [1, 2], hook=hook)
    assert stepped_meanwhile == [8]  # request 1 ran to its end while request 2's claim was held
    assert ledger.rows[2].outcome.completed and ledger.rows[2].attempts == 1


def test_a_claim_under_way_when_the_worker_stops_has_its_deliveries_handed_back(ledger, broker):
    ledger.rows[1] = Row("batch_a")
    broker.publish_request(1, "batch_a")
    gate, claim = threading.Event(), ledger.claim
    ledger.claim = lambda ids, name: (gate.wait(10), claim(ids, name))[1]
    worker = make_worker(ledger, broker)

    def until() -> bool:
        if worker.claiming is not None:
            gate.set()  # the claim answers while the worker stops
            return True
        return False

    worker.run(until=until)
    assert broker.requeued == [json.dumps(request_body(1, "batch_a")).encode()]
    assert ledger.rows[1].attempts == 0 and ledger.rows[1].outcome is None and not broker.acked


def test_a_jobs_first_claimed_requests_step_before_more_deliveries_are_read(ledger, broker):
    """At a job's start the window's deliveries keep coming while the first claim is answered: the engine, empty
    until then, steps its first requests before the loop reads more (reading hundreds of them delayed a job's
    first step by 86 ms on RabbitMQ)."""
    for i in range(1, 201):
        ledger.rows[i] = Row("batch_a", params=SamplingParams(max_tokens=2, temperature=0))
    for i in range(1, 5):
        broker.publish_request(i, "batch_a")
    events: list[tuple[str, int]] = []
    receive = broker.receive

    def logged_receive(limit, timeout):
        got = receive(limit, timeout)
        if got:
            events.append(("read", len(got)))
            if len(events) == 1:  # the rest of the window arrives while the first claim is under way
                for i in range(5, 201):
                    broker.publish_request(i, "batch_a")
        return got

    broker.receive = logged_receive
    engine = FakeEngine(Settings(checkpoint_interval=0), on_batch=lambda ids: events.append(("step", len(ids))))
    worker = make_worker(ledger, broker, engine)
    worker.broker.window = 1000
    run_until_done(worker, ledger, range(1, 201))
    assert events[:3] == [("read", 4), ("step", 4), ("read", 196)], events[:5]

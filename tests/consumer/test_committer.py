"""Outcomes are committed beside the engine's next step, and a message is still acked only after its
outcome committed: the loop steps on while a commit is under way, and a worker killed between a
commit and its ack leaves a message whose redelivery is skipped, never a second result."""

from __future__ import annotations

import json
import threading

import pytest

from tests.support.consumer_fakes import FakeBroker, FakeEngine, Row, WorkerKilled, make_worker, run_until_done
from worker.config import Settings
from worker.engine.request import SamplingParams
from worker.messaging.topology import request_body

pytestmark = pytest.mark.usefixtures("fast_loop")


def test_the_loop_steps_on_while_a_commit_is_under_way_and_acks_only_after_it(ledger, broker):
    ledger.rows[1] = Row("batch_a", params=SamplingParams(max_tokens=1, temperature=0))
    ledger.rows[2] = Row("batch_a", params=SamplingParams(max_tokens=6, temperature=0))
    for i in (1, 2):
        broker.publish_request(i, "batch_a")
    gate, stepped_meanwhile = threading.Event(), []
    record = ledger.record

    def slow_record(outcomes, worker):  # the database takes its time over the first commit
        if not gate.is_set():
            gate.wait(10)
            stepped_meanwhile.append(len(engine.tokens["2"][0]))
            assert not broker.acked, "a message was acked before its outcome committed"
        return record(outcomes, worker)

    ledger.record = slow_record
    engine = FakeEngine(Settings(checkpoint_interval=0))
    worker = make_worker(ledger, broker, engine)

    def open_gate_once_2_is_done(call: int) -> None:
        if not gate.is_set() and len(engine.tokens.get("2", [[]])[0]) >= 6:
            gate.set()  # request 2 ran to its end while request 1's commit was held

    run_until_done(worker, ledger, [1, 2], hook=open_gate_once_2_is_done)
    assert stepped_meanwhile == [6]
    recorded = set()
    for kind, what, *_ in ledger.events:  # every ack after its outcome's commit
        if kind == "record":
            recorded.update(what)
        else:
            assert what in recorded
    assert sorted(e[1] for e in ledger.events if e[0] == "ack") == [1, 2]


class KilledAtAck(FakeBroker):
    """A broker whose worker process dies as it is about to ack: whatever was committed stays
    committed, and nothing more reaches the broker."""

    def ack_all(self, deliveries):
        self.broken = True
        raise WorkerKilled("killed between the commit and the ack")


def test_a_worker_killed_between_commit_and_ack_leaves_no_second_result(ledger):
    for i in (1, 2, 3):
        ledger.rows[i] = Row("batch_a")
    first = KilledAtAck(ledger)
    for i in (1, 2, 3):
        first.publish_request(i, "batch_a")
    with pytest.raises(WorkerKilled):
        run_until_done(make_worker(ledger, first), ledger, [1, 2, 3])
    committed = {i: ledger.rows[i].outcome for i in (1, 2, 3)}
    assert all(committed.values()) and not first.acked

    second = FakeBroker(ledger)  # the broker redelivers what was never acked
    for i in (1, 2, 3):
        second.publish_request(i, "batch_a")
    engine = FakeEngine(Settings(checkpoint_interval=0))
    worker = make_worker(ledger, second, engine)
    worker.run(until=lambda: len(second.acked) == 3)
    assert not engine.batches  # skipped: nothing ran again
    assert {i: ledger.rows[i].outcome for i in (1, 2, 3)} == committed
    assert sorted(second.acked) == sorted(json.dumps(request_body(i, "batch_a")).encode() for i in (1, 2, 3))

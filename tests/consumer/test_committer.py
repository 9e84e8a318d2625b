"""Outcomes are committed beside the engine's next step, and a message is still acked only after its
outcome committed: the loop steps on while a commit is under way, and a worker killed between a
commit and its ack leaves a message whose redelivery is skipped, never a second result. A few
outcomes wait a little for more, so that a commit carries a group."""

from __future__ import annotations

import json
import threading
import time

import pytest

import worker.consumer.committer as committer
from tests.support.consumer_fakes import FakeBroker, FakeEngine, Row, WorkerKilled, make_worker, run_until_done
from worker.config import Settings
from worker.consumer.committer import Committer
from worker.consumer.database_health import DatabaseHealth
from worker.consumer.ledger import Outcome
from worker.consumer.outcomes import OutcomeBook, Pending
from worker.engine.request import SamplingParams
from worker.messaging.topology import request_body
from worker.metrics import WorkerMetrics

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


def test_a_few_outcomes_wait_for_more_and_are_committed_together(ledger, monkeypatch):
    monkeypatch.setattr(committer, "GATHER_SECONDS", 0.3)
    for i in range(1, 40):
        ledger.rows[i] = Row("batch_a")
    metrics = WorkerMetrics()
    c = Committer(OutcomeBook(ledger, DatabaseHealth("w", metrics), metrics, "w"))

    def put(ids):
        c.put([Pending(Outcome.failure(i, "batch_a", "x", "y"), "default", None) for i in ids])

    def committed(count: int) -> list[int]:
        done, deadline = [], time.monotonic() + 5
        while len(done) < count and time.monotonic() < deadline:
            done += [p.outcome.request_id for p in c.take()]
            time.sleep(0.005)
        return done

    put([1])  # the first goes at once
    assert committed(1) == [1]
    put([2])
    put([3, 4])  # within the gathering time of the commit before: one commit for the three
    assert committed(3) == [2, 3, 4]
    put(range(5, 5 + committer.GATHER_COUNT))  # a group already: at once
    t0 = time.monotonic()
    assert len(committed(committer.GATHER_COUNT)) == committer.GATHER_COUNT and time.monotonic() - t0 < 0.25
    c.close(flush=True, timeout=5)
    assert [ids for kind, ids in ledger.events] == [[1], [2, 3, 4], list(range(5, 5 + committer.GATHER_COUNT))]


def test_a_stop_while_an_outcome_is_being_committed_hands_back_none_of_it(ledger, broker):
    """A finished request whose outcome the committer holds has run: a stop's drain, which hands back
    the requests no step has run yet, must not take it for one (its KV freed, it computes no token), or
    its attempt is released and its message requeued while its result commits: a result with no
    delivery counted (seen as ``attempts 0`` in tests/system/test_outages.py on a busy machine)."""
    ledger.rows[1] = Row("batch_a", params=SamplingParams(max_tokens=1, temperature=0))
    ledger.rows[2] = Row("batch_a", params=SamplingParams(max_tokens=30, temperature=0))
    for i in (1, 2):
        broker.publish_request(i, "batch_a")
    gate, held = threading.Event(), threading.Event()
    record = ledger.record

    def held_record(outcomes, worker):  # request 1's commit waits until the stop has begun its drain
        if not gate.is_set():
            held.set()
            gate.wait(10)
        return record(outcomes, worker)

    ledger.record = held_record
    worker = make_worker(ledger, broker)
    stopped_at = []

    def stop_while_held(call: int) -> None:
        if held.is_set() and not stopped_at:
            worker.stop()
            stopped_at.append(call)
        elif stopped_at and call > stopped_at[0] + 2:
            gate.set()

    run_until_done(worker, ledger, [1, 2], hook=stop_while_held)
    assert stopped_at and gate.is_set()
    assert ledger.rows[1].outcome is not None and ledger.rows[2].outcome is not None
    assert [ledger.rows[1].attempts, ledger.rows[2].attempts] == [1, 1]
    assert not broker.requeued
    assert sorted(e[1] for e in ledger.events if e[0] == "ack") == [1, 2]

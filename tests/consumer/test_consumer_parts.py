"""The engine worker's logic with no server: fakes of the ledger, the broker link and the engine
(``tests/support/consumer_fakes.py``). Bad messages, the message/row contract, poison, blast radius and the
database going away, each checked against what the worker committed and acked."""

from __future__ import annotations

import time

import pytest

from tests.support.consumer_fakes import FakeEngine, Row, make_worker, run_until_done
from worker.checkpoint.connector import StoreConnector
from worker.config import Settings
from worker.consumer import loop as consumer
from worker.consumer import suspects
from worker.consumer.ledger import Claim, Death
from worker.engine.request import SamplingParams
from worker.messaging.topology import request_body

pytestmark = pytest.mark.usefixtures("fast_loop")


def acked_after_recorded(ledger, only: set[bytes] | None = None) -> bool:
    """Each ack of a request message (of the bodies ``only``, default all) came after its outcome's commit."""
    recorded = set()
    for kind, what, *body in ledger.events:
        if kind == "record":
            recorded.update(what)
        elif what is not None and (only is None or body[0] in only) and what not in recorded:
            return False
    return True


def test_bad_messages_are_dead_lettered_with_their_reason_and_the_good_ones_run(ledger, broker):
    for i in (1, 2, 3):
        ledger.rows[i] = Row("batch_a")
    ledger.rows[10] = Row("batch_b", tenant="bob")
    bad = {b"not json at all": "unreadable message",
           b'{"request_id": "1", "job_id": "batch_a"}': "request_id must be a positive integer",
           b'{"request_id": true, "job_id": "batch_a"}': "request_id must be a positive integer",
           b'{"request_id": 1}': "job_id must be a string",
           b'[1, 2]': "not an object",
           b'{"request_id": 99, "job_id": "batch_a"}': "request 99 is not in the database",
           b'{"request_id": 10, "job_id": "batch_a"}': "belongs to job 'batch_b'"}
    broker.publish(b"\x00\xff binary", content_type="application/octet-stream")
    for body in bad:
        broker.publish(body)
    broker.publish(request_body(10, "batch_b"), tenant="default")  # another tenant's request on this queue
    for i in (1, 2, 3):
        broker.publish_request(i, "batch_a")
    worker = make_worker(ledger, broker)
    run_until_done(worker, ledger, [1, 2, 3])

    reasons = dict(broker.dead)
    assert "content type" in reasons[b"\x00\xff binary"]
    for body, why in bad.items():
        assert why in reasons[body], (body, reasons[body])
    assert "belongs to tenant 'bob' but came from the queue of tenant 'default'" in reasons[
        json_body(request_body(10, "batch_b"))]
    assert len(broker.dead) == len(bad) + 2
    assert all(ledger.rows[i].outcome.completed for i in (1, 2, 3)) and ledger.rows[10].outcome is None
    assert acked_after_recorded(ledger, {json_body(request_body(i, "batch_a")) for i in (1, 2, 3)})
    assert not broker.ready and not broker.requeued


def json_body(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()


def test_a_message_is_acked_only_after_its_outcome_is_committed(ledger, broker):
    for i in range(1, 9):
        ledger.rows[i] = Row("batch_a")
        broker.publish_request(i, "batch_a")
    worker = make_worker(ledger, broker)

    def database_blip(call: int) -> None:  # down from the first step until long after the last
        ledger.down = 1 <= call < 40
        if ledger.down:
            assert not broker.acked

    run_until_done(worker, ledger, list(range(1, 9)), hook=database_blip)
    assert acked_after_recorded(ledger)
    assert len(broker.acked) == 8 and all(r.outcome.completed and r.attempts == 1 for r in ledger.rows.values())
    assert worker.metrics.registry.get_sample_value("berth_database_errors_total") > 0
    assert worker.metrics.registry.get_sample_value("berth_outcomes_waiting") == 0


def test_the_row_is_what_runs_not_the_message(ledger, broker):
    ledger.rows[1] = Row("batch_a", prompt=[5, 6], params=SamplingParams(max_tokens=4, temperature=0))
    broker.publish({**request_body(1, "batch_a"), "prompt_token_ids": [9] * 50,
                    "params": {"max_tokens": 999}, "tenant": "eve", "priority": 9})
    worker = make_worker(ledger, broker)
    run_until_done(worker, ledger, [1])
    out = ledger.rows[1].outcome.output
    assert out.prompt_token_ids == [5, 6] and len(out.completions[0].token_ids) == 4


# ---- poison: crashes without progress
def _claim(crashed: bool, strikes: int, progress: int, running: int = 1) -> Claim:
    death = Death(1, "dead-host:1", running, 0.0) if crashed else None
    return Claim(1, "batch_a", "m", "default", 0, [1], SamplingParams(), True, 2, crashed, progress, strikes, None,
                 death=death)


def test_only_a_crash_alone_without_checkpoint_progress_is_a_strike():
    def strikes(claim, tokens):
        return suspects.standing_after(claim, tokens).strikes

    assert strikes(_claim(crashed=False, strikes=2, progress=0), 0) == 2  # handed back, or waiting
    assert strikes(_claim(crashed=True, strikes=2, progress=16), 16) == 3  # died running it alone, no progress
    assert strikes(_claim(crashed=True, strikes=2, progress=16), 32) == 0  # died after progress
    assert suspects.poison_reason(_claim(True, 0, 0), suspects.Standing(1, 2), 3) is None
    reason = suspects.poison_reason(_claim(True, 0, 0), suspects.Standing(1, 3), 3)
    assert "killed its worker 3 times running alone" in reason and "last error: none recorded" in reason


class FakeCheckpoints:
    store_up = True

    def after_step(self):
        pass

    def finished(self, request_id):
        pass

    released = finished

    def save_all(self, timeout):
        pass

    def close(self, timeout):
        pass


class FakeRestorer:
    """Checkpoints as a dict: request id -> output tokens."""

    def __init__(self, saved: dict[str, list[int]]):
        self.saved, self.fetching = saved, []

    @property
    def pending(self) -> int:
        return len(self.fetching)

    def submit(self, request, ref):
        self.fetching.append(request)

    def ready(self):
        out, self.fetching = self.fetching, []
        for request in out:
            if request.request_id in self.saved:
                request.resume_output_ids = [list(self.saved[request.request_id])]
        return out

    def observe_step(self):
        pass

    def close(self):
        pass


def test_poison_is_a_request_whose_worker_keeps_dying_alone_without_progress(ledger, broker):
    params = SamplingParams(max_tokens=12, temperature=0)
    for i in (1, 2, 3, 4):
        ledger.rows[i] = Row("batch_a", params=params, strikes=2, progress=5, attempts=3)
        broker.publish_request(i, "batch_a")
    ledger.crash(1)  # died running it alone a third time, its checkpoint still at 5 tokens: poison
    ledger.crash(2, "dead-host:2")  # died running it, but its checkpoint moved on to 8 tokens: strikes reset
    ledger.rows[3].holder = "dead-host:1"  # held by a dead worker, but no step ever ran it: no strike
    ledger.rows[4].last_error = None  # handed back gracefully (no holder): no strike
    for i in (1, 2):  # where their checkpoints are, as their rows record it
        ledger.rows[i].checkpoint = f"checkpoints/v2/states/w/{i:010d}.seg@0+10"
    worker = make_worker(ledger, broker)
    worker.store = StoreConnector(FakeCheckpoints(), FakeRestorer({"1": [7] * 5, "2": [7] * 8}))
    run_until_done(worker, ledger, [1, 2, 3, 4])

    poison = ledger.rows[1].outcome
    assert not poison.completed and poison.error_code == "delivery_limit"
    assert "killed its worker 3 times running alone" in poison.error
    [(body, reason)] = broker.dead
    assert b'"request_id": 1' in body and "killed its worker 3 times running alone" in reason
    assert ledger.rows[2].outcome.completed and ledger.rows[2].strikes == 0 and ledger.rows[2].progress == 8
    assert len(ledger.rows[2].outcome.output.completions[0].token_ids) == 12  # resumed at 8
    assert ledger.rows[3].outcome.completed and ledger.rows[3].strikes == 2
    assert ledger.rows[4].outcome.completed and ledger.rows[4].strikes == 2


def test_a_redelivered_request_is_read_back_from_where_its_row_says_and_only_then(ledger, broker):
    """The claim carries where the request's latest state is: a request whose row names one is read
    from there (one read), one whose row names none starts over without reading the store."""
    params = SamplingParams(max_tokens=6, temperature=0)
    ref = "checkpoints/v2/states/0123/0000000004.seg@17+300"
    for i in (1, 2):
        ledger.rows[i] = Row("batch_a", params=params, attempts=1)
        ledger.crash(i)  # both died with their worker
        broker.publish_request(i, "batch_a")
    ledger.rows[1].checkpoint = ref
    worker = make_worker(ledger, broker)
    restorer = FakeRestorer({"1": [7] * 3})
    asked = []
    restorer.submit = lambda request, where: (asked.append((request.request_id, where)),
                                              restorer.fetching.append(request))
    worker.store = StoreConnector(FakeCheckpoints(), restorer)
    run_until_done(worker, ledger, [1, 2])
    assert asked == [("1", ref)]
    assert ledger.rows[1].outcome.completed and ledger.rows[2].outcome.completed
    assert ledger.rows[1].progress == 3 and ledger.rows[2].progress == 0


# ---- blast radius
def test_a_request_the_engine_fails_fails_alone_with_its_reason(ledger, broker):
    s = Settings(checkpoint_interval=0)
    for i, prompt in ((1, [1, 2]), (2, [666, 3]), (3, [4]), (4, [555])):
        ledger.rows[i] = Row("batch_a", tenant="alice" if i % 2 else "bob", prompt=prompt)
        broker.publish_request(i, "batch_a", tenant=ledger.rows[i].tenant)
    worker = make_worker(ledger, broker, FakeEngine(s, crash_token=666, rejected_token=555))
    run_until_done(worker, ledger, [1, 2, 3, 4])
    assert ledger.rows[1].outcome.completed and ledger.rows[3].outcome.completed
    failed = ledger.rows[2].outcome
    assert (failed.error_code, failed.error) == ("engine_error", "RuntimeError: injected")
    rejected = ledger.rows[4].outcome
    assert rejected.error_code == "request_rejected" and "refused by the fake engine" in rejected.error
    assert not broker.dead and len(broker.acked) == 4


def test_a_message_that_cannot_be_dead_lettered_stays_queued(ledger, broker):
    broker.dead_letter_fails = True
    broker.publish(b"garbage")
    ledger.rows[1] = Row("batch_a")
    broker.publish_request(1, "batch_a")
    worker = make_worker(ledger, broker)
    run_until_done(worker, ledger, [1])
    assert b"garbage" not in broker.acked and ledger.rows[1].outcome.completed


def test_a_worker_says_it_is_alive_and_what_it_runs(ledger, broker):
    for i in (1, 2):
        ledger.rows[i] = Row("batch_a", params=SamplingParams(max_tokens=40, temperature=0))
        broker.publish_request(i, "batch_a")
    worker = make_worker(ledger, broker)
    run_until_done(worker, ledger, [1, 2])
    assert ledger.beats, "no heartbeat"
    beat = ledger.beats[0]
    assert beat.worker == worker.name and beat.model == "m" and beat.device == "cpu"
    assert beat.kv_blocks_free == 100 and beat.started_at <= beat.at


def test_the_look_every_second_waits_for_the_first_claim_and_the_step_for_no_wait(ledger, broker, monkeypatch):
    """The worker's look every second (its heartbeat, the queue's depth, the tenants) waits while the engine
    is empty and a claim is under way: run at once, as it was, it delayed a job's first step by ~75 ms on
    PostgreSQL and RabbitMQ. While a claim is under way the loop waits for its answer, not for deliveries
    (it waited up to 20 ms in the broker with the claim answered)."""
    monkeypatch.setattr(consumer, "CONTROL_INTERVAL", 1.0)
    for i in (1, 2):
        ledger.rows[i] = Row("batch_a", params=SamplingParams(max_tokens=4, temperature=0))
        broker.publish_request(i, "batch_a")
    order, waits_claiming = [], []
    claim, heartbeat, receive = ledger.claim, ledger.heartbeat, broker.receive

    def slow_claim(ids, worker):
        time.sleep(0.3)
        return claim(ids, worker)

    def noting_receive(limit, timeout):
        if worker.claiming is not None:
            waits_claiming.append(timeout)
        return receive(limit, timeout)

    monkeypatch.setattr(ledger, "claim", slow_claim)
    monkeypatch.setattr(ledger, "heartbeat", lambda beat: (order.append("heartbeat"), heartbeat(beat)))
    monkeypatch.setattr(broker, "receive", noting_receive)
    worker = make_worker(ledger, broker)
    step = worker.engine.step
    monkeypatch.setattr(worker.engine, "step", lambda: (order.append("step"), step())[1])
    run_until_done(worker, ledger, [1, 2])
    assert order[0] == "step" and "heartbeat" in order, order[:5]
    assert waits_claiming and not any(waits_claiming), waits_claiming

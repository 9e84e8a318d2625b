"""Crashes charged to their cause, with no server: the decisions of admission (pure), and the engine
worker over fakes of the ledger, the broker link and the engine (``tests/support/consumer_fakes.py``). A
request that was running when its worker died is a suspect: it runs again only in a group of
suspects alone in the engine, half the size of what died, and only a death while it runs alone is a
strike against it. At every step the ledger names exactly what the engine runs, so a death is
charged to what was running."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.support.consumer_fakes import (
    FakeBroker,
    FakeEngine,
    FakeLedger,
    Row,
    WorkerKilled,
    make_worker,
    run_until_done,
)
from worker.config import Settings
from worker.consumer import suspects
from worker.consumer.ledger import Claim, Death
from worker.consumer.suspects import Standing
from worker.engine.request import SamplingParams

pytestmark = pytest.mark.usefixtures("fast_loop")

KILLER = 666  # a prompt holding this token kills the fake worker whenever a step runs it


def _claim(*, crashed=True, running=8, progress=0, strikes=0, suspect=0) -> Claim:
    death = Death(1, "node-a:7", running, 0.0) if crashed else None
    return Claim(1, "batch_a", "m", "default", 0, [1], SamplingParams(), True, 2, crashed, progress, strikes, None,
                 suspect=suspect, death=death)


# ---- admission's decisions (pure)
def test_a_request_running_when_its_worker_died_is_a_suspect_of_half_the_batch_not_guilty():
    assert suspects.standing_after(_claim(running=8), 0) == Standing(suspect=4, strikes=0)
    assert suspects.standing_after(_claim(running=5, strikes=1), 0) == Standing(3, 1)  # strikes kept, not added
    assert suspects.standing_after(_claim(running=4, suspect=4), 0) == Standing(2, 0)  # its group died: halves
    assert suspects.standing_after(_claim(running=2, suspect=2), 0) == Standing(1, 0)


def test_only_a_death_while_it_ran_alone_is_a_strike_and_progress_clears_everything():
    assert suspects.standing_after(_claim(running=1, suspect=1, strikes=1), 0) == Standing(1, 2)
    assert suspects.standing_after(_claim(running=1), 0) == Standing(1, 1)  # alone in its worker's batch
    assert suspects.standing_after(_claim(running=8, suspect=1, strikes=2, progress=16), 32) == Standing(0, 0)
    # not crashed (handed back, or only waiting in a dead worker's window): it stands where it stood
    assert suspects.standing_after(_claim(crashed=False, suspect=3, strikes=1), 0) == Standing(3, 1)


def test_poison_only_after_the_configured_deaths_alone():
    claim = _claim(running=1, suspect=1)
    assert suspects.poison_reason(claim, Standing(1, 2), 3) is None
    assert suspects.poison_reason(claim, Standing(4, 9), 10) is None
    reason = suspects.poison_reason(claim, Standing(1, 3), 3)
    assert "killed its worker 3 times running alone" in reason and "max_delivery_attempts 3" in reason


def test_a_group_is_as_large_as_its_smallest_class_allows_and_the_smallest_classes_go_first():
    assert suspects.suspect_group([]) == []
    assert suspects.suspect_group([4, 4, 4, 4, 4, 4]) == [0, 1, 2, 3]  # the oldest first
    assert suspects.suspect_group([4, 1, 4, 1]) == [1]  # one that must run alone, alone
    assert suspects.suspect_group([8, 2, 8, 2, 2]) == [1, 3]
    assert suspects.suspect_group([3, 8, 5]) == [0, 1, 2]  # each member's class is at least the group's size


# ---- the worker
def _rows(ledger: FakeLedger, broker: FakeBroker, ids, max_tokens=20, killer=None):
    for i in ids:
        prompt = [1, KILLER, 3] if i == killer else [1, 2, i]
        ledger.rows[i] = Row("batch_a", prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0))
        broker.publish_request(i, "batch_a")


def test_suspects_run_apart_in_groups_while_the_innocent_run_at_full_batch(ledger, broker):
    suspects, innocent = list(range(1, 9)), list(range(9, 13))
    _rows(ledger, broker, suspects + innocent)
    for i in suspects:
        ledger.crash(i)  # all eight were running when that worker died, none had checkpointed progress
    steps = []  # (what the engine runs, what a death now would be charged to)

    def on_batch(ids):
        steps.append(({int(i) for i in ids}, ledger.running(worker.name)))

    s = Settings(checkpoint_interval=0)
    worker = make_worker(ledger, broker, FakeEngine(s, on_batch=on_batch))
    run_until_done(worker, ledger, suspects + innocent)

    assert all(ledger.rows[i].outcome.completed for i in suspects + innocent)
    assert all(ledger.rows[i].strikes == 0 and ledger.rows[i].suspect == 0 for i in suspects)  # cleared
    for ran, charged in steps:  # a death at any step would have been charged to what that step ran
        assert ran == charged, (ran, charged)
    for i in suspects:  # each suspect first ran in a group of suspects alone, at most half of the eight
        first = next(ran for ran, _ in steps if i in ran)
        assert first <= set(suspects) and len(first) <= 4, first
    first_innocent = next(ran for ran, _ in steps if ran & set(innocent))
    assert set(innocent) <= first_innocent  # the innocent ran together, at once
    assert worker.metrics.registry.get_sample_value("berth_suspect_groups_total") == 2


@pytest.mark.parametrize("arrive", ["while the suspects' claim runs", "while the group runs"])
def test_requests_claimed_beside_a_group_of_suspects_are_never_charged_with_its_deaths(ledger, broker, arrive):
    """The claim's thread says its fresh requests started with their baselines (``EngineWorker._claim``);
    not while a group of suspects runs alone, and no group starts while such a claim is under way: at every
    step a death would be charged to what the step ran (and the finished ones being committed), never to a
    request that has not run. The group's steps wait for the innocent's claim (1 s at most); in the first
    case the claim's write waits for a group's step too: a group started beside the claim would run with
    the innocent said started."""
    suspects, innocent = [1, 2, 3, 4], list(range(5, 13))
    _rows(ledger, broker, suspects)
    for i in suspects:
        ledger.crash(i)  # running when that worker died: they run in groups of two, alone
    for i in innocent:
        ledger.rows[i] = Row("batch_a", prompt=[1, 2, i], params=SamplingParams(max_tokens=20, temperature=0))
    steps, claim, begin = [], ledger.claim, ledger.begin
    published, group_stepped, innocent_begun = [], threading.Event(), threading.Event()

    def publish_innocent():
        if not published:
            published.append(True)
            for i in innocent:
                broker.publish_request(i, "batch_a")

    def watched_claim(request_ids, worker_name):
        if set(request_ids) & set(suspects) and arrive == "while the suspects' claim runs":
            publish_innocent()  # claimed next, beside the first group's start
        return claim(request_ids, worker_name)

    def watched_begin(baselines, started=()):
        if set(started) & set(innocent) and arrive == "while the suspects' claim runs":
            group_stepped.wait(1.0)
        begin(baselines, started)
        if set(baselines) & set(innocent):
            innocent_begun.set()

    def on_batch(ids):
        ran = {int(i) for i in ids}
        if ran <= set(suspects):
            if not group_stepped.is_set():
                group_stepped.set()
                if arrive == "while the group runs":
                    publish_innocent()
            innocent_begun.wait(1.0)  # the group's next step comes after the innocent's claim
        steps.append((ran, ledger.running(worker.name)))

    ledger.claim, ledger.begin = watched_claim, watched_begin
    worker = make_worker(ledger, broker, FakeEngine(Settings(checkpoint_interval=0), on_batch=on_batch))
    run_until_done(worker, ledger, suspects + innocent)
    assert all(ledger.rows[i].outcome.completed for i in suspects + innocent)
    assert any(ran <= set(suspects) for ran, _ in steps) and any(ran & set(innocent) for ran, _ in steps)
    have_run: set[int] = set()
    for ran, charged in steps:  # beside what the step runs, only finished ones whose outcome is being committed
        assert ran <= charged and charged - ran <= have_run, (ran, charged)
        have_run |= ran


def _run_until_it_dies(ledger, broker, ids, s) -> bool:
    """One worker life; True if it finished the job, False if a step killed it (its deliveries requeued)."""
    worker = make_worker(ledger, broker, FakeEngine(s, kill_token=KILLER))
    try:
        run_until_done(worker, ledger, ids)
        return True
    except WorkerKilled:
        ledger.died(worker.name)
        broker.ready += [(body, "application/json", "default") for body in broker.requeued]  # as RabbitMQ does
        broker.requeued.clear()
        return False


def test_a_request_that_kills_its_worker_is_narrowed_to_and_failed_alone(ledger, broker):
    ids = list(range(1, 9))
    _rows(ledger, broker, ids, max_tokens=3, killer=5)
    s = Settings(checkpoint_interval=0)
    assert s.max_delivery_attempts == 3
    deaths = 0
    while not _run_until_it_dies(ledger, broker, ids, s):
        deaths += 1
        assert deaths < 20, "never narrowed down"
    # 8 together, then 4, then 2, then alone until max_delivery_attempts deaths alone: 1 + 2 + 3
    assert deaths == 6
    poison = ledger.rows[5].outcome
    assert poison.error_code == "delivery_limit" and "killed its worker 3 times running alone" in poison.error
    assert all(ledger.rows[i].outcome.completed for i in ids if i != 5)
    assert all(ledger.rows[i].strikes == 0 for i in ids if i != 5)


def test_worker_deaths_are_logged_and_measured_with_their_rate_per_host(ledger, broker, caplog):
    _rows(ledger, broker, [1, 2, 3, 4], max_tokens=2)
    for i, holder in ((1, "bad-node:11"), (2, "bad-node:12"), (3, "bad-node:13"), (4, "good-node:5")):
        ledger.crash(i, holder)
    worker = make_worker(ledger, broker)
    with caplog.at_level(logging.WARNING, logger="berth.worker"):
        run_until_done(worker, ledger, [1, 2, 3, 4])
    metric = worker.metrics.registry.get_sample_value
    assert metric("berth_worker_deaths_last_hour", {"host": "bad-node"}) == 3
    assert metric("berth_worker_deaths_last_hour", {"host": "good-node"}) == 1
    died = [r for r in caplog.records if "died while running" in r.getMessage()]
    assert len(died) == 4  # each death once
    looping = [r for r in died if "crash-looping" in r.getMessage()]
    assert looping and all(r.levelno == logging.ERROR and "bad-node" in r.getMessage() for r in looping)
    assert "3 on host bad-node, 4 in all" in looping[0].getMessage()
    assert all(ledger.rows[i].outcome.completed and ledger.rows[i].strikes == 1 for i in (1, 2, 3, 4))


def test_with_the_real_engine_a_death_at_any_step_is_charged_to_what_that_step_ran(ledger, broker, tiny_loaded):
    from worker.engine.engine import Engine

    suspects, innocent = list(range(1, 7)), list(range(7, 11))
    _rows(ledger, broker, suspects + innocent, max_tokens=40)
    for i in suspects:
        ledger.crash(i)
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_seqs=8)
    steps, prepare = [], engine.runner.prepare

    def watched(scheduled, tables=None):
        steps.append(({int(seq.request.request_id) for seq, _ in scheduled}, ledger.running(worker.name)))
        return prepare(scheduled, tables)

    engine.runner.prepare = watched
    engine.model_name = "m"
    worker = make_worker(ledger, broker, engine)
    run_until_done(worker, ledger, suspects + innocent, limit=20000)
    assert all(ledger.rows[i].outcome.completed for i in suspects + innocent)
    for ran, charged in steps:
        assert ran == charged, (ran, charged)
    assert any(ran <= set(suspects) and len(ran) <= 3 for ran, _ in steps)


def test_the_requests_queued_in_the_engine_are_said_started_in_one_write_before_their_steps(ledger, broker,
                                                                                          tiny_llama_dir):
    """On the real engine, 2 seats and 8 requests of different lengths: each is said started before the
    step that first runs it (a crash in that step counts it), and the requests queued behind the first
    two are said in the same write (the claim's, with their baselines), so that the steps that start them
    later need none."""
    from tests.support.jobs_env import TINY_NAME, tiny_settings
    from worker.engine.engine import Engine

    engine = Engine(tiny_settings(tiny_llama_dir, max_num_seqs=2))
    ids = list(range(1, 9))
    for i in ids:
        ledger.rows[i] = Row("batch_a", model=TINY_NAME, prompt=[1, 2, 3, 4 + i],
                             params=SamplingParams(max_tokens=2 + 3 * i, temperature=0, ignore_eos=True))
        broker.publish_request(i, "batch_a")
    writes, starts = [], []
    said, begun = ledger.started, ledger.begin

    def counted(request_ids):
        writes.append(sorted(request_ids))
        said(request_ids)

    def counted_with_baselines(baselines, started=()):  # the claim's thread says them with their baselines
        if started:
            writes.append(sorted(started))
        begun(baselines, started)

    ledger.started, ledger.begin = counted, counted_with_baselines
    worker = make_worker(ledger, broker, engine, prefetch=16)
    on_start = engine.on_start

    def checked(request_ids):  # the engine calls this before the step that first runs these
        on_start(request_ids)
        starts.append(list(request_ids))
        unsaid = [r for r in request_ids if not ledger.rows[int(r)].started]
        assert not unsaid, f"requests {unsaid} run before the database says so"

    engine.on_start = checked
    run_until_done(worker, ledger, ids)
    assert all(ledger.rows[i].outcome is not None for i in ids)
    assert len(starts) >= 4 and writes == [ids], (starts, writes)  # 4+ steps started requests; one write said all

"""The checkpointer beside a real engine (the tiny model): what it writes and when (a round's states as
one segment, KV only where it pays, in runs, each once), a slow store that never slows the engine,
states never torn, an outage of the store and of the database, and the collection of what nothing
needs."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from jobs.pipeline.checkpoint_gc import collect_checkpoints
from storage import ObjectNotFound, open_store
from tests.support.checkpoints import (
    ControlledStore,
    Pointers,
    checkpointer,
    kv_puts,
    prompts,
    read_state,
    run_steps,
    segment_puts,
    stored_states,
    tiny_engine,
)
from worker.checkpoint import writer as checkpoint_writer
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.costs import KvPolicy, TransferRates
from worker.checkpoint.format import (
    KV_PREFIX,
    LEGACY_PREFIX,
    SEGMENT_PREFIX,
    RequestCheckpoint,
    SampleCheckpoint,
    decode_run,
    kv_key,
    segment_states,
)
from worker.checkpoint.writer import CheckpointWriter, KvRun, Snapshot
from worker.config import Settings
from worker.consumer.ledger import LedgerDown
from worker.engine.request import Request, SamplingParams
from worker.metrics import WorkerMetrics


@pytest.fixture
def store(tmp_path):
    return ControlledStore(open_store(f"file://{tmp_path / 'store'}"))


def _states(cp) -> dict[str, RequestCheckpoint]:
    return stored_states(cp.writer.store.inner, cp.pointers)


def _runs(store) -> dict[str, list[bytes]]:
    """Every KV run on the store: its key -> the hashes of the blocks it holds."""
    return {o.key: decode_run(store.inner.get(o.key))[0] for o in store.inner.list(KV_PREFIX)}


def _metric(cp, name: str) -> float:
    return cp.metrics.registry.get_sample_value(name)


def _until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_round_is_one_put_and_short_requests_write_no_kv(tiny_loaded, store):
    """The recovery issue's regression guard, counted on the store (no clocks): with the defaults a
    user gets (every 16 tokens, KV "auto"), a worker running 24 requests writes one state object a
    round, not one per request, and no KV for requests this short: a handful of writes per 1,000
    generated tokens (berth 0.x wrote a state per request every 16 tokens and every full block: >100).
    The tiny model makes 16 steps in milliseconds where the default model on a CPU takes seconds:
    the floor between rounds is off here (it has its test below)."""
    engine = tiny_engine(tiny_loaded)
    settings = Settings(checkpoint_min_seconds=0)
    assert (settings.checkpoint_interval, settings.checkpoint_kv) == (16, "auto")
    cp = Checkpointer(engine, store, settings, WorkerMetrics())
    requests = [Request(str(i), p, SamplingParams(max_tokens=160, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([20 + 3 * i for i in range(24)]))]
    steps = 0

    def stepped():
        nonlocal steps
        steps += 1
        return False

    run_steps(engine, cp, requests, until=stepped)
    assert cp.writer.flush(30)
    cp.close()
    generated = engine.stats.output_tokens
    assert generated == 24 * 160
    state_puts = segment_puts(store)
    rounds = -(-steps // 16)
    assert 0 < state_puts <= rounds, f"{state_puts} state PUTs in {rounds} rounds of 16 steps"
    assert kv_puts(store) == 0, "KV blocks were written for requests that end long before a crash is likely"
    writes = sum(store.puts.values())
    assert 1000 * writes / generated <= 10, f"{writes} writes for {generated} tokens"


def test_rounds_of_fast_steps_wait_for_the_floor_between_them(tiny_loaded, store):
    """At a GPU's pace 16 steps take a tenth of a second: with the default floor of 2 s between
    rounds, steps ten times faster than that still make a round every 2 s, not every 16 steps."""
    engine = tiny_engine(tiny_loaded)
    settings = Settings()
    assert settings.checkpoint_min_seconds == 2
    cp = Checkpointer(engine, store, settings, WorkerMetrics())
    started, steps, wave = time.monotonic(), 0, 0

    def stepped():
        nonlocal steps
        steps += 1
        return time.monotonic() - started > 4.5

    while time.monotonic() - started <= 4.5:  # requests that end early are followed by more, on a fast machine
        requests = [Request(f"{wave}-{i}", p, SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True))
                    for i, p in enumerate(prompts([20, 30, 40, 50]))]
        run_steps(engine, cp, requests, until=stepped)
        wave += 1
    elapsed = time.monotonic() - started
    assert cp.writer.flush(30)
    cp.close()
    most = int(elapsed // 2) + 1  # a round every 2 s at most
    assert steps // 16 > most, f"only {steps} steps in {elapsed:.1f} s: the interval alone makes no more rounds"
    assert 1 <= segment_puts(store) <= most, f"{segment_puts(store)} rounds in {elapsed:.1f} s of {steps} steps"


def test_the_kv_decision_weighs_a_crash_against_the_write():
    rates = TransferRates(prefill_tokens_per_second=500.0, storage_bytes_per_second=100e6,
                          write_bytes_per_second=100e6, put_seconds=0.02, step_seconds=0.1)
    args = dict(block_size=16, block_bytes=737_280, objects=1)
    short, long = 100, 200_000  # steps left: 10 s, or 5.6 hours
    policy = KvPolicy("auto", mtbf=6 * 3600)
    assert not policy.worth_writing(rates, blocks=8, written_blocks=8, remaining_steps=short, **args)
    assert policy.worth_writing(rates, blocks=8, written_blocks=8, remaining_steps=long, **args)
    # a crash expected within the short request's 10 s: worth it for it too; at 10 minutes not yet
    assert KvPolicy("auto", mtbf=10).worth_writing(rates, blocks=8, written_blocks=8, remaining_steps=short, **args)
    assert not KvPolicy("auto", mtbf=600).worth_writing(rates, blocks=8, written_blocks=8, remaining_steps=short,
                                                        **args)
    # reading back no faster than computing: never worth writing
    slow_store = TransferRates(prefill_tokens_per_second=1e6, storage_bytes_per_second=1e6)
    assert not policy.worth_writing(slow_store, blocks=8, written_blocks=8, remaining_steps=long, **args)
    assert KvPolicy("always").worth_writing(rates, blocks=8, written_blocks=8, remaining_steps=short, **args)
    assert not KvPolicy("never").worth_writing(rates, blocks=8, written_blocks=8, remaining_steps=long, **args)
    assert policy.crash_chance(6 * 3600) == pytest.approx(1 - 1 / 2.718281828, rel=1e-6)


class _SlowPrefill(TransferRates):
    """Rates of an engine that computes KV slowly (the tiny model computes it faster than any store)."""

    def observe_step(self, stats):
        pass


def test_kv_is_written_once_recomputing_it_would_cost_more_than_writing_it(tiny_loaded, store):
    """"auto" with what the worker measures: where prefill is slow and workers die often, the same
    short requests' KV blocks pay for their writes."""
    engine = tiny_engine(tiny_loaded)
    rates = _SlowPrefill(prefill_tokens_per_second=20.0)
    cp = Checkpointer(engine, store, Settings(checkpoint_interval=16, checkpoint_min_seconds=0, checkpoint_mtbf=1.0),
                      WorkerMetrics(),
                      on_durable=Pointers(), rates=rates)
    cp.pointers = cp.writer.on_durable
    requests = [Request(str(i), p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([40, 50]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 2 * 33)
    assert cp.writer.flush(30)
    assert kv_puts(store) >= 2 and all(s.kv_runs for s in _states(cp).values())
    cp.close()


def test_a_prefix_shared_by_many_requests_is_stored_once(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_kv="always")
    prefix = prompts([64])[0]  # four full blocks
    requests = [Request(str(i), prefix + prompts([8], seed=i + 1)[0],
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for i in range(8)]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 8 * 30)
    assert cp.writer.flush(30)
    states = _states(cp)
    assert len(states) == 8 and all(s.output_tokens >= 24 and s.fingerprint == engine.fingerprint
                                    for s in states.values())
    run_puts = {k: n for k, n in store.puts.items() if k.startswith(KV_PREFIX)}
    assert set(run_puts.values()) == {1}, "a KV run was written twice"
    runs = _runs(store)
    held = [h for hashes in runs.values() for h in hashes]
    assert len(held) == len(set(held)), "a KV block is stored in two runs"
    named = {kv_key(s.fingerprint, last) for s in states.values() for last in s.kv_runs}
    assert named == set(run_puts) == set(runs)
    prefixes = {tuple(s.samples[0].block_hashes[:4]) for s in states.values()}
    assert len(prefixes) == 1 and len(runs) == 1, "the shared prompt's four blocks should be one run in every state"
    assert runs[kv_key(engine.fingerprint, prefixes.pop()[-1])], "the run is named by the prefix's last block"
    cp.close()


def test_a_state_written_before_its_blocks_is_written_again_once_they_are(store):
    """A state never names a run not yet on the store, so one written while its run waits is short of
    its blocks; once they are through it goes again, so that after ``flush`` it names them all (an
    older state waiting so never overwrites a newer one)."""
    pointers = Pointers()
    writer = CheckpointWriter(store, "fp", WorkerMetrics(), max_pending_bytes=1 << 20, on_durable=pointers)
    hashes = [bytes([i]) * 16 for i in range(3)]

    def snapshot(tokens: int, runs: list) -> Snapshot:
        state = RequestCheckpoint("1", "fp", "digest", 4, [SampleCheckpoint(0, [5] * tokens, hashes)], 0.0)
        return Snapshot(state, runs)

    def stored() -> RequestCheckpoint | None:
        return read_state(store.inner, pointers["1"]) if "1" in pointers else None

    store.kv_gate.clear()  # the run waits
    writer.submit_round([snapshot(10, [KvRun(hashes, torch.zeros(1, 2, 3, 1, 1, 4))])])
    _until(lambda: stored() is not None)
    assert stored().output_tokens == 10 and not stored().block_hashes()
    writer.submit_round([snapshot(20, [])])  # newer progress while the run still waits
    _until(lambda: stored().output_tokens == 20)
    assert not stored().block_hashes()
    store.kv_gate.set()
    assert writer.flush(30)
    assert stored().output_tokens == 20 and stored().block_hashes() == hashes and stored().kv_runs == [hashes[-1]]
    assert segment_puts(store) == 3, "the older state was written again, or the newer one not"
    writer.close()


def test_a_stalled_store_makes_checkpoints_lag_and_never_stops_the_engine(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    kv = engine.kv_usage()
    budget = 6 * kv["kv_bytes"] // kv["blocks_total"]  # six blocks
    cp = checkpointer(engine, store, checkpoint_interval=4, checkpoint_queue_bytes=budget, checkpoint_kv="always")
    store.gate.clear()  # every write now hangs until the test lets it through
    unstall = threading.Timer(120, store.gate.set)  # a regression fails below instead of hanging
    unstall.start()
    requests = [Request(str(i), p, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([40, 50, 60, 70]))]
    for r in requests:
        engine.add_request(r)
    lag_tokens = 0.0
    while engine.has_unfinished():
        engine.step()
        cp.after_step()
        assert cp.writer.room() >= 0, "more KV data queued than the budget"
        lag_tokens = max(lag_tokens, _metric(cp, "berth_checkpoint_lag_tokens"))
    assert not store.gate.is_set(), "the engine only finished once the store moved again: it waited on it"
    unstall.cancel()
    assert lag_tokens > 4 * 4 * 4, "checkpoints did not fall behind a stalled store"
    assert _metric(cp, "berth_checkpoint_superseded_total") > 0, "queued snapshots were not replaced by newer ones"
    store.gate.set()
    cp.close(timeout=0)


def test_states_never_wait_behind_kv_blocks_and_a_finished_requests_blocks_are_dropped(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4, checkpoint_kv="always")
    store.kv_gate.clear()  # KV writes hang; states go through
    unstall = threading.Timer(120, store.kv_gate.set)  # a regression fails below instead of hanging
    unstall.start()
    requests = [Request(str(i), p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([40, 50, 60, 70]))]
    run_steps(engine, cp, requests)
    _until(lambda: cp.writer.lag_seconds() == 0)
    states = _states(cp)
    assert len(states) == 4 and all(s.output_tokens >= 20 for s in states.values()), \
        "states waited behind the KV blocks"
    assert not _runs(store) and not any(s.block_hashes() or s.kv_runs for s in states.values()), \
        "a state named a block that is not on the store"
    uploading = sum(r.nbytes for r in cp.writer._uploading.values())
    assert cp.writer.pending_block_bytes > uploading, "the test needs KV runs queued behind the stalled one"
    for r in requests:
        cp.finished(r.request_id)
    assert cp.writer.pending_block_bytes == uploading, "a finished request's queued runs were kept"
    store.kv_gate.set()
    unstall.cancel()
    assert cp.writer.flush(30)
    assert len(_runs(store)) <= checkpoint_writer.BLOCK_THREADS
    cp.close()


def test_states_are_never_torn_and_name_only_blocks_on_the_store(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=2, checkpoint_kv="always")
    requests = [Request(str(i), p, SamplingParams(max_tokens=100, temperature=0.8, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts([30, 45]))]
    stop, problems, reads = threading.Event(), [], [0]
    last_tokens: dict[str, int] = {}

    def reader():
        seen = set()
        while not stop.is_set():
            for rid, state in _states(cp).items():  # from_json raises on a torn object
                reads[0] += 1
                if state.output_tokens < last_tokens.get(rid, 0):
                    problems.append(f"{rid} went back from {last_tokens[rid]} to {state.output_tokens} tokens")
                last_tokens[rid] = state.output_tokens
                for last in state.kv_runs:
                    k = kv_key(state.fingerprint, last)
                    if k not in seen and not store.inner.exists(k):
                        problems.append(f"{rid} names {k}, which is not on the store")
                    seen.add(k)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        run_steps(engine, cp, requests)
        cp.writer.flush(30)
    finally:
        stop.set()
        thread.join()
    assert not problems, problems[:3]
    assert reads[0] > 10 and max(last_tokens.values()) >= 90
    assert any(s.kv_runs for s in _states(cp).values())
    cp.close()


def test_an_outage_pauses_checkpoints_once_and_they_resume(tiny_loaded, store, caplog, monkeypatch):
    monkeypatch.setattr(checkpoint_writer, "PROBE_BACKOFF", (0.05, 0.2))
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4)
    requests = [Request(str(i), p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([20, 30]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 40)
    assert cp.writer.flush(30) and _metric(cp, "berth_checkpoint_storage_up") == 1
    states_before = _metric(cp, "berth_checkpoint_states_total")
    store.down = True
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        run_steps(engine, cp, until=lambda: engine.stats.output_tokens >= 200)  # the engine keeps going
        assert _metric(cp, "berth_checkpoint_storage_up") == 0 and not cp.store_up
        assert _metric(cp, "berth_checkpoint_failures_total") >= 1
        assert _metric(cp, "berth_checkpoint_lag_tokens") > 100
        store.down = False
        deadline = time.monotonic() + 10
        while not cp.store_up:
            assert time.monotonic() < deadline, "checkpoints did not resume"
            time.sleep(0.05)
        run_steps(engine, cp, until=lambda: engine.stats.output_tokens >= 240)
        assert cp.writer.flush(30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("unavailable" in w for w in warnings) == 1, warnings
    assert sum("is back" in w for w in warnings) == 1, warnings
    assert _metric(cp, "berth_checkpoint_storage_up") == 1
    assert _metric(cp, "berth_checkpoint_states_total") > states_before
    assert all(s.output_tokens >= 100 for s in _states(cp).values())
    cp.close()


def test_a_database_outage_keeps_writing_states_and_records_them_once_it_is_back(tiny_loaded, store, caplog,
                                                                                  monkeypatch):
    """Recording where the states are fails while the database is down: the segments are written all
    the same, the progress does not count as durable (a crash would resume from the last recorded
    state), and the newest refs are recorded once it is back; the engine never waits on any of it."""
    monkeypatch.setattr(checkpoint_writer, "RECORD_BACKOFF", (0.05, 0.2))
    database = Pointers()
    down = threading.Event()
    calls = [0]

    def record(refs):
        calls[0] += 1
        if down.is_set():
            raise LedgerDown("the database is down")
        database(refs)

    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, database, checkpoint_interval=4)
    cp.writer.on_durable = record
    requests = [Request(str(i), p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([20, 30]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 40)
    assert cp.writer.flush(30)
    recorded = stored_states(store.inner, database)
    down.set()
    segments = segment_puts(store)
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        run_steps(engine, cp, until=lambda: engine.stats.output_tokens >= 200)
        assert segment_puts(store) > segments + 5, "states stopped being written while the database was down"
        assert _metric(cp, "berth_checkpoint_lag_tokens") > 100, "unrecorded progress counted as durable"
        assert stored_states(store.inner, database) == recorded
        assert not cp.writer.flush(0.3)
        down.clear()
        assert cp.writer.flush(30)
    latest = stored_states(store.inner, database)
    assert all(latest[r].output_tokens > recorded[r].output_tokens >= 16 for r in recorded)
    assert set(cp.writer.durable_tokens) == set(recorded) and calls[0] > 1
    assert sum("could not record" in r.getMessage() for r in caplog.records) == 1
    assert any("recorded again" in r.getMessage() for r in caplog.records)
    cp.close()


def test_finished_requests_write_no_more_and_handed_back_keep_theirs(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4)
    requests = [Request(str(i), p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([20, 30]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 20)
    assert cp.save_all(timeout=30)
    before = _states(cp)
    assert set(before) == {"0", "1"}
    store.gate.clear()  # the next states wait to be written
    run_steps(engine, cp, until=lambda: engine.stats.output_tokens >= 60)
    assert not cp.save_all(timeout=0.2)
    cp.finished("0")  # its result is in: its waiting state is not worth writing
    cp.released("1")  # handed back: its state is what the next worker continues from
    for r in requests:
        engine.abort(r.request_id)
    store.gate.set()
    assert cp.writer.flush(30)
    after = _states(cp)
    assert after["1"].output_tokens >= 28 > before["1"].output_tokens
    assert after["0"] == before["0"], "a finished request's waiting state was still written and recorded"
    cp.close()


def test_collection_keeps_the_latest_states_and_what_they_name(tiny_loaded, tiny_llama_dir, store, tmp_path):
    from sqlalchemy import select, update

    from jobs import api
    from jobs.records.db import open_database
    from jobs.records.models import RequestRow
    from jobs.records.results import ResultRecord, record_outcomes
    from tests.support.jobs_env import tiny_settings, write_requests

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'jobs.records.db'}",
                             storage_url=f"file://{tmp_path / 'jobstore'}")
    job = api.submit(write_requests(tmp_path / "r.jsonl", 2), settings, eager=True)
    db = open_database(settings.database_url)
    with db.session() as s:
        ids = [str(i) for i in s.scalars(select(RequestRow.id).where(RequestRow.job_id == job.id))]
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4, checkpoint_kv="always")
    requests = [Request(rid, p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for rid, p in zip(ids, prompts([40, 40]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 40)
    assert cp.writer.flush(30)
    cp.close()
    with db.session() as s, s.begin():  # what the worker's ledger records
        for rid, ref in cp.pointers.items():
            s.execute(update(RequestRow).where(RequestRow.id == int(rid)).values(checkpoint=ref))
    state_of = _states(cp)
    runs_of = {rid: {kv_key(s.fingerprint, last) for last in s.kv_runs} for rid, s in state_of.items()}
    assert runs_of[ids[0]] and runs_of[ids[1]] and not runs_of[ids[0]] & runs_of[ids[1]]
    latest_segments = {cp.pointers[rid].split("@")[0] for rid in ids}
    segments = [o.key for o in store.inner.list(SEGMENT_PREFIX)]
    assert len(segments) > len(latest_segments)
    record_outcomes(db, [ResultRecord.failure(int(ids[0]), job.id, "test", "done")])  # request 0 has its outcome
    old = time.time() - 7200
    for key in segments + list(_runs(store)):
        os.utime(store.inner.path(key), (old, old))
    young_run = kv_key(engine.fingerprint, b"\x01" * 16)
    store.inner.put(young_run, b"young and unnamed")
    young_segment = f"{SEGMENT_PREFIX}{'a' * 16}/0000000000.seg"
    store.inner.put(young_segment, b"a worker's segment, its refs not recorded yet")
    for name, age in (("state/1.json", old), ("kv/f/0a.kv", time.time())):
        store.inner.put(LEGACY_PREFIX + name, b"berth before segments")
        os.utime(store.inner.path(LEGACY_PREFIX + name), (age, age))
    killed = store.inner.path(young_run).with_name(".02.kv.x1.berth-tmp")
    killed.write_bytes(b"a writer killed half-way")
    os.utime(killed, (old, old))
    writing = killed.with_name(".03.kv.x2.berth-tmp")
    writing.write_bytes(b"a writer at work")

    collected = collect_checkpoints(store.inner, db, min_age=3600)
    left_segments = {o.key for o in store.inner.list(SEGMENT_PREFIX)}
    left_runs = {o.key for o in store.inner.list(KV_PREFIX)}
    assert left_segments == {cp.pointers[ids[1]].split("@")[0], young_segment}, "only the latest state's segment"
    assert collected.segments_deleted == len(segments) - 1
    assert runs_of[ids[1]] <= left_runs, "a run the latest state of an open request names was collected"
    assert not runs_of[ids[0]] & left_runs, "runs only a finished request named were kept"
    assert young_run in left_runs, "a run younger than min_age was collected"
    assert [o.key for o in store.inner.list(LEGACY_PREFIX)] == [LEGACY_PREFIX + "kv/f/0a.kv"]
    assert collected.temporaries_deleted == 1 and not killed.exists() and writing.exists()
    assert read_state(store.inner, cp.pointers[ids[1]]) == state_of[ids[1]]
    assert ids[1] in segment_states(store.inner.get(cp.pointers[ids[1]].split("@")[0]))
    with pytest.raises(ObjectNotFound):
        store.inner.get(segments[0] if segments[0] not in left_segments else segments[1])


def test_bookkeeping_is_kept_only_for_requests_in_the_engine(tiny_loaded, store):
    """A long-lived worker forgets every request that left it, also those ``finished`` and
    ``released`` never told it of: one handed back after its state was written, one resumed and
    never added (dropped while its checkpoint was read)."""
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4)
    requests = [Request(str(i), p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([20, 30, 25]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 30)
    assert cp.writer.flush(30) and set(cp.writer.durable_tokens) == {"0", "1", "2"}
    engine.abort("0")
    cp.released("0")  # handed back: its state stays on the store
    engine.abort("1")  # aborted with nobody telling the checkpointer
    cp.resumed(RequestCheckpoint("9", "fp", "d", 1, [], 0.0))  # never added
    run_steps(engine, cp, until=lambda: engine.stats.output_tokens >= 40)
    assert set(cp._progress) == set(cp.writer.durable_tokens) == {"2"}
    assert set(_states(cp)) == set("012"), "a request's state was lost"
    cp.close()

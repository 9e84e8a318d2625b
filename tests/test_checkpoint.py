"""The checkpointer beside a real engine (the tiny model): what it writes and when, each KV block
once, a slow store that never slows the engine, states never torn, an outage and the recovery, and
the collection of what nothing needs."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from jobs.checkpoint_gc import collect_checkpoints
from storage import ObjectNotFound, open_store
from tests.checkpoint_support import ControlledStore, checkpointer, prompts, run_steps, tiny_engine
from worker.checkpoint import writer as checkpoint_writer
from worker.checkpoint.format import (
    KV_PREFIX,
    STATE_PREFIX,
    RequestCheckpoint,
    SampleCheckpoint,
    block_key,
    state_key,
)
from worker.checkpoint.writer import CheckpointWriter, Snapshot
from worker.engine.request import Request, SamplingParams
from worker.metrics import WorkerMetrics


@pytest.fixture
def store(tmp_path):
    return ControlledStore(open_store(f"file://{tmp_path / 'store'}"))


def _states(store) -> dict[str, RequestCheckpoint]:
    return {o.key: RequestCheckpoint.from_json(store.inner.get(o.key)) for o in store.inner.list(STATE_PREFIX)}


def _blocks(store) -> list[str]:
    return [o.key for o in store.inner.list(KV_PREFIX)]


def _metric(cp, name: str) -> float:
    return cp.metrics.registry.get_sample_value(name)


def test_a_prefix_shared_by_many_requests_is_stored_once(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store)
    prefix = prompts([64])[0]  # four full blocks
    requests = [Request(str(i), prefix + prompts([8], seed=i + 1)[0],
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for i in range(8)]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 8 * 30)
    assert cp.writer.flush(30)
    states = _states(store)
    assert len(states) == 8 and all(s.output_tokens >= 24 and s.fingerprint == engine.fingerprint
                                    for s in states.values())
    block_puts = {k: n for k, n in store.puts.items() if k.startswith(KV_PREFIX)}
    assert set(block_puts.values()) == {1}, "a KV block was written twice"
    named = {block_key(s.fingerprint, h) for s in states.values() for h in s.block_hashes()}
    assert named == set(block_puts) == set(_blocks(store))
    prefixes = {tuple(s.samples[0].block_hashes[:4]) for s in states.values()}
    assert len(prefixes) == 1, "the shared prompt's blocks should be the same four in every state"
    cp.close()


def _until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_state_written_before_its_blocks_is_written_again_once_they_are(store):
    """A state never names a block not yet on the store, so one written while its blocks wait is
    short of them; once they are through it goes again, so that after ``flush`` it names them all
    (an older state waiting so never overwrites a newer one)."""
    writer = CheckpointWriter(store, "fp", WorkerMetrics(), max_pending_bytes=1 << 20)
    hashes = [bytes([i]) * 16 for i in range(3)]
    key = state_key("1")

    def snapshot(tokens: int, blocks: dict) -> Snapshot:
        state = RequestCheckpoint("1", "fp", "digest", 4, [SampleCheckpoint(0, [5] * tokens, hashes)], 0.0)
        return Snapshot(state, blocks)

    def stored() -> RequestCheckpoint | None:
        return _states(store).get(key)

    store.kv_gate.clear()  # the blocks wait
    writer.submit(snapshot(10, {h: torch.zeros(4) for h in hashes}))
    _until(lambda: stored() is not None)
    assert stored().output_tokens == 10 and not stored().block_hashes()
    writer.submit(snapshot(20, {}))  # newer progress while the blocks still wait
    _until(lambda: stored().output_tokens == 20)
    assert not stored().block_hashes()
    store.kv_gate.set()
    assert writer.flush(30)
    assert stored().output_tokens == 20 and stored().block_hashes() == hashes
    assert store.puts[key] == 3, "the older state was written again, or the newer one not"
    writer.close()


def test_a_stalled_store_makes_checkpoints_lag_and_never_stops_the_engine(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    kv = engine.kv_usage()
    budget = 6 * kv["kv_bytes"] // kv["blocks_total"]  # six blocks
    cp = checkpointer(engine, store, checkpoint_interval=4, checkpoint_queue_bytes=budget)
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
    cp = checkpointer(engine, store, checkpoint_interval=4)
    store.kv_gate.clear()  # KV block writes hang; states go through
    unstall = threading.Timer(120, store.kv_gate.set)  # a regression fails below instead of hanging
    unstall.start()
    requests = [Request(str(i), p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([40, 50, 60, 70]))]
    run_steps(engine, cp, requests)
    deadline = time.monotonic() + 30
    while cp.writer.lag_seconds() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    states = _states(store)
    assert len(states) == 4 and all(s.output_tokens >= 20 for s in states.values()), \
        "states waited behind the KV blocks"
    assert not _blocks(store) and not any(s.block_hashes() for s in states.values()), \
        "a state named a block that is not on the store"
    in_flight = checkpoint_writer.BLOCK_THREADS * (engine.kv_usage()["kv_bytes"] // engine.kv_usage()["blocks_total"])
    assert cp.writer.pending_block_bytes > in_flight, "the test needs KV blocks queued behind the stalled ones"
    for r in requests:
        cp.finished(r.request_id)
    assert cp.writer.pending_block_bytes <= in_flight, "a finished request's queued blocks were kept"
    store.kv_gate.set()
    unstall.cancel()
    assert cp.writer.flush(30)
    assert len(_blocks(store)) <= checkpoint_writer.BLOCK_THREADS and not _states(store)
    cp.close()


def test_states_are_never_torn_and_name_only_blocks_on_the_store(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=2)
    requests = [Request(str(i), p, SamplingParams(max_tokens=100, temperature=0.8, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts([30, 45]))]
    stop, problems, reads = threading.Event(), [], [0]
    last_tokens: dict[str, int] = {}

    def reader():
        blocks = set()
        while not stop.is_set():
            for key, state in _states(store).items():  # from_json raises on a torn object
                reads[0] += 1
                if state.output_tokens < last_tokens.get(key, 0):
                    problems.append(f"{key} went back from {last_tokens[key]} to {state.output_tokens} tokens")
                last_tokens[key] = state.output_tokens
                for h in state.block_hashes():
                    k = block_key(state.fingerprint, h)
                    if k not in blocks and not store.inner.exists(k):
                        problems.append(f"{key} names {k}, which is not on the store")
                    blocks.add(k)

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
    assert all(s.output_tokens >= 100 for s in _states(store).values())
    cp.close()


def test_finished_requests_lose_their_state_and_handed_back_keep_it(tiny_loaded, store):
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4)
    requests = [Request(str(i), p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts([20, 30]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 20)
    assert cp.save_all(timeout=30) and len(_states(store)) == 2
    cp.finished("0")
    cp.released("1")
    assert cp.writer.flush(30)
    assert list(_states(store)) == [state_key("1")]
    cp.close()


def test_collection_keeps_what_states_name_and_young_blocks(tiny_loaded, tiny_llama_dir, store,
                                                            tmp_path):
    from sqlalchemy import select

    from jobs import api
    from jobs.db import open_database
    from jobs.models import RequestRow
    from jobs.results import ResultRecord, record_outcomes
    from tests.jobs_support import tiny_settings, write_requests

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                             storage_url=f"file://{tmp_path / 'jobstore'}")
    job = api.submit(write_requests(tmp_path / "r.jsonl", 2), settings, eager=True)
    db = open_database(settings.database_url)
    with db.session() as s:
        ids = [str(i) for i in s.scalars(select(RequestRow.id).where(RequestRow.job_id == job.id))]
    engine = tiny_engine(tiny_loaded)
    cp = checkpointer(engine, store, checkpoint_interval=4)
    requests = [Request(rid, p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for rid, p in zip(ids, prompts([40, 40]))]
    run_steps(engine, cp, requests, until=lambda: engine.stats.output_tokens >= 40)
    assert cp.writer.flush(30)
    cp.close()
    state_of = _states(store)
    named = {k: {block_key(s.fingerprint, h) for h in s.block_hashes()} for k, s in state_of.items()}
    only_first = named[state_key(ids[0])] - named[state_key(ids[1])]
    assert only_first
    record_outcomes(db, [ResultRecord.failure(int(ids[0]), job.id, "test", "done")])  # request 0 has its outcome
    old = time.time() - 7200
    for key in _blocks(store):
        os.utime(store.inner.path(key), (old, old))
    store.inner.put(block_key(engine.fingerprint, b"\x01" * 16), b"young and unnamed")
    store.inner.put(state_key("garbage"), b"{not json")
    os.utime(store.inner.path(state_key("garbage")), (old, old))
    killed = store.inner.path(block_key(engine.fingerprint, b"\x02" * 16)).with_name(".02.kv.x1.berth-tmp")
    killed.write_bytes(b"a writer killed half-way")
    os.utime(killed, (old, old))
    writing = killed.with_name(".03.kv.x2.berth-tmp")
    writing.write_bytes(b"a writer at work")

    collected = collect_checkpoints(store.inner, db, min_age=3600)
    left = set(_blocks(store))
    assert collected.states_deleted == 2  # request 0's (it has its outcome) and the unreadable one
    assert collected.temporaries_deleted == 1 and not killed.exists() and writing.exists()
    assert not store.inner.exists(state_key(ids[0])) and store.inner.exists(state_key(ids[1]))
    assert named[state_key(ids[1])] <= left, "a block a live state names was collected"
    assert not (only_first & left), "blocks only a finished request named were kept"
    assert block_key(engine.fingerprint, b"\x01" * 16) in left, "a block younger than min_age was collected"
    with pytest.raises(ObjectNotFound):
        store.inner.get(state_key("garbage"))


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
    assert set(_states(store)) == {state_key(r) for r in "012"}, "a request's state was lost"
    cp.close()

"""KV blocks held for interactive work (``Settings.interactive_kv_blocks``): batch sequences never hold
more than the rest of the cache, an interactive request that the held blocks cover starts without
preempting anything, and interactive work may still use every block."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.scheduling import check_block_accounting, fake_step, make_seq
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, SamplingParams, SeqStatus, Sequence
from worker.engine.scheduler import Scheduler


def _held(seqs: list[Sequence], interactive: bool) -> int:
    return len({b for s in seqs if s.status is SeqStatus.RUNNING and s.request.interactive == interactive
                for b in s.block_table})


def test_batch_work_alone_holds_at_most_the_blocks_left_to_it():
    """20 blocks, 5 held: six batch sequences that would fill the cache grow to 15 blocks and then
    preempt one another (recompute), as in a cache of 15, and still all finish."""
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, interactive_blocks=5)
    batch = [make_seq(i, 10, max_tokens=30) for i in range(6)]
    for s in batch:
        sched.add(s)
    most = 0
    for _ in range(2000):
        if not sched.has_work():
            break
        fake_step(sched)
        assert bm.num_used_blocks <= 15 and bm.num_free_blocks >= 5
        most = max(most, bm.num_used_blocks)
        check_block_accounting(bm, batch)
    assert not sched.has_work() and all(s.is_finished for s in batch)
    assert most == 15 and sched.num_preemptions > 0  # batch work used its part to the last block, no more


def test_an_interactive_request_gets_the_held_blocks_without_preempting():
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, interactive_blocks=5)
    batch = [make_seq(i, 14, max_tokens=1000) for i in range(5)]  # 4 blocks each, 20 in all: more than their 15
    for s in batch:
        sched.add(s)
    for _ in range(100):  # until batch work holds its whole part
        fake_step(sched)
        assert bm.num_used_blocks <= 15
        if bm.num_used_blocks == 15:
            break
    assert bm.num_used_blocks == 15 and bm.num_free_blocks == 5

    live = make_seq(10, 11, interactive=True, max_tokens=9)  # 3 blocks for its prompt, 5 by its end
    sched.add(live)
    plan = fake_step(sched)
    assert (live, 11) in plan.scheduled and not plan.preempted
    assert bm.num_used_blocks == 18  # batch work leaves 2 more free: the 5 held, less the 3 it holds
    while not live.is_finished:
        plan = fake_step(sched)
        assert not [s for s in plan.preempted if s.request.interactive]
        assert _held(batch, False) <= 15
    for _ in range(50):  # the live request gone, batch work grows back into its whole part
        if _held(batch, False) == 15:
            break
        fake_step(sched)
    assert _held(batch, False) == 15 and bm.num_free_blocks == 5


def test_interactive_work_may_take_every_block():
    """Interactive sequences beyond the held blocks preempt batch work for the rest, down to none."""
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=128, max_num_seqs=8, interactive_blocks=5)
    batch = [make_seq(i, 10, max_tokens=1000) for i in range(4)]
    for s in batch:
        sched.add(s)
    for _ in range(20):
        fake_step(sched)
    live = [make_seq(10 + i, 39, interactive=True, max_tokens=2) for i in range(2)]  # 10 blocks each
    for s in live:
        sched.add(s)
    plan = fake_step(sched)
    assert {s for s, _ in plan.scheduled} >= set(live) and _held(live, True) == 20
    assert plan.preempted and not any(s.request.interactive for s in plan.preempted)
    assert not any(s.status is SeqStatus.RUNNING for s in batch)


def test_nothing_held_is_the_scheduler_as_before():
    """With no blocks held, batch work fills the cache; an interactive request preempts for room."""
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    batch = [make_seq(i, 14, max_tokens=1000) for i in range(5)]
    for s in batch:
        sched.add(s)
    for _ in range(4):
        fake_step(sched)
    assert bm.num_free_blocks == 0
    live = make_seq(10, 11, interactive=True)
    sched.add(live)
    plan = fake_step(sched)
    assert (live, 11) in plan.scheduled and plan.preempted


def test_batch_tenants_share_the_seats_while_interactive_work_runs():
    """Two batch tenants asking for seats at once get them by weight, however many interactive
    sequences run (a batch admission once read the interactive lanes' claims when one ran, and none
    when two or more did: the first tenant to ask took every seat)."""
    for live in (1, 2):
        sched = Scheduler(BlockManager(512, 4, enable_prefix_cache=False), 1000, max_num_seqs=6)
        for i in range(live):
            sched.add(make_seq(90 + i, 4, interactive=True, max_tokens=500))
        fake_step(sched)
        for i in range(8):
            seq = make_seq(i, 40 if i < 4 else 4, max_tokens=500)
            seq.request.tenant = "A" if i < 4 else "B"
            sched.add(seq)
        for _ in range(3):
            fake_step(sched)
        seats = Counter(s.request.tenant for s in sched.running if not s.request.interactive)
        assert abs(seats["A"] - seats["B"]) <= 1 and sum(seats.values()) == 6 - live, (live, seats)


workloads = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 60), st.integers(1, 30), st.booleans()),
                     min_size=1, max_size=16)


@settings(max_examples=150, deadline=None)
@given(requests=workloads, block_size=st.sampled_from([4, 8]), budget=st.integers(1, 64),
       max_seqs=st.integers(1, 6), mode=st.sampled_from(["recompute", "swap"]), held=st.floats(0, 0.9),
       seats=st.integers(0, 2))
def test_held_blocks_invariants(requests, block_size, budget, max_seqs, mode, held, seats):
    """Batch and interactive requests arriving at random, under a cache that preempts often: batch
    sequences never hold more than the blocks left to them, every block is accounted for, and every
    request finishes."""
    longest = max(p + o for _, p, o, _ in requests)
    need = -(-longest // block_size)
    num_blocks = need + 2
    reserve = int(num_blocks * held)
    num_blocks += reserve  # the engine refuses a batch request larger than batch work's part
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, budget, max_seqs, aging_steps=4, preemption_mode=mode,
                      interactive_seats=min(seats, max_seqs - 1), interactive_blocks=reserve)
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    seqs: list[Sequence] = []
    steps = 0
    while pending or sched.has_work():
        while pending and pending[0][1][0] <= steps:
            i, (_, prompt, out, interactive) = pending.pop(0)
            seq = make_seq(i, prompt, interactive, max_tokens=out)
            seqs.append(seq)
            sched.add(seq)
        plan = fake_step(sched)
        for seq, _ in plan.swap_out:
            assert seq.status is SeqStatus.SWAPPED
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
        assert _held(seqs, False) <= num_blocks - reserve
        check_block_accounting(bm, seqs)
    assert all(s.status is SeqStatus.FINISHED for s in seqs)
    assert bm.num_free_blocks == num_blocks


def test_the_setting_end_to_end(monkeypatch, tiny_llama_dir):
    """BERTH_INTERACTIVE_KV_BLOCKS to the engine's scheduler; a batch request larger than batch work's
    part of the cache is refused, an interactive one of the same size is not."""
    from worker.config import Settings
    from worker.engine.engine import Engine, RequestRejected

    monkeypatch.setenv("BERTH_INTERACTIVE_KV_BLOCKS", "0.5")
    assert Settings().interactive_kv_blocks == 0.5
    with pytest.raises(ValueError, match="interactive_kv_blocks"):
        Settings(interactive_kv_blocks=1)
    engine = Engine(Settings(model=str(tiny_llama_dir), kv_memory=16 * 8192, threads=1))  # 16 blocks of 16 tokens
    assert engine.runner.num_blocks == 16 and engine.scheduler.interactive_blocks == 8
    prompt = list(range(100, 200))
    big = SamplingParams(max_tokens=100, temperature=0)  # 200 tokens: 13 blocks
    with pytest.raises(RequestRejected, match="batch work may hold"):
        engine.add_request(Request("batch", prompt, big))
    live = Request("live", prompt, big)
    live.interactive = True
    engine.add_request(live)
    engine.add_request(Request("small", prompt[:20], SamplingParams(max_tokens=4, temperature=0)))
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == 16

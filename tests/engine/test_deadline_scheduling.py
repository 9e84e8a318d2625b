"""Deadlines and a job's tail in the scheduler: within a tenant, the job whose window ends first runs
first (priority orders jobs of the same deadline); across tenants the shares decide; once a job's
waiting requests fit in the batch, its longest expected start first."""

from __future__ import annotations

import random
from collections import Counter

from tests.support.scheduling import arrive
from worker.engine.block_manager import BlockManager
from worker.engine.job_tail import JobLengths
from worker.engine.request import Request, SamplingParams, Sequence
from worker.engine.scheduler import Scheduler
from worker.engine.waiting_queue import DEADLINE_SLOT, WaitingQueue

HOUR = 3600.0
T0 = 1_700_000_000.0  # a submit time, on a slot's boundary or not: only differences matter


def run(sched: Scheduler, arrivals: dict[int, list[Request]], steps: int, lengths: dict[str, int] | None = None):
    """Drive ``sched`` with a fake model: a request makes one token a step until it has made its length
    (``lengths``, else its max_tokens). The step each request made its last token."""
    lengths = lengths or {}
    done: dict[str, int] = {}
    for step in range(steps):
        for req in arrivals.get(step, []):
            arrive(sched, req)
        if not sched.has_work() and step > max(arrivals):
            break
        for seq, n in sched.schedule().scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1)
                rid = seq.request.request_id
                if seq.num_output_tokens == lengths.get(rid, seq.request.params.max_tokens):
                    sched.finish(seq)
                    done[rid] = step
    return done


def job(name: str, n: int, deadline: float | None, priority: int = 0, tenant: str = "default",
        max_tokens: int = 10) -> list[Request]:
    return [Request(f"{name}{i}", [1] * 10, SamplingParams(max_tokens=max_tokens), priority=priority,
                    tenant=tenant, deadline=deadline, job=name) for i in range(n)]


def test_the_job_whose_window_ends_first_runs_first_whatever_came_first():
    day = job("day", 20, T0 + 24 * HOUR, priority=9)  # submitted first, and with the higher priority
    hour = job("hour", 20, T0 + HOUR + 60, priority=0)  # a minute later, a one-hour window
    done = run(Scheduler(BlockManager(4096, 16), 256, max_num_seqs=4), {0: day, 5: hour}, steps=500)
    assert len(done) == 40
    hour_end = max(v for k, v in done.items() if k.startswith("hour"))
    day_end = max(v for k, v in done.items() if k.startswith("day"))
    assert hour_end < day_end
    # the day job's requests that were waiting when the hour job came wait behind all of it
    assert sum(v > hour_end for k, v in done.items() if k.startswith("day")) >= 20 - 4 - 4


def test_priority_orders_the_jobs_of_one_deadline():
    slot = (T0 // DEADLINE_SLOT) * DEADLINE_SLOT
    low = job("low", 12, slot + 10, priority=0)
    high = job("high", 12, slot + 20, priority=5)  # later within the same slot: the same deadline
    done = run(Scheduler(BlockManager(4096, 16), 256, max_num_seqs=4, aging_steps=10_000), {0: low + high}, 500)
    assert max(v for k, v in done.items() if k.startswith("high")) < min(v for k, v in done.items()
                                                                         if k.startswith("low"))


def test_a_request_without_a_deadline_comes_after_those_with_one():
    free = job("free", 8, None, priority=9)
    due = job("due", 8, T0 + 48 * HOUR, priority=0)
    done = run(Scheduler(BlockManager(4096, 16), 256, max_num_seqs=2), {0: free + due}, 500)
    assert max(v for k, v in done.items() if k.startswith("due")) < min(v for k, v in done.items()
                                                                        if k.startswith("free"))


def test_a_tenants_near_deadline_does_not_take_another_tenants_share():
    sched = Scheduler(BlockManager(4096, 16), 256, max_num_seqs=4)
    a = job("a", 40, T0 + HOUR, tenant="A", max_tokens=30)
    b = job("b", 40, T0 + 24 * HOUR, tenant="B", max_tokens=30)
    tokens: Counter[str] = Counter()
    for step in range(150):
        if step == 0:
            for req in a + b:
                seq = Sequence(request=req, sample_index=0, token_ids=list(req.prompt_token_ids),
                               num_prompt_tokens=len(req.prompt_token_ids))
                req.sequences.append(seq)
                sched.add(seq)
        for seq, n in sched.schedule().scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1)
                tokens[seq.request.tenant] += 1
                if seq.num_output_tokens == 30:
                    sched.finish(seq)
    assert 0.8 <= tokens["A"] / tokens["B"] <= 1.25, tokens


def test_a_jobs_tail_starts_its_longest_first_once_it_fits_in_the_batch():
    lengths = JobLengths()
    queue = WaitingQueue(aging_steps=50, tail_seats=3, lengths=lengths)
    reqs = [Request(f"r{i}", [1] * 4, SamplingParams(max_tokens=m), job="j", deadline=T0)
            for i, m in enumerate([5, 40, 10, 80])]
    seqs = []
    for r in reqs:
        seq = Sequence(request=r, sample_index=0, token_ids=[1] * 4, num_prompt_tokens=4)
        seqs.append(seq)
        queue.add(seq)
    assert queue.head("default") is seqs[0]  # four waiting, three seats: in queue order
    queue.remove(seqs[0])
    assert queue.head("default") is seqs[3]  # three left: they fit, the longest first
    queue.remove(seqs[3])
    assert queue.head("default") is seqs[1]
    off = WaitingQueue(aging_steps=50, tail_seats=3)  # no lengths: no tail
    for seq in seqs[1:3]:
        off.add(seq)
    assert off.head("default") is seqs[1] and WaitingQueue(50).head("default") is None


def test_lengths_are_predicted_from_the_jobs_finished_requests_of_the_same_shape():
    lengths = JobLengths()

    def seq(max_tokens: int, made: int = 0, name: str = "j") -> Sequence:
        r = Request("x", [1] * 4, SamplingParams(max_tokens=max_tokens), job=name)
        return Sequence(request=r, sample_index=0, token_ids=[1] * (4 + made), num_prompt_tokens=4)

    assert lengths.expected_left(seq(100)) == 100  # nothing finished: its budget
    for _ in range(3):
        lengths.finished(seq(100, made=6))  # the long budgets stop early (an end of text)
    lengths.finished(seq(20, made=20))  # the short ones run to their end
    assert lengths.expected_left(seq(100)) == 6
    assert lengths.expected_left(seq(20)) == 20  # a short budget now outranks a long one
    assert lengths.expected_left(seq(50)) == 50 * 38 / 320  # no shape alike: the job's share of budgets used
    assert lengths.expected_left(seq(100, made=4)) == 2  # what it made is counted off
    assert lengths.expected_left(seq(100, name="other")) == 100  # another job's requests tell nothing


def test_the_tail_shortens_a_mixed_jobs_last_stretch():
    rng = random.Random(6)
    budgets = [rng.choice([8, 16, 32, 96]) for _ in range(64)]

    def makespan(tail_first: bool) -> int:
        sched = Scheduler(BlockManager(8192, 16), 512, max_num_seqs=8, tail_first=tail_first)
        reqs = [Request(f"r{i}", [1] * 10, SamplingParams(max_tokens=m), job="j", deadline=T0)
                for i, m in enumerate(budgets)]
        done = run(sched, {0: reqs}, steps=5000)
        assert len(done) == 64
        return max(done.values())

    with_tail, without = makespan(True), makespan(False)
    # the work is the same; started in queue order a long request starts late and runs on alone
    assert with_tail <= without * 0.95, (with_tail, without)  # 311 against 343 steps; ideal 290

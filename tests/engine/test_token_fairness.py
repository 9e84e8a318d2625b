"""Tenants share the engine's tokens by weight: the scheduler's turns (worker/engine/fair_share.py).

Tenant A sends prompts long against the step's token budget, tenant B short requests. At the
scheduler (a fake model: a sequence's next token is 1) the issue's own numbers: 8,000-token
prompts beside 100-token requests under the default budget of 2,048 tokens. On the engine (the
tiny random Llama, real steps) the same shape scaled down to stay quick on a busy CPU: a budget of
64 tokens, A's prompts 512 tokens (8 budgets each), B's 12 tokens. Latency is counted in steps,
never seconds, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

import pytest

from tests.support.models import cut_prompts
from worker.engine.block_manager import BlockManager
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams, SeqStatus, Sequence
from worker.engine.scheduler import Scheduler


@dataclass
class Run:
    """What a run saw, step by step."""

    tokens: list[Counter] = field(default_factory=list)  # per step, the tokens each tenant was given
    waiting: list[set] = field(default_factory=list)  # per step, the tenants with work when it began
    arrived: dict[str, int] = field(default_factory=dict)  # request id -> step it arrived before
    finished: dict[str, int] = field(default_factory=dict)  # request id -> step that finished it

    def latencies(self, prefix: str) -> list[int]:
        return [self.finished[r] - self.arrived[r] + 1 for r in self.finished if r.startswith(prefix)]

    def shares(self, steps: range) -> dict[str, float]:
        total = Counter()
        for i in steps:
            total.update(self.tokens[i])
        n = sum(total.values())
        return {t: v / n for t, v in total.items()}


def tenants_with_work(sched: Scheduler) -> set[str]:
    return {s.request.tenant for s in (*sched.running, *sched.waiting, *sched.swapped)}


def fake_run(sched: Scheduler, arrivals, steps: int) -> Run:
    """Drive ``sched`` with a fake model; ``arrivals(step)`` gives the requests arriving before it."""
    run = Run()
    for step in range(steps):
        for req in arrivals(step):
            seq = Sequence(request=req, sample_index=0, token_ids=list(req.prompt_token_ids),
                           num_prompt_tokens=len(req.prompt_token_ids))
            req.sequences.append(seq)
            req.arrival_step = sched.step_count
            run.arrived[req.request_id] = step
            sched.add(seq)
        run.waiting.append(tenants_with_work(sched))
        plan = sched.schedule()
        got = Counter()
        for seq, n in plan.scheduled:
            got[seq.request.tenant] += n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1)
                if seq.num_output_tokens == seq.request.params.max_tokens:
                    sched.finish(seq)
                    run.finished[seq.request.request_id] = step
        run.tokens.append(got)
    return run


def prompt(tenant: str, i: int, n: int) -> list[int]:
    """A prompt whose first token no other has (the prefix cache would otherwise compute them once)."""
    return [i * 2 + (tenant == "B")] + [7] * (n - 1)


def long_prompts(count: int, length: int, out: int = 16, **kw) -> list[Request]:
    return [Request(f"a{i}", prompt("A", i, length), SamplingParams(max_tokens=out), tenant="A", **kw)
            for i in range(count)]


def short_stream(per_step: int, length: int, out: int, **kw):
    def arrivals(step):
        return [Request(f"b{step}-{i}", prompt("B", step * per_step + i, length), SamplingParams(max_tokens=out),
                        tenant="B", **kw) for i in range(per_step)]
    return arrivals


def both(backlog: list[Request], stream):
    return lambda step: (backlog if step == 0 else []) + stream(step)


# ---- at the scheduler, the numbers

def test_short_requests_beside_8000_token_prompts_finish_as_fast_as_alone():
    """The finding: B finished 582 requests in 3,000 steps beside A (11,968 alone), median 326 steps
    against 16. B's requests now finish as fast as alone, and A takes every token B leaves."""
    def scheduler():
        return Scheduler(BlockManager(200_000, 16), max_num_batched_tokens=2048, max_num_seqs=256)

    stream = short_stream(per_step=4, length=100, out=16)
    alone = fake_run(scheduler(), stream, steps=400)
    beside = fake_run(scheduler(), both(long_prompts(100, 8000), stream), steps=400)
    b_alone, b_beside = alone.latencies("b"), beside.latencies("b")
    assert len(b_beside) >= 0.95 * len(b_alone), (len(b_beside), len(b_alone))
    assert statistics.median(b_beside) <= 2 * statistics.median(b_alone), (statistics.median(b_beside),
                                                                           statistics.median(b_alone))
    # work-conserving: the budget is spent every step while A has prompts to compute
    assert all(sum(t.values()) == 2048 for t in beside.tokens[1:])
    # and no step went to A alone while B had work: a long prefill is chunked
    assert all(t["B"] for t, w in zip(beside.tokens, beside.waiting) if "B" in w)


@pytest.mark.parametrize("weight_a,weight_b", [(1, 1), (3, 1), (1, 3)])
def test_tenants_with_work_get_tokens_by_weight(weight_a, weight_b):
    """Both tenants with more work than the budget: each gets its weight's share within 10%,
    decodes and prefill chunks counted alike."""
    sched = Scheduler(BlockManager(200_000, 16), max_num_batched_tokens=2048, max_num_seqs=256)
    sched.waiting.shares.update(A=weight_a, B=weight_b)
    run = fake_run(sched, both(long_prompts(100, 8000), short_stream(per_step=40, length=200, out=8)), steps=300)
    assert all(w == {"A", "B"} for w in run.waiting[1:]), "both tenants were meant to have work throughout"
    shares = run.shares(range(20, 300))
    for tenant, weight in (("A", weight_a), ("B", weight_b)):
        want = weight / (weight_a + weight_b)
        assert abs(shares[tenant] - want) <= 0.1 * want, (tenant, shares, want)


def test_a_tenant_alone_gets_the_whole_budget():
    """Work-conserving: alone, a tenant's long prefill takes every step's whole budget, in one chunk."""
    sched = Scheduler(BlockManager(200_000, 16), max_num_batched_tokens=2048, max_num_seqs=256)
    sched.waiting.shares.update(A=1, B=1)  # a weight of a tenant with no work holds nothing back
    run = fake_run(sched, lambda step: long_prompts(20, 8000) if step == 0 else [], steps=40)
    assert all(t == {"A": 2048} for t in run.tokens)


def test_a_tenants_priority_is_not_compared_with_another_tenants():
    """Priority orders a tenant's own work: A's priority 9 against B's 0 buys A no tokens."""
    sched = Scheduler(BlockManager(200_000, 16), max_num_batched_tokens=32, max_num_seqs=8)
    a = [Request(f"a{i}", prompt("A", i, 200), SamplingParams(max_tokens=4), tenant="A", priority=9) for i in range(8)]
    b = [Request(f"b{i}", prompt("B", i, 200), SamplingParams(max_tokens=4), tenant="B", priority=0) for i in range(8)]
    run = fake_run(sched, lambda step: a + b if step == 0 else [], steps=40)
    assert all(w == {"A", "B"} for w in run.waiting)
    shares = run.shares(range(40))
    assert abs(shares["A"] - 0.5) <= 0.05, shares


def test_the_cache_is_taken_back_from_the_tenant_over_its_share_not_the_lowest_priority():
    """KV blocks run out: the victim is of the tenant holding more than its share (A: two seats of
    three at equal weight, priority 9), not B's only sequence because its priority is 0."""
    sched = Scheduler(BlockManager(6, 4), max_num_batched_tokens=64, max_num_seqs=8)
    a = [Request(f"a{i}", prompt("A", i, 7), SamplingParams(max_tokens=4), tenant="A", priority=9) for i in range(2)]
    b = [Request("b0", prompt("B", 0, 7), SamplingParams(max_tokens=4), tenant="B", priority=0)]
    fake_run(sched, lambda step: a + b if step == 0 else [], steps=1)  # six blocks: each holds two
    assert sched.bm.num_free_blocks == 0
    for seq in sched.running:
        seq.token_ids.append(1)  # every sequence now needs a third block
    plan = sched.schedule()
    assert [s.request.request_id for s in plan.preempted] == ["a1"], plan.preempted
    assert a[1].sequences[0].status is SeqStatus.WAITING


# ---- on the engine: the tiny random Llama, real steps, scaled down (a budget of 64 tokens)

def engine_run(engine: Engine, arrivals, steps: int) -> Run:
    """Step ``engine`` ``steps`` times, adding ``arrivals(step)`` before each; what each tenant got."""
    run = Run()
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        run.tokens.append(Counter())
        for seq, n in plan.scheduled:
            run.tokens[-1][seq.request.tenant] += n
        return plan

    engine.scheduler.schedule = recorded
    for step in range(steps):
        for req in arrivals(step):
            engine.add_request(req)
            run.arrived[req.request_id] = step
        run.waiting.append(tenants_with_work(engine.scheduler))
        for out in engine.step():
            assert out.error is None, out.error
            run.finished[out.request_id] = step
    assert len(run.tokens) == steps
    return run


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0)


def engine_requests(text_ids, tenant: str, count: int, length: int, out: int, first: int = 0) -> list[Request]:
    prompts = cut_prompts(text_ids, [length] * (first + count), stride=389 if tenant == "A" else 1013)[first:]
    return [Request(f"{tenant.lower()}{first + i}", p, greedy(out), tenant=tenant) for i, p in enumerate(prompts)]


def tiny(tiny_loaded, **kw) -> Engine:
    return Engine(loaded=tiny_loaded, max_num_batched_tokens=64, max_num_seqs=32, kv_memory=2 ** 24, **kw)


def test_engine_short_requests_beside_long_prompts_finish_as_fast_as_alone(tiny_loaded, text_ids):
    """B sends a 12-token request every step, A 512-token prompts (8 budgets each): B's median
    latency in steps stays within 2x of B alone, and A takes what B leaves."""
    def stream(step):
        return engine_requests(text_ids, "B", 1, 12, 8, first=step)

    alone = engine_run(tiny(tiny_loaded), stream, steps=120)
    a = engine_requests(text_ids, "A", 12, 512, 4)
    beside = engine_run(tiny(tiny_loaded), both(a, stream), steps=120)
    b_alone, b_beside = alone.latencies("b"), beside.latencies("b")
    print(f"\nB alone: {len(b_alone)} finished, median {statistics.median(b_alone)} steps; beside A: "
          f"{len(b_beside)}, median {statistics.median(b_beside)}; shares {beside.shares(range(120))}")
    assert len(b_beside) >= len(b_alone) - 2, (len(b_beside), len(b_alone))
    assert statistics.median(b_beside) <= 2 * statistics.median(b_alone), (statistics.median(b_beside),
                                                                           statistics.median(b_alone))
    assert all(sum(t.values()) == 64 for t, w in zip(beside.tokens, beside.waiting) if "A" in w)


@pytest.mark.parametrize("weight_a,weight_b", [(1, 1), (3, 1)])
def test_engine_tenants_with_work_get_tokens_by_weight(tiny_loaded, text_ids, weight_a, weight_b):
    """A's long prompts and a backlog of B's short requests: each tenant's tokens within 10% of its
    weight's share while both have work."""
    engine = tiny(tiny_loaded)
    engine.set_tenant_share("A", weight_a)
    engine.set_tenant_share("B", weight_b)
    a = engine_requests(text_ids, "A", 12, 512, 4)
    run = engine_run(engine, both(a, lambda step: engine_requests(text_ids, "B", 4, 12, 8, first=4 * step)), steps=100)
    assert all(w == {"A", "B"} for w in run.waiting[1:])
    shares = run.shares(range(10, 100))
    print(f"\nweights {weight_a}:{weight_b}, shares {shares}")
    for tenant, weight in (("A", weight_a), ("B", weight_b)):
        want = weight / (weight_a + weight_b)
        assert abs(shares[tenant] - want) <= 0.1 * want, (tenant, shares, want)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_preemption_between_tenants_keeps_outputs_exact(tiny_loaded, text_ids, mode):
    """A cache of 24 blocks of 16 tokens for two tenants (weights 1 and 2, priorities of their own)
    preempts all the time, the victims chosen by fairness: every request completes, its greedy
    tokens those of a run with room to spare."""
    lengths = [37, 180, 9, 120, 64, 150, 23, 99, 140, 5, 77, 160]
    outs = [30, 8, 50, 20, 12, 40, 33, 16, 24, 45, 10, 28]
    prompts = cut_prompts(text_ids, lengths, stride=761)

    def requests():
        return [Request(str(i), p, greedy(outs[i]), tenant="AB"[i % 2], priority=i % 3) for i, p in enumerate(prompts)]

    def outputs(engine):
        engine.set_tenant_share("B", 2.0)
        for req in requests():
            engine.add_request(req)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                done[out.request_id] = out.completions[0].token_ids
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return done

    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, block size, kv heads, head dim, float32
    pressed = Engine(loaded=tiny_loaded, kv_memory=24 * block_bytes, block_size=16, max_num_batched_tokens=48,
                     preemption_mode=mode)
    got = outputs(pressed)
    assert pressed.stats.preemptions > 0, "the workload was meant to preempt"
    assert got == outputs(Engine(loaded=tiny_loaded, kv_memory=2 ** 24, block_size=16, max_num_batched_tokens=48))

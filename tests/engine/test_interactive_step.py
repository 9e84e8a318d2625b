"""The step bound while interactive work runs: a live caller gets a token a step, so batch work fills a
step only up to ``Scheduler.interactive_step_tokens`` while an interactive request is in the engine;
interactive work takes what it needs first, and batch work has the whole budget again once the last
interactive request is gone. The engine sets the bound from the steps' times so that a step takes about
``Settings.interactive_step_seconds`` (``worker/engine/step_pace.py``)."""

from __future__ import annotations

import pytest

from tests.support.jobs_env import tiny_settings
from tests.support.scheduling import fake_step, make_seq
from worker.config import Settings
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, SamplingParams, Sequence
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.step_pace import StepPace


def _seq(i: int, prompt: int, interactive: bool = False, max_tokens: int = 1000) -> Sequence:
    return make_seq(i, prompt, interactive, max_tokens)


def _step(sched: Scheduler) -> dict[bool, int]:
    """A step with the model's part faked (``tests.support.scheduling.fake_step``); the tokens it gave each class
    (True: interactive)."""
    given = {False: 0, True: 0}
    for seq, n in fake_step(sched).scheduled:
        given[seq.request.interactive] += n
    return given


def _busy(bound: int) -> tuple[Scheduler, list[Sequence]]:
    """40 batch sequences decoding (40 tokens a step) under a budget of 256."""
    bm = BlockManager(num_blocks=2048, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=64, interactive_step_tokens=bound)
    batch = [_seq(i, 4) for i in range(40)]
    for s in batch:
        sched.add(s)
    assert _step(sched) == {False: 160, True: 0}  # every prompt in one step
    assert _step(sched) == {False: 40, True: 0}  # then a decode each
    return sched, batch


def test_batch_work_fills_a_step_only_to_the_bound_while_an_interactive_request_runs():
    sched, batch = _busy(bound=24)
    live = _seq(100, 10, interactive=True, max_tokens=5)
    sched.add(live)
    assert _step(sched) == {False: 14, True: 10}  # its prompt first, batch work the rest of 24
    for _ in range(4):
        assert _step(sched) == {False: 23, True: 1}  # a decode each step, beside 23 batch decodes
    assert live.is_finished
    assert _step(sched) == {False: 40, True: 0}  # gone: batch work has the whole budget again
    assert all(not s.is_finished for s in batch) and sched.num_preemptions == 0  # nothing lost its seat


def test_an_interactive_prompt_over_the_bound_is_not_cut_by_it():
    """The bound cuts batch work only: a 100-token interactive prompt runs whole (the budget allows it),
    and batch work waits that step."""
    sched, _ = _busy(bound=24)
    live = _seq(100, 100, interactive=True, max_tokens=3)
    sched.add(live)
    assert _step(sched) == {False: 0, True: 100}
    assert _step(sched) == {False: 23, True: 1}


def test_a_new_interactive_prompt_is_cut_to_the_bound_while_other_streams_decode():
    """A 100-token prompt beside a decoding stream runs in chunks that keep each step to the bound (24):
    the stream gets its token every step, and batch work waits until the prompt is in."""
    sched, _ = _busy(bound=24)
    first = _seq(100, 2, interactive=True, max_tokens=50)
    sched.add(first)
    assert _step(sched) == {False: 22, True: 2}
    sched.add(_seq(101, 100, interactive=True, max_tokens=5))
    given = [_step(sched) for _ in range(5)]
    assert all(sum(g.values()) == 24 for g in given)
    assert [g[True] for g in given] == [24, 24, 24, 24, 9]  # 23 prompt tokens + 1 decode ..., then the last 8 + 1
    assert given[-1][False] == 15 and all(g[False] == 0 for g in given[:-1])


def test_no_bound_gives_batch_work_the_whole_budget_beside_interactive_work():
    """``interactive_step_tokens`` 0: the step's budget alone bounds it (the knob, apart from its default)."""
    sched, _ = _busy(bound=0)
    sched.add(_seq(100, 10, interactive=True, max_tokens=5))
    assert _step(sched) == {False: 40, True: 10}
    assert _step(sched) == {False: 40, True: 1}


def test_batch_work_progresses_in_turn_under_the_bound():
    """With an interactive stream that never ends and a bound below the batch sequences' count, batch
    work still finishes, every sequence of it, without preemption: the served ones finish and the rest
    follow."""
    bm = BlockManager(num_blocks=2048, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=64, interactive_step_tokens=16)
    batch = [_seq(i, 4, max_tokens=20) for i in range(40)]
    for s in batch:
        sched.add(s)
    sched.add(_seq(100, 4, interactive=True, max_tokens=10_000))
    for _ in range(500):
        given = _step(sched)
        assert given[True] >= 1 and sum(given.values()) <= 16
        if all(s.is_finished for s in batch):
            break
    assert all(s.is_finished for s in batch) and sched.num_preemptions == 0


def _plan(interactive: list[int], batch: list[int]):
    """A plan of interactive rows and batch rows, each given that many tokens."""
    rows = [(_seq(i, 4, interactive=True), n) for i, n in enumerate(interactive)]
    rows += [(_seq(100 + i, 4), n) for i, n in enumerate(batch)]
    return SchedulerOutput(scheduled=rows)


def test_the_default_pace_settles_where_a_step_takes_its_target():
    """Steps that cost 48 ms plus 3.5 ms a token (the default model's decode steps, float32, on a 2-core
    AMD EPYC): the default target of 0.15 s settles the bound at the 29 tokens that take 0.15 s, from the
    first bound of 64, in a few steps; a step that prefills an interactive prompt teaches nothing."""
    assert Settings().interactive_step_seconds == 0.15
    pace = StepPace(Settings().interactive_step_seconds, most=2048)
    assert pace.tokens == 64
    for _ in range(30):
        n = pace.tokens
        pace.observe(_plan([1, 1], [1] * (n - 2)), 0.048 + 0.0035 * n)
    assert pace.tokens in (28, 29, 30)
    before = pace.tokens
    pace.observe(_plan([300, 1], [1] * 10), 1.2)  # a 300-token interactive prompt: 4 ms a token, not taken
    pace.observe(_plan([], [1] * 200), 0.9)  # batch work alone: not taken
    pace.observe(_plan([1, 1, 1], []), 0.06)  # three streams alone, 20 ms a token: not full, not taken
    assert pace.tokens == before


def test_the_pace_keeps_to_its_limits():
    pace = StepPace(0.2, most=256)
    pace.observe(_plan([1], [1] * 63), 0.001)  # a fast device: the budget is the only bound
    assert pace.tokens == 256
    for _ in range(10):  # steps far slower than the target: batch work keeps 16 tokens beside the streams
        pace.observe(_plan([1] * 8, [1] * (pace.tokens - 8)), 8.0)
    assert pace.tokens == 16
    assert StepPace(0.0, most=2048).tokens == 2048  # 0: no bound


def test_an_engine_bounds_its_steps_by_the_pace_while_an_interactive_request_runs(tiny_llama_dir):
    """An engine whose target no step can meet (a microsecond) bounds its steps with an interactive request
    in them to the least (16 tokens, once a step of its decodes was timed), and steps without one not at all; the
    interactive answer is the one the request gets alone (greedy), and all batch work finishes."""
    from worker.engine.engine import Engine

    engine = Engine(tiny_settings(tiny_llama_dir, interactive_step_seconds=1e-6))
    assert engine.pace.target == 1e-6 and engine.scheduler.interactive_step_tokens == 64
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate([[5, 6, 7, 8, 9]], params)[0].completions[0].token_ids

    sizes: list[tuple[bool, int]] = []  # per step: an interactive request was in it, the tokens it carried
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        sizes.append((any(s.request.interactive for s in engine.scheduler.running), plan.num_tokens))
        return plan

    engine.scheduler.schedule = recording
    batch = lambda name: Request(name, [100 + len(name), 200, 300], SamplingParams(max_tokens=16, ignore_eos=True))  # noqa: E731
    for i in range(60):
        engine.add_request(batch(f"b{i}"))
    engine.step()  # 180 prompt tokens in one step, with no interactive request
    live = Request("live", [5, 6, 7, 8, 9], params)
    live.interactive = True
    engine.add_request(live)
    for i in range(60):  # 60 decodes and 180 prompt tokens wanted beside it
        engine.add_request(batch(f"c{i}"))
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o for o in engine.step()})
    assert out["live"].completions[0].token_ids == alone
    with_live = [n for live_in, n in sizes if live_in]
    # the first bound twice (its prompt's step teaches nothing), then the least from its first decode on
    assert with_live[:3] == [64, 64, 16] and max(with_live[2:]) == 16
    assert max(n for live_in, n in sizes if not live_in) > 64
    assert len(out) == 121 and all(o.error is None for o in out.values())


@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_a_negative_target_is_refused(value):
    with pytest.raises(ValueError, match="interactive_step_seconds"):
        Settings(interactive_step_seconds=value)


def test_batch_work_keeps_its_floor_beside_streams_at_the_interactive_limit(tiny_llama_dir):
    """Issue 34: another tenant's streams at the interactive limit (a worker's default interactive_prefetch of
    8 requests, each n=8: 64 decodes a step) filled the engine's first bound of 64 tokens, and batch work got
    none of a step (six such streams took a batch job from 537 to 98 tok/s). The engine's scheduler, at the
    defaults a user gets, keeps ``interactive_batch_floor`` of every step's tokens for batch work while it
    waits, every stream still getting its token each step, and nothing preempted. The shares are the
    scheduler's, deterministic (``benchmarks/interactive_floor.py`` measures the tokens/s)."""
    from worker.engine.engine import Engine

    defaults = Settings()
    floor = defaults.interactive_batch_floor
    assert floor > 0
    engine = Engine(tiny_settings(tiny_llama_dir))
    sched = engine.scheduler
    assert (sched.max_num_batched_tokens, sched.interactive_step_tokens) == (defaults.max_num_batched_tokens, 64)
    batch = [_seq(i, 4) for i in range(40)] + [_seq(50 + i, 1500, max_tokens=4) for i in range(4)]
    for s in batch:
        sched.add(s)
    _step(sched)
    streams = [_seq(1000 + i, 4, interactive=True, max_tokens=30) for i in range(defaults.interactive_prefetch * 8)]
    for s in streams:
        s.request.tenant = "tenant-b"
        sched.add(s)
    shares = []
    for _ in range(20):
        given = _step(sched)
        shares.append(given[False] / sum(given.values()))
        assert given[True] == len(streams) or given[True] == 4 * len(streams)  # their prompts, then a token each
        assert given[False] >= floor * sum(given.values()), given
    print(f"batch work's share of each step beside {len(streams)} streams: {min(shares):.3f} at least "
          f"(floor {floor})")
    for _ in range(20):
        _step(sched)
    assert all(s.is_finished for s in streams) and sched.num_preemptions == 0

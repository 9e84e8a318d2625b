"""The step bound while interactive work runs (``Settings.interactive_step_tokens``): a live caller gets a
token a step, so batch work fills a step only up to the bound while an interactive request is in the
engine; interactive work takes what it needs first, and batch work has the whole budget again once the
last interactive request is gone."""

from __future__ import annotations

import pytest

from tests.jobs_support import tiny_settings
from worker.config import Settings
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, SamplingParams, Sequence
from worker.engine.scheduler import Scheduler


def _seq(i: int, prompt: int, interactive: bool = False, max_tokens: int = 1000) -> Sequence:
    request = Request(str(i), [i * 1000 + j for j in range(prompt)], SamplingParams(max_tokens=max_tokens))
    request.interactive = interactive
    seq = Sequence(request=request, sample_index=0, token_ids=list(request.prompt_token_ids), num_prompt_tokens=prompt)
    request.sequences.append(seq)
    return seq


def _step(sched: Scheduler) -> dict[bool, int]:
    """A step with the model's part faked; the tokens it gave each class (True: interactive)."""
    plan = sched.schedule()
    given = {False: 0, True: 0}
    for seq, n in plan.scheduled:
        given[seq.request.interactive] += n
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                sched.finish(seq)
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


def test_the_default_bound_reaches_the_engines_scheduler(tiny_llama_dir):
    """The default (128) is what an engine gets; a step of an engine running an interactive request beside
    more batch work than that carries no more than 128 tokens, one without it more; the interactive
    answer is the one the request gets alone (greedy)."""
    from worker.engine.engine import Engine

    assert Settings().interactive_step_tokens == 128
    engine = Engine(tiny_settings(tiny_llama_dir))
    assert engine.scheduler.interactive_step_tokens == 128
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
    engine.step()  # 180 prompt tokens in one step: more than the bound, with no interactive request
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
    assert with_live and max(with_live) == 128  # full to the bound, no more
    assert max(n for live_in, n in sizes if not live_in) > 128
    assert len(out) == 121 and all(o.error is None for o in out.values())


@pytest.mark.parametrize("value", [-1])
def test_a_negative_bound_is_refused(value):
    with pytest.raises(ValueError, match="interactive_step_tokens"):
        Settings(interactive_step_tokens=value)

"""Isolation in the engine: while a request marked ``isolated`` is in it, every step runs isolated
requests only (a worker's crash suspects run so, apart from all other work); the others wait where
they are and finish afterwards, every output as in a run without isolation."""

from __future__ import annotations

from tests.support.models import cut_prompts
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, n=2)


def _requests(text_ids) -> list[Request]:
    prompts = cut_prompts(text_ids, [40, 17, 90, 33, 8, 64, 21, 50])
    return [Request(f"r{i}", list(ids), SAMPLED if i % 3 == 0 else GREEDY) for i, ids in enumerate(prompts)]


def _watch(engine: Engine) -> list[set[str]]:
    """The request ids of each step the model runs."""
    steps, original = [], engine.runner.prepare

    def prepare(scheduled, tables=None):
        steps.append({seq.request.request_id for seq, _ in scheduled})
        return original(scheduled, tables)

    engine.runner.prepare = prepare
    return steps


def _tokens(done) -> dict:
    return {rid: [c.token_ids for c in out.completions] for rid, out in done.items()}


def _run(engine: Engine, requests: list[Request], hook=lambda step: None) -> dict:
    for r in requests:
        engine.add_request(r)
    done, step = {}, 0
    while engine.has_unfinished():
        hook(step)
        step += 1
        for out in engine.step():
            done[out.request_id] = out
    return _tokens(done)


def test_isolated_requests_step_alone_and_every_output_is_unchanged(tiny_loaded, text_ids):
    clean = _run(Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_seqs=8), _requests(text_ids))
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_seqs=8)
    steps = _watch(engine)
    requests = _requests(text_ids)
    apart = {"r2", "r3", "r6"}

    def hook(step):
        if step == 3:  # the others have run a few steps: they hold blocks and wait while the group runs
            for r in requests:
                if r.request_id in apart:
                    r.isolated = True
                    engine.add_request(r)
        if step == 12:
            engine.release("r6")  # cleared: runs with the others once the group is done

    done = _run(engine, [r for r in requests if r.request_id not in apart], hook)
    assert done == clean
    isolated_steps = [s for s in steps if s & apart]
    group_done = max(i for i, s in enumerate(steps) if s & {"r2", "r3"})
    assert all(s <= apart for s in steps[3:group_done + 1])  # nothing else ran while the group did
    assert isolated_steps and steps[3] <= apart and steps[0] and not steps[0] & apart
    assert any("r6" in s and s - apart for s in steps[group_done + 1:])  # released: beside the others
    assert engine.block_manager.num_used_blocks == 0


def test_isolated_requests_take_the_blocks_they_need_from_the_waiting_others(tiny_loaded, text_ids):
    small = {"kv_memory": "160KiB", "max_num_seqs": 8}  # room for a few of the requests at once
    clean = _run(Engine(loaded=tiny_loaded, **small), _requests(text_ids))
    engine = Engine(loaded=tiny_loaded, **small)
    steps = _watch(engine)
    requests = _requests(text_ids)

    def hook(step):
        if step == 6:
            r = requests[7]
            r.isolated = True
            engine.add_request(r)

    done = _run(engine, requests[:7], hook)
    assert done == clean
    alone = [s for s in steps if "r7" in s]
    assert alone and all(s == {"r7"} for s in alone)
    assert engine.stats.preemptions > 0
